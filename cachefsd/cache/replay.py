"""Reads replayed through an eviction policy, with no cache behind it: what
``benchmarks/policy_sim.py`` compares policies with, and what ``cachefsd
doctor``'s what-if table (``diagnose/whatif.py``) runs a job's observed
order through at other cache sizes.

The cache here is a set of block names with a byte capacity, run by a real
policy from ``policy.py`` by the tiers' own rule (``tier.victims_for``): a
miss admits the block once it has been read (refused when the policy gives
no victim up), a read another job is still to make this epoch is marked
for the policy as the mount marks it (``policy.ReadMarks``), and a block
the prefetcher brought (``admit(ahead=True)``) carries its planned use.
The epoch clock is the daemon's own workload model, told of every open and
read as the mount tells it. Hooks run before each read and after it (a
next-use oracle, a simulated prefetcher).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from cachefsd.cache.policy import EvictionPolicy, PlannedUse, ReadMarks
from cachefsd.cache.tier import NoRoom, victims_for
from cachefsd.jobs import UNKNOWN_JOB
from cachefsd.workload.model import WorkloadModel


class ReplayCache:
    """Block names, a byte capacity and ``policy``; each block is
    ``size_of(block)`` bytes (1 by default: a capacity in blocks)."""

    def __init__(
        self,
        policy: EvictionPolicy,
        capacity: int,
        size_of: Callable[[str], int] = lambda _: 1,
        planned: PlannedUse | None = None,
    ) -> None:
        self.policy = policy
        self.capacity = capacity
        self.planned = planned
        self.resident: set[str] = set()
        self._size_of = size_of
        self._used = 0

    def read(self, block: str) -> bool:
        """A read of ``block``; a miss admits it. Whether it hit."""
        if self.planned is not None:
            self.planned.consumed(block)
        if block in self.resident:
            self.policy.accessed(block)
            return True
        self.admit(block)
        return False

    def admit(self, block: str, ahead: bool = False) -> bool:
        """Take ``block`` in if there is room, or once the policy has given
        enough residents up; False if it refuses."""
        size = self._size_of(block)
        if size > self.capacity:
            return False
        try:
            victims_for(self.policy, block, self._used + size - self.capacity, self._evict, "replayed")
        except NoRoom:
            return False
        self.resident.add(block)
        self._used += size
        self.policy.admitted(block, ahead)
        return True

    def _evict(self, block: str) -> int:
        self.resident.remove(block)
        size = self._size_of(block)
        self._used -= size
        self.policy.removed(block)
        if self.planned is not None:
            self.planned.consumed(block)
        return size


class ReplayHook(Protocol):
    """Called around each read of a replay."""

    def before(self, position: int, now: float) -> None:
        """The read at trace ``position`` is next."""
        ...

    def after(self, opens: int) -> None:
        """A read is done; ``opens`` files have been read."""
        ...


def replay(
    cache: ReplayCache,
    trace: Sequence[str],
    clock: WorkloadModel,
    jobs: Sequence[str] | None = None,
    blocks_of: Callable[[str], Sequence[str]] = lambda path: (path,),
    file_size: Callable[[str], int] = lambda _: 1,
    hooks: Sequence[ReplayHook] = (),
    read_seconds: float = 0.001,
    read_marks: ReadMarks | None = None,
) -> list[bool]:
    """Replay ``trace`` (files, read whole by ``jobs``, one job when None)
    through ``cache``: hit per block read, in order. Each job lists the
    dataset first, as a loader does. ``read_seconds`` apart: time only
    orders the model's events. ``read_marks``: where a read another job
    is still to make is marked, which ``cache``'s policy was given."""
    readers = [UNKNOWN_JOB] * len(trace) if jobs is None else jobs
    listing = {path: file_size(path) for path in set(trace)}
    for job in dict.fromkeys(readers):
        clock.listed("", listing, 0.0, job)
    hits: list[bool] = []
    for position, path in enumerate(trace):
        now = position * read_seconds
        for hook in hooks:
            hook.before(position, now)
        job = readers[position]
        size = listing[path]
        clock.opened(path, size, now, job)
        clock.read(path, 0, size, now, job)
        blocks = blocks_of(path)
        if read_marks is not None and clock.wanted_elsewhere(path, job):  # as the mount asks at each read
            with read_marks.reading(frozenset(blocks).__contains__):
                hits.extend(cache.read(block) for block in blocks)
        else:
            hits.extend(cache.read(block) for block in blocks)
        for hook in hooks:
            hook.after(position + 1)
    return hits
