"""What ``GET /stats`` answers (``control/answers.py`` types it; ``cli/stats.py``
draws it for ``cachefsd stats`` / ``top``).

The daemon side (``DaemonStats``) computes its answer from the very
metrics the Prometheus endpoint exports, read through their objects in
``metrics.py`` (no metric is named twice), so a dashboard and ``cachefsd
stats`` never disagree about a counter. What a counter cannot say by
itself is added here:

- the hit ratio over the last minute: a small ring of (time, cache bytes,
  cold bytes) samples taken every ``SAMPLE_INTERVAL_SECONDS`` (``HitRing``),
  and a writable mount's upload rate from one of uploaded bytes
  (``RateRing``);
- fetch latency quantiles, interpolated from the histogram's buckets as
  Prometheus' ``histogram_quantile`` does (``histogram_quantile``);
- residency: how many bytes of each top-level prefix of the source each
  tier holds, from one index query cached for ``RESIDENCY_REFRESH_SECONDS``
  and shared with the ``cachefsd_resident_bytes`` metric (``Residency``);
- the workload model's epochs, per workload;
- a writable mount's staged files and due uploads, from its staging and
  uploader (the same calls its ``cachefsd_staged_bytes`` and
  ``cachefsd_upload_oldest_pending_seconds`` gauges export).

Concurrency: ``HitRing``, ``RateRing`` and ``Residency`` each guard their state with
their own lock; ``DaemonStats.snapshot`` is called on control-server
threads concurrently with the sampler thread.
"""

from __future__ import annotations

import logging
import math
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from cachefsd.control.answers import (
    AccessTotals,
    CacheTotals,
    DedupTotals,
    EpochsAnswer,
    FetchByKind,
    FetchTotals,
    HitRatios,
    JobActivity,
    MountReadsAnswer,
    NodeActivity,
    NodeFacts,
    NodeReads,
    PrefetchTotals,
    PrefixResidency,
    ReadBytes,
    ResidencyAnswer,
    SourceBytes,
    SourceCounts,
    ThisMount,
    UploadFailure,
    WritesAnswer,
)
from cachefsd.metrics import JOB_LABEL, value_of, values_by

if TYPE_CHECKING:
    from cachefsd.metrics import FetchLabel, Metrics

log = logging.getLogger(__name__)

# The ring behind the last-minute hit ratio: a sample every 5 s is fine
# enough for a ratio people read once a refresh, and 13 samples cover the
# minute (plus one spare so the far end stays inside the window despite
# the sampler's jitter): a fixed 15 tuples, whatever the read rate.
SAMPLE_INTERVAL_SECONDS = 5.0
HIT_WINDOW_SECONDS = 60.0
_RING_SAMPLES = int(HIT_WINDOW_SECONDS // SAMPLE_INTERVAL_SECONDS) + 2
# Residency is a GROUP BY over every block reference (a million rows for a
# 4 TiB cache of 4 MiB blocks, about a second of sqlite): at most once per
# this long, whoever asks (a scrape every 15 s, ``top`` every second).
RESIDENCY_REFRESH_SECONDS = 30.0
# ``cachefsd stats`` is a person asking now: residency is counted for the
# answer, never reused from a scrape a moment before the cache filled (which
# showed "nothing cached" beside a full tier). ``top`` asks every second; the
# query runs on its own connection, so even a slow one over a huge cache
# delays only the stats answer, never a read.
STATS_RESIDENCY_MAX_AGE = 0.0
# Prefixes exported (the largest by resident bytes); the rest are summed
# under OTHER_PREFIX, so the metric's series stay bounded whatever the
# bucket's layout (one directory per sample would otherwise be a series per
# sample).
MAX_RESIDENCY_PREFIXES = 50
OTHER_PREFIX = "(other)"
# Keys at the source's root have no first component; an empty label value
# means "no label" to Prometheus, so they get a name of their own.
ROOT_PREFIX = "(root)"
SOURCES = ("cache", "cold")


# -- quantiles from histogram buckets -----------------------------------------


def histogram_quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float | None:
    """The ``q`` quantile of a histogram given as (upper bound, cumulative
    count) buckets, the ``+Inf`` one included, the way Prometheus'
    ``histogram_quantile`` computes it: linear interpolation inside the
    bucket the rank falls in, the lowest bucket starting at 0, and the
    highest finite bound when the rank falls in ``+Inf``. None where
    Prometheus says NaN (no observations, no ``+Inf`` bucket); ``q`` is
    clamped to [0, 1] rather than returning infinities, which JSON lacks."""
    ordered: list[tuple[float, float]] = []
    for bound, count in sorted(buckets):
        if ordered and ordered[-1][0] == bound:
            ordered[-1] = (bound, ordered[-1][1] + count)  # coalesce duplicate bounds
        else:
            ordered.append((bound, count))
    if len(ordered) < 2 or not math.isinf(ordered[-1][0]):
        return None
    # Counts scraped while observations land may be momentarily non-monotonic.
    highest = 0.0
    for position, (bound, count) in enumerate(ordered):
        highest = max(highest, count)
        ordered[position] = (bound, highest)
    observations = ordered[-1][1]
    if observations <= 0:
        return None
    rank = min(max(q, 0.0), 1.0) * observations
    b = next(position for position, (_, count) in enumerate(ordered) if count >= rank)
    if b == len(ordered) - 1:
        return ordered[-2][0]
    if b == 0 and ordered[0][0] <= 0:
        return ordered[0][0]
    start, end, count = 0.0, ordered[b][0], ordered[b][1]
    if b > 0:
        start = ordered[b - 1][0]
        count -= ordered[b - 1][1]
        rank -= ordered[b - 1][1]
    return start + (end - start) * (rank / count)


# -- the last-minute hit ratio ------------------------------------------------


@dataclass(frozen=True, slots=True)
class HitSample:
    at: float  # monotonic seconds
    cache_bytes: float
    cold_bytes: float


class HitRing:
    """A bounded ring of read-byte counter samples, for hit ratios over a
    recent window instead of since mount (a mount that was cold an hour
    ago and is all hits now reads 100 %, not 60 %)."""

    def __init__(self, window: float = HIT_WINDOW_SECONDS, size: int = _RING_SAMPLES) -> None:
        self._window = window
        self._lock = threading.Lock()
        self._samples: deque[HitSample] = deque(maxlen=size)

    def add(self, at: float, cache_bytes: float, cold_bytes: float) -> None:
        with self._lock:
            self._samples.append(HitSample(at, cache_bytes, cold_bytes))

    def ratio(self, now: float, cache_bytes: float, cold_bytes: float) -> tuple[float | None, float]:
        """(hit ratio, seconds covered) of the bytes read between the oldest
        sample at most ``window`` old and the counters now. The ratio is
        None when nothing was read in that span (or there is no sample in
        it yet): no reads is not a 0 % hit ratio."""
        with self._lock:
            baseline = next((s for s in self._samples if now - s.at <= self._window), None)
        if baseline is None:
            return None, 0.0
        cached = cache_bytes - baseline.cache_bytes
        total = cached + cold_bytes - baseline.cold_bytes
        return (cached / total if total > 0 else None), now - baseline.at


class RateRing:
    """``HitRing`` for the rate of one counter: (time, total) samples,
    for its growth per second over a recent window."""

    def __init__(self, window: float = HIT_WINDOW_SECONDS, size: int = _RING_SAMPLES) -> None:
        self._window = window
        self._lock = threading.Lock()
        self._samples: deque[tuple[float, float]] = deque(maxlen=size)

    def add(self, at: float, total: float) -> None:
        with self._lock:
            self._samples.append((at, total))

    def rate(self, now: float, total: float) -> tuple[float | None, float]:
        """(per second, seconds covered) of the growth from the oldest
        sample at most ``window`` old to ``total`` now; None without such
        a sample, or before any time passed since it."""
        with self._lock:
            baseline = next(((at, then) for at, then in self._samples if now - at <= self._window), None)
        if baseline is None or now <= baseline[0]:
            return None, 0.0
        return (total - baseline[1]) / (now - baseline[0]), now - baseline[0]


# -- residency ------------------------------------------------------------------


def bound_prefixes(rows: Iterable[tuple[str, str, int]], limit: int) -> list[tuple[str, dict[str, int]]]:
    """(prefix, bytes by tier) of the ``limit`` prefixes with the most
    resident bytes, largest first, then ``OTHER_PREFIX`` summing the rest
    (if any). Root keys (prefix ``''``) are named ``ROOT_PREFIX``."""
    by_prefix: dict[str, dict[str, int]] = {}
    for prefix, tier, nbytes in rows:
        tiers = by_prefix.setdefault(prefix or ROOT_PREFIX, {})
        tiers[tier] = tiers.get(tier, 0) + nbytes
    ranked = sorted(by_prefix.items(), key=lambda item: (-sum(item[1].values()), item[0]))
    kept, rest = ranked[:limit], ranked[limit:]
    if rest:
        other: dict[str, int] = {}
        for _, tiers in rest:
            for tier, nbytes in tiers.items():
                other[tier] = other.get(tier, 0) + nbytes
        kept.append((OTHER_PREFIX, other))
    return kept


@dataclass(frozen=True, slots=True)
class ResidencySnapshot:
    computed_at: float | None  # monotonic; None before the first query
    prefixes: list[tuple[str, dict[str, int]]]
    error: str | None = None


class Residency:
    """How much of each top-level prefix each tier holds, recomputed at
    most every ``refresh`` seconds and only when asked (a scrape, a stats
    call): an idle daemon nobody watches never scans its index. A failed
    query keeps the last answer (with the error), and is not retried
    before ``refresh`` either."""

    def __init__(
        self,
        query: Callable[[], list[tuple[str, str, int]]],
        tiers: Sequence[str],
        refresh: float = RESIDENCY_REFRESH_SECONDS,
        limit: int = MAX_RESIDENCY_PREFIXES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._query = query
        self.tiers = list(tiers)
        self.refresh = refresh
        self.limit = limit
        self._clock = clock
        self._lock = threading.Lock()  # also makes concurrent askers share one query
        self._snapshot = ResidencySnapshot(None, [])

    def current(self, max_age: float | None = None) -> ResidencySnapshot:
        """The residency, recomputed if older than ``max_age`` (default: the
        refresh interval)."""
        with self._lock:
            now = self._clock()
            at = self._snapshot.computed_at
            if at is None or now - at >= (self.refresh if max_age is None else max_age):
                try:
                    prefixes = bound_prefixes(self._query(), self.limit)
                    self._snapshot = ResidencySnapshot(now, prefixes)
                except sqlite3.Error as exc:
                    log.warning("residency query failed: %s", exc)
                    self._snapshot = ResidencySnapshot(now, self._snapshot.prefixes, str(exc))
            return self._snapshot

    def age(self, snapshot: ResidencySnapshot) -> float | None:
        """Seconds since ``snapshot`` was computed, on the clock that stamped it."""
        return None if snapshot.computed_at is None else self._clock() - snapshot.computed_at

    def rows(self) -> list[tuple[str, str, int]]:
        """(prefix, tier, bytes) for ``cachefsd_resident_bytes``: every
        configured tier of every kept prefix, zeros included, so a series
        does not vanish when its tier empties."""
        return [
            (prefix, tier, tiers.get(tier, 0))
            for prefix, tiers in self.current().prefixes
            for tier in [*self.tiers, *sorted(set(tiers) - set(self.tiers))]
        ]


# -- the daemon's answer --------------------------------------------------------


class StagedFiles(Protocol):
    """A writable mount's staged files as stats sees them (``writes.staged.Staging``)."""

    def staged_bytes(self) -> int: ...
    def staged_files(self) -> int: ...


class DueUploads(Protocol):
    """A writable mount's uploads as stats sees them (``writes.uploads.Uploads``)."""

    def due_count(self) -> int: ...
    def failing(self) -> int: ...
    def oldest_due_seconds(self) -> float: ...
    def oldest_failing(self) -> tuple[str, str] | None: ...


class MountWrites(Protocol):
    """What makes a mount writable, as stats sees it (``fs.Writes``)."""

    @property
    def staging(self) -> StagedFiles: ...
    @property
    def uploads(self) -> DueUploads: ...


class AccessStats(Protocol):
    """The workload model as stats sees it (``workload.model.WorkloadModel``)."""

    def current(self) -> int: ...
    def stats(self) -> dict[str, object]: ...


def _ratio(part: float, whole: float) -> float | None:
    return part / whole if whole > 0 else None


def _ints(values: dict[str, float]) -> dict[str, int]:
    return {key: int(value) for key, value in sorted(values.items())}


class DaemonStats:
    """The daemon's activity in ``GET /stats`` (``MountHandlers`` adds the
    mount's own facts) and the sampler thread behind the last-minute ratio."""

    def __init__(
        self,
        metrics: Metrics,
        model: AccessStats,
        residency: Residency,
        source: str,
        mount: str,
        node: Callable[[], NodeFacts],
        passthrough: Callable[[], str],
        clock: Callable[[], float] = time.monotonic,
        writes: MountWrites | None = None,
    ) -> None:
        """The stats of the mount at ``mount`` (of ``source``), beside
        ``node()``: what its daemon shows of itself; ``passthrough()``:
        whether its cached files are served through the kernel;
        ``writes``: what makes it writable, if it is."""
        self._metrics = metrics
        self._model = model
        self.residency = residency
        self._source = source
        self._mount = mount
        self._node = node
        self._passthrough = passthrough
        self._clock = clock
        self._started = clock()
        self._ring = HitRing()
        self._writes = writes
        self._uploaded = RateRing()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cachefsd-stats", daemon=True)

    def start(self) -> None:
        self.sample()
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout=SAMPLE_INTERVAL_SECONDS)

    def _run(self) -> None:
        while not self._stopped.wait(SAMPLE_INTERVAL_SECONDS):
            try:
                self.sample()
            except Exception:
                log.exception("stats sample failed")

    def sample(self) -> None:
        """Add a ring sample. Reads only the read-bytes counter (and a
        writable mount's upload bytes), never the residency collector."""
        now = self._clock()
        by_source = values_by(self._metrics.read_bytes, "source")
        self._ring.add(now, by_source.get("cache", 0.0), by_source.get("cold", 0.0))
        if self._writes is not None:
            self._uploaded.add(now, value_of(self._metrics.upload_bytes, mount=self._mount))

    def snapshot(self) -> NodeActivity:
        """The activity of this mount's daemon: ``mount`` is what this
        mount's readers got; the rest is the node's, all its mounts
        together (one cache). Read from the metrics the Prometheus endpoint
        exports, so a dashboard and ``cachefsd stats`` agree."""
        metrics = self._metrics
        now = self._clock()
        read_bytes = values_by(metrics.read_bytes, "source")
        cache_bytes, cold_bytes = read_bytes.get("cache", 0.0), read_bytes.get("cold", 0.0)
        last_minute, window = self._ring.ratio(now, cache_bytes, cold_bytes)
        issued = value_of(metrics.prefetch_issued_bytes)
        used = value_of(metrics.prefetch_used_bytes)
        wasted = value_of(metrics.prefetch_wasted_bytes)
        access = AccessTotals.model_validate(self._model.stats())
        derived = metrics.derived()
        residency = self.residency.current(max_age=STATS_RESIDENCY_MAX_AGE)
        age = self.residency.age(residency)
        mount_reads = values_by(metrics.mount_reads, "source", mount=self._mount)
        mount_bytes = values_by(metrics.mount_read_bytes, "source", mount=self._mount)
        mount_cache, mount_cold = mount_bytes.get("cache", 0.0), mount_bytes.get("cold", 0.0)
        reads = values_by(metrics.reads, "source")
        return NodeActivity(
            mount=ThisMount(
                mountpoint=self._mount,
                reads=MountReadsAnswer(
                    count=SourceCounts(
                        cache=int(mount_reads.get("cache", 0.0)), cold=int(mount_reads.get("cold", 0.0))
                    ),
                    bytes=ReadBytes(
                        cache=int(mount_cache), cold=int(mount_cold), total=int(mount_cache + mount_cold)
                    ),
                ),
                hit_ratio=_ratio(mount_cache, mount_cache + mount_cold),
                stall_seconds=value_of(metrics.mount_read_stall, mount=self._mount),
                passthrough=self._passthrough(),
            ),
            node=self._node(),
            uptime_seconds=round(now - self._started, 3),
            reads=NodeReads(
                count=SourceCounts(cache=int(reads.get("cache", 0.0)), cold=int(reads.get("cold", 0.0))),
                bytes=ReadBytes(
                    cache=int(cache_bytes), cold=int(cold_bytes), total=int(cache_bytes + cold_bytes)
                ),
                served_bytes=_ints(values_by(metrics.served_bytes, "tier")),
            ),
            hit_ratio=HitRatios(
                since_mount=_ratio(cache_bytes, cache_bytes + cold_bytes),
                last_minute=last_minute,
                last_minute_seconds=round(window, 3),
                by_tier=derived.tier_hit_ratios,
            ),
            stall_seconds=value_of(metrics.read_stall),
            fetch=FetchByKind(
                demand=self._fetch("demand"),
                prefetch=self._fetch("prefetch"),
                metadata=self._fetch("metadata"),
                shared=self._fetch("shared"),
            ),
            prefetch=PrefetchTotals(
                issued_bytes=int(issued),
                used_bytes=int(used),
                wasted_bytes=int(wasted),
                accuracy=_ratio(used, issued),
                waste=_ratio(wasted, issued),
            ),
            dedup=DedupTotals(
                disk_saved_bytes=int(value_of(metrics.dedup_saved_bytes, where="disk")),
                wire_saved_bytes=int(value_of(metrics.dedup_saved_bytes, where="wire")),
            ),
            cache=CacheTotals(
                used_bytes=int(derived.cache_used_bytes),
                capacity_bytes=int(derived.cache_capacity_bytes),
                promotions=int(value_of(metrics.promotions)),
                demotions=int(value_of(metrics.demotions)),
                evictions=_ints(values_by(metrics.evictions, "tier")),
                corrupt_blocks=_ints(values_by(metrics.corrupt_blocks, "tier")),
                errors=_ints(values_by(metrics.cache_errors, "tier")),
            ),
            epoch=EpochsAnswer(
                current=int(value_of(metrics.epoch_number)),
                workloads={name: workload.epoch for name, workload in access.per_workload.items()},
            ),
            jobs=self._jobs(),
            access=access,
            residency=ResidencyAnswer(
                source=self._source,
                tiers=self.residency.tiers,
                age_seconds=None if age is None else round(age, 3),
                refresh_seconds=self.residency.refresh,
                max_prefixes=self.residency.limit,
                error=residency.error,
                prefixes=[
                    PrefixResidency(
                        prefix=prefix, bytes=dict(sorted(tiers.items())), total_bytes=sum(tiers.values())
                    )
                    for prefix, tiers in residency.prefixes
                ],
            ),
            writes=None if self._writes is None else self._writes_now(self._writes, now),
        )

    def _writes_now(self, writes: MountWrites, now: float) -> WritesAnswer:
        """The mount's staged files and uploads: counts from its uploader,
        totals from the metrics."""
        metrics = self._metrics
        mount = self._mount
        uploaded = value_of(metrics.upload_bytes, mount=mount)
        rate, span = self._uploaded.rate(now, uploaded)
        buckets = [
            (float(bound), count)
            for bound, count in values_by(metrics.upload_seconds, "le", "_bucket", mount=mount).items()
        ]
        failure = writes.uploads.oldest_failing()
        return WritesAnswer(
            staged_bytes=writes.staging.staged_bytes(),
            staged_files=writes.staging.staged_files(),
            uploads_due=writes.uploads.due_count(),
            uploads_in_flight=int(value_of(metrics.uploads_in_flight, mount=mount)),
            uploads_failing=writes.uploads.failing(),
            oldest_due_seconds=round(writes.uploads.oldest_due_seconds(), 3),
            uploaded_bytes=int(uploaded),
            uploaded_files=int(value_of(metrics.uploads, mount=mount, result="ok")),
            failed_attempts=int(value_of(metrics.uploads, mount=mount, result="failed")),
            upload_bytes_per_second=rate,
            upload_rate_seconds=round(span, 3),
            upload_p50_seconds=histogram_quantile(0.5, buckets),
            upload_p99_seconds=histogram_quantile(0.99, buckets),
            oldest_failure=None if failure is None else UploadFailure(key=failure[0], error=failure[1]),
        )

    def _jobs(self) -> dict[str, JobActivity]:
        """The reading jobs the metrics name (``JobLabels``), and their loader meters' totals."""
        metrics = self._metrics
        reads = {source: values_by(metrics.job_reads, JOB_LABEL, source=source) for source in SOURCES}
        read_bytes = {
            source: values_by(metrics.job_read_bytes, JOB_LABEL, source=source) for source in SOURCES
        }
        stall = values_by(metrics.job_read_stall, JOB_LABEL)
        batches = values_by(metrics.job_batches, JOB_LABEL)
        data_wait = values_by(metrics.job_data_wait, JOB_LABEL)
        step = values_by(metrics.job_step, JOB_LABEL)
        names = set(stall).union(*reads.values(), *read_bytes.values(), batches, data_wait, step)
        jobs: dict[str, JobActivity] = {}
        for name in sorted(names):
            cache_bytes, cold_bytes = read_bytes["cache"].get(name, 0.0), read_bytes["cold"].get(name, 0.0)
            jobs[name] = JobActivity(
                reads=SourceCounts(
                    cache=int(reads["cache"].get(name, 0.0)), cold=int(reads["cold"].get(name, 0.0))
                ),
                bytes=SourceBytes(cache=int(cache_bytes), cold=int(cold_bytes)),
                hit_ratio=_ratio(cache_bytes, cache_bytes + cold_bytes),
                stall_seconds=stall.get(name, 0.0),
                batches=int(batches.get(name, 0.0)),
                data_wait_fraction=_ratio(data_wait.get(name, 0.0), step.get(name, 0.0)),
            )
        return jobs

    def _fetch(self, kind: FetchLabel) -> FetchTotals:
        metrics = self._metrics
        buckets = [
            (float(bound), count)
            for bound, count in values_by(metrics.fetch_latency, "le", "_bucket", kind=kind).items()
        ]
        return FetchTotals(
            count=int(value_of(metrics.fetch_latency, "_count", kind=kind)),
            bytes=int(value_of(metrics.fetch_bytes, kind=kind)),
            retries=int(value_of(metrics.fetch_retries, kind=kind)),
            errors=int(value_of(metrics.fetch_errors, kind=kind)),
            p50_seconds=histogram_quantile(0.5, buckets),
            p99_seconds=histogram_quantile(0.99, buckets),
        )
