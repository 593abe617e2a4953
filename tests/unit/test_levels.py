"""The ``BlockCache`` contract, run over every level: the recent blocks in
RAM, the tiered local cache, the shared tier (over an in-memory bucket).
A miss is None; a block put is found again, verified, with its hash; a
damaged block is a miss and counted; a level with a capacity never holds
more."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from cachefsd.aio import LoopThread
from cachefsd.cache.blocks import Block, BlockCache, FileSpan, Use, Version
from cachefsd.cache.codec import Codec, content_hash
from cachefsd.cache.index import Index
from cachefsd.cache.maintenance import reconcile
from cachefsd.cache.policy import LruPolicy
from cachefsd.cache.recent import RecentBlocks
from cachefsd.cache.shared import SharedCache
from cachefsd.cache.tier import Tier
from cachefsd.cache.tiered import TieredCache
from cachefsd.metrics import Metrics, SharedFetches
from cachefsd.store.memory import MemoryStore

BLOCK = 64 << 10
# Room for this many blocks in the levels that have a capacity.
CAPACITY_BLOCKS = 4
READ = Use()


@dataclass
class Level:
    """A level under test, and what the contract needs to know of it."""

    name: str
    cache: BlockCache
    metrics: Metrics
    # Spoils the stored copy of a block (by hash), for a level that keeps one out of RAM.
    damage: Callable[[str], None] | None
    used_bytes: Callable[[], int] | None  # for a level with a byte capacity
    capacity: int


def version(key: str, size: int = BLOCK) -> Version:
    return Version("memory://test", key, "e1", size, BLOCK, content_etag=False)


def content_of(block: Block) -> bytes:
    """A block's bytes; a span's read from its file, which is then closed."""
    content = block.content
    if isinstance(content, FileSpan):
        try:
            return os.pread(content.fd, content.length, content.offset)
        finally:
            os.close(content.fd)
    return bytes(content)


def corrupt_counted(level: Level) -> float:
    return sum(
        sample.value
        for family in level.metrics.corrupt_blocks.collect()
        for sample in family.samples
        if sample.name.endswith("_total")
    )


@contextmanager
def opened_level(kind: str, tmp_path: Path) -> Iterator[Level]:
    metrics = Metrics(CollectorRegistry())
    capacity = CAPACITY_BLOCKS * BLOCK
    if kind == "recent":
        recent = RecentBlocks(capacity)
        yield Level("memory", recent, metrics, None, lambda: recent.used_bytes, capacity)
    elif kind == "tiered":
        index = Index(tmp_path / "index.sqlite")
        hot = Tier("hot", tmp_path / "hot", capacity, Codec.RAW, LruPolicy())
        cache = TieredCache([hot], index, metrics)
        reconcile(cache)
        index.start_serving()

        def damage(digest: str) -> None:
            path = next((tmp_path / "hot").rglob(digest))
            content = bytearray(path.read_bytes())
            content[-1] ^= 1
            path.write_bytes(bytes(content))

        yield Level("hot", cache, metrics, damage, lambda: hot.used_bytes, hot.capacity)
        index.close()
    else:
        io = LoopThread()
        store = MemoryStore()
        shared = SharedCache(
            store, io, BLOCK, metrics, SharedFetches(metrics), time.monotonic, write_behind=False
        )

        def spoil(digest: str) -> None:
            path = f"blocks/{BLOCK}/{digest}"
            store.put(path, asyncio.run(store.get_object(path))[:-1] + b"?")

        yield Level("shared", shared, metrics, spoil, None, 0)
        shared.close()
        io.stop()


@pytest.fixture(name="level", params=["recent", "tiered", "shared"])
def fixture_level(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Level]:
    with opened_level(request.param, tmp_path) as level:
        yield level


@pytest.fixture(name="stored_level", params=["tiered", "shared"])
def fixture_stored_level(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Level]:
    """A level that keeps its blocks out of RAM, where they can be damaged."""
    with opened_level(request.param, tmp_path) as level:
        yield level


@pytest.fixture(name="bounded_level", params=["recent", "tiered"])
def fixture_bounded_level(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Level]:
    """A level with a byte capacity of its own (a lifecycle rule ages the shared one)."""
    with opened_level(request.param, tmp_path) as level:
        yield level


def test_a_block_never_put_is_a_miss(level: Level) -> None:
    assert level.cache.get(version("nothing"), 0, READ) is None
    assert level.cache.get_many(version("nothing"), [0, 1], READ) == {}
    assert level.cache.residency(version("nothing"), 0) is None


def test_a_block_put_is_found_again(level: Level) -> None:
    data = os.urandom(BLOCK - 100)
    digest = content_hash(data)
    wanted = version("k", BLOCK - 100)
    level.cache.put(wanted, 0, digest, bytearray(data), READ)  # as a fetch brings it
    block = level.cache.get(wanted, 0, READ)
    assert block is not None
    assert (block.digest, content_of(block), block.level) == (digest, data, level.name)
    expected = None if level.name == "memory" else level.name  # RAM is no residence
    assert level.cache.residency(wanted, 0) == expected


def test_another_version_of_the_object_finds_nothing(level: Level) -> None:
    data = os.urandom(1000)
    level.cache.put(version("k", 1000), 0, content_hash(data), data, READ)
    other = Version("memory://test", "k", "e2", 1000, BLOCK, content_etag=False)
    assert level.cache.get(other, 0, READ) is None


def test_a_damaged_block_is_a_miss_and_counted(stored_level: Level) -> None:
    level = stored_level
    assert level.damage is not None
    data = os.urandom(BLOCK)
    digest = content_hash(data)
    level.cache.put(version("k"), 0, digest, data, READ)
    level.damage(digest)
    assert level.cache.get(version("k"), 0, READ) is None
    assert corrupt_counted(level) == 1


def test_a_level_with_a_capacity_never_holds_more(bounded_level: Level) -> None:
    level = bounded_level
    assert level.used_bytes is not None
    for index in range(3 * CAPACITY_BLOCKS):
        data = os.urandom(BLOCK)
        level.cache.put(version("big", 3 * CAPACITY_BLOCKS * BLOCK), index, content_hash(data), data, READ)
        assert level.used_bytes() <= level.capacity
    assert level.used_bytes() > 0


def test_many_blocks_are_put_and_got_at_once(level: Level) -> None:
    contents = {index: os.urandom(100 + index) for index in range(3)}
    wanted = version("many", 3 * BLOCK)
    level.cache.put_many(
        wanted, {index: (content_hash(data), data) for index, data in contents.items()}, READ
    )
    found = level.cache.get_many(wanted, [0, 1, 2, 3], READ)
    assert {index: content_of(block) for index, block in found.items()} == contents
