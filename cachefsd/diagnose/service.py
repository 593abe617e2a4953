"""What a mount's control socket serves of the loader meters: their reports
in (``POST /meter``), and ``GET /diagnose`` out, which ``cachefsd doctor``
judges.

``GET /diagnose`` answers a ``DiagnosisAnswer`` (``control/answers.py``):
the jobs whose meters report to this mount. ``reader_seconds`` is the time
the processes reading for each meter's loop had: what ``reads.read_seconds``
and ``reads.stall_seconds`` (summed over those readers) are shares of.
``reads`` cover the metered window (from the job's first report); None when
the daemon counted the job's reads with other jobs'. ``observed`` is the
job's read order on this mount (a sample of it) for the what-if replay.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

from cachefsd.control.answers import (
    CacheSetup,
    DiagnosisAnswer,
    MeteredJobAnswer,
    MeteredReads,
    ObservedReads,
)
from cachefsd.control.client import MeterTotals
from cachefsd.diagnose.ledger import MeterLedger
from cachefsd.diagnose.whatif import MAX_REPLAYED_FILES
from cachefsd.jobs import CallerJobs
from cachefsd.workload.model import ObservedOrder


@dataclass(frozen=True, slots=True)
class CacheFacts:
    capacity_bytes: Callable[[], int]
    policy: str
    block_size: int


class Diagnosis:
    def __init__(
        self,
        ledger: MeterLedger,
        jobs: CallerJobs,
        observed: Callable[[str, int], ObservedOrder | None],
        mountpoint: str,
        cache: CacheFacts,
    ) -> None:
        self._ledger = ledger
        self._jobs = jobs
        self._observed = observed
        self._mountpoint = mountpoint
        self._cache = cache

    def meter(self, pid: int, meter_id: str, totals: MeterTotals, readers: int) -> None:
        """A meter's report, for the job of the process ``pid`` that sent it."""
        self._ledger.report(self._jobs.of(pid), self._mountpoint, meter_id, totals, readers)

    def snapshot(self) -> DiagnosisAnswer:
        jobs = []
        for metered in self._ledger.jobs(self._mountpoint):
            observed = self._observed(metered.job, MAX_REPLAYED_FILES)
            jobs.append(
                MeteredJobAnswer(
                    job=metered.job,
                    batches=metered.totals.batches,
                    data_wait_seconds=metered.totals.data_wait_seconds,
                    step_seconds=metered.totals.step_seconds,
                    reader_seconds=metered.reader_seconds,
                    meters=metered.meters,
                    last_report_seconds_ago=metered.last_report_seconds_ago,
                    reads=None
                    if metered.reads is None
                    else MeteredReads.model_validate(asdict(metered.reads)),
                    observed=None if observed is None else ObservedReads.model_validate(asdict(observed)),
                )
            )
        return DiagnosisAnswer(
            mountpoint=self._mountpoint,
            cache=CacheSetup(
                capacity_bytes=self._cache.capacity_bytes(),
                policy=self._cache.policy,
                block_size=self._cache.block_size,
            ),
            jobs=jobs,
        )
