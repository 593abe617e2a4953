"""The shared tier: a block is served only if its header and its content
prove it is the block asked for, and a mapping only if it is the one of the
version asked for; over an in-memory object store, blocks one node writes
are what another reads; a failing store is a miss, a bug is not."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from cachefsd.aio import LoopThread
from cachefsd.cache.blocks import Use, Version
from cachefsd.cache.codec import CorruptBlock, content_hash
from cachefsd.cache.shared import (
    SHARED_HEADER,
    SharedCache,
    mapping_path,
    open_shared,
    pack,
    shared_credentials,
    unpack,
)
from cachefsd.errors import AccessDenied, CachefsdError, StoreError
from cachefsd.fetch import FetchKind
from cachefsd.store.base import ObjectStore
from cachefsd.store.faulty import Faults, FaultyStore
from cachefsd.store.memory import MemoryStore

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
    """The shared tier's events, and its fetcher's."""

    def __init__(self) -> None:
        self.fetched: list[tuple[FetchKind, int]] = []
        self.failed: list[FetchKind] = []
        self.writes: list[bool] = []
        self.corrupt: list[str] = []

    def fetch_done(self, kind: FetchKind, seconds: float, nbytes: int) -> None:
        self.fetched.append((kind, nbytes))

    def fetch_retry(self, kind: FetchKind) -> None:
        raise AssertionError("the shared tier never retries")

    def fetch_failed(self, kind: FetchKind) -> None:
        self.failed.append(kind)

    def shared_written(self, ok: bool) -> None:
        self.writes.append(ok)

    def block_corrupt(self, tier: str) -> None:
        self.corrupt.append(tier)


READ = Use()
AHEAD = Use("prefetch", ahead=True)


def version(key: str = "k", etag: str = "e1", size: int = BLOCK + 500, block_size: int = BLOCK) -> Version:
    return Version("s3://b", key, etag, size, block_size, content_etag=False)


@pytest.fixture(name="io")
def fixture_io() -> Iterator[LoopThread]:
    loop = LoopThread()
    yield loop
    loop.stop()


def tier_over(
    store: ObjectStore, io: LoopThread, events: Events, block_size: int = BLOCK, write_behind: bool = True
) -> SharedCache:
    return SharedCache(store, io, block_size, events, events, time.monotonic, write_behind)


def found(tier: SharedCache, wanted: Version, indices: list[int]) -> dict[int, tuple[str, bytes]]:
    return {
        index: (block.digest, bytes(block.content))  # type: ignore[arg-type]  # a bucket's blocks are bytes
        for index, block in tier.get_many(wanted, indices, READ).items()
    }


def object_at(store: MemoryStore, path: str) -> bytes:
    return asyncio.run(store.get_object(path))


def test_blocks_written_by_one_node_are_read_by_another(io: LoopThread) -> None:
    store, events = MemoryStore(), Events()
    contents = {0: os.urandom(BLOCK), 1: os.urandom(500)}
    writer = tier_over(store, io, events)
    blocks = {index: (content_hash(content), content) for index, content in contents.items()}
    writer.put_many(version(), blocks, READ)
    writer.close()  # the queue is drained
    assert events.writes == [True, True]
    reader = tier_over(store, io, Events())
    assert found(reader, version(), [0, 1, 2]) == blocks
    assert reader.get(version(), 1, READ) is not None
    assert [reader.residency(version(), index) for index in (0, 1, 2)] == ["shared", "shared", None]
    # Another version of the key, or the same one read with another size, finds nothing.
    assert found(reader, version(etag="e2"), [0, 1]) == {}
    assert found(reader, version(size=BLOCK), [0, 1]) == {}


def test_a_stale_or_damaged_mapping_and_a_corrupt_block_are_misses(io: LoopThread) -> None:
    store, events = MemoryStore(), Events()
    content = os.urandom(1000)
    digest = content_hash(content)
    one = version(size=1000)
    tier_over(store, io, Events(), write_behind=False).put_many(one, {0: (digest, content)}, READ)
    path = mapping_path("s3://b", "k", "e1", BLOCK)
    mapping = json.loads(object_at(store, path))
    store.put(path, json.dumps({**mapping, "etag": "e0"}).encode())  # a stale mapping
    assert found(tier_over(store, io, events), one, [0]) == {}
    store.put(path, b"{not json")
    assert found(tier_over(store, io, events), one, [0]) == {}
    store.put(path, json.dumps(mapping).encode())
    store.put(f"blocks/{BLOCK}/{digest}", pack(content, digest, BLOCK)[:-1] + b"?")
    assert found(tier_over(store, io, events), one, [0]) == {}
    assert events.corrupt == ["shared"]


def test_runs_of_one_version_written_at_once_are_all_mapped(io: LoopThread) -> None:
    # A stage's workers write runs of one large object side by side.
    store, events = MemoryStore(), Events()
    tier = tier_over(store, io, events, write_behind=False)
    contents = {index: os.urandom(100) for index in range(16)}
    big = version("big", "e", 16 * BLOCK)

    def write(index: int) -> None:
        content = contents[index]
        tier.put(big, index, content_hash(content), content, AHEAD)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(write, range(16)))
    reader = tier_over(store, io, Events())
    assert all(reader.residency(big, index) == "shared" for index in range(16))


def test_nodes_of_two_block_sizes_keep_their_own_copies(io: LoopThread) -> None:
    store, events = MemoryStore(), Events()
    content = os.urandom(300)  # a small file: the same block at any block size
    for block_size in (BLOCK, 2 * BLOCK):
        tier = tier_over(store, io, events, block_size, write_behind=False)
        small = version(size=300, block_size=block_size)
        tier.put_many(small, {0: (content_hash(content), content)}, READ)
        assert found(tier, small, [0]) == {0: (content_hash(content), content)}
    assert events.corrupt == []


def test_reads_ask_the_fetcher_as_their_use_says(io: LoopThread) -> None:
    """A prefetch's requests wait behind a demand read's: a mapping and its
    blocks go with the kind of the read that wanted them."""
    store, events = MemoryStore(), Events()
    content = os.urandom(BLOCK)
    tier_over(store, io, Events(), write_behind=False).put_many(
        version(), {0: (content_hash(content), content)}, READ
    )
    tier = tier_over(store, io, events)
    assert tier.get_many(version(), [0], AHEAD)
    assert [kind for kind, _ in events.fetched] == ["prefetch", "prefetch"]  # the mapping, then the block
    assert events.fetched[1][1] == len(pack(content, content_hash(content), BLOCK))
    assert tier.get_many(version(), [0], READ)
    assert events.fetched[2][0] == "demand"  # the mapping is remembered: only the block


def test_a_failing_store_is_a_miss_then_left_alone_for_a_while(io: LoopThread) -> None:
    memory = MemoryStore()
    content = os.urandom(500)
    tier_over(memory, io, Events(), write_behind=False).put_many(
        version(), {0: (content_hash(content), content)}, READ
    )
    faulty, events = FaultyStore(memory, Faults(failures_left=1, error=AccessDenied)), Events()
    tier = tier_over(faulty, io, events)
    assert found(tier, version(), [0]) == {}
    assert events.failed == ["demand"]
    assert "injected fault" in tier.last_error
    calls = faulty.calls
    assert found(tier, version(), [0]) == {}  # down: not asked at all
    assert faulty.calls == calls


def test_a_write_that_fails_says_why_when_written_at_once(io: LoopThread) -> None:
    faulty = FaultyStore(MemoryStore(), Faults(failures_left=1))
    tier = tier_over(faulty, io, Events(), write_behind=False)
    with pytest.raises(
        StoreError, match=r"could not write k's blocks to the shared tier: PUT .*injected fault"
    ):
        tier.put(version(), 0, content_hash(b"abc"), b"abc", AHEAD)


class Broken(MemoryStore):
    async def get_object(self, key: str) -> bytes:
        raise TypeError("a bug of ours")


def test_a_bug_is_not_a_miss(io: LoopThread) -> None:
    tier = tier_over(Broken(), io, Events())
    with pytest.raises(TypeError, match="a bug of ours"):
        tier.get_many(version(), [0], READ)


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
        tier = tier_over(open_shared("s3://fleet/blocks", endpoint), io, events, write_behind=False)
        small = version(size=100)
        assert found(tier, small, [0]) == {}  # the mapping's GET timed out: a miss
        assert "GET" in tier.last_error
        assert new_connections() >= 1
        assert found(tier, small, [0]) == {}
        assert new_connections() == 0  # the next read did not try
        with pytest.raises(StoreError, match="could not write"):
            tier.put_many(small, {0: (content_hash(b"abc"), b"abc")}, READ)
        with pytest.raises(CachefsdError, match="cannot be written"):
            tier.check()
        tier.close()
        for connection in held:
            connection.close()


def test_shared_credentials_of_its_own_come_from_the_variables_named() -> None:
    environ = {"FLEET_AWS_ACCESS_KEY_ID": "AKIAFLEET", "FLEET_AWS_SECRET_ACCESS_KEY": "s3cr3t"}
    credentials = shared_credentials("FLEET_", environ)
    assert credentials is not None
    assert (credentials.access_key_id, credentials.secret_access_key) == ("AKIAFLEET", "s3cr3t")
    assert "s3cr3t" not in repr(credentials)
    assert shared_credentials(None, environ) is None  # the environment's own chain
    open_shared("s3://fleet/blocks", "http://127.0.0.1:9", "FLEET_", environ)  # opens without a request
    with pytest.raises(CachefsdError, match="FLEET_AWS_SECRET_ACCESS_KEY not set") as missing:
        open_shared("s3://fleet/blocks", None, "FLEET_", {"FLEET_AWS_ACCESS_KEY_ID": "AKIAFLEET"})
    assert "AKIAFLEET" not in str(missing.value)  # never a credential in an error


def test_a_bad_shared_url_or_endpoint_names_its_setting() -> None:
    with pytest.raises(CachefsdError, match=r"cache\.shared\.url: .*invalid bucket name"):
        open_shared("s3://x/blocks", None)
    with pytest.raises(CachefsdError, match=r"cache\.shared\.endpoint_url"):
        open_shared("s3://fleet/blocks", "ftp://nowhere")


def test_a_shared_tier_on_azure_opens_on_its_endpoint() -> None:
    """``--shared-tier az://...``: the account from the endpoint (Azurite's), no request made."""
    store = open_shared("az://fleet/blocks", "http://127.0.0.1:9/devstoreaccount1")
    assert store.cache_key == "az://fleet/blocks@http://127.0.0.1:9/devstoreaccount1"
    with pytest.raises(CachefsdError, match=r"cache\.shared\.url: .*invalid container name"):
        open_shared("az://x/blocks", "http://127.0.0.1:9/devstoreaccount1")
