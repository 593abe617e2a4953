"""Page-cache warming: which planned cached files to read from the cache
disk into the page cache next, within a budget of bytes ahead of the readers.

With a plan (a hint, or a replay the model trusts), a file that is already
cached is warmed as its turn nears (``CachedBlocks.warm``:
``posix_fadvise(WILLNEED)``, which does not wait), at most
``PrefetchTuning.warm_ahead_bytes`` of files warmed and not opened yet, so
that a hit does not wait on the cache disk either. A file whose turn has
come is not warmed (that would only race its read), nor one whose workload
has left the epoch it was planned in.

Positions count opens: a file at position p is due once the mount has seen
p opens. Pure: the opens so far are passed in. No lock: only the prefetch
thread uses it.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

# Whether a prediction of a workload made in an epoch is stale: the workload has left that epoch.
Stale = Callable[[str, int], bool]


@dataclass(frozen=True, order=True)
class ToWarm:
    """A planned cached file, ordered by its position."""

    position: float
    path: str
    workload: str
    epoch: int


@dataclass(frozen=True)
class _Warmed:
    position: float
    nbytes: int
    workload: str
    epoch: int


class WarmQueue:
    def __init__(self, budget_bytes: int) -> None:
        self._budget_bytes = budget_bytes
        self._to_warm: list[ToWarm] = []  # a heap: nearest first
        self._warmed: deque[_Warmed] = deque()  # warmed and not opened yet, in the order warmed
        self._warmed_bytes = 0

    @property
    def warmed_bytes(self) -> int:
        """Bytes warmed whose turn has not come, as of the last ``turned``."""
        return self._warmed_bytes

    def plan(self, file: ToWarm) -> None:
        heapq.heappush(self._to_warm, file)

    def turned(self, opens: int) -> None:
        """The mount has seen ``opens`` opens: files warmed for earlier
        positions no longer count against the budget."""
        while self._warmed and self._warmed[0].position < opens:
            self._warmed_bytes -= self._warmed.popleft().nbytes

    def next(self, opens: int, stale: Stale) -> ToWarm | None:
        """The nearest planned file still to warm, while the budget has room;
        files whose turn has come or whose pass is over are dropped."""
        while self._to_warm and self._warmed_bytes < self._budget_bytes:
            file = heapq.heappop(self._to_warm)
            if file.position < opens or stale(file.workload, file.epoch):
                continue
            return file
        return None

    def warmed(self, file: ToWarm, nbytes: int) -> None:
        """``file`` (``nbytes``) was warmed."""
        self._warmed.append(_Warmed(file.position, nbytes, file.workload, file.epoch))
        self._warmed_bytes += nbytes

    def void(self, stale: Stale) -> None:
        """Files warmed for a pass that is over stop counting against the
        budget; those still to warm are dropped as they come up (``next``)."""
        self._warmed = deque(entry for entry in self._warmed if not stale(entry.workload, entry.epoch))
        self._warmed_bytes = sum(entry.nbytes for entry in self._warmed)
