"""Is a training job starving for data, and why: the loader meter
(``watch``, which training code imports), and what ``cachefsd doctor``
makes of it beside the daemon's view of the job's reads.

Importing this package loads only the standard library: the daemon's side
(``ledger``), the verdict rules (``verdict``) and the what-if replay
(``whatif``) are submodules imported by who needs them.
"""

from cachefsd.control.client import MeterTotals
from cachefsd.diagnose.meter import watch

__all__ = ["MeterTotals", "watch"]
