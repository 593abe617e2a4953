"""Why a job starves, from the loop's data wait and the store's stalls, and
what to change. Pure rules over numbers: ``cachefsd doctor`` feeds them
what the daemon's ledger and workload model report.

The verdict uses the thresholds of TensorFlow's input-pipeline analyzer on
the share of the loop's time spent waiting for the next batch: under 5 %
the job is not input-bound (the accelerator is the bottleneck), 5-20 %
moderately, 20 % or more highly. An input-bound job waits on its readers
(a DataLoader's workers, or the loop's own ``next()`` without them): on
**storage** when they spend at least half their time reading (the time
the job's reads took in the daemon, summed over its readers, over the
time they had: the ``read_fraction``), else on **preprocessing** (they
decode and augment too slowly). The part of the reads spent waiting on
the store (``storage_stall_fraction``) says which storage advice fits.
When the daemon counts the job's reads with other jobs' (more jobs read
than the metrics name), the cause is unknown: **input-bound**.
"""

from __future__ import annotations

from dataclasses import dataclass

from cachefsd.config import human_bytes
from cachefsd.diagnose.whatif import WhatIf

NOT_INPUT_BOUND = "not-input-bound"
STORAGE = "storage"
PREPROCESSING = "preprocessing"
INPUT_BOUND = "input-bound"  # cause unknown

INPUT_BOUND_FROM = 0.05
HIGHLY_INPUT_BOUND_FROM = 0.20
STORAGE_EXPLAINS = 0.5
# A hit ratio the table calls "enough": a cache size that reaches it is the one to ask for.
ENOUGH_HIT_RATIO = 0.95
# Fewer batches than this say little: the verdict stands, with a caution.
FEW_BATCHES = 20


def verdict(data_wait_fraction: float, read_fraction: float | None) -> str:
    if data_wait_fraction < INPUT_BOUND_FROM:
        return NOT_INPUT_BOUND
    if read_fraction is None:
        return INPUT_BOUND
    if read_fraction >= STORAGE_EXPLAINS:
        return STORAGE
    return PREPROCESSING


def severity(data_wait_fraction: float) -> str:
    """TensorFlow's words for how input-bound a job is."""
    if data_wait_fraction < INPUT_BOUND_FROM:
        return "not input-bound"
    if data_wait_fraction < HIGHLY_INPUT_BOUND_FROM:
        return "moderately input-bound"
    return "highly input-bound"


@dataclass(frozen=True, slots=True)
class JobFacts:
    """What the advice is drawn from: one job, as the daemon saw it."""

    mountpoint: str
    batches: int
    data_wait_fraction: float
    # Shares of its readers' time spent reading, and waiting on the store
    # (part of the first); None when its reads are counted with other jobs'.
    read_fraction: float | None
    storage_stall_fraction: float | None
    epoch: int | None
    order_source: str | None  # "hint", "replay", "unknown"; None if no reads seen
    repeats: bool
    working_set_bytes: int | None
    capacity_bytes: int


def advice(facts: JobFacts, table: list[WhatIf]) -> list[str]:
    """What to do, most useful first."""
    notes = []
    if facts.batches < FEW_BATCHES:
        notes.append(f"only {facts.batches} batches measured so far: let the job run longer, then ask again")
    kind = verdict(facts.data_wait_fraction, facts.read_fraction)
    if kind == NOT_INPUT_BOUND:
        notes.append(
            f"nothing to change in the input pipeline: the loop waits for data "
            f"{facts.data_wait_fraction:.1%} of its time; the model's compute is the bottleneck"
        )
        return notes
    if kind == INPUT_BOUND:
        notes.append(
            "the daemon counts this job's reads with other jobs' (more jobs read than its metrics name), "
            "so it cannot tell whether they wait on the store: ask again when fewer jobs read"
        )
        return notes
    if kind == PREPROCESSING:
        notes.append(
            f"its readers spent only {facts.read_fraction:.1%} of their time reading: "
            "they are too slow at the rest. Use more DataLoader workers (num_workers), or make "
            "decoding and augmentation cheaper (smaller stored images, decoding on the GPU)"
        )
        return notes
    return notes + _storage_advice(facts, table)


def size_setting(nbytes: int) -> str:
    """``nbytes`` rounded up to what ``--cache-size`` takes: whole GiB, or MiB below one."""
    if nbytes >= 1 << 30:
        return f"{-(-nbytes // (1 << 30))}G"
    return f"{max(1, -(-nbytes // (1 << 20)))}M"


def _storage_advice(facts: JobFacts, table: list[WhatIf]) -> list[str]:
    # Only a job whose reads the daemon can tell apart gets here (``INPUT_BOUND`` otherwise).
    assert facts.read_fraction is not None
    assert facts.storage_stall_fraction is not None
    if facts.storage_stall_fraction < STORAGE_EXPLAINS * facts.read_fraction:
        return [
            f"its reads took {facts.read_fraction:.1%} of its readers' time, but waited on the store "
            f"for only {facts.storage_stall_fraction:.1%}: reading what is cached is what is slow. "
            "Profile the daemon (py-spy dump --pid), or put the cache on a faster disk"
        ]
    notes = []
    working_set = facts.working_set_bytes
    if working_set is not None and working_set > facts.capacity_bytes:
        enough = next((row for row in table if row.hit_ratio >= ENOUGH_HIT_RATIO), None)
        size = size_setting(enough.capacity_bytes if enough is not None else working_set)
        notes.append(
            f"the cache ({human_bytes(facts.capacity_bytes)}) is smaller than what this job reads "
            f"({human_bytes(working_set)}): each epoch rereads most of the rest from the store. "
            f"A cache of {size} keeps it (--cache-size {size}, or [cache] size)"
        )
    elif facts.epoch == 0:
        notes.append(
            f"the first epoch reads from the store: stage the dataset before the job "
            f"(cachefsd stage {facts.mountpoint}), and the first epoch reads from the cache"
        )
    if facts.order_source == "unknown" and not facts.repeats:
        notes.append(
            "the daemon does not know the read order: wrap the sampler in "
            "cachefsd.hints.HintingSampler, and the prefetcher fetches exactly what is read next"
        )
    if not notes:
        notes.append(
            "the store does not keep up with the job even with the order known and the data fitting: "
            "raise [prefetch] concurrency and lookahead, or stage the dataset before the job"
        )
    return notes
