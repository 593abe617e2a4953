"""The tiered block cache: capacity, movement, deduplication, corruption,
crash reconciliation, verification."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import sqlite3
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from cachefsd.cache import tier as tier_module
from cachefsd.cache.blocks import FileSpan, Use, Version
from cachefsd.cache.codec import Codec, content_hash, decode_file, encode, encode_file
from cachefsd.cache.directory import TierSpec, gc, open_cache, verify
from cachefsd.cache.index import SCHEMA_VERSION, BlockRef, Index, IndexDamaged
from cachefsd.cache.maintenance import reconcile, verify_blocks
from cachefsd.cache.policy import EpochAwarePolicy, LruPolicy, MinioPolicy, PlannedUse, ReadMarks
from cachefsd.cache.replay import ReplayCache
from cachefsd.cache.tier import HELD_DESCRIPTORS, NoRoom, Tier, disk_bytes, victims_for
from cachefsd.cache.tiered import CHECK_BUFFER_BYTES, CacheTuning, TieredCache
from cachefsd.errors import CachefsdError, ConfigError
from cachefsd.metrics import Metrics
from cachefsd.workload.model import WorkloadModel
from tests.metrics import sample
from tests.polling import wait_until
from tests.unit.conftest import Clock

COMPRESSIBLE = b"training sample " * 4096  # 64 KiB that lz4 shrinks a lot


@contextmanager
def tiered(
    root: Path,
    hot: int,
    warm: int | None = None,
    hot_policy: str = "lru",
    clock: Callable[[], float] = time.monotonic,
) -> Iterator[tuple[TieredCache, Metrics]]:
    index = Index(root / "index.sqlite")
    metrics = Metrics(CollectorRegistry())
    tiers = [
        Tier("hot", root / "hot", hot, Codec.RAW, MinioPolicy() if hot_policy == "minio" else LruPolicy())
    ]
    if warm is not None:
        tiers.append(Tier("warm", root / "warm", warm, Codec.LZ4, LruPolicy()))
    cache = TieredCache(tiers, index, metrics, clock=clock)
    reconcile(cache)
    try:
        yield cache, metrics
    finally:
        index.close()


def on_disk(root: Path, tier: str = "hot") -> int:
    blocks = root / tier / "blocks"
    return sum(disk_bytes(path.stat().st_size) for path in blocks.rglob("*") if path.is_file())


def admit(cache: TieredCache, ref: BlockRef, data: bytes) -> str:
    digest = content_hash(data)
    cache.admit(ref, digest, data)
    return digest


def read(cache: TieredCache, ref: BlockRef) -> bytes | None:
    digest = cache.lookup(ref)
    return None if digest is None else cache.read(digest)


def ref(key: str, block: int = 0) -> BlockRef:
    return BlockRef("src", key, "etag", block)


def resident(cache: TieredCache, ref: BlockRef) -> bool:
    """Whether ``ref``'s block is cached, without reading it (a read would
    end its plan and rank it as read)."""
    digest = cache.lookup(ref)
    return digest is not None and cache.tier_of(digest) is not None


def test_admitted_block_reads_back_from_owner_only_files(tmp_path: Path) -> None:
    with tiered(tmp_path, 1 << 20) as (cache, _):
        admit(cache, ref("k"), b"x" * 5000)
        assert read(cache, ref("k")) == b"x" * 5000
        assert cache.used_bytes == disk_bytes(5000) == on_disk(tmp_path)
        assert all(path.stat().st_mode & 0o077 == 0 for path in (tmp_path / "hot").rglob("*"))


def test_identical_content_is_stored_once(tmp_path: Path) -> None:
    with tiered(tmp_path, 1 << 20) as (cache, metrics):
        data = os.urandom(10_000)
        refs = [BlockRef("s3://a", "x", "1", 0), BlockRef("s3://b", "other/y", "2", 3)]
        for each in refs:
            admit(cache, each, data)
        assert on_disk(tmp_path) == disk_bytes(10_000)
        assert all(read(cache, each) == data for each in refs)
        assert sample(metrics.registry, "cachefsd_dedup_saved_bytes_total", where="disk") == 10_000


def test_adopting_a_block_of_ones_own_counts_no_saving(tmp_path: Path) -> None:
    """A read missed its block, then a prefetch of it landed before the read
    looked for a twin by etag: it finds its own block, which saved nothing."""
    with tiered(tmp_path, 1 << 20) as (cache, metrics):
        data = os.urandom(10_000)
        identity = ("etag", 10_000)
        cache.admit(ref("k"), content_hash(data), data, identity, ahead=True)
        assert cache.adopt(ref("k"), identity) == (content_hash(data), data)
        assert sample(metrics.registry, "cachefsd_dedup_saved_bytes_total", where="wire") == 0
        assert sample(metrics.registry, "cachefsd_dedup_saved_bytes_total", where="disk") == 0
        # A twin under another key is a saving.
        assert cache.adopt(BlockRef("src", "twin", "etag", 0), identity) == (content_hash(data), data)
        assert sample(metrics.registry, "cachefsd_dedup_saved_bytes_total", where="wire") == 10_000


def test_corrupt_block_is_dropped_not_served(tmp_path: Path) -> None:
    with tiered(tmp_path, 1 << 20) as (cache, metrics):
        data = os.urandom(5000)
        digest = admit(cache, ref("k"), data)
        path = cache.tiers[0].path_of(digest)
        damaged = bytearray(path.read_bytes())
        damaged[-1] ^= 0xFF
        path.write_bytes(bytes(damaged))
        assert read(cache, ref("k")) is None
        assert not path.exists()
        assert cache.lookup(ref("k")) is None
        assert sample(metrics.registry, "cachefsd_cache_corrupt_blocks_total", tier="hot") == 1
        assert cache.used_bytes == 0


def written(tier: Tier, data: bytes) -> str:
    digest = content_hash(data)
    tier.write(digest, encode_file(data, tier.codec, digest))
    return digest


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_held_warm_hands_its_descriptor_to_the_next_open(tmp_path: Path) -> None:
    """Once the path is gone only a descriptor opened before can read the
    block: the open after a held warm gets that one, once; a plain warm
    holds nothing."""
    tier = Tier("hot", tmp_path, 1 << 20, Codec.RAW, LruPolicy())
    data = os.urandom(5000)
    digest = written(tier, data)
    path, away = tier.path_of(digest), tmp_path / "away"
    tier.warm(digest)
    path.rename(away)
    with pytest.raises(FileNotFoundError):
        tier.open(digest)
    away.rename(path)
    tier.warm(digest, hold=True)
    path.rename(away)
    fd = tier.open(digest)
    try:
        assert os.pread(fd, 1 << 20, 0) == data
    finally:
        os.close(fd)
    with pytest.raises(FileNotFoundError):
        tier.open(digest)


def test_held_descriptors_are_bounded_and_closed_with_their_block(tmp_path: Path) -> None:
    """A held warm whose read never comes (the kernel had the pages) must
    not pile up descriptors, nor keep an evicted block's disk space."""
    tier = Tier("hot", tmp_path, 1 << 30, Codec.RAW, LruPolicy())
    digests = [written(tier, os.urandom(100)) for _ in range(HELD_DESCRIPTORS + 8)]
    before = open_descriptors()
    for digest in digests:
        tier.warm(digest, hold=True)
    assert open_descriptors() == before + HELD_DESCRIPTORS
    for digest in digests:
        tier.delete(digest)
    assert open_descriptors() == before


def test_a_warm_holds_nothing_it_should_not(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not a block deleted while it was being warmed (evicted, or dropped as
    corrupt and written anew), and not a compressed one, which is read by
    path and decoded."""
    raw = Tier("hot", tmp_path / "hot", 1 << 20, Codec.RAW, LruPolicy())
    compressed = Tier("warm", tmp_path / "warm", 1 << 20, Codec.LZ4, LruPolicy())
    data = os.urandom(5000)
    digest = written(raw, data)
    written(compressed, data)
    before = open_descriptors()
    compressed.warm(digest, hold=True)
    assert open_descriptors() == before

    advise = os.posix_fadvise

    def deleted_meanwhile(fd: int, offset: int, length: int, advice: int) -> None:
        raw.delete(digest)
        advise(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", deleted_meanwhile)
    raw.warm(digest, hold=True)
    assert open_descriptors() == before

    monkeypatch.setattr(os, "posix_fadvise", advise)
    kept = written(raw, os.urandom(5000))
    raw.warm(kept, hold=True)  # the control: a raw block not deleted meanwhile is held
    assert open_descriptors() == before + 1


def test_a_capacity_larger_than_the_disk_is_bounded_by_its_free_space(tmp_path: Path) -> None:
    """The tier leaves room on its filesystem for the index and the log
    beside it, whatever its capacity says."""
    tier = Tier("hot", tmp_path, 1 << 60, Codec.RAW, LruPolicy())
    assert 0 < tier.room() < shutil.disk_usage(tmp_path).free


def test_a_full_hot_tier_demotes_to_warm_and_a_warm_hit_promotes(tmp_path: Path) -> None:
    blocks = [COMPRESSIBLE + bytes([i]) for i in range(4)]
    block = disk_bytes(len(blocks[0]))
    with tiered(tmp_path, hot=2 * block, warm=1 << 20) as (cache, metrics):
        for i, data in enumerate(blocks):
            admit(cache, ref(f"k{i}"), data)
        assert sample(metrics.registry, "cachefsd_cache_demotions_total") == 2
        assert cache.tiers[0].block_count == 2
        assert cache.tiers[1].block_count == 2
        assert on_disk(tmp_path, "warm") < on_disk(tmp_path, "hot")  # lz4 in the warm tier
        assert read(cache, ref("k0")) == blocks[0]  # a warm hit...
        # ...moves up, pushing another block down
        assert sample(metrics.registry, "cachefsd_cache_promotions_total") == 1
        assert cache.tiers[0].holds(content_hash(blocks[0]))
        assert all(read(cache, ref(f"k{i}")) == data for i, data in enumerate(blocks))
        assert on_disk(tmp_path, "hot") <= 2 * block


def test_a_policy_that_keeps_everything_sends_newcomers_to_the_next_tier(tmp_path: Path) -> None:
    block = disk_bytes(5000)
    with tiered(tmp_path, hot=2 * block, warm=1 << 20, hot_policy="minio") as (cache, _):
        for i in range(4):
            admit(cache, ref(f"k{i}"), os.urandom(5000))
        assert cache.tiers[0].block_count == 2
        assert cache.tiers[1].block_count == 2


def test_room_is_free_space_plus_what_the_policy_would_give_up(tmp_path: Path) -> None:
    """What a prefetcher may fill: an LRU tier gives up everything, MinIO nothing."""
    block = os.urandom(8192)
    file_bytes = disk_bytes(len(block))
    for policy, expected in (("lru", 4 * file_bytes), ("minio", 2 * file_bytes)):
        root = tmp_path / policy
        root.mkdir()
        with tiered(root, hot=4 * file_bytes, hot_policy=policy) as (cache, _):
            assert cache.room() == 4 * file_bytes
            admit(cache, ref("a"), block)
            admit(cache, ref("b"), os.urandom(8192))
            assert cache.room() == expected


def test_an_opened_cache_ranks_by_the_plan(tmp_path: Path) -> None:
    """``open_cache`` hands the plan to the epoch-aware policy: a block
    planned sooner evicts the one planned latest."""
    block = os.urandom(8192)
    file_bytes = disk_bytes(len(block))
    (tmp_path / "hot").mkdir()
    spec = TierSpec("hot", str(tmp_path / "hot"), 2 * file_bytes, "raw")
    planned, epochs = PlannedUse(), WorkloadModel()
    metrics = Metrics(CollectorRegistry())
    with open_cache(tmp_path, [spec], "epoch-aware", epochs, metrics, planned=planned) as opened:
        cache = opened.cache
        late, later = os.urandom(8192), os.urandom(8192)
        cache.admit(ref("late"), content_hash(late), late, ahead=True, next_use=10.0)
        cache.admit(ref("later"), content_hash(later), later, ahead=True, next_use=20.0)
        soon = os.urandom(8192)
        cache.admit(ref("soon"), content_hash(soon), soon, ahead=True, next_use=1.0)
        assert [resident(cache, ref(key)) for key in ("soon", "late", "later")] == [True, True, False]
        cache.admit(ref("unplanned"), content_hash(block), block, ahead=True)
        assert not resident(cache, ref("unplanned"))  # due blocks are kept over it


def _reopen(root: Path, block_size: int, migrate: bool = True) -> bool:
    """Open the cache under ``root`` at ``block_size``; whether block 0 of k
    was found (it is cached if not)."""
    spec = TierSpec("hot", str(root / "hot"), 1 << 20, "raw")
    metrics = Metrics(CollectorRegistry())
    with open_cache(
        root, [spec], "lru", WorkloadModel(), metrics, block_size=block_size, migrate_block_size=migrate
    ) as opened:
        found = opened.cache.lookup(ref("k")) is not None
        if not found:
            opened.cache.admit(ref("k"), content_hash(_block_at(block_size)), _block_at(block_size))
        return found


def _block_at(block_size: int) -> bytes:
    """Block 0 of k when read at ``block_size``: other bytes at another size."""
    return f"k at {block_size}".encode() * 512


def test_a_cache_mounted_at_another_block_size_forgets_its_blocks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Block i at 4 MiB is not block i at 1 MiB: served as one another, a
    reader got the wrong bytes with no error. A mount at another size
    drops every reference, and reconciling removes the blocks."""
    (tmp_path / "hot").mkdir()
    assert not _reopen(tmp_path, 4 << 20)
    assert _reopen(tmp_path, 4 << 20)
    assert not _reopen(tmp_path, 1 << 20)
    assert "filled at 4.0 MiB blocks, now read at 1.0 MiB" in caplog.text
    assert _reopen(tmp_path, 1 << 20)
    # Sizes that print alike are told apart (a damaged record said "filled
    # at 4.0 MiB blocks, now read at 4.0 MiB").
    database = sqlite3.connect(tmp_path / "index.sqlite", isolation_level=None)
    database.execute("UPDATE meta SET value = ? WHERE name = 'block_size'", (str((1 << 20) + 1),))
    database.close()
    assert not _reopen(tmp_path, 1 << 20)
    assert "filled at 1048577 bytes blocks, now read at 1048576 bytes" in caplog.text
    # The block of the old size went with its references: one block file left, the new one.
    assert sorted(path.name for path in (tmp_path / "hot" / "blocks").rglob("*") if path.is_file()) == [
        content_hash(_block_at(1 << 20))
    ]


def test_a_stage_at_another_block_size_refuses_and_keeps_the_cache(tmp_path: Path) -> None:
    """An offline stage (or its --check) without the mount's --block-size
    must not wipe what it was asked to measure."""
    (tmp_path / "hot").mkdir()
    _reopen(tmp_path, 64 << 10)
    with pytest.raises(ConfigError, match=r"block_size: .* was filled at 64\.0 KiB blocks, not 4\.0 MiB"):
        _reopen(tmp_path, 4 << 20, migrate=False)
    assert _reopen(tmp_path, 64 << 10, migrate=False)


@pytest.mark.parametrize(("block_size", "kept"), [(8192, True), (16 << 10, False), (4096, False)])
def test_an_index_from_before_the_size_was_recorded_is_judged_by_its_blocks(
    tmp_path: Path, block_size: int, kept: bool
) -> None:
    """A 24 KiB object cached in three 8 KiB blocks by a version that did
    not record the size: its blocks are blocks 0-2 at 8 KiB only (at 16
    KiB the first block would be full, at 4 KiB none would be larger)."""
    (tmp_path / "hot").mkdir()
    spec = TierSpec("hot", str(tmp_path / "hot"), 1 << 20, "raw")
    three = [BlockRef("s3://b", "three", "e", index) for index in range(3)]

    def opened(block_size: int | None) -> Any:
        metrics = Metrics(CollectorRegistry())
        return open_cache(
            tmp_path, [spec], "lru", WorkloadModel(), metrics, block_size=block_size, migrate_block_size=True
        )

    with opened(None) as cache:  # records no size, as before
        for block, part in zip(three, (b"a" * 8192, b"b" * 8192, b"c" * 8192), strict=True):
            cache.cache.admit(block, content_hash(part), part)
    with opened(block_size) as cache:
        assert (cache.cache.lookup(three[0]) is not None) == kept


def test_a_block_being_demoted_or_promoted_is_never_a_miss(tmp_path: Path) -> None:
    """A demoted block is out of the hot tier's accounting before its warm
    copy is written, and a promoted one out of the warm tier's: a reader in
    that window found it nowhere, and fetched it again from the bucket."""
    blocks = [os.urandom(64 << 10) for _ in range(24)]
    file_bytes = disk_bytes(len(blocks[0]))
    with tiered(tmp_path, hot=2 * file_bytes, warm=1 << 30) as (cache, metrics):
        digests = [admit(cache, ref("k", index), data) for index, data in enumerate(blocks[:2])]
        misses: list[str] = []
        reads = 0
        done = threading.Event()

        def reader() -> None:
            nonlocal reads
            while not done.is_set():
                for digest in list(digests):
                    reads += 1
                    if cache.read(digest) is None:  # each read of a warm block promotes it
                        misses.append(digest)

        thread = threading.Thread(target=reader)
        thread.start()
        try:
            wait_until(lambda: reads > 0, "the reader to start", 10.0)
            for index, data in enumerate(blocks[2:], start=2):
                digests.append(admit(cache, ref("k", index), data))  # demotes a hot block
        finally:
            done.set()
            thread.join(10)
        assert misses == []
        # The windows were there to fall into: blocks moved both ways while it read.
        assert sample(metrics.registry, "cachefsd_cache_demotions_total") >= len(blocks) - 2
        assert sample(metrics.registry, "cachefsd_cache_promotions_total") > 0


def test_a_damaged_index_is_set_aside_not_a_failed_mount(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The cache is advisory: an index a crash or a bad disk left unreadable
    costs re-fetches, never a cache directory that can no longer be mounted."""
    (tmp_path / "hot").mkdir()
    (tmp_path / "index.sqlite").write_bytes(b"not a database, whatever happened to it" * 100)
    spec = TierSpec("hot", str(tmp_path / "hot"), 1 << 20, "raw")
    metrics = Metrics(CollectorRegistry())
    with open_cache(tmp_path, [spec], "lru", WorkloadModel(), metrics) as opened:
        data = os.urandom(100)
        opened.cache.admit(ref("k"), content_hash(data), data)
        assert read(opened.cache, ref("k")) == data
    assert "index.sqlite is damaged (file is not a database)" in caplog.text
    assert (tmp_path / "index.sqlite.damaged").read_bytes().startswith(b"not a database")  # for a post-mortem


def test_a_hot_tier_of_frames_from_the_previous_format_is_never_served(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Before schema 4 a raw tier's file was a frame: the content after a
    40-byte header. A mount sets such a cache aside with its index (its
    files are orphans, deleted); and a frame under a current index is no
    block file either (longer than its content): start-up drops it."""
    (tmp_path / "hot").mkdir()
    spec = TierSpec("hot", str(tmp_path / "hot"), 1 << 20, "raw")
    data = os.urandom(5000)
    digest = content_hash(data)

    def mount() -> Any:
        return open_cache(tmp_path, [spec], "lru", WorkloadModel(), Metrics(CollectorRegistry()))

    def left_by_the_previous_format(schema: int) -> Path:
        with mount() as opened:
            opened.cache.admit(ref("k"), digest, data)
            path = opened.cache.tiers[0].path_of(digest)
        path.write_bytes(bytes(encode(data)))  # the frame, in 8 KiB on disk as the content is
        database = sqlite3.connect(tmp_path / "index.sqlite", isolation_level=None)
        database.execute("UPDATE meta SET value = ? WHERE name = 'schema_version'", (str(schema),))
        database.close()
        return path

    path = left_by_the_previous_format(3)
    with caplog.at_level(logging.WARNING), mount() as opened:
        assert opened.cache.lookup(ref("k")) is None
        assert opened.dropped.orphans == 1
        assert not path.exists()
    assert f"has schema 3, expected {SCHEMA_VERSION}; starting a new index" in caplog.text

    path = left_by_the_previous_format(SCHEMA_VERSION)
    with mount() as opened:
        assert opened.dropped.corrupt == [digest]
        assert opened.cache.lookup(ref("k")) is None
        assert not path.exists()


# A block reference twice: the primary key's index damaged, a flipped block
# number made one block's row name another's, whose bytes it then served.
_DUPLICATE_REFERENCE = """
ALTER TABLE block_refs RENAME TO damaged;
CREATE TABLE block_refs (source TEXT, key TEXT, etag TEXT, block INTEGER, hash TEXT);
INSERT INTO block_refs SELECT * FROM damaged;
INSERT INTO block_refs SELECT source, key, etag, block, 'ffffffffffffffffffffffffffffffff' FROM damaged;
DROP TABLE damaged;
CREATE INDEX block_refs_by_hash ON block_refs(hash);
"""


@pytest.mark.parametrize(
    "damage",
    [
        # Not UTF-8 text: Python's sqlite3 fails with no SQLite code.
        "UPDATE block_refs SET hash = CAST(x'68ff74' AS TEXT)",
        # In the blocks table, which the load does not read but reconcile
        # does: "database disk image is malformed" refused the mount.
        "UPDATE blocks SET tier = CAST(x'68ff74' AS TEXT)",
        # Values sqlite stores as they come, that we never wrote.
        "UPDATE blocks SET disk_bytes = 'x'",
        "UPDATE blocks SET tier = x'05'",  # a blob: TEXT columns keep numbers as text
        "UPDATE blocks SET last_used = 'x'",
        "UPDATE block_refs SET etag = x'07'",
        "UPDATE blocks SET hash = 'not/a/hash'",
        "UPDATE block_refs SET block = -2",  # -1 is a whole file's (index.WHOLE)
        "UPDATE meta SET value = 'two' WHERE name = 'schema_version'",
        "UPDATE meta SET value = '4M' WHERE name = 'block_size'",  # read by a mount, not by verify
        _DUPLICATE_REFERENCE,
        # An index of a table that no longer matches it: seen by a write
        # that reaches it, or by verify's integrity check.
        "PRAGMA writable_schema = ON; "
        "UPDATE sqlite_master SET sql = 'CREATE INDEX block_refs_by_hash ON block_refs(etag)' "
        "WHERE name = 'block_refs_by_hash'",
        # A damaged schema: "no such column: last_used" (SQLITE_ERROR) refused every mount.
        "PRAGMA writable_schema = ON; "
        "UPDATE sqlite_master SET sql = replace(sql, 'last_used REAL', 'last_usex REAL') "
        "WHERE name = 'blocks'",
    ],
)
def test_a_damaged_index_is_reported_by_verify_and_set_aside_by_a_mount(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    spec = TierSpec("hot", str(tmp_path / "hot"), 1 << 20, "raw")
    (tmp_path / "hot").mkdir()  # a tier of its own: the second attempt takes its lock again
    cache_dir = tmp_path / "cache"

    def mount() -> Any:
        return open_cache(
            cache_dir, [spec], "lru", WorkloadModel(), Metrics(CollectorRegistry()), block_size=1 << 20
        )

    data = os.urandom(100)
    with mount() as opened:
        opened.cache.admit(ref("k"), content_hash(data), data)
    database = sqlite3.connect(cache_dir / "index.sqlite", isolation_level=None)
    database.executescript(damage)
    database.close()
    if "block_size" not in damage:
        damaged = (cache_dir / "index.sqlite").read_bytes()
        with pytest.raises(CachefsdError, match=r"index\.sqlite is damaged .*: the next mount sets it aside"):
            verify(cache_dir, repair=False)
        assert (cache_dir / "index.sqlite").read_bytes() == damaged
    with mount() as opened:
        assert read(opened.cache, ref("k")) is None  # its block is fetched again
        assert opened.cache.tiers[0].block_count == 0
        opened.cache.admit(ref("k"), content_hash(data), data)
        assert read(opened.cache, ref("k")) == data
    assert "index.sqlite is damaged" in caplog.text
    assert "the next mount sets it aside" not in caplog.text  # this one did
    assert (cache_dir / "index.sqlite.damaged").exists()  # for a post-mortem
    assert verify(cache_dir, repair=False).checked == 1


def test_damage_found_while_serving_is_set_aside_by_the_next_mount(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Damage sqlite only notices when a write reaches it: each admission
    failed to be recorded, at every mount, and verify said clean."""
    spec = TierSpec("hot", str(tmp_path), 1 << 20, "raw")

    def mount() -> Any:
        return open_cache(tmp_path, [spec], "lru", WorkloadModel(), Metrics(CollectorRegistry()))

    first, second = os.urandom(100), os.urandom(100)
    with mount() as opened:
        opened.cache.admit(ref("first"), content_hash(first), first)
        database = sqlite3.connect(tmp_path / "index.sqlite", isolation_level=None)
        database.executescript(  # a damaged schema, seen by the daemon's next statement
            "PRAGMA writable_schema = ON; UPDATE sqlite_master SET sql = 'CREATE TABLE blocks (' "
            "WHERE name = 'blocks'; PRAGMA schema_version = 100; PRAGMA writable_schema = OFF;"
        )
        database.close()
        with caplog.at_level(logging.ERROR):
            opened.cache.admit(ref("second"), content_hash(second), second)  # best effort: no error
        assert "index.sqlite is damaged (malformed database schema" in caplog.text
    with pytest.raises(CachefsdError, match=r"index\.sqlite is damaged \(noted before: malformed"):
        verify(tmp_path, repair=False)
    with mount() as opened:
        assert read(opened.cache, ref("first")) is None  # set aside: fetched again
        opened.cache.admit(ref("second"), content_hash(second), second)
        assert read(opened.cache, ref("second")) == second
    assert verify(tmp_path, repair=False).checked == 1


def test_a_directory_where_the_damaged_index_or_its_note_goes_does_not_refuse_the_mount(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Hunt R: "[Errno 21] Is a directory" refused the mount."""
    spec = TierSpec("hot", str(tmp_path), 1 << 20, "raw")
    (tmp_path / "index.sqlite").write_bytes(b"not a database" * 100)
    (tmp_path / "index.sqlite.damaged").mkdir()
    (tmp_path / "index.sqlite.damage-found").mkdir()
    with open_cache(tmp_path, [spec], "lru", WorkloadModel(), Metrics(CollectorRegistry())) as opened:
        data = os.urandom(100)
        opened.cache.admit(ref("k"), content_hash(data), data)
        # Not noted where a directory is in the way: said, not taken for noted already.
        assert not opened.index.note_damage(IndexDamaged("found later"))
    assert "cannot note the damage" in caplog.text
    assert "removed (it cannot be kept as" in caplog.text
    assert "kept as" not in caplog.text.replace("cannot be kept as", "")
    with open_cache(tmp_path, [spec], "lru", WorkloadModel(), Metrics(CollectorRegistry())) as opened:
        assert read(opened.cache, ref("k")) == data


@pytest.mark.parametrize(
    "layout",
    [
        "[{",
        '[{"name": "hot"}]',
        '[{"name": "hot", "dir": ".", "capacity": 1, "codec": "rav"}]',
        '[{"name": "hot", "dir": ".", "capacity": "1", "codec": "raw"}]',
    ],
)
def test_a_damaged_tier_layout_is_reported_by_verify(tmp_path: Path, layout: str) -> None:
    """verify reads the layout the index records (the mount does not):
    damaged, it printed a traceback."""
    spec = TierSpec("hot", str(tmp_path), 1 << 20, "raw")
    with open_cache(tmp_path, [spec], "lru", WorkloadModel(), Metrics(CollectorRegistry())):
        pass
    database = sqlite3.connect(tmp_path / "index.sqlite", isolation_level=None)
    database.execute("UPDATE meta SET value = ? WHERE name = 'tiers'", (layout,))
    database.close()
    with pytest.raises(
        CachefsdError, match=r"tier layout recorded in .* is damaged .*; the next mount records its own"
    ):
        verify(tmp_path, repair=False)


@pytest.mark.parametrize(
    "maintain",
    [lambda d: verify(d, repair=False), lambda d: verify(d, repair=True), gc],
    ids=["verify", "verify --repair", "gc"],
)
def test_maintenance_reports_a_damaged_index_and_leaves_it(tmp_path: Path, maintain: Any) -> None:
    """verify and gc diagnose; they must not replace the evidence with an
    empty index and then say the directory holds no cache."""
    damaged = b"not a database, whatever happened to it" * 100
    (tmp_path / "index.sqlite").write_bytes(damaged)
    with pytest.raises(CachefsdError, match=r"index\.sqlite is damaged .*: the next mount sets it aside"):
        maintain(tmp_path)
    assert (tmp_path / "index.sqlite").read_bytes() == damaged


def test_an_unwritable_tier_falls_through_to_the_next(tmp_path: Path) -> None:
    with tiered(tmp_path, hot=1 << 20, warm=1 << 20) as (cache, metrics):
        data = os.urandom(5000)
        digest = content_hash(data)
        (tmp_path / "hot" / "blocks" / digest[:2]).write_bytes(b"a file where a directory must go")
        admit(cache, ref("k"), data)
        assert read(cache, ref("k")) == data
        assert cache.tiers[1].holds(digest)
        assert sample(metrics.registry, "cachefsd_cache_errors_total", tier="hot") >= 1


def test_checking_a_large_block_keeps_no_buffer_of_its_size(tmp_path: Path) -> None:
    """Each FUSE thread kept a buffer the size of the largest block it had
    checked, for the daemon's life: 704 MiB in 11 threads at 64 MiB blocks.
    A file is read through one buffer of a default block, a part at a time."""
    data = os.urandom(16 << 20)
    with tiered(tmp_path, hot=64 << 20) as (cache, _):
        digest = admit(cache, ref("big"), data)
    with tiered(tmp_path, hot=64 << 20) as (cache, _):  # a new daemon: nothing checked yet
        tracemalloc.start()
        try:
            hit = cache.raw_hit(digest)
            held, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert hit is not None
        os.close(hit[1])
        assert held < CHECK_BUFFER_BYTES + (1 << 20)


def test_damage_past_the_first_part_a_check_reads_is_found(tmp_path: Path) -> None:
    data = os.urandom(2 * CHECK_BUFFER_BYTES + 5)
    with tiered(tmp_path, hot=64 << 20) as (cache, _):
        digest = admit(cache, ref("big"), data)
        path = cache.tiers[0].path_of(digest)
    with open(path, "r+b") as block_file:  # in place: same size, same row
        block_file.seek(len(data) - 1)
        block_file.write(bytes([data[-1] ^ 0xFF]))
    with tiered(tmp_path, hot=64 << 20) as (cache, _):  # a new daemon: nothing checked yet
        assert cache.raw_hit(digest) is None
        assert cache.lookup(ref("big")) is None


def test_a_tier_whose_disk_fails_is_left_alone_for_a_while(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A read-only or vanished disk: no room offered to prefetch (which
    fetched the same blocks over and over), one warning, not one a block."""
    clock = Clock()
    with tiered(tmp_path, hot=1 << 20, clock=clock) as (cache, metrics):
        assert cache.room() > 0
        shutil.rmtree(tmp_path / "hot" / "tmp")  # every write fails
        with caplog.at_level(logging.WARNING):
            admit(cache, ref("a"), os.urandom(5000))
            admit(cache, ref("b"), os.urandom(5000))
        assert ["cannot cache block" in record.message for record in caplog.records] == [True]
        assert sample(metrics.registry, "cachefsd_cache_errors_total", tier="hot") == 1
        assert cache.room() == 0
        (tmp_path / "hot" / "tmp").mkdir()
        clock.now += CacheTuning().disk_error_backoff_seconds - 1
        assert cache.room() == 0
        clock.now += 1
        assert cache.room() > 0  # tried again after the backoff
        admit(cache, ref("c"), b"c" * 5000)
        assert read(cache, ref("c")) == b"c" * 5000


def test_a_block_whose_name_is_blocked_leaves_the_tier_taking_others(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A directory (or an immutable file) where one block's file goes: the
    disk is fine, so only that block is not cached; it stopped the whole
    tier for 30 s, and at every mount."""
    blocked, other = os.urandom(5000), os.urandom(5000)
    with tiered(tmp_path, hot=1 << 20) as (cache, metrics):
        cache.tiers[0].path_of(content_hash(blocked)).mkdir(parents=True)
        with caplog.at_level(logging.WARNING):
            admit(cache, ref("blocked"), blocked)
            admit(cache, ref("blocked", 1), blocked)  # not tried again: one write, one warning
        assert [record.message for record in caplog.records if "Is a directory" in record.message] != []
        assert len(caplog.records) == 1
        assert sample(metrics.registry, "cachefsd_cache_errors_total", tier="hot") == 1
        assert read(cache, ref("blocked")) is None
        assert cache.room() > 0
        admit(cache, ref("other"), other)
        assert read(cache, ref("other")) == other
        assert list((tmp_path / "hot" / "tmp").iterdir()) == []


@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EROFS, errno.EPERM], ids=errno.errorcode.get)
def test_a_disk_that_fails_placing_a_block_stops_the_tier_for_a_while(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: int
) -> None:
    """Only a name in the way is the block's problem: a disk that fails the
    rename (full, read-only, an immutable blocks/) stops the tier for a
    while, not one warning and one wasted write per block."""

    def failing(source: Any, destination: Any) -> None:
        raise OSError(error, os.strerror(error))

    with tiered(tmp_path, hot=1 << 20) as (cache, _):
        monkeypatch.setattr(tier_module.os, "replace", failing)
        admit(cache, ref("k"), os.urandom(5000))
        assert read(cache, ref("k")) is None
        assert cache.room() == 0


@pytest.mark.parametrize("broken", ["hot", "warm"])
def test_a_failing_tier_is_neither_promoted_nor_demoted_into(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, broken: str
) -> None:
    """Each warm hit tried a hot write, and each eviction from hot a warm
    one, with a warning each."""
    blocks = {f"k{i}": os.urandom(5000) for i in range(4)}
    with tiered(tmp_path, hot=12_000, warm=1 << 20) as (cache, metrics), caplog.at_level(logging.WARNING):
        if broken == "warm":  # before the admissions, whose evictions demote
            shutil.rmtree(tmp_path / "warm" / "tmp")
        for key, data in blocks.items():
            admit(cache, ref(key), data)
        if broken == "hot":  # after them: the warm hits below promote
            shutil.rmtree(tmp_path / "hot" / "tmp")
        for _ in range(5):
            for key, data in blocks.items():
                assert read(cache, ref(key)) in (data, None)  # a block not demoted is dropped
        assert sample(metrics.registry, "cachefsd_cache_errors_total", tier=broken) == 1
        assert len([record for record in caplog.records if record.message.startswith(f"{broken} tier:")]) == 1


def test_reconcile_after_a_crash(tmp_path: Path) -> None:
    kept, lost, moved = os.urandom(3000), os.urandom(3000), os.urandom(3000)
    with tiered(tmp_path, 1 << 20, 1 << 20) as (cache, _):
        for key, data in (("kept", kept), ("lost", lost), ("moved", moved)):
            admit(cache, ref(key), data)
    # What a kill -9 can leave: a half-written temp file, a renamed file whose
    # row was never committed, a row whose file is gone, and a block copied
    # to the warm tier by a demotion that never reached the index.
    (tmp_path / "hot" / "tmp" / f"{content_hash(kept)}.12345678").write_bytes(b"partial")
    orphan = os.urandom(3000)
    orphan_path = tmp_path / "hot" / "blocks" / content_hash(orphan)[:2] / content_hash(orphan)
    orphan_path.parent.mkdir(exist_ok=True)
    orphan_path.write_bytes(orphan)
    (tmp_path / "hot" / "blocks" / content_hash(lost)[:2] / content_hash(lost)).unlink()
    half_moved = tmp_path / "warm" / "blocks" / content_hash(moved)[:2] / content_hash(moved)
    half_moved.parent.mkdir(parents=True, exist_ok=True)
    half_moved.write_bytes(bytes(encode(moved, Codec.LZ4)))

    with tiered(tmp_path, 1 << 20, 1 << 20) as (cache, _):
        assert list((tmp_path / "hot" / "tmp").iterdir()) == []
        assert not orphan_path.exists()
        assert not half_moved.exists()
        assert read(cache, ref("kept")) == kept
        assert read(cache, ref("moved")) == moved
        assert read(cache, ref("lost")) is None
        assert cache.used_bytes == on_disk(tmp_path) + on_disk(tmp_path, "warm")


def test_start_up_removes_only_our_own_misplaced_files(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A tier may be a directory the user gave that holds their own files
    (``--cache-dir /scratch``, with its own ``tmp``): start-up deleted every
    file in ``tmp`` and every name that was no block (all of /tmp).
    Only our names are ours: a temp file, a block in the wrong shard; a
    stray no longer refuses the mount, and is left alone."""
    data = os.urandom(3000)
    while content_hash(data)[:2] in ("cc", "dd", "ee", "ff"):  # the shards planted below
        data = os.urandom(3000)
    with tiered(tmp_path, 1 << 20) as (cache, _):
        admit(cache, ref("k"), data)
    tier, digest = tmp_path / "hot", content_hash(data)
    elsewhere = tmp_path / "elsewhere"
    ours = [
        tier / "tmp" / f"{digest}.0123abcd",
        tier / "blocks" / "ff" / digest,
        tier / "blocks" / "ee",  # a file where a shard goes: every block of it refused
    ]
    theirs = [
        tier / "tmp" / "notes.txt",
        tier / "blocks" / "stray",
        tier / "blocks" / "zz" / digest,
        tier / "blocks" / digest[:2] / "notes.txt",
        tier / "blocks" / digest[:2] / f"{digest}.bak",
        elsewhere / f"dd{digest[2:]}",
        elsewhere / f"cc{digest[2:]}",
    ]
    for path in ours + theirs:
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"x" * 5000)
    (tier / "blocks" / "dd").symlink_to(elsewhere)  # never followed out of the tier
    (tier / "blocks" / digest[:2] / f"cc{digest[2:]}").symlink_to(elsewhere / f"cc{digest[2:]}")
    (tier / "blocks" / digest[:2] / "0123456789abcdef0123456789abcdef").mkdir()  # not a file: left
    (tier / "tmp" / f"{'0' * 32}.00000000").mkdir()  # our name, cannot be unlinked: logged
    with caplog.at_level(logging.WARNING), tiered(tmp_path, 1 << 20) as (cache, _):
        assert read(cache, ref("k")) == data
        assert cache.used_bytes == disk_bytes(len(data))
    assert not any(path.exists() for path in ours)
    assert all(path.read_bytes() == b"x" * 5000 for path in theirs)
    assert "cannot remove" in caplog.text
    assert "hot tier: 7 entries in" in caplog.text  # stray, zz, dd, notes.txt, .bak, the symlink, the dir


def _offline_stage(cache_dir: Path) -> None:
    """What ``stage`` opens without a daemon: the cache's own recorded tiers."""
    spec = TierSpec("hot", str(cache_dir), 1 << 20, "raw")
    metrics = Metrics(CollectorRegistry())
    with open_cache(cache_dir, [spec], "lru", WorkloadModel(), metrics, keep_recorded_layout=True):
        pass


@pytest.mark.parametrize(
    "maintain",
    [lambda d: verify(d, repair=False), gc, _offline_stage],
    ids=["verify", "gc", "offline stage"],
)
def test_maintenance_refuses_a_recorded_tier_that_holds_no_blocks(tmp_path: Path, maintain: Any) -> None:
    """A tier deleted since, or a damaged record naming another directory
    ('.' flipped to '/' named /, and verify deleted every file in /tmp):
    the command says so, and creates or deletes nothing there (an offline
    stage too)."""
    spec = TierSpec("hot", str(tmp_path / "hot"), 1 << 20, "raw")
    (tmp_path / "hot").mkdir()
    cache_dir = tmp_path / "cache"
    with open_cache(cache_dir, [spec], "lru", WorkloadModel(), Metrics(CollectorRegistry())) as opened:
        data = os.urandom(100)
        opened.cache.admit(ref("k"), content_hash(data), data)
    victim = tmp_path / "victim"
    (victim / "tmp").mkdir(parents=True)
    (victim / "tmp" / "precious").write_bytes(b"mine")
    database = sqlite3.connect(cache_dir / "index.sqlite", isolation_level=None)
    layout = json.dumps([{"name": "hot", "dir": str(victim), "capacity": 1 << 20, "codec": "raw"}])
    database.execute("UPDATE meta SET value = ? WHERE name = 'tiers'", (layout,))
    database.close()
    with pytest.raises(CachefsdError, match=r"the hot tier at .*victim, which holds no cached blocks"):
        maintain(cache_dir)
    left = sorted(path.relative_to(victim) for path in victim.rglob("*"))
    assert left == [Path("tmp"), Path("tmp/precious")]


def test_a_smaller_capacity_on_restart_keeps_the_most_recent_and_says_what_it_evicted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A mistyped size emptied a warm cache, and the log said only "3 blocks kept"."""
    with tiered(tmp_path, 1 << 20) as (cache, _):
        for i in range(10):
            admit(cache, ref(f"k{i}"), os.urandom(8000))
        cache.save_recency()
    with caplog.at_level(logging.WARNING), tiered(tmp_path, 3 * disk_bytes(8040)) as (cache, _):
        assert on_disk(tmp_path) <= cache.capacity
        assert cache.tiers[0].block_count == 3
        assert read(cache, ref("k9")) is not None
        assert read(cache, ref("k0")) is None
    assert "hot tier: 7 cached blocks (" in caplog.text
    assert "evicted at start: beyond its capacity" in caplog.text


def test_verify_finds_and_repairs_damage(tmp_path: Path) -> None:
    with tiered(tmp_path, 1 << 20, 1 << 20) as (cache, _):
        digests = [admit(cache, ref(f"k{i}"), os.urandom(3000)) for i in range(3)]
        assert verify_blocks(cache, repair=False).checked == 3
        cache.tiers[0].path_of(digests[0]).write_bytes(b"rotten")
        cache.tiers[0].path_of(digests[1]).unlink()
        report = verify_blocks(cache, repair=True)
        assert report.corrupt == [digests[0]]
        assert report.missing == [digests[1]]
        clean = verify_blocks(cache, repair=False)
        assert clean.checked == 1
        assert not clean.corrupt
        assert not clean.missing


def _snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` and its bytes, the index as SQL."""
    files = {str(path.relative_to(root)): path.read_bytes() for path in root.rglob("*") if path.is_file()}
    database = sqlite3.connect(root / "index.sqlite")
    files["index as SQL"] = "\n".join(database.iterdump()).encode()
    database.close()
    return {name: data for name, data in files.items() if not name.startswith("index.sqlite")}


def test_verify_without_repair_reports_damage_and_changes_nothing(tmp_path: Path) -> None:
    """Without --repair it is a check: a row whose file is gone or of the
    wrong size, and files no row names, are reported, and left as found."""
    (tmp_path / "hot").mkdir()
    spec = TierSpec("hot", str(tmp_path / "hot"), 1 << 20, "raw")
    with open_cache(tmp_path, [spec], "lru", WorkloadModel(), Metrics(CollectorRegistry())) as opened:
        digests = [admit(opened.cache, ref(f"k{i}"), os.urandom(3000)) for i in range(3)]
        tier = opened.cache.tiers[0]
    tier.path_of(digests[0]).write_bytes(b"short")
    tier.path_of(digests[1]).unlink()
    orphan = os.urandom(3000)
    tier.path_of(content_hash(orphan)).parent.mkdir(exist_ok=True)
    tier.path_of(content_hash(orphan)).write_bytes(orphan)
    (tmp_path / "hot" / "tmp" / f"{content_hash(orphan)}.0000abcd").write_bytes(b"partial")
    before = _snapshot(tmp_path)

    for _ in range(2):
        report = verify(tmp_path, repair=False)
        assert (report.checked, report.corrupt, report.missing, report.orphans) == (
            3,
            [digests[0]],
            [digests[1]],
            2,
        )
        assert _snapshot(tmp_path) == before

    report = verify(tmp_path, repair=True)
    assert (report.corrupt, report.missing, report.orphans) == ([digests[0]], [digests[1]], 2)
    report = verify(tmp_path, repair=False)
    assert (report.checked, report.corrupt, report.missing, report.orphans) == (1, [], [], 0)


def test_a_repair_the_index_cannot_record_is_reported_unrepaired(tmp_path: Path) -> None:
    """A full index disk: dropping the bad block fails, and the report says
    so rather than claiming a repair (the CLI then exits 1)."""
    with tiered(tmp_path, 1 << 20) as (cache, _):
        digests = [admit(cache, ref(f"k{i}"), os.urandom(3000)) for i in range(2)]
        cache.tiers[0].path_of(digests[0]).write_bytes(b"rotten")
        cache._index._db.execute("PRAGMA query_only = ON")  # sqlite refuses every write, as when full
        report = verify_blocks(cache, repair=True)
        assert report.corrupt == [digests[0]]
        assert report.unrepaired == [digests[0]]


operations = st.lists(
    st.tuples(
        st.sampled_from(["admit", "read", "release"]),
        st.integers(min_value=0, max_value=15),  # which key
        st.integers(min_value=0, max_value=3),  # which content (shared across keys: dedup)
        st.integers(min_value=1, max_value=3),  # version
    ),
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(
    operations,
    st.integers(min_value=4096, max_value=8 * 4096),
    st.integers(min_value=4096, max_value=8 * 4096),
)
def test_capacities_are_never_exceeded_and_reads_are_exact(
    ops: list[tuple[str, int, int, int]], hot: int, warm: int
) -> None:
    contents = [bytes([n]) * (1000 + 3000 * n) for n in range(4)]
    admitted: dict[BlockRef, bytes] = {}  # the model: each block's last admitted content
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        with tiered(root, hot, warm) as (cache, _):
            for op, key, content, version in ops:
                each = BlockRef("src", f"k{key}", f"v{version}", 0)
                if op == "admit":
                    admit(cache, each, contents[content])
                    admitted[each] = contents[content]
                elif op == "read":
                    # A miss is allowed (evicted), another block's bytes never.
                    data = read(cache, each)
                    assert data is None or data == admitted.get(each)
                else:
                    cache.release_version("src", f"k{key}", f"v{version}", block_count=1)
                    admitted.pop(each, None)
                for tier in cache.tiers:
                    assert on_disk(root, tier.name) <= tier.capacity
                    assert tier.used_bytes == on_disk(root, tier.name)
            for tier in cache.tiers:
                for block in (root / tier.name / "blocks").rglob("*"):
                    if block.is_file():
                        # every file on disk is whole and named right
                        decode_file(block.read_bytes(), tier.codec, block.name)


def test_a_read_ends_a_blocks_plan_and_a_refused_block_keeps_none(tmp_path: Path) -> None:
    block = os.urandom(8192)
    file_bytes = disk_bytes(len(block))
    (tmp_path / "hot").mkdir()
    spec = TierSpec("hot", str(tmp_path / "hot"), file_bytes, "raw")
    planned = PlannedUse()
    metrics = Metrics(CollectorRegistry())
    with open_cache(tmp_path, [spec], "epoch-aware", WorkloadModel(), metrics, planned=planned) as opened:
        cache = opened.cache
        digest = content_hash(block)
        cache.admit(ref("planned"), digest, block, ahead=True, next_use=5.0)
        assert planned.next_use(digest) == 5.0
        hit = cache.raw_hit(digest)
        assert hit is not None
        os.close(hit[1])
        assert planned.next_use(digest) is None
        too_big = os.urandom(2 * 8192)
        cache.admit(ref("too big"), content_hash(too_big), too_big, ahead=True, next_use=6.0)
        assert not resident(cache, ref("too big"))
        assert planned.next_use(content_hash(too_big)) is None


def test_a_tier_and_the_replayed_cache_make_room_by_one_rule() -> None:
    """Victims until the newcomer fits; a refusal keeps the victims already
    given up out (the tier deletes or demotes them all the same)."""
    policy = LruPolicy()
    for block in ("a", "b", "c"):
        policy.admitted(block)
    sizes = {"a": 1, "b": 2, "c": 3}

    def remove(block: str) -> int:
        policy.removed(block)
        return sizes[block]

    assert victims_for(policy, "new", 2, remove, "test") == ["a", "b"]
    with pytest.raises(NoRoom) as refused:
        victims_for(MinioPolicy(), "new", 1, sizes.__getitem__, "test")
    assert refused.value.victims == []
    replayed = ReplayCache(LruPolicy(), 3, sizes.__getitem__)
    assert replayed.admit("a")
    assert replayed.admit("b")
    assert replayed.admit("c")  # 3 bytes: both residents go
    assert replayed.resident == {"c"}
    full = ReplayCache(MinioPolicy(), 3, sizes.__getitem__)
    assert full.admit("c")
    assert not full.admit("a")


def test_a_block_adopted_by_a_marked_read_stays_due_for_the_other_job(tmp_path: Path) -> None:
    """A read another job is still to make may find its block under another
    object of the same content (dedup by etag): the block it adopts ranks as
    due elsewhere, as a hit would, and outlives a block only read."""

    class Epoch5:
        def current(self) -> int:
            return 5

    marks = ReadMarks()
    file_bytes = disk_bytes(4096)
    index = Index(tmp_path / "index.sqlite")
    hot = Tier(
        "hot", tmp_path / "hot", 2 * file_bytes, Codec.RAW, EpochAwarePolicy(Epoch5(), elsewhere=marks)
    )
    cache = TieredCache([hot], index, Metrics(CollectorRegistry()))
    reconcile(cache)
    index.start_serving()
    shared, read, new = (os.urandom(4096) for _ in range(3))

    def version(key: str) -> Version:
        return Version("s", key, f"etag-{key[0]}", 4096, 1 << 20, content_etag=True)

    def read_through(wanted: Version) -> None:
        block = cache.get(wanted, 0, Use())
        assert block is not None
        cache.served(wanted, 0, block)
        if isinstance(block.content, FileSpan):
            os.close(block.content.fd)

    cache.put(version("a/x"), 0, content_hash(shared), shared, Use())
    adopter = version("a/y")  # the same etag and size as a/x: its content
    with marks.reading(lambda digest: cache.lookup(adopter.ref(0)) == digest):
        read_through(adopter)
    cache.put(version("b"), 0, content_hash(read), read, Use())
    read_through(version("b"))
    cache.put(version("c"), 0, content_hash(new), new, Use())
    assert cache.lookup(adopter.ref(0)) == content_hash(shared)
    assert cache.lookup(version("b").ref(0)) is None
    index.close()
