"""The daemon's side of the loader meter: per job and mount, what its meters
reported, set beside what the daemon saw of the same job's reads over the
same time.

A job (``jobs.py``: a process group) may run several meters: one per pass
when ``watch`` wraps each epoch, one per rank of a ``torchrun`` job. Each
reports cumulative totals under an id of its own, so the job's totals are
the sum of its meters' latest, and a report lost or repeated changes
nothing. A meter also says how many processes read for its loop (a
DataLoader's workers, 0 for the loop itself); their time (``_Meter.reader_seconds``)
is what the job's read stall, summed over its readers, is a share of. The job's reads (read
stall, bytes from the cache and from the store, as the metrics count them)
are taken when its first report comes and again when asked, so both views
cover the same window. A meter reports to the mount its loop reads, and
``doctor`` of that mount shows it.

Bounded: ``MAX_JOBS`` (job, mount) entries, the one that reported least
recently going first; ``MAX_METERS_PER_JOB`` meters an entry, beyond which
the one that reported least recently (a pass long over: a meter lives for
one pass) is folded into the entry's totals. The metrics get each report's
increase over the same meter's last report, remembered for
``MAX_METERS_REMEMBERED`` meters, so that a forgotten entry that reports
again is not counted twice.

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

from cachefsd.control.client import MeterTotals

MAX_JOBS = 64
MAX_METERS_PER_JOB = 256
MAX_METERS_REMEMBERED = 16384


@dataclass(frozen=True, slots=True)
class JobReads:
    """A job's reads as counted so far: the time they took in the daemon,
    the part of it they waited on the store, and their bytes by source."""

    read_seconds: float = 0.0
    stall_seconds: float = 0.0
    cache_bytes: float = 0.0
    cold_bytes: float = 0.0

    def since(self, start: JobReads) -> JobReads:
        return JobReads(
            max(0.0, self.read_seconds - start.read_seconds),
            max(0.0, self.stall_seconds - start.stall_seconds),
            max(0.0, self.cache_bytes - start.cache_bytes),
            max(0.0, self.cold_bytes - start.cold_bytes),
        )


class MeterEvents(Protocol):
    def meter_reported(self, job: str, batches: int, data_wait_seconds: float, step_seconds: float) -> None:
        """What a job's meters measured since their last reports (increases)."""
        ...


@dataclass(frozen=True, slots=True)
class MeteredJob:
    job: str
    totals: MeterTotals
    reader_seconds: float  # the time the processes reading for its loops had (``_Meter.reader_seconds``)
    meters: int
    reads: JobReads | None  # over the metered window; None when the daemon cannot tell this job's reads
    last_report_seconds_ago: float


@dataclass(frozen=True, slots=True)
class _Meter:
    totals: MeterTotals
    readers: int

    def reader_seconds(self) -> float:
        """The time its readers had: workers read all along the steps; a loop
        that reads itself does so only inside ``next()``."""
        if self.readers == 0:
            return self.totals.data_wait_seconds
        return self.totals.step_seconds * self.readers


@dataclass
class _Entry:
    start: JobReads | None
    last_report: float
    retired: MeterTotals = field(default_factory=MeterTotals)
    retired_reader_seconds: float = 0.0
    meters: OrderedDict[str, _Meter] = field(default_factory=OrderedDict)

    def totals(self) -> MeterTotals:
        return _sum([self.retired, *(meter.totals for meter in self.meters.values())])

    def reader_seconds(self) -> float:
        return self.retired_reader_seconds + sum(meter.reader_seconds() for meter in self.meters.values())


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
        self._entries: OrderedDict[tuple[str, str], _Entry] = OrderedDict()  # least recently reported first
        self._last: OrderedDict[str, MeterTotals] = OrderedDict()  # meter -> its last totals

    def report(self, job: str, mount: str, meter: str, totals: MeterTotals, readers: int) -> None:
        """Meter ``meter`` of ``job``, reading through ``mount`` with
        ``readers`` processes, has measured ``totals`` so far."""
        now = self._clock()
        with self._lock:
            key = (job, mount)
            entry = self._entries.get(key)
            if entry is None:
                entry = self._entries[key] = _Entry(self._reads_of(job), now)
                while len(self._entries) > MAX_JOBS:
                    self._entries.popitem(last=False)
            elif entry.start is None:  # the job's reads were counted with others' then
                entry.start = self._reads_of(job)
            self._entries.move_to_end(key)
            entry.last_report = now
            previous = self._last.pop(meter, MeterTotals())
            # Totals only grow; a meter that reports less is ignored, not subtracted.
            latest = MeterTotals(
                max(previous.batches, totals.batches),
                max(previous.data_wait_seconds, totals.data_wait_seconds),
                max(previous.step_seconds, totals.step_seconds),
            )
            self._last[meter] = latest
            if len(self._last) > MAX_METERS_REMEMBERED:
                self._last.popitem(last=False)
            entry.meters.pop(meter, None)
            entry.meters[meter] = _Meter(latest, readers)
            if len(entry.meters) > MAX_METERS_PER_JOB:
                _, oldest = entry.meters.popitem(last=False)
                entry.retired = _sum([entry.retired, oldest.totals])
                entry.retired_reader_seconds += oldest.reader_seconds()
            self._events.meter_reported(
                job,
                latest.batches - previous.batches,
                latest.data_wait_seconds - previous.data_wait_seconds,
                latest.step_seconds - previous.step_seconds,
            )

    def jobs(self, mount: str) -> list[MeteredJob]:
        """Every job metered through ``mount``, the one that reported last first."""
        now = self._clock()
        with self._lock:
            out = []
            for (job, through), entry in reversed(self._entries.items()):
                if through != mount:
                    continue
                reads = self._reads_of(job)
                window = None if reads is None or entry.start is None else reads.since(entry.start)
                age = now - entry.last_report
                meters = len(entry.meters)
                out.append(MeteredJob(job, entry.totals(), entry.reader_seconds(), meters, window, age))
            return out


def _sum(totals: list[MeterTotals]) -> MeterTotals:
    return MeterTotals(
        sum(t.batches for t in totals),
        sum(t.data_wait_seconds for t in totals),
        sum(t.step_seconds for t in totals),
    )
