"""The loader meter: how long a training loop waits for its next batch.

``watch(loader, mountpoint)`` wraps any iterable of batches (a PyTorch
``DataLoader``, a WebDataset pipeline, a generator) and yields the same
batches. Around each ``next()`` it reads a monotonic clock twice: the time
spent inside is the loop's **data wait**, the time from one batch's arrival
to the next is its **step**. Their ratio is what TensorFlow's input-pipeline
analyzer classes a job by (under 5 %: not input-bound).

The first batch of a pass is left out of both: its wait is the loader
starting (worker processes forking, importing, opening the dataset), paid
once a pass whatever the storage, and it would dominate a short run.

The totals go to the daemon of ``mountpoint`` over its control socket
(``POST /meter``), which names the job from the sender's process (``jobs.py``:
the process group its DataLoader workers share) and sets them beside what
it saw of the same job's reads (``cachefsd doctor``), with the number of
processes that read for the loop (a DataLoader's ``num_workers``; 0 when
the loop's own ``next()`` reads, as with no workers or a plain generator).
A thread of the meter's own posts them when the first batch is in, every
``REPORT_SECONDS``, and once when the pass ends; the loop itself only adds
two clock readings and a few floats per batch. Totals are cumulative per
meter, so a lost report loses nothing.

Measuring never breaks training: nothing the reports do reaches the loop.
A path not under a cachefsd mount, or a daemon that cannot be reached,
costs one logged warning per process and a retry every ``RETRY_SECONDS``;
the end of a pass waits at most ``CLOSE_WAIT_SECONDS`` for its last report.
Only the standard library is imported here.

A pass's thread lives from its first batch to its end: a loader that forks
its workers at ``iter()`` (a DataLoader) forks them before it starts. A
``watch`` nested in another's pass (a validation loop inside an epoch)
forks while the outer one's thread runs, which holds no lock the children use.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol, TypeVar

from cachefsd.control.client import ControlClient, MeterTotals, client_for
from cachefsd.control.mounts import find_mount, not_a_mount

log = logging.getLogger(__name__)

Batch = TypeVar("Batch")

# Often enough for ``doctor`` and a dashboard to follow a run, rarely enough
# that the daemon spends nothing on it (one small request per job a second).
REPORT_SECONDS = 2.0
# A report is a few numbers to a local socket: a daemon that takes longer
# is wedged, and the sender gives up on it rather than queue behind it.
REPORT_TIMEOUT_SECONDS = 2.0
# After a failed report, reports wait this long: a restarted daemon is
# found again, a gone one costs a connect attempt per half minute.
RETRY_SECONDS = 30.0
# How long the end of a pass waits for its last report: a healthy daemon
# answers in a millisecond; a wedged one must not hold the next epoch up.
CLOSE_WAIT_SECONDS = 0.5


class LoaderMeter:
    """The arithmetic of one pass over a loader, on an injected clock. Used
    by one thread (the loop's); ``totals`` may be read from another (one
    attribute read of an immutable value)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._asked_at = 0.0
        self._arrived_at: float | None = None
        self.totals = MeterTotals()

    def asking(self) -> None:
        """The loop calls ``next()`` now."""
        self._asked_at = self._clock()

    def arrived(self) -> None:
        """The batch asked for is here."""
        now = self._clock()
        if self._arrived_at is not None:  # the first batch is the loader starting
            totals = self.totals
            self.totals = MeterTotals(
                totals.batches + 1,
                totals.data_wait_seconds + (now - self._asked_at),
                totals.step_seconds + (now - self._arrived_at),
            )
        self._arrived_at = now


class TotalsSink(Protocol):
    """Where a meter's totals go; raises ``ControlError`` when they cannot."""

    def send(self, meter_id: str, totals: MeterTotals, readers: int) -> None: ...


class DaemonSink:
    """The daemon of the mount at or above a path."""

    def __init__(self, mountpoint: str | os.PathLike[str]) -> None:
        self._mountpoint = mountpoint
        self._client: ControlClient | None = None

    def send(self, meter_id: str, totals: MeterTotals, readers: int) -> None:
        if self._client is None:
            mount = find_mount(self._mountpoint)
            if mount is None:
                raise not_a_mount(self._mountpoint)
            self._client = client_for(mount, REPORT_TIMEOUT_SECONDS)
        self._client.meter(meter_id, readers, totals)


class _Backoff:
    """Process-wide: after a failed report, none is tried for
    ``RETRY_SECONDS`` (a daemon that is gone is not asked again every few
    seconds by every meter); the first failure warns, once per process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._until = 0.0
        self._warned = False

    def allows(self, now: float) -> bool:
        with self._lock:
            return now >= self._until

    def failed(self, now: float, why: object) -> None:
        with self._lock:
            self._until = now + RETRY_SECONDS
            warn, self._warned = not self._warned, True
        if warn:
            log.warning("cachefsd: the loader meter reports nothing for now: %s", why)


_backoff = _Backoff()


class Reporter:
    """Posts a meter's totals from a thread of its own: once at ``start``,
    every ``interval`` seconds, and a last time when ``close`` is called,
    which waits at most ``CLOSE_WAIT_SECONDS`` for it. The loop's thread
    never sends: a daemon that is slow or gone costs the loop nothing."""

    def __init__(
        self,
        meter: LoaderMeter,
        sink: TotalsSink,
        readers: int,
        interval: float = REPORT_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._meter = meter
        self._sink = sink
        self._readers = readers
        self._interval = interval
        self._clock = clock
        self._id = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Begin reporting. Called once the loader has started its workers,
        so that no thread of ours exists when they fork."""
        self._thread = threading.Thread(target=self._run, name="cachefsd-meter", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(CLOSE_WAIT_SECONDS)

    def _run(self) -> None:
        self._send()
        while not self._stop.wait(self._interval):
            self._send()
        self._send()  # the pass is over: its final totals

    def _send(self) -> None:
        now = self._clock()
        if not _backoff.allows(now):
            return
        try:
            self._sink.send(self._id, self._meter.totals, self._readers)
        except Exception as exc:  # whatever it is, training goes on
            _backoff.failed(now, exc)


def watch(
    loader: Iterable[Batch],
    mountpoint: str | os.PathLike[str],
    sink: TotalsSink | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Iterator[Batch]:
    """The batches of ``loader``, unchanged, while measuring the loop's data
    wait and step and reporting them to the daemon of ``mountpoint`` (or
    ``sink``). One call is one pass: call it every epoch, as ``iter`` is.

        for batch in cachefsd.diagnose.watch(loader, "/mnt/imagenet"):
            train_step(batch)
    """
    meter = LoaderMeter(clock)
    readers = int(getattr(loader, "num_workers", 0) or 0)  # a DataLoader's workers; 0: the loop itself
    reporter = Reporter(meter, DaemonSink(mountpoint) if sink is None else sink, readers)
    batches = iter(loader)
    started = False
    try:
        while True:
            meter.asking()
            try:
                batch = next(batches)
            except StopIteration:
                return
            meter.arrived()
            if not started:
                started = True
                reporter.start()
            yield batch
    finally:
        if started:
            reporter.close()
