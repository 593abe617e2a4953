"""Hot and warm tiers through real mounts: blocks move between tiers and
never overflow them, identical content is cached and downloaded once, a
``kill -9`` under churn leaves a cache that ``verify`` finds clean, and the
maintenance commands and tier flags behave as doc/configuration.md says.

The promises under test (doc/configuration.md, "Tiers"; SEMANTICS.md,
"Crashes"): each tier's capacity is never exceeded; blocks are demoted
instead of dropped and promoted on reuse; warm frames are compressed; a
block is stored once whatever object, prefix or bucket holds it; nothing a
crash leaves behind is ever served or reported clean.

Bytes on disk are counted as the daemon accounts them: each block file's
size rounded up to the 4 KiB allocation unit. Every wait is a bounded poll.
"""

from __future__ import annotations

import functools
import os
import random
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from cachefsd.cache.codec import content_hash, decode
from cachefsd.cache.tier import disk_bytes
from cachefsd.testing.s3_server import S3TestServer
from tests.integration.conftest import Mount, MountFactory, drop_page_cache, force_unmount, free_port, run_cli
from tests.integration.datasets import new_bucket, put_objects
from tests.integration.torture import (
    KILL_ROUNDS,
    assert_reads_right,
    kill_during_reads,
    metric,
    write_manifest,
)
from tests.polling import wait_until

KiB = 1 << 10
MiB = 1 << 20

BLOCK_SIZE = 64 * KiB
# These tests count and check block files: without passthrough, a file read
# to its end gets no whole file (``cache.whole``), a file of its own.
NO_WHOLE_FILES = ("-o", "nopassthrough")
# How long whole files may take to be made on a loaded machine.
POLL_SECONDS = 60.0
# verify and gc on a cache in use must answer at once, not after a lock wait.
FAIL_FAST_SECONDS = 10.0


def _tier_flags(
    s3_server: S3TestServer, hot: Path, hot_size: str, warm: Path, warm_size: str
) -> tuple[str, ...]:
    """Mount flags for the test bucket in 64 KiB blocks, with a hot and a
    warm tier, and the blocks alone in them (``NO_WHOLE_FILES``)."""
    return (
        *NO_WHOLE_FILES,
        "--endpoint-url",
        s3_server.endpoint_url,
        "--block-size",
        "64K",
        "--hot",
        str(hot),
        "--hot-size",
        hot_size,
        "--warm",
        str(warm),
        "--warm-size",
        warm_size,
    )


def _block_files(tier_dir: Path) -> list[Path]:
    return sorted(path for path in (tier_dir / "blocks").glob("*/*") if path.is_file())


def _disk_bytes(tier_dir: Path) -> int:
    """Bytes on disk of a tier's block files, as the daemon accounts them."""
    return sum(disk_bytes(path.stat().st_size) for path in _block_files(tier_dir))


def _blocks_of(data: bytes) -> list[bytes]:
    return [data[start : start + BLOCK_SIZE] for start in range(0, len(data), BLOCK_SIZE)]


def _assert_within_capacity(tiers: dict[str, tuple[Path, int]], when: str) -> None:
    for name, (tier_dir, capacity) in tiers.items():
        used = _disk_bytes(tier_dir)
        assert used <= capacity, f"{when}: {used} bytes of blocks in the {capacity}-byte {name} tier"


def _read_all(mount: Mount, objects: dict[str, bytes], names: Iterable[str] | None = None) -> None:
    for name in objects if names is None else names:
        assert mount.path(name).read_bytes() == objects[name], f"{name}: wrong bytes through the mount"


def _compressible(seed: int, size: int) -> bytes:
    """Text-like records (a CSV shard): lz4 shrinks them several times, and
    no two blocks of any two such files are equal (no content dedup)."""
    rng = random.Random(seed)
    lines = []
    total = 0
    while total < size:
        line = f"sample-{seed:03d}-{len(lines):07d},split=train,label={rng.randrange(10)},weight=1.0\n"
        lines.append(line)
        total += len(line)
    return "".join(lines).encode()[:size]


# -- 1. hot and warm -------------------------------------------------------------------------


def test_blocks_demote_to_warm_promote_on_reuse_and_never_overflow_a_tier(
    tmp_path: Path, s3_server: S3TestServer, s3_client: Any, mounter: MountFactory
) -> None:
    # 3 MiB: six times the hot tier, well inside hot + warm even uncompressed.
    text = {f"text/{i}.csv": _compressible(i, 256 * KiB) for i in range(6)}
    noise = {f"noise/{i}.bin": os.urandom(256 * KiB) for i in range(6)}
    objects = {**text, **noise}
    bucket = new_bucket(s3_client, "tiers")
    put_objects(s3_client, bucket, objects)
    hot, warm, cache_dir = tmp_path / "hot", tmp_path / "warm", tmp_path / "cache"
    tiers = {"hot": (hot, 512 * KiB), "warm": (warm, 8 * MiB)}
    flags = _tier_flags(s3_server, hot, "512K", warm, "8M")

    # Pass 1: the text is read first, so it is what the hot tier gives up
    # to the warm one (and what the warm tier compresses).
    mount = mounter(f"s3://{bucket}", *flags, cache_dir=cache_dir)
    _read_all(mount, objects)
    _assert_within_capacity(tiers, "after the first pass")
    metrics = mount.metrics()
    assert metric(mount, "cachefsd_cache_demotions_total") > 0
    assert metric(mount, "cachefsd_cache_evictions_total") == 0, "hot + warm hold the dataset"
    for name, (tier_dir, capacity) in tiers.items():
        assert metrics[f"cachefsd_tier_capacity_bytes{{tier={name}}}"] == capacity
        assert metrics[f"cachefsd_tier_used_bytes{{tier={name}}}"] == _disk_bytes(tier_dir), name
        assert metrics[f"cachefsd_tier_blocks{{tier={name}}}"] == len(_block_files(tier_dir)), name
    all_blocks = sum(len(_blocks_of(body)) for body in objects.values())
    assert len(_block_files(hot)) + len(_block_files(warm)) == all_blocks

    # Hot files are the blocks' bare content, named by its hash (the kernel
    # can be handed one as an object's file); warm frames are lz4: the text
    # blocks it holds take a fraction of their size.
    dataset_blocks = {block for body in objects.values() for block in _blocks_of(body)}
    for block_file in _block_files(hot):
        content = block_file.read_bytes()
        assert content_hash(content) == block_file.name, block_file
        assert content in dataset_blocks, block_file
    warm_text_raw = warm_text_disk = 0
    text_blocks = {block for body in text.values() for block in _blocks_of(body)}
    for block_file in _block_files(warm):
        raw = decode(block_file.read_bytes(), block_file.name)
        if raw in text_blocks:
            warm_text_raw += len(raw)
            warm_text_disk += disk_bytes(block_file.stat().st_size)
    assert warm_text_raw >= 1 * MiB, "the text should have been demoted to the warm tier"
    assert warm_text_disk < warm_text_raw / 2, f"{warm_text_disk} bytes on disk for {warm_text_raw} of text"
    warm_blocks = metrics["cachefsd_tier_blocks{tier=warm}"]
    assert metrics["cachefsd_tier_used_bytes{tier=warm}"] < warm_blocks * BLOCK_SIZE
    mount.unmount()

    # Pass 2 with a new daemon on the same tiers: its 64 MiB buffer of decoded
    # blocks would otherwise answer every read of this small dataset, and the
    # tiers would never see the pass (dropping the page cache is not enough).
    drop_page_cache()
    s3_server.reset_counts()
    mount = mounter(f"s3://{bucket}", *flags, cache_dir=cache_dir)
    _read_all(mount, objects)
    assert s3_server.get_object_count == 0, "the second pass went to the bucket"
    # Hits in the warm tier move up, in place of hot blocks already read
    # (the default epoch-aware policy gives up blocks read in this epoch).
    assert metric(mount, "cachefsd_cache_promotions_total") > 0
    assert metric(mount, "cachefsd_tier_read_bytes_total") >= sum(len(body) for body in objects.values())
    assert mount.metrics()["cachefsd_tier_read_bytes_total{tier=warm}"] > 0
    _assert_within_capacity(tiers, "after the second pass")
    mount.unmount()
    _assert_within_capacity(tiers, "after unmount")


# -- 2. dedup by etag ------------------------------------------------------------------------


def test_same_objects_under_two_prefixes_are_cached_and_downloaded_once(
    tmp_path: Path, s3_server: S3TestServer, s3_client: Any, mounter: MountFactory
) -> None:
    # Random and distinct: no two blocks are equal, so only the copies share.
    files = {f"{i}.bin": os.urandom(192 * KiB + i * 1000) for i in range(4)}
    bucket = new_bucket(s3_client, "dedup")
    put_objects(
        s3_client, bucket, {f"{prefix}/{name}": body for prefix in "ab" for name, body in files.items()}
    )
    one_copy = sum(disk_bytes(len(block)) for body in files.values() for block in _blocks_of(body))
    mount = mounter(
        f"s3://{bucket}", *NO_WHOLE_FILES, "--endpoint-url", s3_server.endpoint_url, "--block-size", "64K"
    )

    s3_server.reset_counts()
    _read_all(mount, {f"a/{name}": body for name, body in files.items()})
    assert s3_server.get_object_count > 0
    assert _disk_bytes(mount.cache_dir) == one_copy

    s3_server.reset_counts()
    _read_all(mount, {f"b/{name}": body for name, body in files.items()})
    assert s3_server.get_object_count == 0, "b/ was downloaded although a/ holds the same objects"
    assert _disk_bytes(mount.cache_dir) == one_copy, "b/ took disk space of its own"
    saved = mount.metrics()["cachefsd_dedup_saved_bytes_total{where=wire}"]
    assert saved >= sum(len(body) for body in files.values())


def test_two_buckets_with_the_same_objects_share_one_cache(
    tmp_path: Path, s3_server: S3TestServer, s3_client: Any, mounter: MountFactory
) -> None:
    objects = {f"shard-{i}.bin": os.urandom(160 * KiB + i) for i in range(4)}
    first, second = new_bucket(s3_client, "dedup1"), new_bucket(s3_client, "dedup2")
    put_objects(s3_client, first, objects)
    put_objects(s3_client, second, objects)
    cache_dir = tmp_path / "shared-cache"
    flags = ("--endpoint-url", s3_server.endpoint_url, "--block-size", "64K")

    mount = mounter(f"s3://{first}", *flags, cache_dir=cache_dir)
    _read_all(mount, objects)
    mount.unmount()
    cached = _disk_bytes(cache_dir)
    assert cached > 0

    s3_server.reset_counts()
    mount = mounter(f"s3://{second}", *flags, cache_dir=cache_dir)
    _read_all(mount, objects)
    assert s3_server.get_object_count == 0, "the second bucket's objects were downloaded again"
    assert mount.metrics()["cachefsd_dedup_saved_bytes_total{where=wire}"] >= sum(map(len, objects.values()))
    mount.unmount()
    assert _disk_bytes(cache_dir) == cached, "the second bucket's objects took disk space of their own"


# -- 3. kill -9 under tier churn -------------------------------------------------------------

# Kill once blocks are being demoted out of hot and evicted out of warm: the
# whole dataset is more than both tiers hold, so the churn goes on until every
# block has been fetched once.
KILL_AFTER_DEMOTIONS = 8
KILL_AFTER_EVICTIONS = 4


def _churning(mount: Mount) -> bool:
    """True once the hot tier is demoting blocks and the warm one evicting them."""
    return (
        metric(mount, "cachefsd_cache_demotions_total") >= KILL_AFTER_DEMOTIONS
        and metric(mount, "cachefsd_cache_evictions_total") >= KILL_AFTER_EVICTIONS
    )


def test_sigkill_under_tier_churn_leaves_a_cache_verify_finds_clean(
    tmp_path: Path, s3_server: S3TestServer, s3_client: Any, mounter: MountFactory
) -> None:
    # 8 MiB of random blocks through 512 KiB of hot and 2 MiB of warm.
    objects = {f"shard-{i:02d}.bin": os.urandom(256 * KiB) for i in range(32)}
    bucket = new_bucket(s3_client, "torture")
    put_objects(s3_client, bucket, objects)
    manifest = tmp_path / "manifest.txt"
    write_manifest(manifest, objects)
    hot, warm, cache_dir = tmp_path / "hot", tmp_path / "warm", tmp_path / "cache"
    tiers = {"hot": (hot, 512 * KiB), "warm": (warm, 2 * MiB)}
    flags = _tier_flags(s3_server, hot, "512K", warm, "2M")

    new_mount = functools.partial(mounter, f"s3://{bucket}", *flags, cache_dir=cache_dir)

    kill_during_reads(
        new_mount, manifest, KILL_ROUNDS, _churning, "demotions and evictions under the readers"
    )

    mount = new_mount()
    assert_reads_right(mount, objects, "after the kills")
    _assert_within_capacity(tiers, "after the kills")
    mount.unmount()

    result = run_cli("verify", "--cache-dir", str(cache_dir))
    assert result.returncode == 0, result.stdout + result.stderr
    assert ": 0 corrupt, 0 missing" in result.stdout, result.stdout
    result = run_cli("gc", "--cache-dir", str(cache_dir))
    assert result.returncode == 0, result.stdout + result.stderr
    for name, (tier_dir, _) in tiers.items():
        assert list((tier_dir / "tmp").iterdir()) == [], f"temp files left in the {name} tier"
        assert _block_files(tier_dir), f"the {name} tier holds no blocks at all"
    _assert_within_capacity(tiers, "after gc")


# -- 4. verify finds damage ------------------------------------------------------------------


def _flip_payload_byte(block_file: Path) -> None:
    """In place, same size: only the block's hash can tell (the last byte is
    content in a raw tier's file, payload in a warm tier's frame)."""
    contents = bytearray(block_file.read_bytes())
    contents[-1] ^= 0xFF
    with open(block_file, "r+b") as handle:
        handle.write(contents)


def test_verify_reports_damaged_blocks_and_repair_drops_them(
    tmp_path: Path, s3_server: S3TestServer, s3_client: Any, mounter: MountFactory
) -> None:
    objects = {f"{i}.bin": os.urandom(256 * KiB) for i in range(4)}
    bucket = new_bucket(s3_client, "verify")
    put_objects(s3_client, bucket, objects)
    hot, warm, cache_dir = tmp_path / "hot", tmp_path / "warm", tmp_path / "cache"
    flags = _tier_flags(s3_server, hot, "256K", warm, "4M")
    mount = mounter(f"s3://{bucket}", *flags, cache_dir=cache_dir)
    _read_all(mount, objects)
    mount.unmount()
    result = run_cli("verify", "--cache-dir", str(cache_dir))
    assert result.returncode == 0, result.stdout + result.stderr

    # Two blocks of different files (a block file is named by its content's
    # hash): each comes back with a GET of its own. Two of one file could
    # share one, with the file's first run.
    file_of = {
        content_hash(data[start : start + 64 * KiB]): key
        for key, data in objects.items()
        for start in range(0, len(data), 64 * KiB)
    }
    deleted = random.choice(_block_files(hot))
    others = [path for path in _block_files(warm) if file_of[path.name] != file_of[deleted.name]]
    corrupted = random.choice(others)
    _flip_payload_byte(corrupted)
    deleted.unlink()

    for attempt in ("first", "second"):  # verify without --repair changes nothing
        result = run_cli("verify", "--cache-dir", str(cache_dir))
        assert result.returncode != 0, f"{attempt} verify: {result.stdout}"
        assert "Traceback" not in result.stderr, result.stderr
        assert ": 1 corrupt, 1 missing" in result.stdout, f"{attempt} verify: {result.stdout}"
        assert f"corrupt {corrupted.name}" in result.stdout.splitlines(), result.stdout
        assert f"missing {deleted.name}" in result.stdout.splitlines(), result.stdout

    result = run_cli("verify", "--cache-dir", str(cache_dir), "--repair")
    assert result.returncode == 0, result.stdout + result.stderr
    assert not corrupted.exists(), "repair left the corrupt block file"
    result = run_cli("verify", "--cache-dir", str(cache_dir))
    assert result.returncode == 0, result.stdout + result.stderr
    assert ": 0 corrupt, 0 missing" in result.stdout, result.stdout

    s3_server.reset_counts()
    mount = mounter(f"s3://{bucket}", *flags, cache_dir=cache_dir)
    _read_all(mount, objects)
    # Exactly the two dropped blocks went back to the bucket.
    assert s3_server.get_object_count == 2


def test_verify_checks_a_moved_cache_where_it_now_is(tmp_path: Path, mounter: MountFactory) -> None:
    """After ``mv cache cache2`` (or on a copy), verify checked, and locked,
    the blocks at the old path, or crashed when it was gone."""
    source = tmp_path / "src"
    source.mkdir()
    for i in range(3):
        (source / f"{i}.bin").write_bytes(os.urandom(100 * KiB))
    mount = mounter(str(source), cache_dir=tmp_path / "cache")
    for i in range(3):
        assert mount.path(f"{i}.bin").read_bytes() == (source / f"{i}.bin").read_bytes()
    mount.unmount()
    moved = tmp_path / "moved"
    (tmp_path / "cache").rename(moved)
    _flip_payload_byte(_block_files(moved)[0])
    result = run_cli("verify", "--cache-dir", str(moved))
    assert "Traceback" not in result.stderr, result.stderr
    assert ": 1 corrupt, 0 missing" in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize("command", [["verify"], ["gc"], ["stage", "SOURCE", "--check"]])
def test_reading_a_directory_with_no_cache_leaves_nothing_behind(command: list[str], tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    (source / "a.bin").write_bytes(b"a" * KiB)
    typo = tmp_path / "no-such-cache"
    argv = [str(source) if arg == "SOURCE" else arg for arg in command]
    result = run_cli(*argv, "--cache-dir", str(typo))
    assert result.returncode != 0
    assert "holds no cache" in result.stderr, result.stderr
    assert not typo.exists()


# -- 5. maintenance on a cache in use --------------------------------------------------------


@pytest.mark.parametrize("command", ["verify", "gc"])
def test_maintenance_on_a_mounted_cache_fails_fast_in_one_line(
    command: str, tmp_path: Path, mounter: MountFactory
) -> None:
    source = tmp_path / "src"
    source.mkdir()
    (source / "x.bin").write_bytes(os.urandom(100 * KiB))
    mount = mounter(str(source))
    assert mount.path("x.bin").read_bytes() == (source / "x.bin").read_bytes()

    started = time.monotonic()
    result = run_cli(command, "--cache-dir", str(mount.cache_dir))
    elapsed = time.monotonic() - started

    assert result.returncode != 0
    message = result.stderr.strip()
    assert "\n" not in message, message
    assert "Traceback" not in message
    assert "in use" in message, message
    assert message.endswith("unmount the mount using it first"), message
    assert elapsed < FAIL_FAST_SECONDS, f"{command} refused only after {elapsed:.1f}s"
    assert mount.alive
    assert mount.path("x.bin").read_bytes() == (source / "x.bin").read_bytes()


# -- 6. tier sizes -----------------------------------------------------------------------------


def test_tier_size_as_a_share_of_its_filesystem(tmp_path: Path, mounter: MountFactory) -> None:
    source = tmp_path / "src"
    source.mkdir()
    (source / "x.bin").write_bytes(os.urandom(100 * KiB))
    hot = tmp_path / "hot"
    hot.mkdir()
    mount = mounter(str(source), "--hot", str(hot), "--hot-size", "1%")
    assert mount.path("x.bin").read_bytes() == (source / "x.bin").read_bytes()
    stats = os.statvfs(hot)
    expected = int(stats.f_blocks * stats.f_frsize / 100)
    assert mount.metrics()["cachefsd_tier_capacity_bytes{tier=hot}"] == expected


@pytest.mark.parametrize(
    "size_flags",
    [("--hot-size", "0%"), ("--hot-size", "150%"), ("--hot-size", "abc"), ()],
    ids=["zero-percent", "over-100-percent", "not-a-size", "missing"],
)
def test_bad_tier_size_is_a_one_line_error_naming_the_field(
    size_flags: tuple[str, ...], tmp_path: Path
) -> None:
    source = tmp_path / "src"
    source.mkdir()
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    try:
        result = run_cli(
            "mount",
            str(source),
            str(mountpoint),
            "--cache-dir",
            str(tmp_path / "cache"),
            "--metrics-addr",
            f"127.0.0.1:{free_port()}",
            "--hot",
            str(tmp_path / "hot"),
            *size_flags,
        )
    finally:
        force_unmount(mountpoint)
    assert result.returncode != 0
    assert not os.path.ismount(mountpoint)
    message = result.stderr.strip()
    assert "\n" not in message, message
    assert "Traceback" not in message
    assert "cache.hot.size" in message, message


# -- 7. one tier -------------------------------------------------------------------------------


def test_single_tier_cache_dir_reports_as_the_hot_tier(tmp_path: Path, mounter: MountFactory) -> None:
    source = tmp_path / "src"
    source.mkdir()
    objects = {f"{i}.bin": os.urandom(200 * KiB) for i in range(3)}
    for name, body in objects.items():
        (source / name).write_bytes(body)
    mount = mounter(str(source), "--block-size", "64K", "--cache-size", "4M")
    _read_all(mount, objects)
    # Each file, read to its end, gets a whole file in the background: the
    # tier's files are compared with its metrics once they are all made.
    wait_until(
        lambda: metric(mount, "cachefsd_whole_files_total") == len(objects),
        "the whole files are made",
        POLL_SECONDS,
    )
    metrics = mount.metrics()
    assert metrics["cachefsd_tier_capacity_bytes{tier=hot}"] == 4 * MiB
    assert metrics["cachefsd_tier_used_bytes{tier=hot}"] == _disk_bytes(mount.cache_dir) > 0
    assert metrics["cachefsd_tier_blocks{tier=hot}"] == len(_block_files(mount.cache_dir))
    assert not any("tier=warm" in sample for sample in metrics), "a single-tier cache reports a warm tier"
    mount.unmount()

    mount = mounter(str(source), "--block-size", "64K", "--cache-size", "4M", cache_dir=mount.cache_dir)
    _read_all(mount, objects)
    assert mount.metrics()["cachefsd_tier_read_bytes_total{tier=hot}"] >= sum(map(len, objects.values()))
