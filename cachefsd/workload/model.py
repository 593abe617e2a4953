"""The workload model: what each workload will read next, learned from the
events a mount sees. The façade a mount uses; the rules live in the
modules it composes, each readable alone:

- ``identity.py``: jobs and workloads (one job reading one dataset), roots,
  merges, idle jobs forgotten;
- ``epochs.py``: a workload's working set, epochs, unread files, and the
  plan it follows;
- ``plans.py``: an order of files (hint, replay) and whether to trust it;
- ``streams.py``: sequential readers inside large files.

The model is fed every directory listing, open and read (path, offset,
size, time, and the job of the reading process) and answers: what is read
next (``predict``, for the prefetcher), when each file a trusted plan
places is read next (``planned``, which the prefetcher hands to the
eviction policy), which epoch it is (``current``, an ``EpochClock``),
whether another job is still to read a file this epoch
(``wanted_elsewhere``, ``planned_elsewhere``), what a job read
(``observed``, for ``cachefsd doctor``) and ``stats``.

Predictions, per workload, in priority order: a live stream's next window;
a trusted plan's remaining order (a hint, else a replay of the previous
epoch); the epoch's unread files in listing order. ``predict`` interleaves
workloads round-robin, one prediction each in turn, and skips the
workloads idle for ``JOB_IDLE_SECONDS``.

Units. ``Prediction.distance`` and the distances of ``planned`` count FILES:
the number of other files the workload is predicted to open before this one
is needed (0: needed now, as for a stream's next window). The prefetcher
turns them into positions on its own count of opens, which do not move as
the reader advances (what an eviction policy caching them needs).

Cost: every event is O(depth of the path), O(1) in practice, except an
open or hint that ends an epoch, which copies the working set
(``epochs.py``); ``predict`` is O(limit + workloads + streams).

Concurrency: ``_lock`` guards every field and everything the model owns
(``Workloads`` and, through it, each workload's ``Epochs``, ``Streams``
and plans, none of which has a lock of its own). It is a leaf lock: nothing
outside the model is called while holding it. Methods with the ``_locked``
suffix need it held. Nothing here does I/O, reads a clock or starts
threads: time comes in with the events, and ``_now`` is the latest event
time seen.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Final

from cachefsd.jobs import UNKNOWN_JOB
from cachefsd.workload.epochs import add_files
from cachefsd.workload.identity import Workload, Workloads, clean, common_directory
from cachefsd.workload.streams import STREAM_MAX_WINDOW

# A whole file predicted by a plan or the unread set: fetch at most its first
# stream-sized window (the consumer clips to the object); a stream takes
# over once the reader is in the file. Also used when the size is unknown.
FILE_PREDICTION_BYTES: Final = STREAM_MAX_WINDOW
# stats() details the most recently active workloads only: a /stats answer
# and the table ``cachefsd stats`` draws stay small on a node of many jobs.
STATS_MAX_WORKLOADS: Final = 32


@dataclass(frozen=True, slots=True)
class Prediction:
    """A byte range predicted to be read: ``[offset, offset + length)`` of
    ``path``, clipped by the consumer to the object's size. ``distance`` is
    the number of other files the workload is predicted to open first (0:
    now); ``planned`` when it comes from a plan (hint or replay), which
    places the file exactly, rather than from the unread set, which only
    estimates. ``workload`` (``identity.workload_id``) and ``epoch`` say
    whose pass it belongs to: a consumer that keeps predictions across
    rounds drops them when that workload turns."""

    path: str
    offset: int
    length: int
    distance: float
    planned: bool = False
    workload: str = field(default="", compare=False)
    epoch: int = field(default=0, compare=False)


@dataclass(frozen=True)
class ObservedOrder:
    """What ``observed`` saw of a job's reads of its largest dataset:
    ``order`` is a sample of one epoch's files in the order they were
    opened, one in about ``sample_every`` of the working set's."""

    workload: str
    order: list[str]
    sizes: dict[str, int]
    sample_every: int
    working_set_files: int
    working_set_bytes: int
    repeats: bool  # the last epoch replayed the one before (no shuffle)
    source: str  # what the prefetcher follows: "hint", "replay" or "unknown"
    epoch: int


class WorkloadModel:
    """Learns workloads, working sets, epochs, streams and orders from mount
    events; see the module docstring. Thread-safe; usable as an ``EpochClock``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Guarded by _lock:
        self._workloads = Workloads()
        self._now = float("-inf")
        self._max_epoch = 0

    # -- events ------------------------------------------------------------

    def listed(self, directory: str, files: dict[str, int], now: float, job: str = UNKNOWN_JOB) -> None:
        """``directory`` was listed for ``job`` at ``now``; ``files`` maps
        each child FILE's path to its size. The workloads of other jobs that
        hold the directory learn of its files too: a working set is the dataset's."""
        directory = clean(directory)
        listed = {clean(name): size for name, size in files.items()}
        with self._lock:
            self._now = max(self._now, now)
            mine = self._workloads.of_job(job, self._now)
            workload = self._workloads.listed(mine, directory)
            workload.last_event = max(workload.last_event, now)  # listed, not engaged: kept a while
            holders = [workload]
            for other in self._workloads.jobs().values():
                held = None if other is mine else other.holds(directory)
                if held is not None:
                    holders.append(held)
            add_files([holder.epochs for holder in holders], listed)

    def opened(self, path: str, size: int, now: float, job: str = UNKNOWN_JOB) -> None:
        """``path`` (``size`` bytes, -1 if unknown) was opened for reading at ``now`` by ``job``."""
        path = clean(path)
        with self._lock:
            workload = self._touch_locked(path, now, job)
            if workload.epochs.opened(path, size):
                self._turned_locked(workload)

    def read(self, path: str, offset: int, length: int, now: float, job: str = UNKNOWN_JOB) -> None:
        """``length`` bytes of ``path`` at ``offset`` were read at ``now`` by ``job``."""
        path = clean(path)
        with self._lock:
            workload = self._touch_locked(path, now, job)
            size = workload.epochs.working.get(path, -1)
            workload.streams.read(path, offset, length, size, now)

    def satisfied(self, path: str, workload: str) -> bool:
        """``path``, predicted for ``workload`` (``Prediction.workload``),
        needs nothing fetched (it is cached): stop predicting it until that
        workload opens it or starts a new epoch (a planned one, until its
        turn nears). Whether this is news (it was not satisfied already)."""
        path = clean(path)
        with self._lock:
            found = self._workloads.by_id(workload)
            return found is not None and found.epochs.satisfy(path)

    def hint(self, order: list[str], now: float, job: str = UNKNOWN_JOB) -> None:
        """The exact order of the current (or next) epoch of ``job``'s
        workload that ``order[0]`` belongs to; replaces that workload's
        previous hint, and no other's. Paths of other workloads are ignored;
        an empty order is a no-op."""
        paths = [clean(path) for path in order]
        if not paths:
            return
        with self._lock:
            mine = self._workloads.of_job(job, self._now)
            roots = {self._workloads.root_of(mine, path) for path in paths}
            if len(roots) > 1:
                # One loader's order over what were guessed to be several workloads.
                self._workloads.claim_root(mine, common_directory(sorted(roots)))
            workload = self._touch_locked(paths[0], now, job)
            hinted = [path for path in paths if self._workloads.root_of(mine, path) == workload.root]
            if workload.epochs.hinted(hinted):
                self._turned_locked(workload)

    # -- questions ---------------------------------------------------------

    def predict(self, limit: int) -> list[Prediction]:
        """Up to ``limit`` predicted reads, workloads interleaved round-robin,
        each one's nearest predicted use first (streams, plan, unread files)."""
        out: list[Prediction] = []
        if limit <= 0:
            return out
        with self._lock:
            sources = [
                self._predictions_locked(workload, limit)
                for workload in self._workloads.all()
                if workload.active(self._now)
            ]
            while sources and len(out) < limit:
                alive = []
                for source in sources:
                    prediction = next(source, None)
                    if prediction is None:
                        continue
                    alive.append(source)
                    out.append(prediction)
                    if len(out) >= limit:
                        break
                sources = alive
        return out

    def planned(self) -> list[tuple[str, float]]:
        """Every file a trusted plan (hint, replay) places and its workload
        has not opened this epoch, with its distance (files to be opened
        before it), over all workloads. O(plan lengths): for planning what
        is already cached, once per plan, not per round."""
        out: list[tuple[str, float]] = []
        with self._lock:
            for workload in self._workloads.all():
                out.extend(workload.epochs.planned())
        return out

    def current(self) -> int:
        """``EpochClock``: the highest epoch of any workload. Never decreases
        (epochs only grow, and the highest is kept when its workload is
        forgotten); with one workload it is that workload's epoch."""
        with self._lock:
            return self._max_epoch

    def wanted_elsewhere(self, path: str, job: str = UNKNOWN_JOB) -> bool:
        """Whether a workload of a job other than ``job``, reading in the
        last ``JOB_IDLE_SECONDS``, still has ``path`` to read this epoch: a
        block of it read now is due again (``policy.DueElsewhere``). Two
        jobs of a sweep on one dataset each read every file once an epoch,
        in orders of their own. O(jobs)."""
        # Asked at every FUSE read. With one job, it is the asker (its read,
        # told first, made it one): the usual node answers without the lock.
        if self._workloads.job_count() < 2:
            return False
        path = clean(path)
        with self._lock:
            for other in self._workloads.jobs().values():
                if other.job == job:
                    continue
                workload = other.existing(path)
                if (
                    workload is not None
                    and workload.active(self._now)
                    and workload.epochs.still_to_read(path)
                ):
                    return True
            return False

    def planned_elsewhere(self, path: str, job: str = UNKNOWN_JOB) -> float | None:
        """The soonest a trusted plan (hint, replay) of a workload of another
        job places ``path`` that the workload has not opened this epoch, in
        that workload's files to open first (as ``planned``); None if none
        does. A read consumes a block's plan, and the cache keeps one plan a
        block: when two jobs plan it, the one still to read it plans it
        again with this. O(jobs)."""
        path = clean(path)
        soonest: float | None = None
        with self._lock:
            for other in self._workloads.jobs().values():
                if other.job == job:
                    continue
                workload = other.existing(path)
                distance = None if workload is None else workload.epochs.planned_at(path)
                if distance is not None:
                    soonest = distance if soonest is None else min(soonest, distance)
        return soonest

    def jobs(self) -> set[str]:
        """The jobs (``cachefsd/jobs.py``) the model keeps workloads of: those
        that read in the last ``JOB_IDLE_SECONDS``, or since the last new job came."""
        with self._lock:
            return set(self._workloads.jobs())

    def job_epochs(self) -> dict[str, int]:
        """Each job (``cachefsd/jobs.py``) -> the highest epoch of its workloads."""
        with self._lock:
            return {
                job: max(workload.epochs.epoch for workload in workloads.by_root.values())
                for job, workloads in self._workloads.jobs().items()
                if workloads.by_root
            }

    def epoch_of(self, workload: str) -> int | None:
        """The epoch of the workload named ``workload`` (``Prediction.workload``),
        or of the one it was merged into; None once it is gone (idle)."""
        with self._lock:
            found = self._workloads.named(workload)
            return None if found is None else found.epochs.epoch

    def workload_of(self, path: str, job: str = UNKNOWN_JOB) -> str | None:
        """The name (``workload_id``) of ``job``'s workload that ``path`` belongs to now, None if none yet."""
        with self._lock:
            found = self._workloads.known(job).existing(clean(path))
            return None if found is None else found.id

    def take_turns(self) -> dict[str, int]:
        """The workloads that started an epoch since the last call -> their
        epoch now: one workload's new pass says nothing of another's."""
        with self._lock:
            return self._workloads.take_turns()

    def observed(self, job: str, max_files: int) -> ObservedOrder | None:
        """The read order of ``job``'s largest workload (by working set): its
        last whole epoch, else this one so far, thinned to at most about
        ``max_files`` files by a hash of their names (the same files every
        epoch, so a replay of the sample behaves as one of the whole);
        None if the job has no workload. O(epoch), of which only C-speed
        copies (a few ms per million files) hold the lock that opens take."""
        with self._lock:
            mine = self._workloads.jobs().get(job)
            if mine is None or not mine.by_root:
                return None
            largest = max(mine.by_root.values(), key=lambda candidate: len(candidate.epochs.working))
            epochs = largest.epochs
            order = list(epochs.replay.order if epochs.replay is not None else epochs.order)
            sizes = list(epochs.working.values())
            source = epochs.order_source()
            repeats = epochs.replay is not None and epochs.replay.judged_good()
            name, epoch = largest.id, epochs.epoch
        every = max(1, -(-len(sizes) // max_files))
        sample = [path for path in order if every == 1 or zlib.crc32(path.encode()) % every == 0]
        with self._lock:
            sampled_sizes = {path: epochs.working.get(path, -1) for path in sample}
        return ObservedOrder(
            workload=name,
            order=sample,
            sizes=sampled_sizes,
            sample_every=every,
            working_set_files=len(sizes),
            working_set_bytes=sum(size for size in sizes if size > 0),
            repeats=repeats,
            source=source,
            epoch=epoch,
        )

    def stats(self) -> dict[str, object]:
        """Totals over all workloads (``workloads`` counts them), and details of
        the most recently active ones (``per_workload``, by workload name).

        ``hint_coverage`` is the share of this epoch's opens (all workloads)
        that came where a hint predicted them: 0.0 without hints, near 1.0
        when loaders send exact hints.
        """
        with self._lock:
            workloads = self._workloads.all()
            opens = sum(len(workload.epochs.order) for workload in workloads)
            hinted = sum(
                workload.epochs.hint.matched for workload in workloads if workload.epochs.hint is not None
            )
            active = sorted(workloads, key=lambda workload: workload.last_event, reverse=True)
            return {
                "epoch": self._max_epoch,
                "workloads": len(workloads),
                "working_set_files": sum(len(workload.epochs.working) for workload in workloads),
                "unread_files": sum(workload.epochs.unread_count() for workload in workloads),
                "read_this_epoch_files": opens,
                "active_streams": sum(workload.streams.live(self._now) for workload in workloads),
                "hint_coverage": hinted / opens if opens else 0.0,
                "per_workload": {
                    workload.id: self._workload_stats_locked(workload)
                    for workload in active[:STATS_MAX_WORKLOADS]
                },
            }

    # -- helpers -----------------------------------------------------------

    def _touch_locked(self, path: str, now: float, job: str) -> Workload:
        """The workload an open or read of the FILE ``path`` by ``job`` at ``now`` belongs to, engaged."""
        self._now = max(self._now, now)
        workload = self._workloads.of_file(self._workloads.of_job(job, self._now), path)
        workload.engaged = True
        workload.last_event = max(workload.last_event, now)
        return workload

    def _turned_locked(self, workload: Workload) -> None:
        self._max_epoch = max(self._max_epoch, workload.epochs.epoch)
        self._workloads.turned(workload)

    def _predictions_locked(self, workload: Workload, limit: int) -> Iterator[Prediction]:
        """One workload's predictions, nearest first. Consumed under the lock."""
        name, epoch = workload.id, workload.epochs.epoch
        for path, offset, length in workload.streams.windows(self._now):
            yield Prediction(path, offset, length, 0.0, workload=name, epoch=epoch)
        working = workload.epochs.working
        for path, distance, planned in workload.epochs.files(limit):
            size = working.get(path, -1)
            length = FILE_PREDICTION_BYTES if size < 0 else min(size, FILE_PREDICTION_BYTES)
            yield Prediction(path, 0, length, distance, planned, name, epoch)

    def _workload_stats_locked(self, workload: Workload) -> dict[str, object]:
        epochs = workload.epochs
        return {
            "epoch": epochs.epoch,
            "working_set_files": len(epochs.working),
            "unread_files": epochs.unread_count(),
            "read_this_epoch_files": len(epochs.order),
            "order": epochs.order_source(),
            "hint_files": 0 if epochs.hint is None else len(epochs.hint.order),
            "hint_matched": 0 if epochs.hint is None else epochs.hint.matched,
            "active_streams": workload.streams.live(self._now),
        }
