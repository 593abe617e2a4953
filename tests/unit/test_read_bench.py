"""The read benchmark's arithmetic: ratios paired by repeat, medians, the
issue's targets judged, and the server's ranges; and its readers' epochs."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from benchmarks.epoch_bench import Mounted
from benchmarks.read_bench import (
    CACHEFSD,
    COLD,
    CONTENDERS,
    DROPPED,
    KEPT,
    LOCAL,
    MIB,
    RCLONE,
    S3FS,
    Cpu,
    Epoch,
    Readers,
    Row,
    check_targets,
    in_turn,
    measure_epoch,
    per_core,
    summarize,
)
from benchmarks.server_ceiling import aligned_ranges


def epoch(mb_per_s: float, files: int = 100, cpu: float | None = None) -> Epoch:
    """An epoch of ``files`` files, 1 MB a second's worth at ``mb_per_s``, 1 s long."""
    return Epoch(
        seconds=1.0,
        nbytes=int(mb_per_s * 1e6),
        files=files,
        cpu=None if cpu is None else Cpu(cpu / 2, cpu / 2),
    )


def test_a_warm_ratio_pairs_each_repeat_with_the_local_disk_of_that_repeat() -> None:
    epochs = {
        ("images", DROPPED, LOCAL, 0): epoch(100),
        ("images", DROPPED, LOCAL, 1): epoch(400),
        ("images", DROPPED, LOCAL, 2): epoch(200),
        ("images", DROPPED, CACHEFSD, 0): epoch(50),
        ("images", DROPPED, CACHEFSD, 1): epoch(200),
        ("images", DROPPED, CACHEFSD, 2): epoch(100),
    }
    rows = {row.contender: row for row in summarize(epochs, {})}
    # Each repeat is 0.5 x local; a ratio of medians would say 100 / 200.
    assert rows[CACHEFSD].ratio == pytest.approx(0.5)
    assert rows[CACHEFSD].MBps == pytest.approx(100)
    assert rows[CACHEFSD].MBps_low == pytest.approx(50)
    assert rows[CACHEFSD].MBps_high == pytest.approx(200)
    assert rows[LOCAL].ratio is None
    assert rows[LOCAL].cpu_us_per_file is None


def test_a_cold_ratio_is_to_that_repeats_ceiling() -> None:
    epochs = {("shards", COLD, RCLONE, 0): epoch(300), ("shards", COLD, RCLONE, 1): epoch(300)}
    (row,) = summarize(epochs, {("shards", 0): 600.0, ("shards", 1): 1000.0})
    assert row.ratio == pytest.approx((0.5 + 0.3) / 2)


def test_cpu_is_told_a_file_and_a_mib_with_its_system_share() -> None:
    (row,) = summarize({("images", COLD, S3FS, 0): Epoch(2.0, 4 * MIB, 10, Cpu(0.003, 0.001))}, {})
    assert row.cpu_us_per_file == pytest.approx(400)
    assert row.cpu_ms_per_MiB == pytest.approx(1.0)
    assert row.system_share == pytest.approx(0.25)
    assert row.files_per_s == pytest.approx(5)


def test_an_idle_daemon_has_no_system_share() -> None:
    (row,) = summarize({("images", KEPT, CACHEFSD, 0): epoch(1000, cpu=0.0)}, {})
    assert row.cpu_us_per_file == 0
    assert row.system_share is None


EMPTY_ROW = Row(
    dataset="",
    case="",
    contender="",
    runs=3,
    files_per_s=1.0,
    MBps=100.0,
    MBps_low=100.0,
    MBps_high=100.0,
    ratio=None,
    cpu_us_per_file=None,
    cpu_ms_per_MiB=None,
    system_share=None,
)


def row(dataset: str, case: str, contender: str, **fields: Any) -> Row:
    return replace(EMPTY_ROW, dataset=dataset, case=case, contender=contender, **fields)


def verdicts(rows: list[Row], obstore_ms: dict[str, float]) -> dict[str, bool | None]:
    return {check.target: check.met for check in check_targets(rows, obstore_ms)}


def test_targets_are_judged_from_cachefsds_rows_alone() -> None:
    rows = [
        row("images", DROPPED, CACHEFSD, ratio=0.85, cpu_us_per_file=200.0),
        row("shards", DROPPED, CACHEFSD, ratio=0.85, cpu_ms_per_MiB=0.05),
        row("images", DROPPED, RCLONE, ratio=0.95),
        row("images", COLD, CACHEFSD, ratio=0.9, MBps=50.0, cpu_us_per_file=900.0),
        row("images", COLD, RCLONE, MBps=40.0),
        row("images", COLD, S3FS, MBps=60.0),
    ]
    got = verdicts(rows, {"images": 0.4, "shards": 1.0})
    assert got["warm, dropped, images >= 0.8 x local"] is True
    assert got["warm, dropped, shards >= 0.9 x local"] is False
    assert got["warm, dropped, images: daemon CPU <= 150 us a file"] is False
    assert got["warm, dropped, shards: daemon CPU about 0 (0.1 ms) a MiB"] is True
    assert got["cold, images: daemon CPU <= 1 ms a file"] is True
    assert got["cold, images: daemon CPU <= 2 x obstore's (0.40 ms)"] is False  # 0.9 / 0.4 = 2.25
    assert got["cold, images >= 0.8 of the server's ceiling"] is True
    assert got["cold, images: ahead of rclone"] is True
    assert got["cold, images: ahead of s3fs"] is False


def test_a_target_without_its_measurement_is_neither_met_nor_failed() -> None:
    got = verdicts([row("images", COLD, CACHEFSD, MBps=50.0)], {})
    assert got["warm, kept, images >= 0.9 x local"] is None
    assert got["cold, images: ahead of rclone"] is None  # rclone was skipped
    assert got["cold, shards: daemon CPU <= 1 ms a MiB"] is None


def test_one_core_serves_the_inverse_of_the_cpu_a_file_and_a_mib() -> None:
    rows = [
        row("images", DROPPED, CACHEFSD, cpu_us_per_file=500.0),
        row("shards", DROPPED, CACHEFSD, cpu_ms_per_MiB=2.0),
        row("images", KEPT, CACHEFSD, cpu_us_per_file=0.0),
        row("shards", KEPT, CACHEFSD, cpu_ms_per_MiB=0.0),
    ]
    lines = per_core(rows)
    assert "warm, page cache dropped: 2,000 files/s, 0.52 GB/s of shards" in lines
    assert "warm, page cache kept: no limit, no limit of shards" in lines


def test_each_repeat_starts_its_mounts_at_another_one_after_the_local_disk() -> None:
    contenders = list(CONTENDERS)
    firsts = set()
    for repeat in range(len(contenders) - 1):
        order = in_turn(contenders, repeat)
        assert order[0].name == LOCAL
        assert sorted(c.name for c in order) == sorted(c.name for c in contenders)
        firsts.add(order[1].name)
    assert len(firsts) == len(contenders) - 1


def test_ranges_cover_an_object_in_whole_parts_only() -> None:
    assert aligned_ranges(12 << 20, 4 << 20) == (
        "bytes=0-4194303",
        "bytes=4194304-8388607",
        "bytes=8388608-12582911",
    )
    assert aligned_ranges(128 << 10, 4 << 20) == ()


@pytest.fixture(name="readers", scope="module")
def fixture_readers() -> Iterator[Readers]:
    readers = Readers(2)
    yield readers
    readers.close()


def write_files(root: Path, sizes: dict[str, int]) -> None:
    for relative, size in sizes.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_bytes(b"x" * size)


SIZES = {f"d/{index}.bin": index * 1000 for index in range(9)}


def test_an_epoch_reads_every_file_once(tmp_path: Path, readers: Readers) -> None:
    write_files(tmp_path, SIZES)
    seconds, nbytes = readers.epoch(tmp_path, list(SIZES), seed="0")
    assert nbytes == sum(SIZES.values())
    assert seconds > 0


def test_an_epoch_that_reads_other_bytes_than_the_datasets_fails(tmp_path: Path, readers: Readers) -> None:
    write_files(tmp_path, SIZES | {"d/8.bin": 10})  # one file cut short, as a broken mount would serve it
    mounted = Mounted(root=tmp_path, stop=lambda: None)
    with pytest.raises(RuntimeError, match="bytes of the dataset's"):
        measure_epoch(readers, mounted, list(SIZES), sum(SIZES.values()), seed="0")
    assert measure_epoch(readers, mounted, list(SIZES), sum(SIZES.values()) - 7990, seed="0").cpu is None
