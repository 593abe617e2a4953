"""Eviction policies: which block of a full tier goes first.

A policy is pure bookkeeping over block names (content hashes): the tier
tells it what entered, what was read and what left, and asks it for a
victim when it needs room. A policy may refuse (``victim`` returns None):
the new block is then not admitted, which is how MinIO and the epoch-aware
policy avoid thrashing on shuffled epochs.

Why not plain LRU: training reads every sample once per epoch in a new
random order. Under that access pattern LRU evicts blocks that are still to
be read this epoch to make room for blocks that will not be read again until
the next one, and its steady hit ratio falls to about f + (1-f)ln(1-f) for a
cache holding a fraction f of the dataset (CoorDL, VLDB 2021). JuiceFS's
2-random does a little better (about 22 % at f = 0.5), a cache that stops
replacing once full (CoorDL's MinIO) hits exactly f, and the epoch-aware
policy below hits f too while still letting the cache follow a changing
working set. ``benchmarks/policy_sim.py`` replays shuffled epochs through
every policy here and against Belady's offline optimum.

Every operation is O(1) or O(log n) (amortised), plus, for the epoch-aware
policy, O(epochs that still have residents) and a bounded heap walk in
``spare``: a tier can hold millions of blocks and calls the policy under
its lock. Policies are tolerant of the
tier's bookkeeping order: ``admitted`` of a resident block counts as a read,
``accessed`` and ``removed`` of a block the policy does not hold are no-ops.
Policies do no I/O, start no threads and take no locks: the tier calls them
under its own. ``PlannedUse``, shared by the prefetcher and the tiers, has
its own lock; ``ReadMarks`` keeps per-thread state and needs none.
"""

from __future__ import annotations

import heapq
import random
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Final, Protocol

LRU: Final = "lru"
TWO_RANDOM: Final = "2-random"
MINIO: Final = "minio"
EPOCH_AWARE: Final = "epoch-aware"
POLICY_NAMES: Final = (LRU, TWO_RANDOM, MINIO, EPOCH_AWARE)
# Training epochs are the workload this daemon exists for; see the module docstring.
DEFAULT_POLICY: Final = EPOCH_AWARE

# ``spare`` counts planned residents up to this many unless told how many
# are enough: a walk bounded whatever the size of the tier.
SPARE_COUNT_LIMIT: Final = 1024

# Rebuild the next-use heap when it holds more than this many entries per
# live one. Each re-read or re-rank of a block with a known next use leaves
# one stale entry behind; a factor of 2 keeps memory within twice the
# residents, and the O(n) rebuild runs at most once per n updates (amortised
# O(1)).
HEAP_SLACK: Final = 2


# Where the epoch-aware policy ranks a block another job is still to read:
# between the current epoch and the next, so it is neither this epoch's
# victim nor stale until the clock is two epochs on.
DUE_ELSEWHERE_RANK: Final = 0.5


class EvictionPolicy(Protocol):
    """Bookkeeping for one tier. Not thread-safe: the tier calls it under its lock."""

    def admitted(self, block: str, ahead: bool = False) -> None:
        """``block`` entered the tier: just read, or, when ``ahead``, fetched
        before anyone asked for it (prefetch, stage) and not read yet."""
        ...

    def accessed(self, block: str) -> None:
        """``block`` was read from the tier."""
        ...

    def removed(self, block: str) -> None:
        """``block`` left the tier (evicted, demoted, promoted, corrupt, released)."""
        ...

    def victim(self, incoming: str | None = None) -> str | None:
        """The block to evict next, or None to refuse the admission that needs room.

        ``incoming`` is the block that needs the room, when the tier knows it;
        a policy with next-use knowledge compares it with the residents. The
        victim stays resident until the tier calls ``removed``; None is also
        the answer when the policy holds no block.
        """
        ...

    def spare(self, incoming_use: float | None = None, enough: int = SPARE_COUNT_LIMIT) -> int:
        """How many residents ``victim`` would give up now for a block whose
        next use is ``incoming_use`` (None: unknown): what a prefetcher may
        fill without being refused. May stop counting planned residents once
        it has found ``enough``."""
        ...

    def next_use_changed(self, block: str) -> None:
        """The plan changed ``block``'s next use without a read."""
        ...


class EpochClock(Protocol):
    """Where the current training epoch comes from (the workload model owns the real one)."""

    def current(self) -> int:
        """The current epoch number; never decreases."""
        ...


class NextUse(Protocol):
    """Exact knowledge of when a block will be read next (a loader's plan, fed by prefetch).

    Values are positions on one time axis, smaller = sooner; None means the
    plan does not say. A block's value may change when it is read (the tier
    then calls ``accessed``) or when the plan changes, in which case the
    feeder calls ``EpochAwarePolicy.next_use_changed``. Within one
    ``victim`` call the answers must be stable.
    """

    def next_use(self, block: str) -> float | None:
        """When ``block`` is read next, or None if unknown."""
        ...


class DueElsewhere(Protocol):
    """Whether another job is still to read a block this epoch: the jobs of
    a sweep each read every block of one dataset once an epoch, in orders
    of their own, so a block one of them just read may be due for another."""

    def due_elsewhere(self, block: str) -> bool:
        """Asked as ``block`` is read (or admitted for a read): whether a job
        other than its reader is still to read it this epoch."""
        ...


class ReadMarks:
    """The daemon's ``DueElsewhere``. Who is still to read what is known by
    file and job (the workload model's ``wanted_elsewhere``), and only the
    read path knows both: the mount marks a read that another job is still
    to read the bytes of (``reading``, given which blocks are the read's),
    and while it runs, those blocks are due elsewhere. The policies are
    asked on the reading thread as the read counts each block (its hit, or
    the admission of a block fetched or promoted for it), so the mark is
    per thread: concurrent reads of different jobs each answer for
    themselves, and off a marked read (prefetch, stage, a block demoted to
    make room) every block answers no. A mark's test runs under the tier's
    lock and may look the read's blocks up in the index, whose lock comes
    after a tier's (``tiered.py``)."""

    def __init__(self) -> None:
        self._local = threading.local()

    @contextmanager
    def reading(self, blocks: Callable[[str], bool]) -> Iterator[None]:
        """Within the block, on this thread: a block is due elsewhere when
        ``blocks(block)`` says it is one of the marked read's; the mark
        around it, if any, is restored after."""
        outer = getattr(self._local, "blocks", None)
        self._local.blocks = blocks
        try:
            yield
        finally:
            self._local.blocks = outer

    def due_elsewhere(self, block: str) -> bool:
        blocks: Callable[[str], bool] | None = getattr(self._local, "blocks", None)
        return blocks is not None and blocks(block)


class PlannedUse:
    """The daemon's ``NextUse``: the position (on the prefetcher's count of
    opens) at which a block is planned to be read next, for blocks fetched
    ahead and for residents a loader's hint places; None for any other.
    Positions are absolute so that blocks planned at different times compare
    correctly. The prefetcher plans; the cache records a plan before it
    admits the block, so the policies weigh a newcomer against the residents."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._planned: dict[str, float] = {}

    def plan(self, block: str, position: float) -> None:
        with self._lock:
            self._planned[block] = position

    def consumed(self, block: str) -> None:
        """Read, or no longer planned: the policies find out lazily."""
        with self._lock:
            self._planned.pop(block, None)

    def next_use(self, block: str) -> float | None:
        with self._lock:
            return self._planned.get(block)


class LruPolicy:
    """Least recently used first: the baseline, and right for non-epoch workloads."""

    def __init__(self) -> None:
        # Oldest read first; the values are unused.
        self._order: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, block: object) -> bool:
        return block in self._order

    def admitted(self, block: str, ahead: bool = False) -> None:
        self._order[block] = None
        self._order.move_to_end(block)

    def accessed(self, block: str) -> None:
        if block in self._order:
            self._order.move_to_end(block)

    def removed(self, block: str) -> None:
        self._order.pop(block, None)

    def victim(self, incoming: str | None = None) -> str | None:
        return next(iter(self._order), None)

    def spare(self, incoming_use: float | None = None, enough: int = SPARE_COUNT_LIMIT) -> int:
        return len(self._order)

    def next_use_changed(self, block: str) -> None:
        """LRU ignores plans."""


class TwoRandomPolicy:
    """JuiceFS's default: sample two resident blocks, evict the less recently used.

    Approximates LRU without an ordered structure and, by its randomness,
    thrashes a little less on shuffled epochs. Sampling is O(1): residents
    live in a list with an index map, and removal swaps the last entry into
    the hole.
    """

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._blocks: list[str] = []
        self._index: dict[str, int] = {}
        # Logical time of each resident's last read; a counter, not a clock,
        # so equal-time ties cannot happen and tests are deterministic.
        self._last_read: dict[str, int] = {}
        self._tick = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: object) -> bool:
        return block in self._index

    def _touch(self, block: str) -> None:
        self._tick += 1
        self._last_read[block] = self._tick

    def admitted(self, block: str, ahead: bool = False) -> None:
        if block not in self._index:
            self._index[block] = len(self._blocks)
            self._blocks.append(block)
        self._touch(block)

    def accessed(self, block: str) -> None:
        if block in self._index:
            self._touch(block)

    def removed(self, block: str) -> None:
        position = self._index.pop(block, None)
        if position is None:
            return
        last = self._blocks.pop()
        if last != block:
            self._blocks[position] = last
            self._index[last] = position
        del self._last_read[block]

    def victim(self, incoming: str | None = None) -> str | None:
        count = len(self._blocks)
        if count == 0:
            return None
        if count == 1:
            return self._blocks[0]
        first = self._rng.randrange(count)
        second = self._rng.randrange(count - 1)
        if second >= first:
            second += 1
        a, b = self._blocks[first], self._blocks[second]
        return a if self._last_read[a] <= self._last_read[b] else b

    def spare(self, incoming_use: float | None = None, enough: int = SPARE_COUNT_LIMIT) -> int:
        return len(self._blocks)

    def next_use_changed(self, block: str) -> None:
        """2-random ignores plans."""


class MinioPolicy:
    """CoorDL's MinIO: once full, never replace; new blocks are refused.

    Under per-epoch shuffling every resident is read exactly once per epoch,
    so the hit ratio is exactly the cached fraction, which beats LRU. The
    price: the cache never follows a changing working set. Blocks the tier
    removes for its own reasons (demotion, corruption) free room that the
    next admissions take.
    """

    def __init__(self) -> None:
        self._resident: set[str] = set()

    def __len__(self) -> int:
        return len(self._resident)

    def __contains__(self, block: object) -> bool:
        return block in self._resident

    def admitted(self, block: str, ahead: bool = False) -> None:
        self._resident.add(block)

    def accessed(self, block: str) -> None:
        """Reads change nothing: MinIO keeps whatever filled the cache first."""

    def removed(self, block: str) -> None:
        self._resident.discard(block)

    def victim(self, incoming: str | None = None) -> str | None:
        return None

    def spare(self, incoming_use: float | None = None, enough: int = SPARE_COUNT_LIMIT) -> int:
        return 0

    def next_use_changed(self, block: str) -> None:
        """MinIO ignores plans."""


class EpochAwarePolicy:
    """Evict what was already read this epoch; keep what is still unread.

    Each block remembers the epoch of its last read (admission counts: a
    block is admitted because it was just read). A block read in the current
    epoch will, under once-per-epoch sampling, not be needed again until the
    next epoch; a block last read in the previous epoch is still to come; a
    block read in neither has left the working set (a finished job, a
    dataset no longer used). So:

    - stale blocks (last read before the previous epoch) go first, oldest
      first: without this rule an abandoned dataset would hold its space
      forever;
    - then a victim is taken from the blocks read in the current epoch, the one
      whose last read is the EARLIEST in the epoch first. Under independent
      per-epoch shuffles every such block is equally useless until the next
      epoch, so the choice costs nothing there, and "earliest" protects the
      blocks being read right now: the kernel splits one block into many
      FUSE reads, and a sample's block is often read again shortly (packed
      shards, several crops). Choosing the most recent one instead would
      evict a block in the middle of its read;
    - when every resident was last read in the previous epoch, admission is
      refused: each is still to be read this epoch, and the newcomer, just
      read, is the least useful block of all. Steady state is MinIO's hit
      ratio (the cached fraction), but the contents follow the working set.
    - a block read while another job sharing the dataset is still to read
      it this epoch (``DueElsewhere``: a sweep's jobs each read every block
      once an epoch, in orders of their own) ranks as due too, until a read
      that leaves no job to come, and goes stale only once the clock (the
      leading job's epoch) is two epochs on: a job an epoch behind the
      leader still needs it;
    - a block fetched ahead (prefetch, stage) has not been read: it ranks as
      if last read in the previous epoch, due in this one, until it is read
      (or goes stale unread). Counting its admission as a read would make it
      the first victim of the next admission, often another prefetch filling
      the same room.

    With a ``NextUse`` (exact knowledge from a loader's plan), the ranking
    becomes Belady's, with unknown next uses placed by the epoch rule:

    1. stale or read this epoch, next use unknown: farthest; evicted first,
       in that order, as above;
    2. next use known: farthest first, evicted only if ``incoming`` is given
       with a known next use that is strictly sooner (otherwise refuse);
    3. last read in the previous epoch, next use unknown: due this epoch;
       never evicted.

    Next uses are cached in a max-heap when a block is read, when
    ``next_use_changed`` is called, or when a rank-1 block turns out to have
    one; ``victim`` re-checks the top entry, so outdated values cost a
    re-push, never a wrong answer about residency.
    """

    def __init__(
        self, epochs: EpochClock, next_use: NextUse | None = None, elsewhere: DueElsewhere | None = None
    ) -> None:
        self._epochs = epochs
        self._next_use = next_use
        self._elsewhere = elsewhere
        # Epoch of each resident's last read (admission counts), as ranked:
        # its group's key below.
        self._epoch_of: dict[str, float] = {}
        # Residents whose next use is unknown, grouped by the epoch of their
        # last read (``DUE_ELSEWHERE_RANK`` past it when another job is still
        # to read them), earliest read first within a group. Groups are
        # dropped when empty: at most two an epoch with residents.
        self._unknown: dict[float, OrderedDict[str, None]] = {}
        # Residents with a known next use: block -> (next use, entry id) of
        # its one valid heap entry; the heap holds (-next use, entry id, block)
        # and may hold stale entries, skipped on pop and purged by compaction.
        self._known: dict[str, tuple[float, int]] = {}
        self._heap: list[tuple[float, int, str]] = []
        self._entry = 0

    def __len__(self) -> int:
        return len(self._epoch_of)

    def __contains__(self, block: object) -> bool:
        return block in self._epoch_of

    def admitted(self, block: str, ahead: bool = False) -> None:
        if not ahead:
            self._read(block)
        elif block not in self._epoch_of:
            self._settle(block, self._epochs.current() - 1)

    def accessed(self, block: str) -> None:
        if block in self._epoch_of:
            self._read(block)

    def removed(self, block: str) -> None:
        epoch = self._epoch_of.pop(block, None)
        if epoch is None:
            return
        self._forget_placement(block, epoch)

    def next_use_changed(self, block: str) -> None:
        """The plan changed ``block``'s next use without a read; re-rank it. O(log n)."""
        epoch = self._epoch_of.get(block)
        if epoch is None or (block not in self._known and self._lookup(block) is None):
            return  # not here, or still unplanned: it keeps its place in the read order
        self._forget_placement(block, epoch)
        self._place(block, epoch)

    def victim(self, incoming: str | None = None) -> str | None:
        current = self._epochs.current()
        while True:
            epoch = self._evictable_epoch(current)
            if epoch is not None:
                block = next(iter(self._unknown[epoch]))
                if self._lookup(block) is None:
                    return block
                # The plan now knows this block: rank it by its next use.
                self._forget_placement(block, epoch)
                self._place(block, epoch)
                continue
            if not self._heap:
                return None
            negative, entry, block = self._heap[0]
            if self._known.get(block) != (-negative, entry):
                heapq.heappop(self._heap)
                continue
            latest = self._lookup(block)
            if latest != -negative:
                self._forget_placement(block, self._epoch_of[block])
                self._place(block, self._epoch_of[block])
                continue
            newcomer = None if incoming is None else self._lookup(incoming)
            if newcomer is not None and newcomer < latest:
                return block
            return None

    def spare(self, incoming_use: float | None = None, enough: int = SPARE_COUNT_LIMIT) -> int:
        """The stale blocks and those read this epoch (an upper bound:
        ``victim`` re-ranks any of them the plan has since given a next use),
        plus, for a newcomer with a known next use, the planned residents
        due after it."""
        current = self._epochs.current()
        unplanned = sum(
            len(group) for epoch, group in self._unknown.items() if epoch < current - 1 or epoch == current
        )
        if incoming_use is None or unplanned >= enough:
            return unplanned
        return unplanned + self._planned_after(incoming_use, enough - unplanned)

    def _planned_after(self, when: float, enough: int) -> int:
        """Residents planned for after ``when``, counted up to ``enough``.
        They sit at the top of the max-heap (no entry is later than its
        parent), so the walk visits only them and their direct children,
        plus the outdated entries among them."""
        count = visited = 0
        pending = [0]
        while pending and count < enough and visited < HEAP_SLACK * 2 * enough:
            position = pending.pop()
            if position >= len(self._heap):
                continue
            visited += 1
            negative, entry, block = self._heap[position]
            if -negative <= when:
                continue
            if self._known.get(block) == (-negative, entry):
                count += 1
            pending.extend((2 * position + 1, 2 * position + 2))
        return count

    def _evictable_epoch(self, current: int) -> float | None:
        """The group ``victim`` takes from: the stalest, else this epoch's.
        O(groups), and there are at most two groups an epoch that still has residents."""
        oldest = min(self._unknown, default=None)
        if oldest is not None and oldest < current - 1:
            return oldest
        return current if current in self._unknown else None

    def _lookup(self, block: str) -> float | None:
        return None if self._next_use is None else self._next_use.next_use(block)

    def _read(self, block: str) -> None:
        if self._elsewhere is not None and self._elsewhere.due_elsewhere(block):
            # Another job is still to read it: due, until the clock (the
            # leading job's epoch) has moved on twice, so that a job still
            # in the leader's previous epoch keeps it too.
            self._settle(block, self._epochs.current() + DUE_ELSEWHERE_RANK)
        else:
            self._settle(block, self._epochs.current())

    def _settle(self, block: str, epoch: float) -> None:
        previous = self._epoch_of.get(block)
        if previous is not None:
            self._forget_placement(block, previous)
        self._epoch_of[block] = epoch
        self._place(block, epoch)

    def _place(self, block: str, epoch: float) -> None:
        when = self._lookup(block)
        if when is None:
            self._unknown.setdefault(epoch, OrderedDict())[block] = None
            return
        self._entry += 1
        self._known[block] = (when, self._entry)
        heapq.heappush(self._heap, (-when, self._entry, block))

    def _forget_placement(self, block: str, epoch: float) -> None:
        if self._known.pop(block, None) is not None:
            self._compact_heap()
            return
        group = self._unknown.get(epoch)
        if group is not None:
            group.pop(block, None)
            if not group:
                del self._unknown[epoch]

    def _compact_heap(self) -> None:
        """Drop stale heap entries once they outnumber the live ones (amortised O(1))."""
        if len(self._heap) > HEAP_SLACK * (len(self._known) + 1):
            self._heap = [(-when, entry, block) for block, (when, entry) in self._known.items()]
            heapq.heapify(self._heap)


def make_policy(
    name: str,
    epochs: EpochClock,
    rng: random.Random,
    next_use: NextUse | None = None,
    elsewhere: DueElsewhere | None = None,
) -> EvictionPolicy:
    """The policy called ``name`` (one of ``POLICY_NAMES``); ValueError for any other.

    ``epochs``, ``next_use`` and ``elsewhere`` only matter to the epoch-aware
    policy, ``rng`` only to 2-random; every policy takes them so config can
    switch freely.
    """
    if name == LRU:
        return LruPolicy()
    if name == TWO_RANDOM:
        return TwoRandomPolicy(rng)
    if name == MINIO:
        return MinioPolicy()
    if name == EPOCH_AWARE:
        return EpochAwarePolicy(epochs, next_use, elsewhere)
    raise ValueError(f"unknown eviction policy {name!r}; expected one of {', '.join(POLICY_NAMES)}")
