"""Epochs: one workload's passes over its dataset, what it has left to read
in the current one, and the order it is expected to read it in.

Training reads a dataset in epochs: every file once per epoch, usually in a
fresh shuffled order, sometimes in the same order every time (a loader that
does not shuffle, shards read in sequence). Only opens feed epochs: many
reads after one open count once.

Boundaries. An epoch ends when a file already opened this epoch is opened
again AND at least ``MIN_EPOCH_FRACTION`` of the reference size has been
opened this epoch; the reference is the working set, or the previous
epoch's file count when that is smaller (a distributed sampler gives each
node a share of the dataset). A re-open of one of the last few files
opened is a peek (a loader that opens a file twice to read its header),
never a boundary. A new hint also starts
an epoch, unless the current one has barely begun (then the hint joins it).
Epochs are numbered from 0.

Working set: path -> size of the dataset's files. Listings are the first
guess (so the unread set, and with it prediction, is useful from the first
open of epoch 0); files opened without having been listed join it. It only
grows: datasets are immutable, and a stale entry costs one useless
prediction, which the prefetcher drops when the file is not found. The
workloads of several jobs on one dataset share one working set
(``share_working_set``, ``add_files``).

Files, in the order to fetch them (``files``): a trusted plan's remaining
order (``plans.py``: a hint, else a replay of the previous epoch), then the
unread files in working-set order ("unread, order unknown"). Files the
prefetcher reports ``satisfy``-ed (wholly cached) are left out until they
are opened or the epoch ends: with the whole dataset cached, a round would
otherwise rebuild thousands of useless predictions. A planned one comes
back once its turn is ``PLAN_RECHECK_FILES`` away, in case it was evicted
since.

Cost: an open is O(1); an epoch boundary copies the working set once (a
dict copy, about 30 ms per million files), amortised O(1) per open since an
epoch holds at least ``MIN_EPOCH_FRACTION`` of it; ``files`` skips the holes
reads leave in the unread dict (C-speed, about 1 ms per million at worst).

Concurrency: none here. A workload's ``Epochs`` is guarded by the lock of
its owner (``model.WorkloadModel``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Final

from cachefsd.workload.plans import HINT_MIN_MATCH, REPLAY_MIN_MATCH, Plan

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

# A workload that starts on a dataset another job's workload listed gets its
# unread set after this many opens (before, it may be a shell's ``cat``).
SEED_UNREAD_OPENS: Final = 16

# files() looks at most this many plan entries per file asked for, so a
# plan whose head was read out of order cannot make it O(plan).
PLAN_SCAN_FACTOR: Final = 4
# A planned file found wholly cached is predicted again once it is this many
# files from its turn: the plan's own sooner files may have evicted it since
# (Belady gives up the farthest), and then it must be fetched again before
# its read. The prefetcher's check of a cached file is a dictionary lookup
# per block, so the cost is this many lookups per workload and round.
PLAN_RECHECK_FILES: Final = 64
# A hint arriving when the current epoch has opened at most this fraction of
# the hint's length joins the epoch instead of starting a new one: the
# loader's pass began (and the re-open rule noticed) just before the hint came.
HINT_JOIN_FRACTION: Final = 1 / 16


class Epochs:
    """One workload's working set, current epoch and plans."""

    def __init__(self) -> None:
        # Working set: path -> size (-1 unknown), in listing / first-seen order.
        self.working: dict[str, int] = {}
        # Working-set files not opened this epoch -> size, in working-set order,
        # but for those in ``satisfied``. A plain dict, not an OrderedDict: the
        # per-epoch reset is a copy of ``working`` (about 30 ms per million
        # files, against 400 ms to build an OrderedDict under the lock), and
        # iterating past the holes that reads leave costs about 1 ms per million
        # in the worst case (a reader in listing order, late in the epoch).
        self.unread: dict[str, int] = {}
        # Files not opened this epoch that need nothing fetched (the prefetcher
        # found them cached) -> size: out of ``unread`` so that predictions do
        # not go over them again every round, which with a cache holding the
        # whole dataset is every file, every round.
        self.satisfied: dict[str, int] = {}
        # Opened this epoch: path -> its position in ``order``.
        self.seen: dict[str, int] = {}
        # First opens of this epoch, in order.
        self.order: list[str] = []
        self.epoch = 0
        self.previous_size: int | None = None
        self.replay: Plan | None = None
        self.hint: Plan | None = None
        # Made with another job's working set: ``unread`` stays empty until
        # ``SEED_UNREAD_OPENS`` files were opened (a shell's ``cat`` of a
        # file should not copy a million names).
        self.unread_pending = False

    # -- events ---------------------------------------------------------------

    def opened(self, path: str, size: int) -> bool:
        """``path`` (``size`` bytes, -1 if unknown) was opened; whether that began a new epoch."""
        if size >= 0 or path not in self.working:
            self.working[path] = size
        position = self.seen.get(path)
        began = False
        if position is not None:
            if not self._ends_epoch(position):
                return False
            self.start(None)
            began = True
        self._first_open(path)
        return began

    def hinted(self, order: list[str]) -> bool:
        """The loader's exact ``order`` of this epoch or the next; whether it began a new epoch."""
        plan = Plan.of(order, HINT_MIN_MATCH, trusted=True)
        if len(self.order) <= HINT_JOIN_FRACTION * len(order):
            # The pass has barely begun: the hint is for this epoch.
            for position, path in enumerate(self.order):
                plan.observe(position, path)
            self.hint = plan
            return False
        self.start(plan)
        return True

    def satisfy(self, path: str) -> bool:
        """``path`` needs nothing fetched: leave it out of ``files`` until it
        is opened or the epoch ends. Whether this is news."""
        if path in self.seen or path in self.satisfied:
            return False
        self.satisfied[path] = self.unread.pop(path, self.working.get(path, -1))
        return True

    def share_working_set(self, other: Epochs) -> None:
        """Start on ``other``'s working set (another job's workload of the
        same dataset), shared from now on; unread once the seed opens came."""
        self.working = other.working
        self.unread_pending = True

    def absorb(self, child: Epochs) -> None:
        """Fold in the epochs of a workload made below this one's root: the
        child's opens this epoch count as opens here; its plans are dropped
        (they were orders of a part of the dataset)."""
        for path, size in child.working.items():
            self.working.setdefault(path, size)
        for path in child.order:
            if path not in self.seen:
                self.seen[path] = len(self.order)
                self.order.append(path)
        for path, size in child.working.items():
            if path not in self.seen and path not in self.satisfied:
                self.unread[path] = size
        for path in self.seen:
            self.unread.pop(path, None)
        self.epoch = max(self.epoch, child.epoch)

    def start(self, hint: Plan | None) -> None:
        """End the epoch and begin the next, following ``hint`` if given; O(working set)."""
        if self.order:
            # This epoch replayed the previous one: trust the replay at once next time.
            repeated = self.replay is not None and self.replay.judged_good()
            self.replay = Plan(self.order, self.seen, REPLAY_MIN_MATCH, trusted=repeated)
            self.previous_size = len(self.order)
        self.epoch += 1
        self.order = []
        self.seen = {}
        self.unread = self.working.copy()
        self.unread_pending = False
        self.satisfied = {}
        self.hint = hint

    def _ends_epoch(self, position: int) -> bool:
        """A re-open of the file opened at ``position`` this epoch: a new pass?"""
        opens = len(self.order)
        peek_window = min(REOPEN_PEEK_WINDOW, opens // REOPEN_PEEK_DIVISOR)
        if position >= opens - peek_window:
            return False
        reference = len(self.working)
        if self.previous_size is not None:
            reference = min(reference, self.previous_size)
        return opens >= MIN_EPOCH_FRACTION * reference

    def _first_open(self, path: str) -> None:
        position = len(self.order)
        self.order.append(path)
        self.seen[path] = position
        self.unread.pop(path, None)
        self.satisfied.pop(path, None)
        if self.unread_pending and len(self.order) >= SEED_UNREAD_OPENS:
            self.unread = {path: size for path, size in self.working.items() if path not in self.seen}
            self.unread_pending = False
        if self.hint is not None:
            self.hint.observe(position, path)
        if self.replay is not None:
            self.replay.observe(position, path)

    # -- questions ------------------------------------------------------------

    def plan(self) -> Plan | None:
        """The order to follow now: a trusted hint, else a trusted replay."""
        if self.hint is not None and self.hint.trusted():
            return self.hint
        if self.replay is not None and self.replay.trusted():
            return self.replay
        return None

    def order_source(self) -> str:
        """What ``files`` follows: "hint", "replay" or "unknown"."""
        plan = self.plan()
        return "unknown" if plan is None else "hint" if plan is self.hint else "replay"

    def unread_count(self) -> int:
        return len(self.unread) + len(self.satisfied)

    def files(self, limit: int) -> Iterator[tuple[str, float, bool]]:
        """(path, distance, planned) of the files still to open this epoch,
        nearest first: a trusted plan's (``planned``) for about ``limit``
        files, then the unread ones. The distance counts the files to be
        opened first."""
        emitted: set[str] = set()
        plan = self.plan()
        if plan is not None:
            plan.advance(self.seen)
            stop = min(len(plan.order), plan.low + PLAN_SCAN_FACTOR * limit)
            for path, distance in plan.placements(self.seen, len(self.order), stop):
                if path not in self.satisfied or distance < PLAN_RECHECK_FILES:
                    emitted.add(path)
                    yield path, distance, True
        # Unread, order unknown: under a random order the expected wait is half the rest.
        expected = max(0.0, (self.unread_count() - 1) / 2)
        for path in self.unread:
            if path not in emitted:
                yield path, expected, False

    def planned(self) -> Iterator[tuple[str, float]]:
        """Every file the trusted plan places and this epoch has not opened, with its distance."""
        plan = self.plan()
        if plan is not None:
            yield from plan.placements(self.seen, len(self.order), len(plan.order))

    def planned_at(self, path: str) -> float | None:
        """The distance at which the trusted plan places ``path``, not opened
        this epoch; None if it is opened or no trusted plan places it."""
        plan = None if path in self.seen else self.plan()
        if plan is None or path not in plan.index:
            return None
        return float(max(0, plan.index[path] - len(self.order)))

    def still_to_read(self, path: str) -> bool:
        """``path`` is in the working set and not opened this epoch."""
        return path in self.working and path not in self.seen


def add_files(holders: list[Epochs], files: dict[str, int]) -> None:
    """Listed ``files`` (path -> size) join the working set of each of
    ``holders`` (which workloads of several jobs may share), and the new ones
    are unread by each holder that did not open them this epoch."""
    # Every holder's new files first: a shared working set, grown for one
    # holder, would hide them from the next.
    for epochs in holders:
        if not epochs.unread_pending:
            epochs.unread.update(
                (path, size)
                for path, size in files.items()
                if path not in epochs.working and path not in epochs.seen
            )
    for epochs in holders:
        epochs.working.update(files)
