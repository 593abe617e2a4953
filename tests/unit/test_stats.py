"""What ``GET /stats`` computes and how ``cachefsd stats`` / ``top`` show it:
quantiles from histogram buckets, the last-minute hit ratio and upload rate
rings, the residency query on a real sqlite index and its bounded metric,
the snapshot's agreement with the registry (a writable mount's writes
too), and the rendered tables."""

from __future__ import annotations

import json
import os
import pty
import re
import sqlite3
import termios
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from pydantic import ValidationError
from rich.console import Console

from cachefsd.cache.index import BlockRef, Index, StoredBlock
from cachefsd.cli.stats import render
from cachefsd.cli.top import SPARK_CHARS, Keys, Throughput, sparkline, writes_line
from cachefsd.control.answers import AccessTotals, StatsAnswer, WritesAnswer
from cachefsd.diagnose.ledger import JobReads
from cachefsd.fs import ROOT_INODE
from cachefsd.metrics import LATENCY_BUCKETS, Metrics, value_of
from cachefsd.stats import (
    HIT_WINDOW_SECONDS,
    OTHER_PREFIX,
    ROOT_PREFIX,
    SAMPLE_INTERVAL_SECONDS,
    DaemonStats,
    HitRing,
    RateRing,
    Residency,
    bound_prefixes,
    histogram_quantile,
)
from cachefsd.workload.model import WorkloadModel
from tests.answers import ACCESS, STATS, WRITES, node_facts
from tests.unit.conftest import BLOCK_SIZE, RigFactory

INF = float("inf")


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# -- quantiles -------------------------------------------------------------------


# 40 observations: 10 up to 0.1 s, 20 in (0.1, 0.5], 10 in (0.5, 1].
BUCKETS = [(0.1, 10.0), (0.5, 30.0), (1.0, 40.0), (INF, 40.0)]


@pytest.mark.parametrize(
    ("q", "expected"),
    [
        (0.0, 0.0),
        (0.1, 0.04),  # rank 4 of the first bucket, which starts at 0
        (0.25, 0.1),  # exactly the first bucket's bound
        (0.5, 0.3),  # rank 20: 10 into the 20 of (0.1, 0.5]
        (0.99, 0.98),  # rank 39.6: 9.6 into the 10 of (0.5, 1]
        (1.0, 1.0),
    ],
)
def test_quantile_interpolates_inside_the_bucket_like_prometheus(q: float, expected: float) -> None:
    assert histogram_quantile(q, BUCKETS) == pytest.approx(expected)


def test_quantile_in_the_inf_bucket_is_the_highest_finite_bound() -> None:
    assert histogram_quantile(0.9, [(1.0, 5.0), (2.5, 5.0), (INF, 10.0)]) == 2.5


def test_quantile_is_none_without_observations_or_an_inf_bucket() -> None:
    assert histogram_quantile(0.5, [(0.1, 0.0), (INF, 0.0)]) is None
    assert histogram_quantile(0.5, [(0.1, 3.0), (1.0, 5.0)]) is None
    assert histogram_quantile(0.5, []) is None


def test_quantile_takes_buckets_in_any_order_and_tolerates_a_torn_scrape() -> None:
    shuffled = [BUCKETS[2], BUCKETS[0], BUCKETS[3], BUCKETS[1]]
    assert histogram_quantile(0.5, shuffled) == pytest.approx(0.3)
    # A count observed between reading two buckets may make them non-monotonic.
    torn = [(0.1, 10.0), (0.5, 9.0), (1.0, 20.0), (INF, 20.0)]
    # Taken as (0.5, 10), as Prometheus does: rank 15 falls 5 into the 10 of (0.5, 1].
    assert histogram_quantile(0.75, torn) == pytest.approx(0.75)


def test_quantile_of_a_real_histogram() -> None:
    registry = CollectorRegistry()
    histogram = Histogram("t_seconds", "test", buckets=(0.25, 0.5, 0.75, 1.0), registry=registry)
    for step in range(1, 101):
        histogram.observe(step / 100)  # 0.01 .. 1.00, evenly
    buckets = [
        (float(sample.labels["le"]), sample.value)
        for family in registry.collect()
        for sample in family.samples
        if sample.name == "t_seconds_bucket"
    ]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.5)
    assert histogram_quantile(0.9, buckets) == pytest.approx(0.9)


# -- the last-minute ratio ------------------------------------------------------------


def test_last_minute_ratio_forgets_the_cold_start() -> None:
    """A cold first 30 s, then a minute of hits: since mount it reads half
    cold; over the last minute it reads all hits."""
    ring = HitRing()
    cache = cold = 0.0
    now = 0.0
    while now <= 90.0:
        ring.add(now, cache, cold)
        if now < 30.0:
            cold += 100.0
        else:
            cache += 100.0
        now += SAMPLE_INTERVAL_SECONDS
    ratio, covered = ring.ratio(now, cache, cold)
    assert cache / (cache + cold) < 0.7
    assert ratio == 1.0
    assert HIT_WINDOW_SECONDS - SAMPLE_INTERVAL_SECONDS <= covered <= HIT_WINDOW_SECONDS


def test_last_minute_ratio_counts_only_bytes_read_in_the_window() -> None:
    ring = HitRing()
    ring.add(0.0, 1000.0, 1000.0)  # before the window
    ring.add(50.0, 1000.0, 1000.0)
    ratio, covered = ring.ratio(100.0, 1300.0, 1100.0)  # 300 cached, 100 cold since t=50
    assert ratio == pytest.approx(0.75)
    assert covered == 50.0


def test_last_minute_ratio_is_none_without_reads_or_samples() -> None:
    ring = HitRing()
    assert ring.ratio(10.0, 5.0, 5.0) == (None, 0.0)
    ring.add(0.0, 5.0, 5.0)
    assert ring.ratio(10.0, 5.0, 5.0) == (None, 10.0)  # nothing read since
    assert ring.ratio(HIT_WINDOW_SECONDS + 1, 9.0, 9.0) == (None, 0.0)  # the only sample is too old


def test_the_ring_is_bounded() -> None:
    ring = HitRing(window=60.0, size=3)
    for second in range(100):
        ring.add(float(second), float(second), 0.0)
    # Only the last three samples remain: the baseline is t=97, not t=40.
    assert ring.ratio(100.0, 100.0, 0.0) == (1.0, 3.0)


def test_upload_rate_is_over_the_last_minute() -> None:
    ring = RateRing()
    assert ring.rate(1000.0, 0.0) == (None, 0.0)  # no sample yet
    ring.add(1000.0, 0.0)
    ring.add(1005.0, 100.0)
    assert ring.rate(1000.0, 0.0) == (None, 0.0)  # no time passed
    assert ring.rate(1010.0, 1000.0) == (100.0, 10.0)
    # The first sample is more than a minute old: the rate starts at the second.
    assert ring.rate(1063.0, 1000.0) == (pytest.approx(900 / 58), 58.0)
    assert ring.rate(2000.0, 1000.0) == (None, 0.0)


# -- residency ---------------------------------------------------------------------


def _block(digest: str, tier: str, raw: int) -> StoredBlock:
    return StoredBlock(digest, tier, raw + 4096, raw, 0.0)


@pytest.fixture(name="index")
def fixture_index(tmp_path: Path) -> Index:
    index = Index(tmp_path / "index.sqlite")
    source = "s3://bucket/data"
    index.record(BlockRef(source, "train/a.tar", "e", 0), _block("a0", "hot", 100))
    index.record(BlockRef(source, "train/a.tar", "e", 1), _block("a1", "warm", 50))
    index.record(BlockRef(source, "train/deep/b.jpg", "e", 0), _block("b0", "hot", 7))
    index.record(BlockRef(source, "val/c.jpg", "e", 0), _block("c0", "warm", 30))
    index.record(BlockRef(source, "README", "e", 0), _block("r0", "hot", 3))
    # The same content under another prefix: stored once, resident for both.
    index.record(BlockRef(source, "val/copy-of-a0", "e", 0), _block("a0", "hot", 100))
    # Another source in the same cache is not this mount's.
    index.record(BlockRef("s3://other", "train/x", "e", 0), _block("x0", "hot", 999))
    return index


def test_residency_query_groups_raw_bytes_by_first_path_component_and_tier(index: Index) -> None:
    rows = index.resident_bytes_by_prefix("s3://bucket/data")
    assert rows == [
        ("", "hot", 3),
        ("train", "hot", 107),
        ("train", "warm", 50),
        ("val", "hot", 100),
        ("val", "warm", 30),
    ]
    index.move_block("a1", "hot", 4096)  # a promotion moves its bytes to the other tier
    assert ("train", "hot", 157) in index.resident_bytes_by_prefix("s3://bucket/data")
    index.remove_block("a0")  # an eviction removes them from every prefix
    assert index.resident_bytes_by_prefix("s3://bucket/data") == [
        ("", "hot", 3),
        ("train", "hot", 57),
        ("val", "warm", 30),
    ]
    assert index.resident_bytes_by_prefix("s3://nothing") == []
    index.close()


def test_bound_prefixes_keeps_the_largest_and_sums_the_rest() -> None:
    rows = [("a", "hot", 1), ("b", "hot", 50), ("b", "warm", 10), ("c", "warm", 20), ("", "hot", 5)]
    assert bound_prefixes(rows, 2) == [
        ("b", {"hot": 50, "warm": 10}),
        ("c", {"warm": 20}),
        (OTHER_PREFIX, {"hot": 6}),
    ]
    assert bound_prefixes(rows, 10)[-1] == ("a", {"hot": 1})
    assert (ROOT_PREFIX, {"hot": 5}) in bound_prefixes(rows, 10)


def test_residency_is_queried_at_most_once_per_refresh(index: Index) -> None:
    clock = FakeClock()
    queries: list[float] = []

    def query() -> list[tuple[str, str, int]]:
        queries.append(clock.now)
        return index.resident_bytes_by_prefix("s3://bucket/data")

    residency = Residency(query, ["hot", "warm"], refresh=30.0, limit=2, clock=clock)
    metrics = Metrics(CollectorRegistry())
    metrics.watch_residency("/mnt/data", "s3://bucket/data", residency.rows)
    assert queries == [], "registering the collector must not scan the index"

    def sample(prefix: str, tier: str) -> float | None:
        labels = {"source": "s3://bucket/data", "prefix": prefix, "tier": tier}
        return metrics.registry.get_sample_value("cachefsd_resident_bytes", labels)

    assert sample("train", "hot") == 107
    assert sample("train", "warm") == 50
    assert sample("val", "hot") == 100
    assert sample(OTHER_PREFIX, "hot") == 3  # the root's bytes, beyond the 2 largest
    assert sample(OTHER_PREFIX, "warm") == 0  # every tier of a kept prefix, zeros included
    clock.now += 29.0
    index.remove_block("a0")
    assert sample("train", "hot") == 107  # cached: the index is not scanned per scrape
    assert len(queries) == 1
    clock.now += 1.0
    assert sample("train", "hot") == 7
    assert len(queries) == 2
    index.close()


def test_a_failing_residency_query_keeps_the_last_answer() -> None:
    clock = FakeClock()
    answers: list[Any] = [[("a", "hot", 5)], sqlite3.OperationalError("disk I/O error")]

    def query() -> list[tuple[str, str, int]]:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    residency = Residency(query, ["hot"], refresh=30.0, clock=clock)
    assert residency.rows() == [("a", "hot", 5)]
    clock.now += 30.0
    snapshot = residency.current()
    assert snapshot.prefixes == [("a", {"hot": 5})]
    assert snapshot.error == "disk I/O error"
    assert residency.current() is snapshot  # not retried before the refresh interval


# -- the snapshot ------------------------------------------------------------------


class FakeModel:
    def __init__(self) -> None:
        self.epoch = 0

    def current(self) -> int:
        return self.epoch

    def stats(self) -> dict[str, object]:
        workload = ACCESS["per_workload"]["python[4242]:train"]
        return {
            **ACCESS,
            "epoch": self.epoch,
            "per_workload": {"train": {**workload, "epoch": self.epoch}, "val": {**workload, "epoch": 0}},
        }


def served(stats: DaemonStats) -> dict[str, Any]:
    """``stats``' snapshot as the daemon serves it."""
    answer: dict[str, Any] = json.loads(json.dumps(stats.snapshot().model_dump(mode="json")))
    return answer


def test_snapshot_agrees_with_the_registry(index: Index) -> None:
    clock = FakeClock()
    metrics = Metrics(CollectorRegistry())
    residency = Residency(lambda: index.resident_bytes_by_prefix("s3://bucket/data"), ["hot", "warm"])
    metrics.watch_residency("/mnt/data", "s3://bucket/data", residency.rows)
    model = FakeModel()
    metrics.watch_epoch(model.current, dict)
    stats = DaemonStats(
        metrics, model, residency, "s3://bucket/data", "/mnt/data", node_facts, lambda: "on", clock=clock
    )
    stats.sample()  # t=1000: nothing read yet
    metrics.read_done({"cold": 300}, 0.5, "python[1]", 0.0)
    clock.now += 70.0
    stats.sample()  # t=1070: the cold read is now more than a minute old
    metrics.read_done({"hot": 600, "memory": 100}, 0.0, "python[1]", 0.0)
    for seconds in (0.001, 0.002, 0.003, 0.2):
        metrics.fetch_done("demand", seconds, 1000)
    metrics.prefetch_issued(400)
    metrics.prefetch_used(300)
    metrics.prefetch_wasted(100)
    metrics.dedup_saved("wire", 64)
    metrics.tier_usage("hot", 8192, 1 << 20, 2)
    model.epoch = 3
    clock.now += 5.0

    snapshot = served(stats)
    registry = metrics.registry
    assert snapshot["reads"]["bytes"] == {"cache": 700, "cold": 300, "total": 1000}
    assert snapshot["reads"]["served_bytes"] == {"cold": 300, "hot": 600, "memory": 100}
    assert snapshot["reads"]["count"] == {"cache": 1, "cold": 1}
    assert snapshot["hit_ratio"]["since_mount"] == pytest.approx(0.7)
    assert snapshot["hit_ratio"]["since_mount"] == registry.get_sample_value("cachefsd_hit_ratio")
    assert snapshot["hit_ratio"]["last_minute"] == 1.0
    assert snapshot["hit_ratio"]["last_minute_seconds"] == 5.0
    assert snapshot["stall_seconds"] == 0.5
    demand = snapshot["fetch"]["demand"]
    assert demand["count"] == 4
    assert demand["bytes"] == 4000
    buckets = [
        (bound, float(sum(s <= bound for s in (0.001, 0.002, 0.003, 0.2)))) for bound in LATENCY_BUCKETS
    ]
    assert demand["p50_seconds"] == pytest.approx(histogram_quantile(0.5, [*buckets, (INF, 4.0)]))
    assert 0.1 < demand["p99_seconds"] <= 0.25
    assert snapshot["fetch"]["prefetch"]["p50_seconds"] is None
    assert snapshot["prefetch"] == {
        "issued_bytes": 400,
        "used_bytes": 300,
        "wasted_bytes": 100,
        "accuracy": 0.75,
        "waste": 0.25,
    }
    assert snapshot["dedup"] == {"disk_saved_bytes": 0, "wire_saved_bytes": 64}
    assert snapshot["cache"]["used_bytes"] == 8192
    assert snapshot["epoch"] == {"current": 3, "workloads": {"train": 3, "val": 0}}
    assert registry.get_sample_value("cachefsd_epoch") == 3
    resident = {entry["prefix"]: entry for entry in snapshot["residency"]["prefixes"]}
    assert resident["train"] == {"prefix": "train", "bytes": {"hot": 107, "warm": 50}, "total_bytes": 157}
    assert resident[ROOT_PREFIX]["total_bytes"] == 3
    labels = {"source": "s3://bucket/data", "prefix": "train", "tier": "warm"}
    assert registry.get_sample_value("cachefsd_resident_bytes", labels) == 50
    index.close()


def stats_of(
    residency: Residency, metrics: Metrics | None = None, clock: Callable[[], float] = time.monotonic
) -> DaemonStats:
    """The stats of a mount of ``s3://bucket/data`` on ``/mnt/data``."""
    return DaemonStats(
        metrics or Metrics(CollectorRegistry()),
        FakeModel(),
        residency,
        "s3://bucket/data",
        "/mnt/data",
        node_facts,
        lambda: "on",
        clock,
    )


def test_snapshot_lists_each_named_job_with_its_loader_meter() -> None:
    metrics = Metrics(CollectorRegistry())
    residency = Residency(lambda: [], ["hot"])
    stats = stats_of(residency, metrics, FakeClock())
    metrics.read_done({"cold": 300}, 0.5, "python[1]", 0.6)
    metrics.read_done({"hot": 600, "memory": 100}, 0.0, "python[1]", 0.25)
    metrics.meter_reported("python[1]", 10, 1.0, 4.0)
    assert served(stats)["jobs"] == {
        "python[1]": {
            "reads": {"cache": 1, "cold": 1},
            "bytes": {"cache": 700, "cold": 300},
            "hit_ratio": pytest.approx(0.7),
            "stall_seconds": 0.5,
            "batches": 10,
            "data_wait_fraction": 0.25,
        }
    }
    assert metrics.job_reads_so_far("python[1]") == JobReads(pytest.approx(0.85), 0.5, 700.0, 300.0)
    assert metrics.job_reads_so_far("nobody[2]") == JobReads()  # it would get a series at its first read


def test_a_read_only_mount_has_no_writes() -> None:
    assert served(stats_of(Residency(lambda: [], ["hot"])))["writes"] is None


def test_a_writable_mounts_writes_agree_with_its_uploads_and_the_registry(make_rig: RigFactory) -> None:
    """Staged and failing after a failed attempt, then uploaded: the stats
    and the metrics the endpoint exports say the same."""
    rig = make_rig(writable=True)
    writes = rig.fs.writes
    assert writes is not None
    mount = str(rig.cache_dir / "mnt")  # the rig's mountpoint, its metrics' label
    rig.metrics.for_mount(mount).watch_writes(writes.staging.staged_bytes, writes.uploads.oldest_due_seconds)
    clock = FakeClock()
    stats = DaemonStats(
        rig.metrics,
        FakeModel(),
        Residency(lambda: [], ["hot"]),
        rig.store.uri,
        mount,
        node_facts,
        lambda: "on",
        clock,
        writes=writes,
    )
    stats.sample()  # t=1000: nothing uploaded yet
    registry = rig.metrics.registry
    labels = {"mount": mount}
    rig.namespace.listdir("/")  # listed before the store fails: only the upload meets the fault
    rig.faulty.faults.failures_left = 1  # the first attempt fails; its retry waits 2 s
    data = os.urandom(3 * BLOCK_SIZE + 5)
    _, handle = rig.fs.create(ROOT_INODE, "model.pt", os.O_WRONLY | os.O_CREAT)
    rig.fs.write(handle, 0, memoryview(data))
    rig.fs.release(handle)
    _, failed = writes.uploads.wait(None, 30.0)
    assert list(failed) == ["model.pt"]
    clock.now += 5.0

    staged = served(stats)["writes"]
    assert staged["staged_bytes"] == len(data) == registry.get_sample_value("cachefsd_staged_bytes", labels)
    assert staged["staged_files"] == 1
    assert staged["uploads_due"] == staged["uploads_failing"] == 1
    assert staged["uploads_in_flight"] == 0
    assert staged["oldest_due_seconds"] > 0
    assert staged["failed_attempts"] == 1
    assert registry.get_sample_value("cachefsd_uploads_total", {**labels, "result": "failed"}) == 1
    assert staged["uploaded_bytes"] == staged["uploaded_files"] == 0
    assert staged["upload_bytes_per_second"] == 0.0  # measured over 5 s, not unknown
    assert staged["upload_p50_seconds"] is None
    assert staged["oldest_failure"] == {"key": "model.pt", "error": "injected fault"}

    _, failed = writes.uploads.wait(None, 30.0)  # retried now
    assert not failed
    clock.now += 10.0
    done = served(stats)["writes"]
    assert done["staged_bytes"] == done["staged_files"] == done["uploads_due"] == 0
    assert registry.get_sample_value("cachefsd_staged_bytes", labels) == 0
    assert done["oldest_due_seconds"] == 0.0
    assert done["uploaded_bytes"] == len(data)
    assert registry.get_sample_value("cachefsd_upload_bytes_total", labels) == len(data)
    assert done["uploaded_files"] == 1
    assert registry.get_sample_value("cachefsd_uploads_total", {**labels, "result": "ok"}) == 1
    assert done["failed_attempts"] == 1
    assert done["upload_bytes_per_second"] == pytest.approx(len(data) / 15.0)
    assert done["upload_rate_seconds"] == 15.0
    assert done["upload_p50_seconds"] is not None
    assert done["upload_p50_seconds"] <= done["upload_p99_seconds"]
    assert done["oldest_failure"] is None


def test_a_residency_computed_for_the_snapshot_is_not_negative_seconds_old(index: Index) -> None:
    """It is computed after the snapshot's clock was read: "as of 0 s ago", not "-0"."""
    residency = Residency(lambda: index.resident_bytes_by_prefix("s3://bucket/data"), ["hot"])
    stats = stats_of(residency)
    assert f"{stats.snapshot().residency.age_seconds:.0f}" == "0"
    index.close()


def test_stats_count_residency_afresh_after_a_scrape() -> None:
    """A scrape a moment before the cache filled must not make ``cachefsd
    stats`` say nothing is cached beside a full tier."""
    rows: list[tuple[str, str, int]] = []
    residency = Residency(lambda: list(rows), ["hot"])
    stats = stats_of(residency)
    assert residency.current().prefixes == []  # the scrape
    rows.append(("train", "hot", 4096))
    assert served(stats)["residency"]["prefixes"] == [
        {"prefix": "train", "bytes": {"hot": 4096}, "total_bytes": 4096}
    ]


# -- showing it ---------------------------------------------------------------------


def _text(stats: dict[str, Any], throughput: Any = None) -> str:
    console = Console(record=True, width=120, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(render(StatsAnswer.model_validate(stats), throughput))
    console.file.close()
    return console.export_text()


def test_names_are_shown_as_they_are_never_as_markup() -> None:
    """Keys are data: "[v2]imagenet" is a name, and "x[/]" once crashed
    ``cachefsd stats`` with a MarkupError."""
    residency = STATS["residency"]
    prefixes = [
        {"prefix": name, "bytes": {"hot": 1 << 20}, "total_bytes": 1 << 20}
        for name in ("[v2]imagenet", "[red]train", "x[/]")
    ]
    stats = {
        **STATS,
        "residency": {**residency, "prefixes": prefixes},
        "epoch": {"current": 1, "workloads": {"[bold]job": 1}},
    }
    text = _text(stats)
    for name in ("[v2]imagenet", "[red]train", "x[/]", "[bold]job: 1"):
        assert name in text


def test_the_stats_table_shows_every_section() -> None:
    text = _text(STATS)
    lines = text.splitlines()
    assert "/mnt/imagenet" in lines[0]
    assert "s3://datasets/imagenet" in lines[0]
    assert "up 1h02m05s" in lines[0]
    assert "epoch 2" in lines[0]
    hot = next(line for line in lines if line.startswith("│ hot"))
    assert "25.0 GiB" in hot
    assert "100.0 GiB" in hot
    assert "25.0 %" in hot
    assert "6400" in hot
    assert "90.0 %" in text  # since mount
    assert "never reach the daemon" in " ".join(text.split())  # why a cached epoch may read 0 %
    assert "99.5 %" in text  # last minute
    assert "last 58 s" in text
    assert "12.5 ms / 420.0 ms" in text
    assert "256 demand GETs" in text
    assert "12.50 s" in text  # stall
    assert "memory 0 B" not in text  # a place that served nothing is not listed
    assert "used 1.5 GiB (75.0 %)" in text
    assert "wasted 512.0 MiB" in text
    assert "disk 1.0 MiB" in text
    assert "2 (train: 2, val: 1)" in text
    train = next(line for line in lines if line.startswith("│ train"))
    assert [cell.strip() for cell in train.split("│")[2:5]] == ["24.0 GiB", "0 B", "24.0 GiB"]
    assert any(line.startswith(f"│ {OTHER_PREFIX}") for line in lines)
    assert "as of 12 s ago" in text
    job = next(line for line in lines if line.startswith("│ python[4242]"))
    assert [cell.strip() for cell in job.split("│")[2:7]] == ["1000", "90.0 %", "3.50 s", "120", "37.5 %"]
    unmetered = next(line for line in lines if line.startswith("│ cat[77]"))
    assert [cell.strip() for cell in unmetered.split("│")[5:7]] == ["-", "-"]


def test_the_stats_table_shows_a_writable_mounts_writes() -> None:
    assert "uploads due" not in _text(STATS)  # a read-only mount has none
    text = _text({**STATS, "writes": WRITES})
    lines = text.splitlines()
    assert "3.0 GiB in 3 files" in text
    due = next(line for line in lines if "uploads due" in line)
    assert "3 (1 uploading, 1 failing), oldest due 95.00 s" in due
    assert "40.0 GiB in 20 files (4 failed attempts)" in text
    rate = next(line for line in lines if "upload rate last 55 s" in line)
    assert "250.0 MiB/s" in rate
    assert "8.00 s / 24.00 s" in text
    assert "ckpt/step-9/[rank0].pt: AccessDenied: no PutObject" in text  # a key, not markup


def test_the_stats_table_of_an_idle_mount() -> None:
    idle = json.loads(json.dumps(STATS))
    idle["hit_ratio"] = {"since_mount": None, "last_minute": None, "last_minute_seconds": 0.0, "by_tier": {}}
    idle["fetch"]["demand"].update(p50_seconds=None, p99_seconds=None, count=0)
    idle["residency"].update(prefixes=[], age_seconds=None)
    text = _text(idle)
    assert "hit ratio since mount   │ -" in text
    assert "- / - (0 demand GETs" in text
    assert "(nothing cached)" in text


# -- top -------------------------------------------------------------------------------


def test_sparkline_scales_to_the_largest_value() -> None:
    assert sparkline([0, 1, 2, 3, 4, 5, 6, 7]) == SPARK_CHARS
    assert sparkline([0.0, 0.0, 0.0]) == "▁▁▁"
    assert sparkline([5, -3, 10]) == "▅▁█"
    assert sparkline([]) == ""


def test_sparkline_merges_values_into_its_width() -> None:
    line = sparkline([1.0] * 100 + [0.0] * 20, width=6)
    assert line == "█████▁"


def test_throughput_is_bytes_per_interval() -> None:
    throughput = Throughput(interval=1.0, label="served")
    throughput.add(10.0, 1000.0)
    assert list(throughput.history) == []
    throughput.add(11.0, 3000.0)
    throughput.add(12.0, 3000.0)
    assert list(throughput.history) == [2000.0, 0.0]
    assert throughput.rate == 0.0
    assert throughput.history.maxlen == 60


def test_top_shows_uploads_under_reads_staged_bytes_and_the_uploads_due() -> None:
    served, uploaded = Throughput(1.0, "served"), Throughput(1.0, "uploaded")
    for throughput in (served, uploaded):
        throughput.add(10.0, 0.0)
        throughput.add(11.0, float(4 << 20))
    writes = WritesAnswer.model_validate(WRITES)
    line = writes_line(uploaded, writes).plain
    assert line.startswith("uploaded")
    assert "4.0 MiB/s  staged 3.0 GiB, due 3 (1 uploading, 1 failing), oldest due 95.00 s" in line
    # The two sparklines start in one column.
    assert line.index(SPARK_CHARS[-1]) == served.line().plain.index(SPARK_CHARS[-1])
    idle = writes.model_copy(update={"uploads_due": 0})
    assert writes_line(uploaded, idle).plain.endswith("due none")


def test_keys_quit_on_q_and_restore_the_terminal() -> None:
    leader, follower = pty.openpty()
    try:
        before = termios.tcgetattr(follower)
        with open(follower, closefd=False) as stream, Keys(stream) as keys:
            assert not termios.tcgetattr(follower)[3] & termios.ICANON  # cbreak: key by key
            assert not keys.quit_within(0.01)
            os.write(leader, b"x")
            assert not keys.quit_within(0.05)
            os.write(leader, b"q")
            assert keys.quit_within(5.0)
        assert termios.tcgetattr(follower) == before
    finally:
        os.close(leader)
        os.close(follower)


# -- the answer's type -------------------------------------------------------------


def test_the_answer_round_trips_in_its_keys_order() -> None:
    answer = StatsAnswer.model_validate_json(json.dumps(STATS))
    dumped = answer.model_dump(mode="json")
    assert dumped == STATS
    assert list(dumped) == list(STATS)  # the mount's facts first, as ``stats --json`` always showed
    assert answer.jobs["python[4242]"].data_wait_fraction == 0.375


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda stats: stats.update(surprise=1), "surprise"),
        (lambda stats: stats["fetch"]["demand"].update(p90_seconds=0.1), "fetch.demand.p90_seconds"),
        (lambda stats: stats["hit_ratio"].pop("last_minute"), "hit_ratio.last_minute"),
        (lambda stats: stats["fetch"].pop("shared"), "fetch.shared"),
        (lambda stats: stats["access"]["per_workload"]["python[4242]:train"].update(order="guess"), "order"),
    ],
)
def test_an_unknown_or_missing_field_fails_loudly(change: Any, named: str) -> None:
    stats = json.loads(json.dumps(STATS))
    change(stats)
    with pytest.raises(ValidationError, match=re.escape(named)):
        StatsAnswer.model_validate(stats)


def test_the_access_models_own_stats_are_an_answer() -> None:
    """The workload model's stats are a dict of its own: the answer checks every key of it."""
    model = WorkloadModel()
    model.listed("train", {"train/a.jpg": 100, "train/b.jpg": 100}, 0.0, job="python[7]")
    model.opened("train/a.jpg", 100, 1.0, job="python[7]")
    model.read("train/a.jpg", 0, 100, 1.0, job="python[7]")
    access = AccessTotals.model_validate(model.stats())
    assert access.read_this_epoch_files == 1
    assert [(job.working_set_files, job.unread_files) for job in access.per_workload.values()] == [(2, 1)]


def test_a_mount_gone_leaves_no_series_of_its_own() -> None:
    metrics = Metrics(CollectorRegistry())
    kept, gone = metrics.for_mount("/mnt/kept"), metrics.for_mount("/mnt/gone")
    for events in (kept, gone):
        events.request_answered("read")
        events.passthrough_state(True)
        events.read_done({"hot": 10}, 0.0, "python[1]", 0.0)
        events.watch_writes(lambda: 10.0, lambda: 1.0)
        events.upload_started()
    gone.upload_ended("ok", 0.5, 10)
    metrics.forget_mount("/mnt/gone")
    exported = generate_latest(metrics.registry).decode()
    assert 'mount="/mnt/gone"' not in exported
    # A writable mount's upload series exist, at 0, before its first upload ends.
    assert 'cachefsd_uploads_total{mount="/mnt/kept",result="failed"} 0.0' in exported
    assert 'cachefsd_upload_bytes_total{mount="/mnt/kept"} 0.0' in exported
    assert value_of(metrics.fuse_requests, mount="/mnt/kept", operation="read") == 1
    assert value_of(metrics.passthrough, mount="/mnt/kept") == 1
