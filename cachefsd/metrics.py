"""Every metric cachefsd exports, declared once against an injected registry.

Names carry their unit; label values are bounded (source, kind), never a
path. ``Metrics`` implements the event Protocols of the data path
(``ReadEvents``, ``FetchEvents``, ``CacheEvents``), so the data path knows
nothing about Prometheus.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

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


class Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
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
        self.cache_used = Gauge(
            "cachefsd_cache_used_bytes", "Bytes on disk used by cached blocks", registry=registry
        )
        self.cache_capacity = Gauge(
            "cachefsd_cache_capacity_bytes", "Byte capacity of the block cache", registry=registry
        )
        self.evictions = Counter("cachefsd_cache_evictions", "Blocks evicted to make room", registry=registry)
        self.corrupt_blocks = Counter(
            "cachefsd_cache_corrupt_blocks",
            "Cached blocks that failed their hash check and were dropped",
            registry=registry,
        )
        self.cache_errors = Counter(
            "cachefsd_cache_errors",
            "Cache reads or writes that failed (disk full, I/O error) and fell through to the store",
            registry=registry,
        )
        self.hit_ratio = Gauge(
            "cachefsd_hit_ratio",
            "Fraction of bytes read since mount that did not wait on the cold store",
            registry=registry,
        )
        self._lock = threading.Lock()
        self._bytes_total = 0
        self._bytes_cached = 0
        for source in ("cache", "cold"):
            self.reads.labels(source)
            self.read_bytes.labels(source)
        for kind in ("demand", "prefetch", "metadata"):
            self.fetch_latency.labels(kind)
            self.fetch_bytes.labels(kind)
            self.fetch_retries.labels(kind)
            self.fetch_errors.labels(kind)

    # ReadEvents
    def read_done(self, nbytes: int, cold_bytes: int, stall_seconds: float) -> None:
        self.reads.labels("cold" if cold_bytes else "cache").inc()
        self.read_bytes.labels("cache").inc(nbytes - cold_bytes)
        if cold_bytes:
            self.read_bytes.labels("cold").inc(cold_bytes)
            self.read_stall.inc(stall_seconds)
        with self._lock:
            self._bytes_total += nbytes
            self._bytes_cached += nbytes - cold_bytes
            if self._bytes_total:
                self.hit_ratio.set(self._bytes_cached / self._bytes_total)

    # FetchEvents
    def fetch_done(self, kind: FetchKind, seconds: float, nbytes: int) -> None:
        self.fetch_latency.labels(kind).observe(seconds)
        self.fetch_bytes.labels(kind).inc(nbytes)

    def fetch_retry(self, kind: FetchKind) -> None:
        self.fetch_retries.labels(kind).inc()

    def fetch_failed(self, kind: FetchKind) -> None:
        self.fetch_errors.labels(kind).inc()

    # CacheEvents
    def cache_usage(self, used_bytes: int, capacity_bytes: int) -> None:
        self.cache_used.set(used_bytes)
        self.cache_capacity.set(capacity_bytes)

    def block_evicted(self) -> None:
        self.evictions.inc()

    def block_corrupt(self) -> None:
        self.corrupt_blocks.inc()

    def cache_error(self) -> None:
        self.cache_errors.inc()
