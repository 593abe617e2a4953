"""The shared tier: a block is served only if its header and its content
prove it is the block asked for, and a mapping only if it is the one of the
version asked for; over an in-memory object store, blocks one node writes
are what another reads."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import obstore
import pytest
from obstore.store import MemoryStore

from cachefsd.aio import LoopThread
from cachefsd.cache.codec import CorruptBlock, content_hash
from cachefsd.cache.shared import SHARED_HEADER, SharedTier, mapping_path, open_shared, pack, unpack
from cachefsd.errors import CachefsdError

BLOCK = 64 << 10


def test_a_block_round_trips() -> None:
    content = os.urandom(BLOCK - 7)
    digest = content_hash(content)
    assert unpack(pack(content, digest, BLOCK), digest, BLOCK) == content


@pytest.mark.parametrize(
    "damage",
    [
        lambda blob: blob[: len(blob) // 2],  # a truncated write
        lambda blob: blob[:-1] + bytes([blob[-1] ^ 1]),  # bit rot in the content
        lambda blob: b"XXXX" + blob[4:],  # not a shared block at all
        lambda blob: blob[:4] + bytes([2]) + blob[5:],  # another format version
        lambda blob: blob[:3],  # shorter than its header
        lambda blob: b"",
    ],
)
def test_damage_is_always_caught(damage: object) -> None:
    content = os.urandom(BLOCK)
    digest = content_hash(content)
    with pytest.raises(CorruptBlock):
        unpack(damage(pack(content, digest, BLOCK)), digest, BLOCK)  # type: ignore[operator]


def test_a_block_of_another_block_size_or_name_is_refused() -> None:
    content = os.urandom(1000)
    digest = content_hash(content)
    with pytest.raises(CorruptBlock, match="not 131072"):
        unpack(pack(content, digest, BLOCK), digest, 2 * BLOCK)
    other = content_hash(b"other")
    with pytest.raises(CorruptBlock):
        unpack(pack(content, digest, BLOCK), other, BLOCK)  # stored under the wrong name


def test_the_header_says_what_it_holds() -> None:
    content = b"x" * 100
    magic, version, size, length = SHARED_HEADER.unpack_from(pack(content, content_hash(content), BLOCK))
    assert (magic, version, size, length) == (b"CFSS", 1, BLOCK, 100)


def test_mappings_are_named_by_version_and_block_size() -> None:
    one = mapping_path("s3://b", "k", "e1", BLOCK)
    assert one.startswith(f"maps/{BLOCK}/")
    assert one != mapping_path("s3://b", "k", "e2", BLOCK)  # a new version, a new mapping
    assert one != mapping_path("s3://b", "k", "e1", 2 * BLOCK)
    assert one != mapping_path("s3://c", "k", "e1", BLOCK)


class Events:
    def __init__(self) -> None:
        self.fetched: list[int] = []
        self.writes: list[bool] = []
        self.corrupt: list[str] = []

    def fetch_done(self, kind: object, seconds: float, nbytes: int) -> None:
        self.fetched.append(nbytes)

    def shared_written(self, ok: bool) -> None:
        self.writes.append(ok)

    def block_corrupt(self, tier: str) -> None:
        self.corrupt.append(tier)


@pytest.fixture(name="io")
def fixture_io() -> Iterator[LoopThread]:
    loop = LoopThread()
    yield loop
    loop.stop()


def tier_over(store: MemoryStore, io: LoopThread, events: Events) -> SharedTier:
    return SharedTier(store, io, BLOCK, events, time.monotonic)  # type: ignore[arg-type]


def test_blocks_written_by_one_node_are_read_by_another(io: LoopThread) -> None:
    store, events = MemoryStore(), Events()
    contents = {0: os.urandom(BLOCK), 1: os.urandom(500)}
    writer = tier_over(store, io, events)
    blocks = {index: (content_hash(content), content) for index, content in contents.items()}
    writer.store_later("s3://b", "k", "e1", BLOCK + 500, blocks)
    writer.close()  # the queue is drained
    assert events.writes == [True, True]
    reader = tier_over(store, io, Events())
    assert reader.fetch("s3://b", "k", "e1", BLOCK + 500, [0, 1, 2]) == blocks
    # Another version of the key, or the same one read with another size, finds nothing.
    assert reader.fetch("s3://b", "k", "e2", BLOCK + 500, [0, 1]) == {}
    assert reader.fetch("s3://b", "k", "e1", BLOCK, [0, 1]) == {}


def test_a_stale_or_damaged_mapping_and_a_corrupt_block_are_misses(io: LoopThread) -> None:
    store, events = MemoryStore(), Events()
    content = os.urandom(1000)
    digest = content_hash(content)
    assert tier_over(store, io, Events()).store_now("s3://b", "k", "e1", 1000, {0: (digest, content)})
    path = mapping_path("s3://b", "k", "e1", BLOCK)
    mapping = json.loads(bytes(obstore.get(store, path).bytes()))
    obstore.put(store, path, json.dumps({**mapping, "etag": "e0"}).encode())  # a stale mapping
    assert tier_over(store, io, events).fetch("s3://b", "k", "e1", 1000, [0]) == {}
    obstore.put(store, path, b"{not json")
    assert tier_over(store, io, events).fetch("s3://b", "k", "e1", 1000, [0]) == {}
    obstore.put(store, path, json.dumps(mapping).encode())
    obstore.put(store, f"blocks/{BLOCK}/{digest}", pack(content, digest, BLOCK)[:-1] + b"?")
    assert tier_over(store, io, events).fetch("s3://b", "k", "e1", 1000, [0]) == {}
    assert events.corrupt == ["shared"]


def test_runs_of_one_version_written_at_once_are_all_mapped(io: LoopThread) -> None:
    # A stage's workers write runs of one large object side by side.
    store, events = MemoryStore(), Events()
    tier = tier_over(store, io, events)
    contents = {index: os.urandom(100) for index in range(16)}

    def write(index: int) -> bool:
        content = contents[index]
        return tier.store_now("s3://b", "big", "e", 16 * BLOCK, {index: (content_hash(content), content)})

    with ThreadPoolExecutor(16) as pool:
        assert all(pool.map(write, range(16)))
    assert tier_over(store, io, Events()).mapped("s3://b", "big", "e", 16 * BLOCK) == set(range(16))


def test_nodes_of_two_block_sizes_keep_their_own_copies(io: LoopThread) -> None:
    store, events = MemoryStore(), Events()
    content = os.urandom(300)  # a small file: the same block at any block size
    for block_size in (BLOCK, 2 * BLOCK):
        tier = SharedTier(store, io, block_size, events, time.monotonic)  # type: ignore[arg-type]
        assert tier.store_now("s3://b", "k", "e", 300, {0: (content_hash(content), content)})
        assert tier.fetch("s3://b", "k", "e", 300, [0]) == {0: (content_hash(content), content)}
    assert events.corrupt == []


def test_a_bucket_that_never_answers_costs_one_bounded_wait(io: LoopThread) -> None:
    with socket.socket() as silent:  # accepts connections, answers nothing
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        silent.setblocking(False)
        held: list[socket.socket] = []

        def new_connections() -> int:
            count = 0
            with contextlib.suppress(BlockingIOError):
                while True:
                    held.append(silent.accept()[0])
                    count += 1
            return count

        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        events = Events()
        tier = SharedTier(open_shared("s3://fleet/blocks", endpoint), io, BLOCK, events, time.monotonic)
        assert tier.fetch("s3://b", "k", "e", 100, [0]) == {}  # the mapping's GET timed out: a miss
        assert "GET" in tier.last_error
        assert new_connections() >= 1
        assert tier.fetch("s3://b", "k", "e", 100, [0]) == {}
        assert new_connections() == 0  # the next read did not try
        assert not tier.store_now("s3://b", "k", "e", 3, {0: (content_hash(b"abc"), b"abc")})
        with pytest.raises(CachefsdError, match="cannot be written"):
            tier.check()
        for connection in held:
            connection.close()


def test_shared_credentials_of_its_own_come_from_the_variables_named() -> None:
    environ = {"FLEET_AWS_ACCESS_KEY_ID": "AKIAFLEET", "FLEET_AWS_SECRET_ACCESS_KEY": "s3cr3t"}
    store = open_shared("s3://fleet/blocks", "http://127.0.0.1:9", "FLEET_", environ)
    assert store.config["access_key_id"] == "AKIAFLEET"
    with pytest.raises(CachefsdError, match="FLEET_AWS_SECRET_ACCESS_KEY not set") as missing:
        open_shared("s3://fleet/blocks", None, "FLEET_", {"FLEET_AWS_ACCESS_KEY_ID": "AKIAFLEET"})
    assert "AKIAFLEET" not in str(missing.value)  # never a credential in an error
