"""What the control API answers, typed: ``GET /stats`` (``StatsAnswer``) and
``GET /diagnose`` (``DiagnosisAnswer``).

The daemon fills these models (``control/server.py``'s ``MountHandlers``,
``stats.DaemonStats``, ``diagnose/service.py``) and the commands parse them
(``ControlClient.stats`` for ``cachefsd stats``, ``top`` and ``bench``;
``ControlClient.diagnose`` for ``cachefsd doctor``), so both sides read one
schema by attribute. Every model forbids unknown fields and requires every
field it declares: a daemon and a command that disagree fail loudly at the
command, naming the field, instead of showing a default.

This module imports pydantic and nothing of the daemon: the CLI loads it,
and the stdlib-only client (``client.py``, imported by the loader meter and
``cachefsd.hints``) imports it only inside the call that parses an answer.

Bytes are integers, durations seconds (float), ratios 0..1, or None when
nothing was measured yet (no reads is not a 0 % hit ratio). Maps keyed by a
tier or a source (``served_bytes``, ``evictions``) carry only the places
that exist on the daemon: memory, its tiers, cold, shared.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class _Answer(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TierUsage(_Answer):
    """One configured tier of the node's cache."""

    name: str
    dir: str
    capacity_bytes: int
    used_bytes: int
    blocks: int


class HintCounts(_Answer):
    """Hints this mount received (``POST /hint``) and their paths."""

    received: int
    paths: int
    accepted: int
    unknown: int


class SourceCounts(_Answer):
    """Read requests by where their bytes came from (cold: any byte waited on a store)."""

    cache: int
    cold: int


class SourceBytes(_Answer):
    """Bytes read, by where they came from."""

    cache: int
    cold: int


class ReadBytes(SourceBytes):
    total: int


class MountReadsAnswer(_Answer):
    count: SourceCounts
    bytes: ReadBytes


class ThisMount(_Answer):
    """What this mount's readers got (the rest of the answer is the node's)."""

    mountpoint: str
    reads: MountReadsAnswer
    hit_ratio: float | None
    stall_seconds: float
    passthrough: str  # "on", or "off: " and why (``fuse.session.Passthrough``)


class NodeMount(_Answer):
    mountpoint: str
    source: str


class NodeFacts(_Answer):
    """The daemon this mount belongs to, and all its mounts."""

    pid: int
    cache_dir: str
    metrics_addr: str | None
    mounts: list[NodeMount]


class NodeReads(MountReadsAnswer):
    served_bytes: dict[str, int]  # by place: memory, a tier, shared, cold


class HitRatios(_Answer):
    since_mount: float | None
    last_minute: float | None
    last_minute_seconds: float  # the span ``last_minute`` covers
    by_tier: dict[str, float]  # share of bytes read served by each place


class FetchTotals(_Answer):
    """Requests of one kind to a store (the origin, or the shared tier's bucket)."""

    count: int
    bytes: int
    retries: int
    errors: int
    p50_seconds: float | None
    p99_seconds: float | None


class FetchByKind(_Answer):
    demand: FetchTotals
    prefetch: FetchTotals
    metadata: FetchTotals
    shared: FetchTotals


class PrefetchTotals(_Answer):
    issued_bytes: int
    used_bytes: int
    wasted_bytes: int
    accuracy: float | None  # used / issued
    waste: float | None  # wasted / issued


class DedupTotals(_Answer):
    disk_saved_bytes: int
    wire_saved_bytes: int


class CacheTotals(_Answer):
    """The cache over all tiers; the per-tier counts by tier name."""

    used_bytes: int
    capacity_bytes: int
    promotions: int
    demotions: int
    evictions: dict[str, int]
    corrupt_blocks: dict[str, int]
    errors: dict[str, int]


class EpochsAnswer(_Answer):
    current: int
    workloads: dict[str, int]  # a workload (job:dataset root) -> its epoch


class JobActivity(_Answer):
    """A job the metrics name: its reads, and its loader meter's totals."""

    reads: SourceCounts
    bytes: SourceBytes
    hit_ratio: float | None
    stall_seconds: float
    batches: int
    data_wait_fraction: float | None  # None without a loader meter's step time


class WorkloadAccess(_Answer):
    """One workload (a job reading one dataset) as the workload model sees it."""

    epoch: int
    working_set_files: int
    unread_files: int
    read_this_epoch_files: int
    order: Literal["hint", "replay", "unknown"]  # what the prefetcher follows
    hint_files: int
    hint_matched: int
    active_streams: int


class AccessTotals(_Answer):
    """The workload model over all workloads, and the most recently active ones."""

    epoch: int
    workloads: int
    working_set_files: int
    unread_files: int
    read_this_epoch_files: int
    active_streams: int
    hint_coverage: float  # share of this epoch's opens a hint predicted
    per_workload: dict[str, WorkloadAccess]


class PrefixResidency(_Answer):
    prefix: str
    bytes: dict[str, int]  # by tier
    total_bytes: int


class ResidencyAnswer(_Answer):
    """Bytes of each top-level prefix of the source each tier holds."""

    source: str
    tiers: list[str]
    age_seconds: float | None  # None before the first count
    refresh_seconds: float
    max_prefixes: int
    error: str | None  # why the last count failed (its predecessor is shown)
    prefixes: list[PrefixResidency]


class UploadFailure(_Answer):
    key: str
    error: str  # its last attempt's


class WritesAnswer(_Answer):
    """A writable mount's staged files and their uploads to the bucket."""

    staged_bytes: int  # written and not in the bucket yet
    staged_files: int
    uploads_due: int  # waiting, running, or failed and to be retried
    uploads_in_flight: int
    uploads_failing: int  # due, and their last attempt failed
    oldest_due_seconds: float  # how long the oldest due upload has waited; 0: none is due
    uploaded_bytes: int
    uploaded_files: int  # uploads that ended in the bucket
    failed_attempts: int
    upload_bytes_per_second: float | None  # of uploads ended over ``upload_rate_seconds``
    upload_rate_seconds: float  # the span the rate covers
    upload_p50_seconds: float | None
    upload_p99_seconds: float | None
    oldest_failure: UploadFailure | None  # the failing upload due longest, and why


class NodeActivity(_Answer):
    """What the daemon measured (``stats.DaemonStats``), beside the mount's
    own facts in ``StatsAnswer``."""

    mount: ThisMount
    node: NodeFacts
    uptime_seconds: float
    reads: NodeReads
    hit_ratio: HitRatios
    stall_seconds: float
    fetch: FetchByKind
    prefetch: PrefetchTotals
    dedup: DedupTotals
    cache: CacheTotals
    epoch: EpochsAnswer
    jobs: dict[str, JobActivity]
    access: AccessTotals
    residency: ResidencyAnswer
    writes: WritesAnswer | None  # this mount's; None when it is read-only


class MountFacts(_Answer):
    """The mount asked (``MountHandlers``): what it is, its tiers and its hints."""

    pid: int
    mountpoint: str
    source: str
    block_size: int
    tiers: list[TierUsage]
    hints: HintCounts


class StatsAnswer(NodeActivity, MountFacts):
    """``GET /stats``: the mount's facts, then its daemon's activity (keys in
    that order: pydantic lays out the fields of the last base first)."""


# -- GET /diagnose ------------------------------------------------------------------


class CacheSetup(_Answer):
    """What the doctor's what-if replays a job's reads through."""

    capacity_bytes: int
    policy: str
    block_size: int


class MeteredReads(_Answer):
    """A job's reads over its metered window (``diagnose.ledger.JobReads``):
    their time summed over its readers, the part waiting on a store, and
    their bytes by source."""

    read_seconds: float
    stall_seconds: float
    cache_bytes: float
    cold_bytes: float


class ObservedReads(_Answer):
    """A sample of a job's read order on the mount (the workload model's
    ``ObservedOrder``), for the what-if replay; ``workload`` names the job
    and the dataset it read (``workload.identity``)."""

    workload: str
    order: list[str]
    sizes: dict[str, int]
    sample_every: int
    working_set_files: int
    working_set_bytes: int
    repeats: bool  # the last epoch replayed the one before (no shuffle)
    source: Literal["hint", "replay", "unknown"]  # what the prefetcher follows
    epoch: int


class MeteredJobAnswer(_Answer):
    """A job whose loader meters report to this mount, and its reads."""

    job: str
    batches: int
    data_wait_seconds: float
    step_seconds: float
    reader_seconds: float  # the time of the processes reading for its loops: what reads are shares of
    meters: int
    last_report_seconds_ago: float
    reads: MeteredReads | None  # None while its reads are counted with other jobs'
    observed: ObservedReads | None


class DiagnosisAnswer(_Answer):
    """``GET /diagnose``: the metered jobs of a mount, which ``cachefsd doctor`` judges."""

    mountpoint: str
    cache: CacheSetup
    jobs: list[MeteredJobAnswer]
