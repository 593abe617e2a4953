"""The access model: what a training job will read next, learned from the
events the mount sees.

Training reads a dataset in epochs: every file once per epoch, usually in a
fresh shuffled order, sometimes in the same order every time (a loader that
does not shuffle, shards read in sequence), and large files (tar shards,
arrow or numpy files) front to back. The model is fed every directory
listing, open and read (path, offset, size, time) and answers four
questions: which files are still to be read this epoch (``unread``), what is
read next (``predict``, for the prefetcher), when each file a trusted
plan places is read next (``planned``, which the prefetcher hands to the
eviction policy), and which epoch it is (``current``, an ``EpochClock``).

Jobs. Several jobs may read one mount: different prefixes, or one prefix
(a sweep). Every piece of state below is kept per job, and a job is the
caller that reads (``jobs.py``: the readers' process group) and a root
directory, named ``caller:root`` (the root alone when the caller is
unknown). Of one caller, a path belongs to the job whose root is its
DEEPEST ancestor directory that already is a job root. When no job root is
an ancestor, a new root is made (the same for every caller: which
directories were listed is known to all):

1. if an ancestor directory was listed, the deepest listed ancestor, moved
   up while its parent was listed too (a recursive scan such as ImageFolder's
   lists ``train`` and then every ``train/<class>``: the job is ``train``);
2. otherwise the first path component (``a/x/1.jpg`` -> ``a``);
3. a file directly at the mount root belongs to the job ``""``.

The mount root itself never joins a chain of listed directories: a human
``ls`` of the mount would otherwise merge every job on it into one. The
price is that a dataset whose class folders sit directly at the mount root
is modelled as one job per folder (each still gets its own epochs, unread
set and replayed order) until a hint says otherwise: one hint is one
loader's order, so a hint whose paths fall in several jobs makes their
common directory one job (the mount root, for those class folders), which
then also holds every path no deeper job claims. A listing that makes a new root above existing
listing-made roots (a child listed before its parent) merges them into it.
Roots, once made, are kept while their caller reads: the first event of a
new caller (every shell command is one) forgets the callers idle for
``JOB_IDLE_SECONDS``, with their jobs.

Epochs. A job's epoch ends when a file it already opened this epoch is
opened again AND at least ``MIN_EPOCH_FRACTION`` of the reference size has
been opened this epoch; the reference is the job's working set, or the
previous epoch's file count when that is smaller (a distributed sampler
gives each node a share of the dataset, as in ``ObservedEpochs``). A
re-open of one of the last few files opened is a peek (a loader that opens
a file twice to read its header), never a boundary. Many reads after one
open count once: only opens feed epochs. A new hint also starts an epoch,
unless the current one has barely begun (then the hint joins it). Epochs
are numbered from 0, like ``ObservedEpochs``.

Working set. A working set is the dataset's: a listing reaches every job
that holds its directory, and a caller's new job starts with the working
set another caller's job of the same root has. Listings are the first guess (so the unread set, and with it
prediction, is useful from the first open of epoch 0); files opened without
having been listed join it. It only grows: datasets are immutable, and a
stale entry costs one useless prediction, which the prefetcher drops when
the file is not found.

Predictions, per job, in priority order:

1. sequential streams inside large files: once ``STREAM_CONFIRM_BYTES``
   have been read contiguously, the window after the last byte read. The window starts at
   ``STREAM_INITIAL_WINDOW`` and doubles each time the reader consumes a
   whole window, up to ``STREAM_MAX_WINDOW`` (Mountpoint for S3 grows its
   read window the same way); a non-contiguous read starts a new stream;
2. a hint's remaining order: the loader told us the order; follow it from
   the reader's position, skipping what was read;
3. a replayed order: when this epoch's opens so far match the previous
   epoch's order (or the previous epoch matched the one before it), the rest
   of the previous epoch's order;
4. the unread files of the epoch in listing order: "unread, order unknown".

Files the prefetcher reports ``satisfied`` (wholly cached) are left out of
2-4 until they are opened or the epoch ends: with the whole dataset cached,
a round would otherwise rebuild thousands of useless predictions (tens of
times a second, holding the GIL that every FUSE request needs). A planned
one comes back once its turn is ``PLAN_RECHECK_FILES`` away, in case it was
evicted since.

A plan (hint or replay) is trusted while at least a threshold fraction of
the opens it has seen came at about the position it predicted (within
``_slack``); an untrusted plan is ignored and the next source is used, so a
wrong or stale hint costs the bandwidth of a few predictions, nothing else.
``predict`` interleaves jobs round-robin, one prediction each in turn.

Units. ``Prediction.distance`` and the distances of ``planned`` count FILES:
the number of other files the job is predicted to open before this one is
needed (0: needed now, as for a stream's next window). The prefetcher turns
them into positions on its own count of opens, which do not move as the
reader advances (what an eviction policy caching them needs).

Cost: every event is O(depth of the path) (which is O(1) in practice); an
epoch boundary copies the working set once per epoch (a dict copy, about
30 ms per million files), amortised O(1) per open since an epoch holds at
least ``MIN_EPOCH_FRACTION`` of it; ``predict`` is
O(limit + jobs + streams), plus skipping the holes reads leave in a job's
unread dict (C-speed, about 1 ms per million in the worst case).

Concurrency: all state is guarded by ``_lock``, a leaf lock (nothing is
called while holding it). Methods with the ``_locked`` suffix need it held.
Nothing here does I/O, reads a clock or starts threads: time comes in with
the events, and ``_now`` is the latest event time seen.
"""

from __future__ import annotations

import os
import threading
import zlib
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Final

from cachefsd.jobs import UNKNOWN_JOB

# Half of the reference must have been opened before a re-open ends an
# epoch: a real new pass starts after (nearly) everything was read, while a
# re-read inside an epoch (a retry, a second crop, a sample referencing a
# file twice) can come at any time; requiring half halves the window in
# which one can end an epoch early.
MIN_EPOCH_FRACTION: Final = 0.5

# A re-open of one of the last ``min(REOPEN_PEEK_WINDOW, opens // REOPEN_PEEK_DIVISOR)``
# files opened is a peek, not a new pass. DataLoader workers interleave their
# opens, so a worker's second open of a file can come a few dozen opens after
# its first; a new pass starting with one of those files instead (probability
# about 1/16 under shuffling) only delays the boundary by one open.
REOPEN_PEEK_WINDOW: Final = 32
REOPEN_PEEK_DIVISOR: Final = 16

# First window of a sequential stream: 1 MiB, like Mountpoint for S3's
# initial read window. It grows while the stream is confirmed, so a stream
# predicts 8 MiB when it first does (``STREAM_CONFIRM_BYTES``).
STREAM_INITIAL_WINDOW: Final = 1 << 20
# Largest window: 64 MiB is 16 default 4 MiB blocks in flight for one
# stream, enough to fill a fast link from an object store (about 100 MB/s
# per GET), while the prefetcher's global byte budget bounds the total.
STREAM_MAX_WINDOW: Final = 64 << 20
# Bytes read contiguously that make a stream. Not a count of reads: the
# kernel sends one 1 MiB pread as several contiguous READs, and one mmap
# fault as a read-around of up to its read-ahead (a block, 4 MiB); two
# READs made every random reader a stream, fetched ahead by up to two
# runs (1.6 GB for ten 1 MiB preads of a 6 GiB file).
STREAM_CONFIRM_BYTES: Final = 8 << 20
# Files up to this size are one default block, fetched whole by their first
# read; only larger files get streams.
STREAM_MIN_FILE_BYTES: Final = 4 << 20
# A read this far past the stream's end still continues it: reads served by
# the kernel page cache (kernel_cache, readahead) never reach us and leave gaps.
STREAM_FORWARD_SLACK: Final = 1 << 20
# ... and this far before it: FUSE threads may deliver a reader's reads out of order.
STREAM_BACKWARD_SLACK: Final = 1 << 20
# Streams tracked per job, least recently read dropped first: a loader keeps
# one or two files open per worker; 64 covers 32 workers with room to spare.
MAX_STREAMS_PER_JOB: Final = 64
# A stream not read for this long is finished or abandoned: stop predicting it.
# Long enough for a slow training step between two reads of one shard.
STREAM_IDLE_SECONDS: Final = 30.0

# A job with no event for this long (finished, or evaluating elsewhere)
# predicts nothing, so the prefetcher stops fetching its leftovers. Training
# reads continuously; five minutes covers checkpointing and evaluation pauses.
JOB_IDLE_SECONDS: Final = 300.0
# A job that starts on a dataset another caller's job listed gets its
# unread set after this many opens (before, it may be a shell's ``cat``).
SEED_UNREAD_OPENS: Final = 16

# A whole file predicted by a plan or the unread set: fetch at most its first
# stream-sized window (the consumer clips to the object); a stream takes
# over once the reader is in the file. Also used when the size is unknown.
FILE_PREDICTION_BYTES: Final = STREAM_MAX_WINDOW

# A plan is judged only after this many opens; before that a hint is trusted
# (the loader said so) and a replay is trusted only if the previous epoch
# already replayed the one before it. Eight opens is a batch or two: little
# bandwidth is wasted on a wrong plan, and a random order will not match by chance.
PLAN_PROBATION_OPENS: Final = 8
# "Mostly matches": a replay needs 90 % of the opens at their predicted
# place: loaders that do not shuffle repeat their order exactly (up to the
# slack below), and anything lower is better treated as unknown order.
REPLAY_MIN_MATCH: Final = 0.9
# A hint is kept while half of the opens follow it: the loader knows its order,
# so a lower rate means the hint is stale or for another job.
HINT_MIN_MATCH: Final = 0.5
# An open matches a plan when it is within plan length // PLAN_SLACK_DIVISOR
# places (at least 1) of its predicted position. DataLoader workers open the
# files of several batches at once, so an exact hint is read up to workers x
# prefetch_factor x batch size places out of order (8 x 2 x 256 = 4,096, more
# with several ranks on the node); a random order falls within n/8 of its
# place with probability about 1/4, far below the thresholds. (A cap of 512
# places made an exact hint of a 100k-file dataset at batch 256 look wrong.)
PLAN_SLACK_DIVISOR: Final = 8
# predict() looks at most this many plan entries per prediction asked for,
# so a plan whose head was read out of order cannot make it O(plan).
PLAN_SCAN_FACTOR: Final = 4
# A planned file found wholly cached is predicted again once it is this many
# files from its turn: the plan's own sooner files may have evicted it since
# (Belady gives up the farthest), and then it must be fetched again before
# its read. The prefetcher's check of a cached file is a dictionary lookup
# per block, so the cost is this many lookups per job and round.
PLAN_RECHECK_FILES: Final = 64
# A hint arriving when the current epoch has opened at most this fraction of
# the hint's length joins the epoch instead of starting a new one: the
# loader's pass began (and the re-open rule noticed) just before the hint came.
HINT_JOIN_FRACTION: Final = 1 / 16
# stats() details the most recently active jobs only.
STATS_MAX_JOBS: Final = 32


@dataclass(frozen=True, slots=True)
class Prediction:
    """A byte range predicted to be read: ``[offset, offset + length)`` of
    ``path``, clipped by the consumer to the object's size. ``distance`` is
    the number of other files the job is predicted to open first (0: now);
    ``planned`` when it comes from a plan (hint or replay), which places the
    file exactly, rather than from the unread set, which only estimates.
    ``job`` and ``epoch`` say whose pass it belongs to: a consumer that
    keeps predictions across rounds drops them when that job turns."""

    path: str
    offset: int
    length: int
    distance: float
    planned: bool = False
    job: str = field(default="", compare=False)
    epoch: int = field(default=0, compare=False)


@dataclass
class _Stream:
    """A sequential reader inside one file."""

    start: int  # where its first read began
    end: int  # one past the last byte read
    size: int  # file size, -1 if unknown
    last_read: float
    window: int = STREAM_INITIAL_WINDOW
    consumed: int = 0  # bytes read since the window last grew


class _Plan:
    """An order of files for one epoch (a hint, or the previous epoch's to
    replay) and how well the reader has followed it."""

    def __init__(self, order: list[str], index: dict[str, int], min_match: float, trusted: bool) -> None:
        self.order = order
        # path -> its (first) position in order.
        self.index = index
        self.min_match = min_match
        # The verdict before PLAN_PROBATION_OPENS opens were seen.
        self.trusted_at_start = trusted
        self.slack = max(1, len(order) // PLAN_SLACK_DIVISOR)
        self.low = 0  # entries before this were all read this epoch
        self.observed = 0
        self.matched = 0

    @classmethod
    def of(cls, order: list[str], min_match: float, trusted: bool) -> _Plan:
        index: dict[str, int] = {}
        for position, path in enumerate(order):
            index.setdefault(path, position)
        return cls(order, index, min_match, trusted)

    def observe(self, position: int, path: str) -> None:
        """``path`` was the job's ``position``-th open (0-based) of the epoch."""
        self.observed += 1
        planned = self.index.get(path)
        if planned is not None and abs(planned - position) <= self.slack:
            self.matched += 1

    def trusted(self) -> bool:
        if self.observed < PLAN_PROBATION_OPENS:
            return self.trusted_at_start
        return self.matched >= self.min_match * self.observed

    def judged_good(self) -> bool:
        """Seen long enough and followed: the epoch replayed this order."""
        return self.observed >= PLAN_PROBATION_OPENS and self.trusted()


@dataclass(frozen=True)
class ObservedOrder:
    """What ``observed`` saw of a job's reads: ``order`` is a sample of one
    epoch's files in the order they were opened, one in about
    ``sample_every`` of the working set's."""

    job: str
    order: list[str]
    sizes: dict[str, int]
    sample_every: int
    working_set_files: int
    working_set_bytes: int
    repeats: bool  # the last epoch replayed the one before (no shuffle)
    source: str  # what the prefetcher follows: "hint", "replay" or "unknown"
    epoch: int


@dataclass
class _Job:
    root: str
    made_by_listing: bool
    caller: str = ""  # the job of the processes reading (``jobs.py``), "" if unknown
    # Working set: path -> size (-1 unknown), in listing / first-seen order.
    working: dict[str, int] = field(default_factory=dict)
    # Working-set files not opened this epoch -> size, in working-set order,
    # but for those in ``satisfied``. A plain dict, not an OrderedDict: the
    # per-epoch reset is a copy of ``working`` (about 30 ms per million
    # files, against 400 ms to build an OrderedDict under the lock), and
    # iterating past the holes that reads leave costs about 1 ms per million
    # in the worst case (a reader in listing order, late in the epoch).
    unread: dict[str, int] = field(default_factory=dict)
    # Files not opened this epoch that need nothing fetched (the prefetcher
    # found them cached) -> size: out of ``unread`` so that predictions do
    # not go over them again every round, which with a cache holding the
    # whole dataset is every file, every round.
    satisfied: dict[str, int] = field(default_factory=dict)
    # Opened this epoch: path -> its position in ``order``.
    seen: dict[str, int] = field(default_factory=dict)
    # First opens of this epoch, in order.
    order: list[str] = field(default_factory=list)
    epoch: int = 0
    previous_size: int | None = None
    replay: _Plan | None = None
    hint: _Plan | None = None
    streams: OrderedDict[str, _Stream] = field(default_factory=OrderedDict)
    # Predictions start once the job opened or read a file or sent a hint:
    # a listing alone may be a human's ``ls``.
    engaged: bool = False
    last_event: float = float("-inf")
    # Made with another caller's working set: ``unread`` stays empty until
    # the job has opened ``SEED_UNREAD_OPENS`` files (a shell's ``cat`` of a
    # file should not copy a million names).
    unread_pending: bool = False

    @property
    def id(self) -> str:
        return job_id(self.caller, self.root)

    def unread_count(self) -> int:
        return len(self.unread) + len(self.satisfied)

    def plan(self) -> _Plan | None:
        """The order to follow now: a trusted hint, else a trusted replay."""
        if self.hint is not None and self.hint.trusted():
            return self.hint
        if self.replay is not None and self.replay.trusted():
            return self.replay
        return None


def job_id(caller: str, root: str) -> str:
    """How a job is named to the prefetcher, ``stats`` and metrics: its root
    alone for reads of unknown callers, else ``caller:root``."""
    return f"{caller}:{root}" if caller else root


@dataclass
class _Tree:
    """One caller's jobs, by root."""

    caller: str
    jobs: dict[str, _Job] = field(default_factory=dict)


_NO_JOBS: Final = _Tree(UNKNOWN_JOB)  # what a query about a caller never seen looks in


def _add_files(holders: list[_Job], files: dict[str, int]) -> None:
    """Listed ``files`` (path -> size) join the working set of each of
    ``holders`` (which jobs of several callers may share), and the new ones
    are unread by each holder that did not open them this epoch."""
    listed = {_clean(name): size for name, size in files.items()}
    # Every holder's new files first: a shared working set, grown for one
    # holder, would hide them from the next.
    for job in holders:
        if not job.unread_pending:
            job.unread.update(
                (path, size)
                for path, size in listed.items()
                if path not in job.working and path not in job.seen
            )
    for job in holders:
        job.working.update(listed)


def _dataset_root(tree: _Tree) -> _Job | None:
    """The mount root's job among ``jobs`` when it is a dataset root, made
    by a hint whose paths span several top-level directories (ImageFolder
    class folders right under the mount): it then holds every path no
    deeper job claims. A root job made by a plain listing (someone ran
    ``ls``) or by a file at the root does not."""
    job = tree.jobs.get("")
    return job if job is not None and job.made_by_listing else None


def _common_directory(roots: list[str]) -> str:
    """The deepest directory holding every one of several job ``roots``
    ("" for the mount root)."""
    return os.path.commonpath(roots) if all(roots) else ""


def _clean(path: str) -> str:
    return path.strip("/")


def _ancestors(path: str) -> list[str]:
    """Proper ancestor directories of ``path``, shallowest first, without the root ``""``."""
    out = []
    cut = path.find("/")
    while cut != -1:
        out.append(path[:cut])
        cut = path.find("/", cut + 1)
    return out


def _parent(path: str) -> str:
    cut = path.rfind("/")
    return "" if cut == -1 else path[:cut]


class AccessModel:
    """Learns jobs, working sets, epochs, streams and orders from mount events;
    see the module docstring. Thread-safe; usable as an ``EpochClock``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Guarded by _lock:
        # caller -> job root -> job: the same directory read by two callers
        # is two jobs, each with its epochs, orders, streams and hint.
        self._callers: dict[str, _Tree] = {}
        self._by_id: dict[str, _Job] = {}
        self._aliases: dict[str, str] = {}  # id of a job merged away -> id of the job it went into
        self._listed: set[str] = set()
        self._now = float("-inf")
        self._max_epoch = 0
        self._turns: dict[str, int] = {}  # job id -> epoch, started since ``take_turns``

    # -- events ------------------------------------------------------------

    def listed(self, directory: str, files: dict[str, int], now: float, caller: str = UNKNOWN_JOB) -> None:
        """``directory`` was listed for ``caller`` at ``now``; ``files`` maps
        each child FILE's path to its size. The jobs of other callers that
        hold the directory learn of its files too: a working set is the dataset's."""
        directory = _clean(directory)
        with self._lock:
            self._now = max(self._now, now)
            tree = self._tree_locked(caller)
            if directory:
                self._listed.add(directory)
                job = self._job_for_directory_locked(tree, directory)
            else:
                job = self._job_locked(tree, "", made_by_listing=False)
            job.last_event = max(job.last_event, now)  # listed, not engaged: kept a while
            holders = [job]
            for other in self._callers.values():
                held = None if other is tree else self._existing_job_locked(other, directory)
                if held is not None and (
                    held is _dataset_root(other)
                    or directory == held.root
                    or directory.startswith(held.root + "/")
                ):
                    holders.append(held)
            _add_files(holders, files)

    def opened(self, path: str, size: int, now: float, caller: str = UNKNOWN_JOB) -> None:
        """``path`` (``size`` bytes, -1 if unknown) was opened for reading at ``now`` by ``caller``."""
        path = _clean(path)
        with self._lock:
            job = self._touch_locked(path, now, caller)
            if size >= 0 or path not in job.working:
                job.working[path] = size
            position = job.seen.get(path)
            if position is not None:
                if not self._ends_epoch_locked(job, position):
                    return
                self._start_epoch_locked(job, None)
            self._first_open_locked(job, path)

    def read(self, path: str, offset: int, length: int, now: float, caller: str = UNKNOWN_JOB) -> None:
        """``length`` bytes of ``path`` at ``offset`` were read at ``now`` by ``caller``."""
        path = _clean(path)
        with self._lock:
            job = self._touch_locked(path, now, caller)
            size = job.working.get(path, -1)
            if 0 <= size <= STREAM_MIN_FILE_BYTES:
                return
            end = offset + length
            stream = job.streams.get(path)
            if stream is not None and (
                stream.end - STREAM_BACKWARD_SLACK <= offset <= stream.end + STREAM_FORWARD_SLACK
            ):
                grown = max(0, end - stream.end)
                stream.end = max(stream.end, end)
                stream.consumed += grown
                stream.last_read = now
                stream.size = size
                if stream.consumed >= stream.window:
                    stream.consumed = 0
                    stream.window = min(2 * stream.window, STREAM_MAX_WINDOW)
                job.streams.move_to_end(path)
                return
            # New stream, or a broken one starting over at the initial window.
            job.streams[path] = _Stream(start=offset, end=end, size=size, last_read=now, consumed=length)
            job.streams.move_to_end(path)
            while len(job.streams) > MAX_STREAMS_PER_JOB:
                job.streams.popitem(last=False)

    def satisfied(self, path: str, job_name: str) -> bool:
        """``path``, predicted for the job ``job_name`` (``Prediction.job``),
        needs nothing fetched (it is cached): stop predicting it until that
        job opens it or starts a new epoch (a planned one, until its turn
        nears). Whether this is news (it was not satisfied already)."""
        path = _clean(path)
        with self._lock:
            job = self._by_id.get(job_name)
            if job is None or path in job.seen or path in job.satisfied:
                return False
            job.satisfied[path] = job.unread.pop(path, job.working.get(path, -1))
            return True

    def hint(self, order: list[str], now: float, caller: str = UNKNOWN_JOB) -> None:
        """The exact order of the current (or next) epoch of ``caller``'s job
        that ``order[0]`` belongs to; replaces that job's previous hint, and
        no other job's. Paths of other jobs are ignored; an empty order is a no-op."""
        paths = [_clean(path) for path in order]
        if not paths:
            return
        with self._lock:
            tree = self._tree_locked(caller)
            roots = {self._root_of_locked(tree, path) for path in paths}
            if len(roots) > 1:
                # One loader's order over what were guessed to be several jobs.
                self._claim_root_locked(tree, _common_directory(sorted(roots)))
            job = self._touch_locked(paths[0], now, caller)
            mine = [path for path in paths if self._root_of_locked(tree, path) == job.root]
            plan = _Plan.of(mine, HINT_MIN_MATCH, trusted=True)
            if len(job.order) <= HINT_JOIN_FRACTION * len(mine):
                # The pass has barely begun: the hint is for this epoch.
                for position, path in enumerate(job.order):
                    plan.observe(position, path)
                job.hint = plan
            else:
                self._start_epoch_locked(job, plan)

    # -- questions ---------------------------------------------------------

    def predict(self, limit: int) -> list[Prediction]:
        """Up to ``limit`` predicted reads, jobs interleaved round-robin, each
        job's nearest predicted use first (streams, plan, unread files)."""
        out: list[Prediction] = []
        if limit <= 0:
            return out
        with self._lock:
            sources = [
                self._job_predictions_locked(job, limit)
                for job in self._by_id.values()
                if self._active_locked(job)
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
        """Every file a trusted plan (hint, replay) places and its job has not
        opened this epoch, with its distance (files to be opened before it),
        over all jobs. O(plan lengths): for planning what is already cached,
        once per plan, not per round."""
        out: list[tuple[str, float]] = []
        with self._lock:
            for job in self._by_id.values():
                plan = job.plan()
                if plan is not None:
                    out.extend(self._placements_locked(job, plan, len(plan.order)))
        return out

    def current(self) -> int:
        """``EpochClock``: the highest epoch of any job. Never decreases (job
        epochs only grow, jobs are never dropped); with one job it is that
        job's epoch."""
        with self._lock:
            return self._max_epoch

    def wanted_elsewhere(self, path: str, caller: str = UNKNOWN_JOB) -> bool:
        """Whether a job of a caller other than ``caller``, reading in the
        last ``JOB_IDLE_SECONDS``, still has ``path`` to read this epoch: a
        block of it read now is due again (``EvictionPolicy.accessed``). Two
        jobs of a sweep on one dataset each read every file once an epoch,
        in orders of their own. O(callers)."""
        # Asked at every FUSE read. With one caller, it is the asker (its
        # read, told first, made it one): the usual node answers without the lock.
        if len(self._callers) < 2:
            return False
        path = _clean(path)
        with self._lock:
            for tree in self._callers.values():
                if tree.caller == caller:
                    continue
                job = self._existing_job_locked(tree, path)
                if (
                    job is not None
                    and self._active_locked(job)
                    and path in job.working
                    and path not in job.seen
                ):
                    return True
            return False

    def planned_elsewhere(self, path: str, caller: str = UNKNOWN_JOB) -> float | None:
        """The soonest a trusted plan (hint, replay) of a job of another
        caller places ``path`` that the job has not opened this epoch, in
        that job's files to open first (as ``planned``); None if none does.
        A read consumes a block's plan, and the cache keeps one plan a
        block: when two jobs plan it, the one still to read it plans it
        again with this. O(callers)."""
        path = _clean(path)
        soonest: float | None = None
        with self._lock:
            for tree in self._callers.values():
                if tree.caller == caller:
                    continue
                job = self._existing_job_locked(tree, path)
                plan = None if job is None or path in job.seen else job.plan()
                if job is None or plan is None or path not in plan.index:
                    continue
                distance = float(max(0, plan.index[path] - len(job.order)))
                soonest = distance if soonest is None else min(soonest, distance)
        return soonest

    def current_epoch(self, job_path: str | None = None, caller: str = UNKNOWN_JOB) -> int:
        """The epoch of ``caller``'s job that ``job_path`` (a root or any path
        under it) belongs to, 0 for an unknown job; ``current()`` when None."""
        with self._lock:
            if job_path is None:
                return self._max_epoch
            job = self._existing_job_locked(self._callers.get(caller, _NO_JOBS), _clean(job_path))
            return 0 if job is None else job.epoch

    def callers(self) -> set[str]:
        """The callers (``jobs.py``) the model keeps jobs of: those that read
        in the last ``JOB_IDLE_SECONDS``, or since the last new caller came."""
        with self._lock:
            return set(self._callers)

    def caller_epochs(self) -> dict[str, int]:
        """Each caller (``jobs.py``) -> the highest epoch of its jobs."""
        with self._lock:
            return {
                caller: max(job.epoch for job in tree.jobs.values())
                for caller, tree in self._callers.items()
                if tree.jobs
            }

    def epoch_of(self, job_name: str) -> int | None:
        """The epoch of the job named ``job_name`` (``Prediction.job``), or
        of the job it was merged into; None once it is gone (idle)."""
        with self._lock:
            job = self._by_id.get(self._aliases.get(job_name, job_name))
            return None if job is None else job.epoch

    def job_of(self, path: str, caller: str = UNKNOWN_JOB) -> str | None:
        """The name (``job_id``) of ``caller``'s job that ``path`` belongs to now, None if none yet."""
        with self._lock:
            job = self._existing_job_locked(self._callers.get(caller, _NO_JOBS), _clean(path))
            return None if job is None else job.id

    def jobs(self) -> list[str]:
        """Every job's name (``job_id``), oldest first."""
        with self._lock:
            return list(self._by_id)

    def take_turns(self) -> dict[str, int]:
        """The jobs that started an epoch since the last call -> their epoch
        now: one job's new pass says nothing of another's."""
        with self._lock:
            turns, self._turns = self._turns, {}
            return turns

    def observed(self, caller: str, max_files: int) -> ObservedOrder | None:
        """The read order of ``caller``'s largest job (by working set): its
        last whole epoch, else this one so far, thinned to at most about
        ``max_files`` files by a hash of their names (the same files every
        epoch, so a replay of the sample behaves as one of the whole);
        None if the caller has no job. O(epoch), of which only C-speed
        copies (a few ms per million files) hold the lock that opens take."""
        with self._lock:
            tree = self._callers.get(caller)
            if tree is None or not tree.jobs:
                return None
            job = max(tree.jobs.values(), key=lambda candidate: len(candidate.working))
            order = list(job.replay.order if job.replay is not None else job.order)
            sizes = list(job.working.values())
            plan = job.plan()
            source = "unknown" if plan is None else "hint" if plan is job.hint else "replay"
            repeats = job.replay is not None and job.replay.judged_good()
            name, epoch = job.id, job.epoch
        every = max(1, -(-len(sizes) // max_files))
        sample = [path for path in order if every == 1 or zlib.crc32(path.encode()) % every == 0]
        with self._lock:
            sampled_sizes = {path: job.working.get(path, -1) for path in sample}
        return ObservedOrder(
            job=name,
            order=sample,
            sizes=sampled_sizes,
            sample_every=every,
            working_set_files=len(sizes),
            working_set_bytes=sum(size for size in sizes if size > 0),
            repeats=repeats,
            source=source,
            epoch=epoch,
        )

    def unread(self, job_path: str, caller: str = UNKNOWN_JOB) -> set[str]:
        """Working-set files of ``caller``'s job of ``job_path`` not opened this epoch. O(working set)."""
        with self._lock:
            job = self._existing_job_locked(self._callers.get(caller, _NO_JOBS), _clean(job_path))
            return set() if job is None else set(job.unread) | set(job.satisfied)

    def read_this_epoch(self, job_path: str, caller: str = UNKNOWN_JOB) -> set[str]:
        """Files ``caller``'s job of ``job_path`` opened this epoch. O(files opened)."""
        with self._lock:
            job = self._existing_job_locked(self._callers.get(caller, _NO_JOBS), _clean(job_path))
            return set() if job is None else set(job.seen)

    def working_set(self, job_path: str, caller: str = UNKNOWN_JOB) -> set[str]:
        """Files of ``caller``'s job of ``job_path``'s working set. O(working set)."""
        with self._lock:
            job = self._existing_job_locked(self._callers.get(caller, _NO_JOBS), _clean(job_path))
            return set() if job is None else set(job.working)

    def stats(self) -> dict[str, object]:
        """Totals over all jobs, and details of the most recently active ones.

        ``hint_coverage`` is the share of this epoch's opens (all jobs) that
        came where a hint predicted them: 0.0 without hints, near 1.0 when
        loaders send exact hints.
        """
        with self._lock:
            jobs = list(self._by_id.values())
            opens = sum(len(job.order) for job in jobs)
            hinted = sum(job.hint.matched for job in jobs if job.hint is not None)
            active = sorted(jobs, key=lambda job: job.last_event, reverse=True)[:STATS_MAX_JOBS]
            return {
                "epoch": self._max_epoch,
                "jobs": len(jobs),
                "working_set_files": sum(len(job.working) for job in jobs),
                "unread_files": sum(job.unread_count() for job in jobs),
                "read_this_epoch_files": opens,
                "active_streams": sum(self._live_streams_locked(job) for job in jobs),
                "hint_coverage": hinted / opens if opens else 0.0,
                "per_job": {job.id: self._job_stats_locked(job) for job in active},
            }

    # -- jobs ---------------------------------------------------------------

    def _active_locked(self, job: _Job) -> bool:
        return job.engaged and self._now - job.last_event <= JOB_IDLE_SECONDS

    def _tree_locked(self, caller: str) -> _Tree:
        """``caller``'s jobs, none yet if it is new. A new caller (every
        shell command is one) first sweeps away the callers idle for
        ``JOB_IDLE_SECONDS``: a job that stopped reading protects nothing."""
        tree = self._callers.get(caller)
        if tree is None:
            for idle in [each for each in self._callers.values() if self._idle_locked(each)]:
                self._drop_locked(idle)
            tree = self._callers[caller] = _Tree(caller)
        return tree

    def _idle_locked(self, tree: _Tree) -> bool:
        return all(self._now - job.last_event > JOB_IDLE_SECONDS for job in tree.jobs.values())

    def _drop_locked(self, tree: _Tree) -> None:
        del self._callers[tree.caller]
        gone = {job.id for job in tree.jobs.values()}
        for name in gone:
            del self._by_id[name]
            self._turns.pop(name, None)
        self._aliases = {child: into for child, into in self._aliases.items() if into not in gone}

    def _job_locked(self, tree: _Tree, root: str, made_by_listing: bool) -> _Job:
        job = tree.jobs.get(root)
        if job is None:
            job = _Job(root, made_by_listing, tree.caller)
            # Another caller's job of the same root knows the working set
            # (it listed the dataset): this one starts its epoch with it unread.
            twin = next((each.jobs[root] for each in self._callers.values() if root in each.jobs), None)
            if twin is not None:
                job.working = twin.working  # shared: the dataset's
                job.unread_pending = True
            tree.jobs[root] = job
            self._by_id[job.id] = job
        return job

    def _existing_job_locked(self, tree: _Tree, path: str) -> _Job | None:
        """The job of ``path`` (a file, directory or root) among ``jobs``, without making one."""
        job = tree.jobs.get(path)
        if job is not None:
            return job
        for directory in reversed(_ancestors(path)):
            job = tree.jobs.get(directory)
            if job is not None:
                return job
        if "/" not in path:
            return tree.jobs.get("")
        return _dataset_root(tree)

    def _root_of_locked(self, tree: _Tree, path: str) -> str:
        """The root of the job among ``jobs`` a FILE ``path`` belongs to or would get."""
        ancestors = _ancestors(path)
        for directory in reversed(ancestors):
            if directory in tree.jobs:
                return directory
        if _dataset_root(tree) is not None:
            return ""
        for directory in reversed(ancestors):
            if directory in self._listed:
                return self._chain_top_locked(directory)
        return ancestors[0] if ancestors else ""

    def _chain_top_locked(self, directory: str) -> str:
        while True:
            parent = _parent(directory)
            if not parent or parent not in self._listed:
                return directory
            directory = parent

    def _file_job_locked(self, tree: _Tree, path: str) -> _Job:
        root = self._root_of_locked(tree, path)
        job = tree.jobs.get(root)
        if job is not None:
            return job
        if root and root in self._listed:
            return self._job_for_directory_locked(tree, root)
        return self._job_locked(tree, root, made_by_listing=False)

    def _job_for_directory_locked(self, tree: _Tree, directory: str) -> _Job:
        """The job among ``jobs`` of a listed ``directory`` (not the root); may make and merge."""
        for candidate in [directory, *reversed(_ancestors(directory))]:
            job = tree.jobs.get(candidate)
            if job is not None:
                return job
        root_job = _dataset_root(tree)
        if root_job is not None:
            return root_job
        root = self._chain_top_locked(directory)
        job = self._job_locked(tree, root, made_by_listing=True)
        prefix = root + "/"
        for other in [other for other in tree.jobs.values() if other.made_by_listing]:
            if other.root.startswith(prefix):
                self._merge_locked(tree, job, other)
        return job

    def _claim_root_locked(self, tree: _Tree, root: str) -> None:
        """A hint spans the directory ``root``: make it one job, folding in
        the jobs that guessed smaller roots below it (one per class folder)."""
        job = self._job_locked(tree, root, made_by_listing=True)
        job.made_by_listing = True  # a root job made by ``ls`` becomes a dataset root too
        prefix = root + "/" if root else ""
        for other in [other for other in tree.jobs.values() if other is not job]:
            if other.root.startswith(prefix) and other.root != root:
                self._merge_locked(tree, job, other)

    def _merge_locked(self, tree: _Tree, into: _Job, child: _Job) -> None:
        """Fold a job made below ``into`` (its child listed first) into it.

        The child's opens this epoch count as opens of ``into``; its orders
        and hint are dropped (they were orders of a part of the job).
        """
        del tree.jobs[child.root]
        del self._by_id[child.id]
        self._aliases = {old: into.id if new == child.id else new for old, new in self._aliases.items()}
        self._aliases[child.id] = into.id
        if self._turns.pop(child.id, None) is not None:
            self._turns[into.id] = max(into.epoch, child.epoch)
        for path, size in child.working.items():
            into.working.setdefault(path, size)
        for path in child.order:
            if path not in into.seen:
                into.seen[path] = len(into.order)
                into.order.append(path)
        for path, size in child.working.items():
            if path not in into.seen and path not in into.satisfied:
                into.unread[path] = size
        for path in into.seen:
            into.unread.pop(path, None)
        into.streams.update(child.streams)
        into.epoch = max(into.epoch, child.epoch)
        into.engaged = into.engaged or child.engaged
        into.last_event = max(into.last_event, child.last_event)

    # -- epochs -------------------------------------------------------------

    def _touch_locked(self, path: str, now: float, caller: str) -> _Job:
        self._now = max(self._now, now)
        job = self._file_job_locked(self._tree_locked(caller), path)
        job.engaged = True
        job.last_event = max(job.last_event, now)
        return job

    def _ends_epoch_locked(self, job: _Job, position: int) -> bool:
        """A re-open of the file opened at ``position`` this epoch: a new pass?"""
        opens = len(job.order)
        peek_window = min(REOPEN_PEEK_WINDOW, opens // REOPEN_PEEK_DIVISOR)
        if position >= opens - peek_window:
            return False
        reference = len(job.working)
        if job.previous_size is not None:
            reference = min(reference, job.previous_size)
        return opens >= MIN_EPOCH_FRACTION * reference

    def _start_epoch_locked(self, job: _Job, hint: _Plan | None) -> None:
        """End the job's epoch; O(working set)."""
        if job.order:
            # This epoch replayed the previous one: trust the replay at once next time.
            repeated = job.replay is not None and job.replay.judged_good()
            job.replay = _Plan(job.order, job.seen, REPLAY_MIN_MATCH, trusted=repeated)
            job.previous_size = len(job.order)
        job.epoch += 1
        self._max_epoch = max(self._max_epoch, job.epoch)
        self._turns[job.id] = job.epoch
        job.order = []
        job.seen = {}
        job.unread = job.working.copy()
        job.unread_pending = False
        job.satisfied = {}
        job.hint = hint

    def _first_open_locked(self, job: _Job, path: str) -> None:
        position = len(job.order)
        job.order.append(path)
        job.seen[path] = position
        job.unread.pop(path, None)
        job.satisfied.pop(path, None)
        if job.unread_pending and len(job.order) >= SEED_UNREAD_OPENS:
            job.unread = {path: size for path, size in job.working.items() if path not in job.seen}
            job.unread_pending = False
        if job.hint is not None:
            job.hint.observe(position, path)
        if job.replay is not None:
            job.replay.observe(position, path)

    # -- predictions --------------------------------------------------------

    def _stream_live_locked(self, stream: _Stream) -> bool:
        return (
            stream.end - stream.start >= STREAM_CONFIRM_BYTES
            and (stream.size < 0 or stream.end < stream.size)
            and self._now - stream.last_read <= STREAM_IDLE_SECONDS
        )

    def _live_streams_locked(self, job: _Job) -> int:
        return sum(1 for stream in job.streams.values() if self._stream_live_locked(stream))

    def _file_prediction_locked(self, job: _Job, path: str, distance: float, planned: bool) -> Prediction:
        size = job.working.get(path, -1)
        length = FILE_PREDICTION_BYTES if size < 0 else min(size, FILE_PREDICTION_BYTES)
        return Prediction(path, 0, length, distance, planned, job.id, job.epoch)

    def _job_predictions_locked(self, job: _Job, limit: int) -> Iterator[Prediction]:
        """One job's predictions, nearest first. Consumed under the lock."""
        for path, stream in reversed(job.streams.items()):
            if self._stream_live_locked(stream):
                length = stream.window if stream.size < 0 else min(stream.window, stream.size - stream.end)
                yield Prediction(path, stream.end, length, 0.0, job=job.id, epoch=job.epoch)
        emitted: set[str] = set()
        plan = job.plan()
        if plan is not None:
            order = plan.order
            while plan.low < len(order) and order[plan.low] in job.seen:
                plan.low += 1
            stop = min(len(order), plan.low + PLAN_SCAN_FACTOR * limit)
            for path, distance in self._placements_locked(job, plan, stop):
                if path not in job.satisfied or distance < PLAN_RECHECK_FILES:
                    emitted.add(path)
                    yield self._file_prediction_locked(job, path, distance, planned=True)
        # Unread, order unknown: under a random order the expected wait is half the rest.
        expected = max(0.0, (job.unread_count() - 1) / 2)
        for path in job.unread:
            if path not in emitted:
                yield self._file_prediction_locked(job, path, expected, planned=False)

    def _placements_locked(self, job: _Job, plan: _Plan, stop: int) -> Iterator[tuple[str, float]]:
        """The files ``plan`` places between its low mark and ``stop`` that
        ``job`` has not opened this epoch, each once, with its distance."""
        opens = len(job.order)
        placed: set[str] = set()
        for position in range(plan.low, stop):
            path = plan.order[position]
            if path not in job.seen and path not in placed:
                placed.add(path)
                yield path, float(max(0, position - opens))

    def _job_stats_locked(self, job: _Job) -> dict[str, object]:
        plan = job.plan()
        source = "unknown" if plan is None else "hint" if plan is job.hint else "replay"
        return {
            "epoch": job.epoch,
            "working_set_files": len(job.working),
            "unread_files": job.unread_count(),
            "read_this_epoch_files": len(job.order),
            "order": source,
            "hint_files": 0 if job.hint is None else len(job.hint.order),
            "hint_matched": 0 if job.hint is None else job.hint.matched,
            "active_streams": self._live_streams_locked(job),
        }
