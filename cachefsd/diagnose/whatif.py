"""What-if: the hit ratio a job would get at other cache sizes, without a rerun.

The daemon keeps each job's order of its last epoch (``WorkloadModel.observed``,
a sample of it by a hash of file names for a large dataset). Replaying
that order through the daemon's eviction policy (``cache.replay``), one
epoch to fill the cache and ``MEASURED_EPOCHS`` more, at each cache size
gives the hit ratio of the epochs after the first, as DS-Analyzer's
what-if table does from three reruns. Later epochs are the observed order
again when the job repeats its order, else seeded shuffles of it (a
shuffling loader draws a new order every epoch). A sample of one file in
k replays at a capacity of 1/k: hit ratios under shuffled epochs depend on
the cached fraction, not on the dataset's size.

The replay has no prefetcher: it is what the cache alone keeps, the floor
of what the mount serves. Pure: no I/O, no clock.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from cachefsd.cache.policy import make_policy
from cachefsd.cache.replay import ReplayCache, replay
from cachefsd.workload.model import ObservedOrder, WorkloadModel

# Cache sizes tried, as fractions of the job's working set, besides the
# cache's own capacity: from a quarter of the data to all of it with room.
WORKING_SET_FRACTIONS = (0.25, 0.5, 0.75, 1.0, 1.25)
MEASURED_EPOCHS = 2
# The daemon samples this many files of a job's order at most: a replay
# costs a few tens of microseconds a block, so a table of six sizes stays
# within a couple of seconds of the doctor's CPU.
MAX_REPLAYED_FILES = 4000


@dataclass(frozen=True, slots=True)
class WhatIf:
    capacity_bytes: int
    hit_ratio: float  # of bytes, in the epochs after the first


def what_if(
    observed: ObservedOrder,
    block_size: int,
    policy: str,
    capacities: Sequence[int],
    seed: int = 0,
) -> list[WhatIf]:
    """The hit ratio of ``observed``'s job at each of ``capacities`` (bytes
    of cache for the whole working set), under ``policy``."""
    if not observed.order:
        return []
    epochs = [list(observed.order)]
    rng = random.Random(seed)
    for _ in range(MEASURED_EPOCHS):
        order = list(observed.order)
        if not observed.repeats:
            rng.shuffle(order)
        epochs.append(order)
    trace = [path for epoch in epochs for path in epoch]
    sizes = {path: max(1, size) for path, size in observed.sizes.items()}
    blocks = {path: _blocks(path, sizes[path], block_size) for path in sizes}
    block_bytes = {block: nbytes for path in sizes for block, nbytes in blocks[path]}
    first_epoch = sum(len(blocks[path]) for path in epochs[0])
    results = []
    for capacity in capacities:
        clock = WorkloadModel()
        cache = ReplayCache(
            make_policy(policy, clock, random.Random(seed)),
            capacity // observed.sample_every,
            block_bytes.__getitem__,
        )
        hits = replay(
            cache,
            trace,
            clock,
            blocks_of=lambda path: [block for block, _ in blocks[path]],
            file_size=sizes.__getitem__,
        )
        names = [block for path in trace for block, _ in blocks[path]][first_epoch:]
        read = sum(block_bytes[name] for name in names)
        hit = sum(
            block_bytes[name] for name, was_hit in zip(names, hits[first_epoch:], strict=True) if was_hit
        )
        results.append(WhatIf(capacity, hit / read if read else 0.0))
    return results


def capacities_to_try(working_set_bytes: int, capacity_bytes: int) -> list[int]:
    """The sizes of the table: fractions of the working set, and the cache's own."""
    sizes = {round(fraction * working_set_bytes) for fraction in WORKING_SET_FRACTIONS}
    sizes.add(capacity_bytes)
    return sorted(size for size in sizes if size > 0)


def _blocks(path: str, size: int, block_size: int) -> list[tuple[str, int]]:
    count = max(1, -(-size // block_size))
    return [(f"{path}#{index}", min(block_size, size - index * block_size)) for index in range(count)]
