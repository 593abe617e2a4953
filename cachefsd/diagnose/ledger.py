"""The daemon's side of the loader meter: per job, what its meters reported,
set beside what the daemon saw of the same job's reads over the same time.

A job (``jobs.py``: a process group) may run several meters: one per pass
when ``watch`` wraps each epoch, one per rank of a ``torchrun`` job. Each
reports cumulative totals under an id of its own, so the job's totals are
the sum of its meters' latest, and a report lost or repeated changes
nothing. The job's reads (read stall, bytes from the cache and from the
store, as the metrics count them) are taken when its first report comes and
again when asked, so both views cover the same window.

Bounded: ``MAX_JOBS`` jobs (the one that reported least recently goes),
and ``MAX_METERS_PER_JOB`` meters a job, beyond which the oldest meter's
totals are folded into the job's and its id forgotten.

Concurrency: every method takes ``_lock``; ``reads_of`` and the events are
called under it (the metrics take only their own locks).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from cachefsd.diagnose.meter import MeterTotals

MAX_JOBS = 64
MAX_METERS_PER_JOB = 256


@dataclass(frozen=True, slots=True)
class JobReads:
    """A job's reads as counted so far."""

    stall_seconds: float = 0.0
    cache_bytes: float = 0.0
    cold_bytes: float = 0.0

    def since(self, start: JobReads) -> JobReads:
        return JobReads(
            max(0.0, self.stall_seconds - start.stall_seconds),
            max(0.0, self.cache_bytes - start.cache_bytes),
            max(0.0, self.cold_bytes - start.cold_bytes),
        )


class MeterEvents(Protocol):
    def meter_reported(self, job: str, batches: int, data_wait_seconds: float, step_seconds: float) -> None:
        """What a job's meters measured since their last reports (deltas)."""
        ...


@dataclass(frozen=True, slots=True)
class MeteredJob:
    job: str
    totals: MeterTotals
    meters: int
    reads: JobReads | None  # over the metered window; None when the daemon cannot tell this job's reads
    last_report_seconds_ago: float


@dataclass
class _Entry:
    start: JobReads | None
    last_report: float
    retired: MeterTotals = field(default_factory=MeterTotals)
    meters: OrderedDict[str, MeterTotals] = field(default_factory=OrderedDict)

    def totals(self) -> MeterTotals:
        return _sum([self.retired, *self.meters.values()])


class MeterLedger:
    def __init__(
        self,
        reads_of: Callable[[str], JobReads | None],
        events: MeterEvents,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._reads_of = reads_of
        self._events = events
        self._clock = clock
        self._lock = threading.Lock()
        self._jobs: OrderedDict[str, _Entry] = OrderedDict()  # least recently reported first

    def report(self, job: str, meter: str, totals: MeterTotals) -> None:
        """Meter ``meter`` of ``job`` has measured ``totals`` so far."""
        now = self._clock()
        with self._lock:
            entry = self._jobs.get(job)
            if entry is None:
                entry = self._jobs[job] = _Entry(self._reads_of(job), now)
                while len(self._jobs) > MAX_JOBS:
                    self._jobs.popitem(last=False)
            elif entry.start is None:  # the job's reads were counted with others' then
                entry.start = self._reads_of(job)
            self._jobs.move_to_end(job)
            entry.last_report = now
            previous = entry.meters.pop(meter, MeterTotals())
            # Totals only grow; a meter that reports less is ignored, not subtracted.
            latest = MeterTotals(
                max(previous.batches, totals.batches),
                max(previous.data_wait_seconds, totals.data_wait_seconds),
                max(previous.step_seconds, totals.step_seconds),
            )
            entry.meters[meter] = latest
            if len(entry.meters) > MAX_METERS_PER_JOB:
                _, oldest = entry.meters.popitem(last=False)
                entry.retired = _sum([entry.retired, oldest])
            self._events.meter_reported(
                job,
                latest.batches - previous.batches,
                latest.data_wait_seconds - previous.data_wait_seconds,
                latest.step_seconds - previous.step_seconds,
            )

    def jobs(self) -> list[MeteredJob]:
        """Every metered job, the one that reported last first."""
        now = self._clock()
        with self._lock:
            entries = list(reversed(self._jobs.items()))
            out = []
            for job, entry in entries:
                reads = self._reads_of(job)
                window = None if reads is None or entry.start is None else reads.since(entry.start)
                out.append(
                    MeteredJob(job, entry.totals(), len(entry.meters), window, now - entry.last_report)
                )
            return out


def _sum(totals: list[MeterTotals]) -> MeterTotals:
    return MeterTotals(
        sum(t.batches for t in totals),
        sum(t.data_wait_seconds for t in totals),
        sum(t.step_seconds for t in totals),
    )
