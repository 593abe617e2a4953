"""The write benchmark's pure parts: its layouts, its writers' files, the
bucket's check, its ratios paired by repeat and its goals judged."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from benchmarks.read_bench import Cpu
from benchmarks.write_bench import (
    CACHEFSD,
    CONTENDERS,
    LOCAL,
    METADATA,
    METADATA_TMP,
    MIB,
    OBSTORE,
    ORDERED,
    RCLONE,
    S3FS,
    File,
    Layout,
    Run,
    check_objects,
    check_targets,
    dcp_layout,
    in_turn,
    large_layout,
    layouts,
    make_source,
    missing,
    summarize,
    write_checkpoint,
)


def test_the_dcp_layout_is_torchs_file_a_tensor_for_two_ranks_and_its_metadata() -> None:
    layout = dcp_layout()
    names = [file.name for file in layout.files]
    assert names[0] == "__0_0.distcp"
    assert names[33] == "__1_0.distcp"
    assert names[-2:] == ["__1_32.distcp", METADATA]
    assert len(layout.ranks) == 2
    assert sum(file.size == 8 * MIB for file in layout.files) == 64
    assert layout.fsync
    assert layout.total_bytes == 2 * (512 + 32 * 8) * MIB + layout.files[-1].size


def test_small_layouts_shrink_every_size_and_keep_every_file() -> None:
    for full, small in zip(layouts(small=False), layouts(small=True), strict=True):
        assert [file.name for file in small.files] == [file.name for file in full.files]
        data = [(f.size, g.size) for f, g in zip(full.files, small.files, strict=True) if f.name != METADATA]
        assert all(size == 16 * shrunk for size, shrunk in data)
    large = large_layout(16)
    assert [file.size for file in large.files] == [64 * MIB] * 4
    assert not large.fsync


def test_a_checkpoint_is_written_with_the_sources_bytes_and_its_metadata_renamed(tmp_path: Path) -> None:
    layout = Layout(
        "t",
        ((File("__0_0.distcp", 3 * MIB), File("__0_1.distcp", 10)), (File("__1_0.distcp", 9 * MIB),)),
        fsync=True,
        metadata=File(METADATA, 100),
    )
    md5s = make_source(layout, tmp_path / "source")
    target = tmp_path / "target"
    target.mkdir()
    started_hook = []
    started, closed = write_checkpoint(layout, tmp_path / "source", target, lambda: started_hook.append(1))
    assert started_hook == [1]
    assert closed > started
    assert sorted(path.name for path in target.iterdir()) == sorted(file.name for file in layout.files)
    assert not (target / METADATA_TMP).exists()
    for file in layout.files:
        assert hashlib.md5((target / file.name).read_bytes()).hexdigest() == md5s[file.name]


def test_a_rank_that_cannot_write_fails_the_checkpoint_with_its_reason(tmp_path: Path) -> None:
    layout = Layout("t", ((File("a", 10),), (File("b", 10),)), fsync=False)
    make_source(layout, tmp_path / "source")
    with pytest.raises(RuntimeError, match="FileNotFoundError"):
        write_checkpoint(layout, tmp_path / "source", tmp_path / "no such directory", lambda: None)


SIZES = {"a": 10, "b": 20}
MD5S = {"a": "aaaa", "b": "bbbb"}


def test_an_object_is_missing_until_it_has_its_size() -> None:
    assert missing(SIZES, {"a": (10, "x")}) == ["b"]
    assert missing(SIZES, {"a": (10, "x"), "b": (5, "y")}) == ["b"]
    assert missing(SIZES, {"a": (10, "x"), "b": (20, "y"), "c": (1, "z")}) == []


def test_a_single_part_etag_is_its_md5_and_an_object_in_parts_is_read_back() -> None:
    read = []

    def read_md5(name: str) -> str:
        read.append(name)
        return "bbbb"

    assert check_objects(SIZES, MD5S, {"a": (10, "aaaa"), "b": (20, "1234-3")}, read_md5) == []
    assert read == ["b"]


def test_the_bucket_is_wrong_when_an_object_is_missing_short_other_or_not_written() -> None:
    listing = {"a": (10, "ffff"), "c": (1, "cccc"), METADATA_TMP: (1, "dddd")}
    assert check_objects(SIZES, MD5S, listing, lambda name: "") == [
        "a holds other bytes",
        "b missing",
        f"{METADATA_TMP} was not written",
        "c was not written",
    ]
    assert check_objects(SIZES, MD5S, {"a": (10, "aaaa"), "b": (2, "bbbb")}, lambda name: "") == [
        "b is 2 bytes, not 20"
    ]


def run(closed: float | None, durable: float | None, cpu: float | None = None) -> Run:
    return Run(closed, durable, 100 * MIB, None if cpu is None else Cpu(cpu, 0.0))


def test_ratios_pair_each_repeat_with_the_local_disk_and_obstore_of_that_repeat() -> None:
    runs = {
        ("large", LOCAL, 0): run(1.0, None),
        ("large", OBSTORE, 0): run(None, 10.0, cpu=0.5),
        ("large", CACHEFSD, 0): run(2.0, 11.0, cpu=1.0),
        ("large", LOCAL, 1): run(4.0, None),
        ("large", OBSTORE, 1): run(None, 40.0, cpu=0.5),
        ("large", CACHEFSD, 1): run(4.0, 40.0, cpu=2.0),
        ("large", CACHEFSD, 2): run(3.0, 30.0, cpu=3.0),  # its local and obstore runs failed
    }
    rows = {row.contender: row for row in summarize(runs)}
    ours = rows[CACHEFSD]
    assert ours.close_ratio == pytest.approx((0.5 + 1.0) / 2)  # a ratio of medians would say 2.5 / 3
    assert ours.durable_ratio == pytest.approx((1.1 + 1.0) / 2)
    assert ours.close_s == 3.0
    assert ours.close_MBps == pytest.approx(100 * MIB / 1e6 / 3.0)
    assert ours.cpu_ms_per_MiB == pytest.approx(20.0)
    assert ours.runs == 3
    assert rows[LOCAL].close_ratio is None
    assert rows[LOCAL].durable_s is None
    assert rows[LOCAL].cpu_ms_per_MiB is None
    assert rows[OBSTORE].close_s is None
    assert rows[OBSTORE].durable_ratio is None
    assert rows[OBSTORE].close_ratio is None


def test_cachefsds_goals_are_judged_by_layout_and_unmeasured_ones_are_neither() -> None:
    runs = {
        ("large", LOCAL, 0): run(1.0, None),
        ("large", OBSTORE, 0): run(None, 10.0),
        ("large", CACHEFSD, 0): run(1.2, 13.0),
        ("large", S3FS, 0): run(30.0, 30.0),
    }
    got = {check.target: check.met for check in check_targets(summarize(runs), ["large", "dcp"])}
    assert got == {
        "large: close >= 0.8 x local": True,  # 1 / 1.2 = 0.83
        "large: durable <= 1.2 x obstore": False,  # 1.3
        "dcp: close >= 0.8 x local": None,
        "dcp: durable <= 1.2 x obstore": None,
    }


def test_the_local_disk_goes_first_and_the_others_take_turns_after_it() -> None:
    contenders = list(CONTENDERS)
    seconds = {in_turn(contenders, repeat)[1].name for repeat in range(len(contenders) - 1)}
    assert seconds == {OBSTORE, ORDERED, CACHEFSD, RCLONE, S3FS}
    assert all(in_turn(contenders, repeat)[0].name == LOCAL for repeat in range(4))
