"""Every metric cachefsd exports, declared once against an injected registry,
and read back through its object (``value_of``, ``values_by``), never by name.

Names carry their unit; label values are bounded (source, kind), never a
path. ``Metrics`` implements the event Protocols of the data path
(``ReadEvents``, ``FetchEvents``, ``CacheEvents``), so the data path knows
nothing about Prometheus.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import GaugeMetricFamily
from prometheus_client.registry import Collector

from cachefsd.cache.tiered import DedupWhere
from cachefsd.diagnose.ledger import JobReads
from cachefsd.fetch import FetchKind

# 100 µs (a local store or an in-region hit) to 30 s (the default deadline).
LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)

# The kind label of the cachefsd_fetch_* metrics: the origin's requests by
# their FetchKind, the shared tier's all as "shared".
FetchLabel = FetchKind | Literal["shared"]


# (prefix, tier, bytes): one sample of ``cachefsd_resident_bytes``.
ResidencyRows = Callable[[], Iterable[tuple[str, str, int]]]

# The label naming a reading job: Prometheus keeps "job" for its scrape
# targets (and renames a "job" label it scrapes to "exported_job").
JOB_LABEL = "reader_job"
# Jobs counted under a label of their own at once (the rest as "other"),
# and how long one reads nothing before its label may go to another.
MAX_JOB_SERIES = 8
JOB_IDLE_SECONDS = 300.0
OTHER_JOBS_LABEL = "other"
UNKNOWN_JOB_LABEL = "unknown"  # a caller the daemon cannot see (another pid namespace)

RESIDENT_BYTES = "cachefsd_resident_bytes"
_RESIDENT_HELP = (
    "Raw bytes of a source's top-level prefix held by a tier (at most a bounded number of "
    'prefixes, the rest as prefix="(other)"; refreshed every few seconds, not per read)'
)


class ResidencyCollector(Collector):
    """``cachefsd_resident_bytes{source, prefix, tier}``, from rows each
    mount's caller computes and caches (``stats.Residency``): a scrape must
    not scan the index, and the labels must already be bounded. Two mounts
    of one source export it once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_mount: dict[str, tuple[str, ResidencyRows]] = {}

    def watch(self, mount: str, source: str, rows: ResidencyRows) -> None:
        with self._lock:
            self._by_mount[mount] = (source, rows)

    def forget(self, mount: str) -> None:
        with self._lock:
            self._by_mount.pop(mount, None)

    def describe(self) -> Iterator[GaugeMetricFamily]:
        """The family without samples: registering must not compute rows."""
        yield GaugeMetricFamily(RESIDENT_BYTES, _RESIDENT_HELP, labels=["source", "prefix", "tier"])

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self._lock:
            by_source = {source: rows for source, rows in self._by_mount.values()}
        family = GaugeMetricFamily(RESIDENT_BYTES, _RESIDENT_HELP, labels=["source", "prefix", "tier"])
        for source, rows in by_source.items():
            for prefix, tier, nbytes in rows():
                family.add_metric([source, prefix, tier], nbytes)
        yield family


def waited_bytes(served: dict[str, int]) -> int:
    """Of a read's bytes, those that waited on a store: the origin's
    (``cold``) and the shared tier's, which is a bucket too."""
    return served.get("cold", 0) + served.get("shared", 0)


class MountEvents:
    """``ReadEvents`` of one mount: the node's counters, and the mount's own
    (``cachefsd_mount_*{mount}``), so a dashboard tells which mount waits;
    and its FUSE edge's (``fuse.session.SessionEvents``)."""

    def __init__(self, metrics: Metrics, mount: str) -> None:
        self._metrics = metrics
        self._mount = mount
        self._requests: dict[str, Counter] = {}
        self._passthrough = metrics.passthrough.labels(mount)
        self._reads = {source: metrics.mount_reads.labels(mount, source) for source in ("cache", "cold")}
        self._bytes = {source: metrics.mount_read_bytes.labels(mount, source) for source in ("cache", "cold")}
        self._stall = metrics.mount_read_stall.labels(mount)

    def read_done(self, served: dict[str, int], stall_seconds: float, job: str, seconds: float) -> None:
        self._metrics.read_done(served, stall_seconds, job, seconds)
        cold_bytes = waited_bytes(served)
        self._reads["cold" if cold_bytes else "cache"].inc()
        self._bytes["cache"].inc(sum(served.values()) - cold_bytes)
        if cold_bytes:
            self._bytes["cold"].inc(cold_bytes)
            self._stall.inc(stall_seconds)

    def request_answered(self, operation: str, count: int = 1) -> None:
        counter = self._requests.get(operation)
        if counter is None:
            counter = self._requests[operation] = self._metrics.fuse_requests.labels(self._mount, operation)
        counter.inc(count)

    def passthrough_state(self, on: bool) -> None:
        self._passthrough.set(1 if on else 0)

    def watch_writes(self, staged_bytes: Callable[[], float], oldest_pending: Callable[[], float]) -> None:
        """Export a writable mount's staged bytes and oldest due upload; its
        upload series exist, at 0, from now."""
        metrics = self._metrics
        metrics.staged_bytes.labels(self._mount).set_function(staged_bytes)
        metrics.upload_oldest_pending.labels(self._mount).set_function(oldest_pending)
        metrics.uploads_in_flight.labels(self._mount)
        metrics.upload_bytes.labels(self._mount)
        metrics.upload_seconds.labels(self._mount)
        for result in ("ok", "failed"):
            metrics.uploads.labels(self._mount, result)

    def upload_started(self) -> None:
        self._metrics.uploads_in_flight.labels(self._mount).inc()

    def upload_ended(self, result: Literal["ok", "failed", "dropped"], seconds: float, nbytes: int) -> None:
        """An upload ended: in the bucket, failed (retried later), or
        dropped (its file changed or went meanwhile)."""
        self._metrics.uploads_in_flight.labels(self._mount).dec()
        if result != "dropped":
            self._metrics.uploads.labels(self._mount, result).inc()
        if result == "ok":
            self._metrics.upload_bytes.labels(self._mount).inc(nbytes)
            self._metrics.upload_seconds.labels(self._mount).observe(seconds)


# The sample of a family that holds its value: a counter's running total,
# a gauge's reading. A histogram's series are named by who reads them.
_VALUE_SUFFIX = {"counter": "_total", "gauge": ""}


def _samples(
    metric: Collector, series: str | None, labels: dict[str, str]
) -> Iterator[tuple[dict[str, str], float]]:
    """(labels, value) of ``metric``'s samples of ``series`` carrying ``labels``."""
    for family in metric.collect():
        name = family.name + (_VALUE_SUFFIX[family.type] if series is None else series)
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                yield sample.labels, sample.value


def value_of(metric: Collector, series: str | None = None, **labels: str) -> float:
    """The sum of ``metric``'s values carrying ``labels``: a counter's
    total, a gauge's reading, or a histogram's ``series`` (``_count``)."""
    return sum(value for _, value in _samples(metric, series, labels))


def values_by(metric: Collector, label: str, series: str | None = None, **labels: str) -> dict[str, float]:
    """``value_of`` for each value of ``label``, of the children that have it."""
    found: dict[str, float] = {}
    for have, value in _samples(metric, series, labels):
        if label in have:
            found[have[label]] = found.get(have[label], 0.0) + value
    return found


@dataclass(frozen=True, slots=True)
class Derived:
    """The values that are functions of other metrics (``Metrics.derived``)."""

    hit_ratio: float  # of bytes read since mount; 0.0 before any read
    tier_hit_ratios: dict[str, float]  # share of bytes read served by each place
    cache_used_bytes: float
    cache_capacity_bytes: float


class _DerivedCollector(Collector):
    """The gauges that are functions of other metrics, computed when scraped
    rather than on every read: hit ratios, and the cache totals over tiers."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return self._families(Derived(0.0, {}, 0.0, 0.0))

    def collect(self) -> Iterator[GaugeMetricFamily]:
        return self._families(self._metrics.derived())

    @staticmethod
    def _families(derived: Derived) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(
            "cachefsd_hit_ratio",
            "Fraction of bytes read since mount that did not wait on the cold store",
            value=derived.hit_ratio,
        )
        by_tier = GaugeMetricFamily(
            "cachefsd_tier_hit_ratio",
            "Fraction of bytes read since mount served by each place (memory, hot, warm, cold)",
            labels=["tier"],
        )
        for tier, ratio in derived.tier_hit_ratios.items():
            by_tier.add_metric([tier], ratio)
        yield by_tier
        yield GaugeMetricFamily(
            "cachefsd_cache_used_bytes",
            "Bytes on disk used by cached blocks, all tiers",
            value=derived.cache_used_bytes,
        )
        yield GaugeMetricFamily(
            "cachefsd_cache_capacity_bytes",
            "Byte capacity of the block cache, all tiers",
            value=derived.cache_capacity_bytes,
        )


class JobLabels:
    """The ``job`` label a job's reads are counted under, bounded: each of
    the first ``MAX_JOB_SERIES`` jobs gets its own; a later one takes the
    place of the job idle longest once that one has read nothing for
    ``JOB_IDLE_SECONDS`` (whose series are removed), and until then is
    counted as ``other``. So a dashboard shows the jobs reading now by name."""

    def __init__(self, dropped: Callable[[str], None], clock: Callable[[], float]) -> None:
        self._dropped = dropped
        self._clock = clock
        self._lock = threading.Lock()
        self._last_read: dict[str, float] = {}  # job with a label of its own -> its latest read

    def named(self) -> list[str]:
        """The labels of the jobs counted under one of their own now."""
        with self._lock:
            return list(self._last_read)

    def label(self, job: str, reading: bool = True) -> str:
        """``job``'s label; ``reading`` when it is for a read, which keeps
        a job that reads from giving its label up (a loader meter's report
        does not)."""
        name = job or UNKNOWN_JOB_LABEL
        now = self._clock()
        with self._lock:
            if name in self._last_read and not reading:
                return name
            if name in self._last_read or len(self._last_read) < MAX_JOB_SERIES:
                self._last_read[name] = now
                return name
            idlest = min(self._last_read, key=self._last_read.__getitem__)
            if now - self._last_read[idlest] < JOB_IDLE_SECONDS:
                return OTHER_JOBS_LABEL
            del self._last_read[idlest]
            self._last_read[name] = now
        self._dropped(idlest)
        return name


class _JobCollector(Collector):
    """Per-job gauges computed when scraped, for the jobs with a label of
    their own: the hit ratio of their bytes, and their epoch."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(self._families())

    def collect(self) -> Iterator[GaugeMetricFamily]:
        return iter(self._families())

    def _families(self) -> list[GaugeMetricFamily]:
        metrics = self._metrics
        ratio = GaugeMetricFamily(
            "cachefsd_job_hit_ratio",
            "Fraction of a job's bytes read that did not wait on the store",
            labels=[JOB_LABEL],
        )
        cache, cold = (
            values_by(metrics.job_read_bytes, JOB_LABEL, source=source) for source in ("cache", "cold")
        )
        for job in sorted(set(cache) | set(cold)):
            total = cache.get(job, 0.0) + cold.get(job, 0.0)
            ratio.add_metric([job], cache.get(job, 0.0) / total if total else 0.0)
        epoch = GaugeMetricFamily(
            "cachefsd_job_epoch", "The epoch a job reads (its highest)", labels=[JOB_LABEL]
        )
        epochs = {job or UNKNOWN_JOB_LABEL: value for job, value in metrics.job_epochs().items()}
        for label in metrics.job_labels.named():
            if label in epochs:
                epoch.add_metric([label], epochs[label])
        return [ratio, epoch]


class Metrics:
    """Every metric the daemon exports, declared once on the registry it is given."""

    def __init__(self, registry: CollectorRegistry, clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = registry
        self.reads = Counter(
            "cachefsd_reads",
            "Read requests answered, by where their bytes came from (cold: any byte waited on the store)",
            ["source"],
            registry=registry,
        )
        self.read_bytes = Counter(
            "cachefsd_read_bytes",
            "Bytes returned to readers, by where they came from",
            ["source"],
            registry=registry,
        )
        self.read_stall = Counter(
            "cachefsd_read_stall_seconds",
            "Time reads spent waiting on the cold store: the starvation signal",
            registry=registry,
        )
        self.job_reads = Counter(
            "cachefsd_job_reads",
            "Read requests answered, by the job that sent them (the most active jobs; the rest as other) "
            "and where their bytes came from (cold: any byte waited on the store)",
            [JOB_LABEL, "source"],
            registry=registry,
        )
        self.job_read_bytes = Counter(
            "cachefsd_job_read_bytes",
            "Bytes returned to a job, by where they came from (cache or cold)",
            [JOB_LABEL, "source"],
            registry=registry,
        )
        self.job_read_stall = Counter(
            "cachefsd_job_read_stall_seconds",
            "Time a job's reads spent waiting on the cold store",
            [JOB_LABEL],
            registry=registry,
        )
        self.job_read_seconds = Counter(
            "cachefsd_job_read_seconds",
            "Time a job's reads took in the daemon, from the cache or the store, summed over its readers",
            [JOB_LABEL],
            registry=registry,
        )
        self.job_batches = Counter(
            "cachefsd_job_batches",
            "Batches a job's loader meters (cachefsd.diagnose.watch) measured",
            [JOB_LABEL],
            registry=registry,
        )
        self.job_data_wait = Counter(
            "cachefsd_job_data_wait_seconds",
            "Time a job's training loop waited for its next batch (its loader meters)",
            [JOB_LABEL],
            registry=registry,
        )
        self.job_step = Counter(
            "cachefsd_job_step_seconds",
            "Time between a job's batches, waits included: data wait over this is its data wait share",
            [JOB_LABEL],
            registry=registry,
        )
        self._declare_mount_series(registry)
        # The series reads count into, looked up once: ``labels()`` costs
        # more than the count, and a read is counted up to ten times. A
        # job's leave with its series (``_drop_job``).
        self._read_series: dict[tuple[int, tuple[str, ...]], Counter] = {}
        self.job_labels = JobLabels(self._drop_job, clock)
        self.job_epochs: Callable[[], dict[str, int]] = dict  # set by ``watch_epoch``
        self.fetch_latency = Histogram(
            "cachefsd_fetch_seconds",
            "Latency of successful requests to the cold store",
            ["kind"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.fetch_bytes = Counter(
            "cachefsd_fetch_bytes", "Bytes fetched from the cold store", ["kind"], registry=registry
        )
        self.fetch_retries = Counter(
            "cachefsd_fetch_retries", "Requests to the cold store retried", ["kind"], registry=registry
        )
        self.fetch_errors = Counter(
            "cachefsd_fetch_errors",
            "Requests to the cold store that failed for good (after retries, or not retryable)",
            ["kind"],
            registry=registry,
        )
        self.tier_used = Gauge(
            "cachefsd_tier_used_bytes", "Bytes on disk used by cached blocks", ["tier"], registry=registry
        )
        self.tier_capacity = Gauge(
            "cachefsd_tier_capacity_bytes", "Byte capacity of a tier", ["tier"], registry=registry
        )
        self.tier_blocks = Gauge("cachefsd_tier_blocks", "Blocks held by a tier", ["tier"], registry=registry)
        self.tier_read_bytes = Counter(
            "cachefsd_tier_read_bytes",
            "Bytes read back from a tier's disk (verified, decompressed)",
            ["tier"],
            registry=registry,
        )
        self.evictions = Counter(
            "cachefsd_cache_evictions", "Blocks evicted from a tier to nothing", ["tier"], registry=registry
        )
        self.whole_files = Counter(
            "cachefsd_whole_files",
            "Whole files made of an object's cached blocks, for the kernel to read itself",
            ["tier"],
            registry=registry,
        )
        self.promotions = Counter(
            "cachefsd_cache_promotions", "Blocks moved up to the hot tier on a hit", registry=registry
        )
        self.demotions = Counter(
            "cachefsd_cache_demotions",
            "Blocks moved down to the warm tier instead of dropped",
            registry=registry,
        )
        self.shared_writes = Counter(
            "cachefsd_shared_writes",
            "Blocks written to the shared tier after an origin fetch, by result (failed: error, full queue)",
            ["result"],
            registry=registry,
        )
        self.corrupt_blocks = Counter(
            "cachefsd_cache_corrupt_blocks",
            "Cached blocks that failed their hash check and were dropped",
            ["tier"],
            registry=registry,
        )
        self.cache_errors = Counter(
            "cachefsd_cache_errors",
            "Cache reads or writes that failed (disk full, I/O error) and fell through to the store",
            ["tier"],
            registry=registry,
        )
        self.dedup_saved_bytes = Counter(
            "cachefsd_dedup_saved_bytes",
            "Bytes deduplication saved: not written again (disk) or not downloaded (wire)",
            ["where"],
            registry=registry,
        )
        self.prefetch_issued_bytes = Counter(
            "cachefsd_prefetch_issued_bytes", "Bytes fetched ahead of the readers", registry=registry
        )
        self.prefetch_used_bytes = Counter(
            "cachefsd_prefetch_used_bytes", "Bytes fetched ahead that a reader then read", registry=registry
        )
        self.prefetch_wasted_bytes = Counter(
            "cachefsd_prefetch_wasted_bytes",
            "Bytes fetched ahead that left the cache before anyone read them",
            registry=registry,
        )
        self.prefetch_warmed_bytes = Counter(
            "cachefsd_prefetch_warmed_bytes",
            "Bytes of cached files a plan places next, read from the cache disk into RAM ahead of their read",
            registry=registry,
        )
        self.epoch_number = Gauge(
            "cachefsd_epoch", "Current training epoch, as the workload model sees it", registry=registry
        )
        self.served_bytes = Counter(
            "cachefsd_served_bytes",
            "Bytes returned to readers, by where they came from: memory, a tier (hot, warm) or cold",
            ["tier"],
            registry=registry,
        )
        # Every series exists from the start, at 0, so a dashboard shows 0
        # rather than "No data" (per-tier ones once the tier reports in).
        self._tiers: set[str] = set()
        for where in ("memory", "cold"):
            self.served_bytes.labels(where)
        for where in ("disk", "wire"):
            self.dedup_saved_bytes.labels(where)
        for source in ("cache", "cold"):
            self.reads.labels(source)
            self.read_bytes.labels(source)
        for kind in ("demand", "prefetch", "metadata"):
            self.fetch_latency.labels(kind)
            self.fetch_bytes.labels(kind)
            self.fetch_retries.labels(kind)
            self.fetch_errors.labels(kind)
        self._residency = ResidencyCollector()
        registry.register(self._residency)
        registry.register(_DerivedCollector(self))
        registry.register(_JobCollector(self))

    def _declare_mount_series(self, registry: CollectorRegistry) -> None:
        """The series each mount has of its own (``MountEvents``)."""
        self.mount_reads = Counter(
            "cachefsd_mount_reads",
            "Read requests answered through one mount, by where their bytes came from",
            ["mount", "source"],
            registry=registry,
        )
        self.mount_read_bytes = Counter(
            "cachefsd_mount_read_bytes",
            "Bytes returned to readers of one mount, by where they came from",
            ["mount", "source"],
            registry=registry,
        )
        self.mount_read_stall = Counter(
            "cachefsd_mount_read_stall_seconds",
            "Time the reads of one mount spent waiting on the cold store",
            ["mount"],
            registry=registry,
        )
        self.fuse_requests = Counter(
            "cachefsd_fuse_requests",
            "Requests the kernel sent one mount and the daemon answered, by operation "
            "(reads served through FUSE passthrough send none)",
            ["mount", "operation"],
            registry=registry,
        )
        self.staged_bytes = Gauge(
            "cachefsd_staged_bytes",
            "Bytes written through one writable mount and not yet in the bucket (never evicted)",
            ["mount"],
            registry=registry,
        )
        self.uploads_in_flight = Gauge(
            "cachefsd_uploads_in_flight", "Uploads of one mount under way", ["mount"], registry=registry
        )
        self.uploads = Counter(
            "cachefsd_uploads",
            "Uploads of one mount's staged files ended, by result (ok, failed: retried later)",
            ["mount", "result"],
            registry=registry,
        )
        self.upload_bytes = Counter(
            "cachefsd_upload_bytes", "Bytes one mount uploaded to the bucket", ["mount"], registry=registry
        )
        self.upload_seconds = Histogram(
            "cachefsd_upload_seconds",
            "Time one upload took, from its start to the object being in the bucket",
            ["mount"],
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900),
            registry=registry,
        )
        self.upload_oldest_pending = Gauge(
            "cachefsd_upload_oldest_pending_seconds",
            "How long the oldest upload due on one mount has waited (0: none is)",
            ["mount"],
            registry=registry,
        )
        self.passthrough = Gauge(
            "cachefsd_passthrough",
            "1 when one mount serves cached files through the kernel (FUSE passthrough), 0 when the "
            "daemon serves every read (the log and stats say why)",
            ["mount"],
            registry=registry,
        )

    def _upload_series(self) -> tuple[Gauge | Counter | Histogram, ...]:
        return (
            self.staged_bytes,
            self.uploads_in_flight,
            self.upload_bytes,
            self.upload_seconds,
            self.upload_oldest_pending,
        )

    def derived(self) -> Derived:
        """The derived gauges' values now (what a scrape of them would show)."""
        read = values_by(self.read_bytes, "source")
        total = sum(read.values())
        return Derived(
            read.get("cache", 0.0) / total if total else 0.0,
            {
                tier: nbytes / total if total else 0.0
                for tier, nbytes in sorted(values_by(self.served_bytes, "tier").items())
            },
            value_of(self.tier_used),
            value_of(self.tier_capacity),
        )

    def watch_residency(self, mount: str, source: str, rows: ResidencyRows) -> None:
        """Export ``rows()`` as ``cachefsd_resident_bytes`` for ``source``
        while ``mount`` is mounted (a source a mount: the label stays bounded)."""
        self._residency.watch(mount, source, rows)

    def for_mount(self, mount: str) -> MountEvents:
        """The events of the mount at ``mount``: its series exist, at 0,
        from now until ``forget_mount``."""
        return MountEvents(self, mount)

    def forget_mount(self, mount: str) -> None:
        """Drop the series of a mount that is gone: the label stays bounded
        by the mounts a daemon has, not by all it ever had."""
        self._residency.forget(mount)
        for counter, labels in (
            *((self.mount_reads, (mount, source)) for source in ("cache", "cold")),
            *((self.mount_read_bytes, (mount, source)) for source in ("cache", "cold")),
            (self.mount_read_stall, (mount,)),
            (self.passthrough, (mount,)),
            *((self.uploads, (mount, result)) for result in ("ok", "failed")),
            *((family, (mount,)) for family in self._upload_series()),
        ):
            with contextlib.suppress(KeyError):
                counter.remove(*labels)
        operations = {
            sample.labels["operation"]
            for family in self.fuse_requests.collect()
            for sample in family.samples
            if sample.labels["mount"] == mount
        }
        for operation in operations:
            self.fuse_requests.remove(mount, operation)

    def _drop_job(self, job: str) -> None:
        for key in list(self._read_series):  # a copy made at once: reads add series meanwhile
            if job in key[1]:
                self._read_series.pop(key, None)
        for counter, labels in (
            (self.job_reads, (job, "cache")),
            (self.job_reads, (job, "cold")),
            (self.job_read_bytes, (job, "cache")),
            (self.job_read_bytes, (job, "cold")),
            (self.job_read_stall, (job,)),
            (self.job_read_seconds, (job,)),
            (self.job_batches, (job,)),
            (self.job_data_wait, (job,)),
            (self.job_step, (job,)),
        ):
            with contextlib.suppress(KeyError):  # a series never incremented
                counter.remove(*labels)

    def job_reads_so_far(self, job: str) -> JobReads | None:
        """``job``'s reads as its series count them so far; None while they
        are counted with other jobs' (``JobLabels``)."""
        name = job or UNKNOWN_JOB_LABEL
        named = self.job_labels.named()
        if name not in named:
            # A job that has not read yet gets a series of its own at its first read, if one is free.
            return JobReads() if len(named) < MAX_JOB_SERIES else None
        return JobReads(
            values_by(self.job_read_seconds, JOB_LABEL).get(name, 0.0),
            values_by(self.job_read_stall, JOB_LABEL).get(name, 0.0),
            values_by(self.job_read_bytes, JOB_LABEL, source="cache").get(name, 0.0),
            values_by(self.job_read_bytes, JOB_LABEL, source="cold").get(name, 0.0),
        )

    # MeterEvents
    def meter_reported(self, job: str, batches: int, data_wait_seconds: float, step_seconds: float) -> None:
        label = self.job_labels.label(job, reading=False)
        self.job_batches.labels(label).inc(batches)
        self.job_data_wait.labels(label).inc(data_wait_seconds)
        self.job_step.labels(label).inc(step_seconds)

    # ReadEvents
    def read_done(self, served: dict[str, int], stall_seconds: float, job: str, seconds: float) -> None:
        cold_bytes = waited_bytes(served)
        nbytes = sum(served.values())
        label = self.job_labels.label(job)
        source = "cold" if cold_bytes else "cache"
        series = self._series
        series(self.reads, source).inc()
        series(self.job_reads, label, source).inc()
        series(self.job_read_seconds, label).inc(seconds)
        series(self.read_bytes, "cache").inc(nbytes - cold_bytes)
        series(self.job_read_bytes, label, "cache").inc(nbytes - cold_bytes)
        if cold_bytes:
            series(self.read_bytes, "cold").inc(cold_bytes)
            series(self.job_read_bytes, label, "cold").inc(cold_bytes)
            self.read_stall.inc(stall_seconds)
            series(self.job_read_stall, label).inc(stall_seconds)
        for source, count in served.items():
            series(self.served_bytes, source).inc(count)

    def _series(self, counter: Counter, *labels: str) -> Counter:
        """``counter.labels(*labels)``, looked up once (the labels are bounded)."""
        key = (id(counter), labels)
        found = self._read_series.get(key)
        if found is None:
            found = self._read_series[key] = counter.labels(*labels)
        return found

    # FetchEvents
    def fetch_done(self, kind: FetchKind, seconds: float, nbytes: int) -> None:
        self.fetch_latency.labels(kind).observe(seconds)
        self.fetch_bytes.labels(kind).inc(nbytes)

    def fetch_retry(self, kind: FetchKind) -> None:
        self.fetch_retries.labels(kind).inc()

    def fetch_failed(self, kind: FetchKind) -> None:
        self.fetch_errors.labels(kind).inc()

    # PrefetchEvents
    def prefetch_issued(self, nbytes: int) -> None:
        self.prefetch_issued_bytes.inc(nbytes)

    def prefetch_used(self, nbytes: int) -> None:
        self.prefetch_used_bytes.inc(nbytes)

    def prefetch_wasted(self, nbytes: int) -> None:
        self.prefetch_wasted_bytes.inc(nbytes)

    def prefetch_warmed(self, nbytes: int) -> None:
        self.prefetch_warmed_bytes.inc(nbytes)

    def watch_epoch(self, current: Callable[[], int], job_epochs: Callable[[], dict[str, int]]) -> None:
        """Export ``current()`` as ``cachefsd_epoch`` and ``job_epochs()``
        (job -> its epoch) as ``cachefsd_job_epoch``, read at each scrape:
        set by whoever happened to look, they lagged the model (by whole
        epochs with prefetching off)."""
        self.epoch_number.set_function(current)
        self.job_epochs = job_epochs

    # CacheEvents
    def tier_usage(self, tier: str, used_bytes: int, capacity_bytes: int, blocks: int) -> None:
        if tier not in self._tiers:
            self._tiers.add(tier)
            for per_tier in (
                self.served_bytes,
                self.tier_read_bytes,
                self.evictions,
                self.corrupt_blocks,
                self.cache_errors,
                self.whole_files,
            ):
                per_tier.labels(tier)
        self.tier_used.labels(tier).set(used_bytes)
        self.tier_capacity.labels(tier).set(capacity_bytes)
        self.tier_blocks.labels(tier).set(blocks)

    def tier_read(self, tier: str, nbytes: int) -> None:
        self.tier_read_bytes.labels(tier).inc(nbytes)

    def block_evicted(self, tier: str) -> None:
        self.evictions.labels(tier).inc()

    def block_moved(self, direction: Literal["promotion", "demotion"]) -> None:
        (self.promotions if direction == "promotion" else self.demotions).inc()

    def block_corrupt(self, tier: str) -> None:
        self.corrupt_blocks.labels(tier).inc()

    def whole_file_made(self, tier: str) -> None:
        self.whole_files.labels(tier).inc()

    # SharedEvents
    def shared_written(self, ok: bool) -> None:
        self.shared_writes.labels("ok" if ok else "failed").inc()

    def cache_error(self, tier: str) -> None:
        self.cache_errors.labels(tier).inc()

    def dedup_saved(self, where: DedupWhere, nbytes: int) -> None:
        self.dedup_saved_bytes.labels(where).inc(nbytes)


class SharedFetches:
    """``FetchEvents`` of the shared tier's fetcher: its requests, demand or
    prefetch, are counted under kind ``shared`` (a bucket beside the
    origin, whose requests keep their own kinds)."""

    LABEL: FetchLabel = "shared"

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def fetch_done(self, kind: FetchKind, seconds: float, nbytes: int) -> None:
        self._metrics.fetch_latency.labels(self.LABEL).observe(seconds)
        self._metrics.fetch_bytes.labels(self.LABEL).inc(nbytes)

    def fetch_retry(self, kind: FetchKind) -> None:
        self._metrics.fetch_retries.labels(self.LABEL).inc()

    def fetch_failed(self, kind: FetchKind) -> None:
        self._metrics.fetch_errors.labels(self.LABEL).inc()
