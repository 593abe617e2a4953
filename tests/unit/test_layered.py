"""The composition of the cache's levels: the order they are asked in, and
what each learns of a block another found or the origin brought; and, over
the whole read path, that concurrent readers of a block cost one request
to the shared tier and one GET from the origin."""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from cachefsd.cache.blocks import FOR_A_READ, Block, BlockCache, FileSpan, Use, Version
from cachefsd.cache.codec import content_hash
from cachefsd.cache.layered import LayeredCache
from cachefsd.store.faulty import Faults, FaultyStore
from cachefsd.store.memory import MemoryStore
from tests.unit.conftest import BLOCK_SIZE, RigFactory, read_concurrently

VERSION = Version("s3://b", "k", "e", 4 * BLOCK_SIZE, BLOCK_SIZE, content_etag=False)
AHEAD = Use("prefetch", ahead=True, next_use=7.0, tier="warm")


class Fake(BlockCache):
    """A level that holds what it is given and says what was asked of it."""

    def __init__(self, name: str, remote: bool = False, in_place: bool = False) -> None:
        self.name = name
        self._remote = remote
        self._in_place = in_place  # serves what it holds in place (a raw tier)
        self.blocks: dict[int, Block] = {}
        self.calls: list[tuple[Any, ...]] = []

    @property
    def remote(self) -> bool:
        return self._remote

    def get(self, version: Version, index: int, use: Use) -> Block | None:
        self.calls.append(("get", index))
        return self.blocks.get(index)

    def get_many(self, version: Version, indices: Sequence[int], use: Use) -> dict[int, Block]:
        self.calls.append(("get_many", tuple(indices), use))
        return {index: self.blocks[index] for index in indices if index in self.blocks}

    def put(self, version: Version, index: int, digest: str, content: bytes | bytearray, use: Use) -> bool:
        self.calls.append(("put", index, use))
        self.blocks[index] = Block(digest, bytes(content), self.name)
        return self._in_place

    def put_many(
        self, version: Version, blocks: Mapping[int, tuple[str, bytes | bytearray]], use: Use
    ) -> None:
        self.calls.append(("put_many", tuple(sorted(blocks)), use))

    def served(self, version: Version, index: int, block: Block) -> bool:
        self.calls.append(("served", index))
        return self._in_place and index in self.blocks

    def residency(self, version: Version, index: int) -> str | None:
        return self.name if index in self.blocks else None

    def forget(self, version: Version) -> None:
        self.calls.append(("forget",))


def block(level: str, data: bytes = b"data") -> Block:
    return Block(content_hash(data), data, level)


def test_near_levels_are_asked_in_order_and_a_remote_one_never_by_find() -> None:
    ram, disk, bucket = Fake("memory"), Fake("hot"), Fake("shared", remote=True)
    bucket.blocks[0] = block("shared")
    cache = LayeredCache([ram, disk, bucket])
    assert cache.find(VERSION, 0) is None
    assert ram.calls == [("get", 0)]
    assert disk.calls == [("get", 0)]
    assert bucket.calls == []
    with pytest.raises(ValueError, match="remote level"):
        LayeredCache([bucket, ram])


def test_a_near_hit_is_served_to_the_others_up_to_one_that_serves_it_in_place() -> None:
    ram, disk = Fake("memory"), Fake("hot", in_place=True)
    disk.blocks[0] = block("hot")
    ram.blocks[1] = block("memory")
    cache = LayeredCache([ram, disk])
    found = cache.find(VERSION, 1)
    assert found is ram.blocks[1]
    assert disk.calls[-1] == ("served", 1)  # the tier's policy counts the read (it does not hold it here)
    ram.calls.clear()
    disk.blocks[2] = Block("h", FileSpan(-1, 0, 10), "hot")  # a raw hit: a span of its file
    assert cache.find(VERSION, 2) is disk.blocks[2]
    assert ram.calls == [("get", 2)]  # no copy of what a file serves


def test_a_compressed_hit_is_kept_in_ram() -> None:
    ram, disk = Fake("memory"), Fake("warm")
    disk.blocks[0] = block("warm")
    LayeredCache([ram, disk]).find(VERSION, 0)
    assert ram.calls == [("get", 0), ("served", 0)]


def test_a_remote_hit_is_put_into_the_near_levels_as_its_use_says() -> None:
    ram, disk, bucket = Fake("memory"), Fake("hot"), Fake("shared", remote=True)
    bucket.blocks[1] = block("shared")
    found = LayeredCache([ram, disk, bucket]).find_remote(VERSION, [0, 1], AHEAD)
    assert found == {1: bucket.blocks[1]}
    assert bucket.calls == [("get_many", (0, 1), AHEAD)]
    assert disk.calls == [("put", 1, AHEAD)]
    assert ram.calls == [("put", 1, AHEAD)]  # the level decides (RAM keeps only what is read)


def test_a_hit_in_a_further_remote_level_is_put_into_the_nearer_ones() -> None:
    disk, near_bucket, far_bucket = Fake("hot"), Fake("rack", remote=True), Fake("region", remote=True)
    far_bucket.blocks[0] = block("region")
    found = LayeredCache([disk, near_bucket, far_bucket]).find_remote(VERSION, [0], FOR_A_READ)
    assert found == {0: far_bucket.blocks[0]}
    assert near_bucket.calls == [("get_many", (0,), FOR_A_READ), ("put", 0, FOR_A_READ)]
    assert far_bucket.calls == [("get_many", (0,), FOR_A_READ)]
    assert disk.calls == [("put", 0, FOR_A_READ)]


def test_an_origin_fetch_fills_near_levels_block_by_block_and_remote_ones_at_its_end() -> None:
    ram, disk, bucket = Fake("memory"), Fake("hot", in_place=True), Fake("shared", remote=True)
    cache = LayeredCache([ram, disk, bucket])
    with cache.filling(VERSION, FOR_A_READ) as put:
        put(0, content_hash(b"a"), b"a")
        assert disk.calls == [("put", 0, FOR_A_READ)]
        assert ram.calls == []  # the raw tier serves it in place
        assert bucket.calls == []
        put(1, content_hash(b"b"), bytearray(b"b"))
    assert bucket.calls == [("put_many", (0, 1), FOR_A_READ)]


def test_what_a_fetch_brought_before_it_failed_still_goes_to_the_remote_levels() -> None:
    disk, bucket = Fake("hot"), Fake("shared", remote=True)
    cache = LayeredCache([disk, bucket])

    def broken_fetch() -> None:
        with cache.filling(VERSION, AHEAD) as put:
            put(2, content_hash(b"c"), b"c")
            raise RuntimeError("the GET broke")

    with pytest.raises(RuntimeError):
        broken_fetch()
    assert bucket.calls == [("put_many", (2,), AHEAD)]


def test_a_read_served_by_a_fetch_is_counted_by_the_near_levels() -> None:
    ram, disk = Fake("memory"), Fake("hot", in_place=True)
    disk.blocks[0] = block("hot")
    cache = LayeredCache([ram, disk])
    cache.served(VERSION, 0, block("cold"))
    assert (disk.calls, ram.calls) == ([("served", 0)], [])
    cache.served(VERSION, 1, block("cold"))  # not in place anywhere: RAM keeps it
    assert ram.calls == [("served", 1)]


def test_residency_is_the_near_levels_unless_there_are_none() -> None:
    disk, bucket = Fake("hot"), Fake("shared", remote=True)
    bucket.blocks[0] = block("shared")
    assert LayeredCache([disk, bucket]).residency(VERSION, 0) is None  # a stage still brings it local
    assert LayeredCache([bucket]).residency(VERSION, 0) == "shared"  # a fleet stage's


def test_a_version_gone_is_forgotten_by_every_level() -> None:
    levels = [Fake("memory"), Fake("hot"), Fake("shared", remote=True)]
    LayeredCache(levels).forget(VERSION)
    assert all(level.calls == [("forget",)] for level in levels)


def test_concurrent_readers_of_a_shared_block_cost_one_request_there_and_none_at_the_origin(
    make_rig: RigFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = os.urandom(BLOCK_SIZE)
    bucket = MemoryStore()
    gate = threading.Event()
    shared = FaultyStore(bucket, Faults(gate=gate))
    rig = make_rig({"f": data}, shared_store=shared)
    info = rig.namespace.lookup("/f").info
    assert info is not None
    assert rig.shared is not None
    gate.set()
    rig.shared.put_many(rig.reader.version(info), {0: (content_hash(data), data)}, FOR_A_READ)
    rig.shared.close()  # the write is out
    other = make_rig({"f": data}, cache_dir=rig.cache_dir.with_name("other"), shared_store=shared)
    gate.clear()
    gets = bucket.get_count
    assert read_concurrently(other, gate, monkeypatch) == [data] * 8
    assert bucket.get_count - gets == 2  # the version's mapping, then its block
    assert other.store.get_count == 0


def test_concurrent_readers_of_a_block_the_shared_tier_lacks_cost_one_get_from_the_origin(
    make_rig: RigFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = os.urandom(BLOCK_SIZE)
    gate = threading.Event()
    bucket = MemoryStore()
    rig = make_rig({"f": data}, shared_store=FaultyStore(bucket, Faults(gate=gate)))
    assert read_concurrently(rig, gate, monkeypatch) == [data] * 8
    assert rig.store.get_count == 1
    assert rig.shared is not None
    rig.shared.close()  # the origin's block is written there
    # The version's mapping, asked once for the eight readers, and once by
    # that write (which adds the block to it).
    assert bucket.get_count == 2
