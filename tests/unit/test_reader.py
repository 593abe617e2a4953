"""Block maths and the read path over an in-memory bucket."""

from __future__ import annotations

import contextlib
import functools
import os
import random
import threading
import time
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cachefsd.cache.blocks import FileSpan
from cachefsd.cache.codec import Codec, content_hash
from cachefsd.cache.tiered import CacheTuning
from cachefsd.errors import DeadlineExceeded
from cachefsd.reader import block_bounds, block_range
from cachefsd.store.base import ObjectInfo
from tests.metrics import sample
from tests.polling import wait_until
from tests.unit.conftest import BLOCK_SIZE, Rig, RigFactory, joined, read_concurrently


@given(
    offset=st.integers(min_value=0, max_value=10_000),
    size=st.integers(min_value=0, max_value=10_000),
    object_size=st.integers(min_value=0, max_value=10_000),
    block_size=st.integers(min_value=1, max_value=4096),
)
def test_block_range_covers_exactly_the_requested_bytes(
    offset: int, size: int, object_size: int, block_size: int
) -> None:
    wanted = set(range(offset, min(offset + size, object_size)))
    covered: set[int] = set()
    for index in block_range(offset, size, object_size, block_size):
        start, end = block_bounds(index, object_size, block_size)
        assert start < end
        block_bytes = set(range(start, end))
        assert block_bytes & wanted, "a block that holds none of the wanted bytes"
        covered |= block_bytes
    assert wanted <= covered


def test_reads_return_exact_bytes_at_any_offset(make_rig: RigFactory) -> None:
    data = os.urandom(5 * BLOCK_SIZE + 123)
    rig = make_rig({"big": data})
    info = rig.namespace.lookup("/big").info
    assert info is not None
    rng = random.Random(1)
    for _ in range(300):
        offset = rng.randrange(0, len(data) + 10)
        size = rng.randrange(0, 3 * BLOCK_SIZE)
        assert joined(rig.reader.read(info, offset, size)) == data[offset : offset + size]


def test_second_read_is_served_from_disk_with_no_get(make_rig: RigFactory) -> None:
    data = os.urandom(3 * BLOCK_SIZE)
    rig = make_rig({"f": data})
    info = rig.namespace.lookup("/f").info
    assert info is not None
    assert joined(rig.reader.read(info, 0, len(data))) == data
    gets = rig.store.get_count
    assert gets == 3
    fresh = make_rig(store=rig.store, cache_dir=rig.cache_dir)
    assert joined(fresh.reader.read(info, 0, len(data))) == data
    assert rig.store.get_count == gets


def test_concurrent_readers_of_one_block_share_one_get(
    make_rig: RigFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = os.urandom(BLOCK_SIZE)
    rig = make_rig({"f": data})
    assert rig.namespace.lookup("/f").info is not None  # listed before the bucket is held
    gate = rig.faulty.faults.gate = threading.Event()  # the first GET stays in flight until all have come
    results = read_concurrently(rig, gate, monkeypatch)
    assert results == [data] * 8
    assert rig.store.get_count == 1


def test_metrics_split_cold_and_cached_bytes(make_rig: RigFactory) -> None:
    data = os.urandom(2 * BLOCK_SIZE)
    rig = make_rig({"f": data})
    info = rig.namespace.lookup("/f").info
    assert info is not None
    joined(rig.reader.read(info, 0, len(data)))
    joined(rig.reader.read(info, 0, len(data)))
    registry = rig.metrics.registry
    assert sample(registry, "cachefsd_read_bytes_total", source="cold") == len(data)
    assert sample(registry, "cachefsd_read_bytes_total", source="cache") == len(data)
    assert rig.metrics.registry.get_sample_value("cachefsd_hit_ratio") == 0.5


def test_a_raw_block_is_served_from_the_file_written_and_checked_once_it_changes(
    make_rig: RigFactory,
) -> None:
    data = os.urandom(2 * BLOCK_SIZE)
    rig = make_rig({"f": data})
    info = rig.namespace.lookup("/f").info
    assert info is not None
    checked = functools.partial(sample, rig.metrics.registry, "cachefsd_tier_read_bytes_total", tier="hot")
    first = rig.reader.read(info, 0, len(data))
    assert all(isinstance(piece, bytes) for piece in first)  # fetched: the bytes the GET brought
    assert joined(first) == data
    # Every later read, however many opens it comes through, is served from
    # the block's file; a file this process wrote from verified bytes is not
    # read back to be hashed (a dataset's first epoch from the cache disk
    # read and hashed every block once more).
    for offset in (100, 0, 4096, 100):
        pieces = rig.reader.read(info, offset, BLOCK_SIZE)
        assert all(isinstance(piece, FileSpan) for piece in pieces)
        assert joined(pieces) == data[offset : offset + BLOCK_SIZE]
    assert checked() == 0
    # A block file written to since is checked again: rot is caught, not served.
    digest = rig.view.digest(info, 0)
    assert digest is not None
    block_file = rig.cache.tiers[0].path_of(digest)
    rotten = bytearray(block_file.read_bytes())
    rotten[-1] ^= 0xFF
    block_file.write_bytes(bytes(rotten))  # in place: the same inode, a new ctime
    assert joined(rig.reader.read(info, 0, 10)) == data[:10]
    assert rig.store.get_count == 3  # the rotten block was fetched again
    assert sample(rig.metrics.registry, "cachefsd_cache_corrupt_blocks_total", tier="hot") == 1


def test_only_the_most_recently_served_checks_are_remembered(make_rig: RigFactory) -> None:
    data = os.urandom(2 * BLOCK_SIZE)
    rig = make_rig({"f": data}, cache_tuning=CacheTuning(checked_files_remembered=1))
    info = rig.namespace.lookup("/f").info
    assert info is not None
    joined(rig.reader.read(info, 0, len(data)))  # fetched
    checked = functools.partial(sample, rig.metrics.registry, "cachefsd_tier_read_bytes_total", tier="hot")
    for offset in (0, 0, BLOCK_SIZE, 0):  # block 0 checked, remembered, forgotten for block 1, checked
        assert joined(rig.reader.read(info, offset, 10)) == data[offset : offset + 10]
    assert checked() == 3 * BLOCK_SIZE


def test_a_read_that_joins_a_run_gets_its_block_before_the_run_ends(make_rig: RigFactory) -> None:
    """A run's blocks are a GET each, several at once, handed over in
    order as they come: its first block is served while the rest are held
    back on the way."""
    data = os.urandom(4 * BLOCK_SIZE)
    rig = make_rig({"f": data})
    info = rig.namespace.lookup("/f").info
    assert info is not None
    rest = rig.faulty.faults.gate = threading.Event()
    rig.faulty.faults.gate_from = BLOCK_SIZE  # a link that sends the first block only
    fetched: list[set[int]] = []
    calls = rig.faulty.calls
    run = threading.Thread(target=lambda: fetched.append(rig.reader.fetch_run_ahead(info, range(4))))
    run.start()
    try:
        wait_until(lambda: rig.faulty.calls - calls == 4, "the run's four GETs to start", 10.0)
        assert joined(rig.reader.read(info, 0, 10)) == data[:10]
        assert rig.reader.fetching(info, 3)  # its last block still to come
    finally:
        rest.set()
    run.join(10)
    assert fetched == [{0, 1, 2, 3}]
    assert sorted(start for _, start, _ in rig.faulty.gets) == [index * BLOCK_SIZE for index in range(4)]
    assert rig.faulty.most_concurrent_gets == 3  # those after the first, at once
    assert joined(rig.reader.read(info, 0, len(data))) == data


def test_served_bytes_are_counted_by_where_they_came_from(make_rig: RigFactory) -> None:
    data = os.urandom(2 * BLOCK_SIZE)
    rig = make_rig({"f": data})
    # Before any read, every series is there at 0: a dashboard shows 0, not "No data".
    registry = rig.metrics.registry
    for name in (
        "cachefsd_served_bytes_total",
        "cachefsd_cache_evictions_total",
        "cachefsd_cache_errors_total",
    ):
        assert registry.get_sample_value(name, {"tier": "hot"}) == 0, name
    assert registry.get_sample_value("cachefsd_served_bytes_total", {"tier": "cold"}) == 0
    info = rig.namespace.lookup("/f").info
    assert info is not None
    joined(rig.reader.read(info, 0, len(data)))  # cold
    joined(rig.reader.read(info, 0, len(data)))  # hot, zero-copy
    assert sample(registry, "cachefsd_served_bytes_total", tier="cold") == len(data)
    assert sample(registry, "cachefsd_served_bytes_total", tier="hot") == len(data)
    assert rig.metrics.registry.get_sample_value("cachefsd_tier_hit_ratio", {"tier": "hot"}) == 0.5


def test_a_prefetch_that_joins_a_demand_get_did_not_fetch(make_rig: RigFactory) -> None:
    """The prefetcher counts what ``fetch_run_ahead`` fetched as issued: a GET
    a read had started is the read's, or accuracy reads above the truth."""
    data = os.urandom(BLOCK_SIZE)
    rig = make_rig({"f": data})
    info = rig.namespace.lookup("/f").info
    assert info is not None
    gate = rig.faulty.faults.gate = threading.Event()  # the read's GET stays in flight
    calls = rig.faulty.calls
    results: list[bytes] = []
    reader = threading.Thread(target=lambda: results.append(joined(rig.reader.read(info, 0, 10))))
    reader.start()
    try:
        wait_until(lambda: rig.faulty.calls > calls, "the read's GET to start", 10.0)
        assert rig.store.get_count == 0  # the read's GET is in flight (counted when it lands)
        assert rig.reader.fetch_run_ahead(info, range(1)) == set()
    finally:
        gate.set()
    reader.join(10)
    assert results == [data[:10]]
    assert rig.store.get_count == 1
    assert rig.reader.fetch_run_ahead(info, range(1)) == set()  # cached now


def test_a_read_that_joined_a_prefetch_which_gave_up_is_not_retried_at_once(
    make_rig: RigFactory,
) -> None:
    """The kernel retries a failed read at once: after waiting out the
    prefetch's deadline, it must not wait out a second one."""
    rig = make_rig({"f": os.urandom(BLOCK_SIZE)})
    info = rig.namespace.lookup("/f").info
    assert info is not None
    rig.faulty.faults.hang = True
    calls = rig.faulty.calls

    def prefetch_that_gives_up() -> None:
        with contextlib.suppress(DeadlineExceeded):
            rig.reader.fetch_run_ahead(info, range(1))

    prefetch = threading.Thread(target=prefetch_that_gives_up)
    prefetch.start()
    wait_until(lambda: rig.faulty.calls > calls, "the prefetch GET to start", 10.0)
    with pytest.raises(DeadlineExceeded):
        rig.reader.read(info, 0, 10)  # joins the prefetch, which gives up
    prefetch.join(10)
    calls = rig.faulty.calls
    with pytest.raises(DeadlineExceeded, match="not retried yet"):
        rig.reader.read(info, 0, 10)
    assert rig.faulty.calls == calls  # answered without a new GET


def read_quarters_at_once(rig: Rig, info: ObjectInfo) -> bytes:
    """Block 0 of ``info`` read as four quarters by four threads at once,
    as the kernel's read-ahead asks for one block; the bytes, in order."""
    quarter = BLOCK_SIZE // 4
    barrier = threading.Barrier(4)
    results: dict[int, bytes] = {}

    def read(offset: int) -> None:
        barrier.wait()
        results[offset] = joined(rig.reader.read(info, offset, quarter))

    threads = [threading.Thread(target=read, args=(offset,)) for offset in range(0, BLOCK_SIZE, quarter)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert not any(thread.is_alive() for thread in threads)
    assert sorted(results) == list(range(0, BLOCK_SIZE, quarter))  # a reader that raised is missing
    return b"".join(results[offset] for offset in sorted(results))


def test_reads_of_one_block_waiting_on_one_get_are_one_stall(make_rig: RigFactory) -> None:
    """The kernel's read-ahead sends several READs of one block at once:
    counted per request, one reader's 0.3 s wait read as 1.2 s of stall."""
    data = os.urandom(BLOCK_SIZE)
    rig = make_rig({"f": data})
    info = rig.namespace.lookup("/f").info
    assert info is not None
    rig.faulty.faults.latency_seconds = 0.3
    started = time.monotonic()
    assert read_quarters_at_once(rig, info) == data
    elapsed = time.monotonic() - started
    assert rig.store.get_count == 1
    # At most the time the four waited together (counted per READ: four times that).
    assert 0.3 <= sample(rig.metrics.registry, "cachefsd_read_stall_seconds_total") <= elapsed


def test_concurrent_reads_of_a_compressed_block_decode_it_once(
    make_rig: RigFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each of the kernel's concurrent READs of a block read and decoded
    all of it before any could keep it in RAM: four for one. Here the
    first read of the block waits until all four READs are past the point
    where they look for it (as they overlap under load)."""
    data = os.urandom(BLOCK_SIZE)
    rig = make_rig({"f": data}, codec=Codec.LZ4)
    info = rig.namespace.lookup("/f").info
    assert info is not None
    digest = content_hash(data)
    rig.cache.admit(rig.reader.ref(info, 0), digest, data)
    decodes: list[str] = []
    read_block, placement = rig.cache.read, rig.cache.placement
    looked, all_looked = [0], threading.Event()

    def counted_placement(digest: str) -> Any:
        looked[0] += 1  # under the GIL; each READ asks once, just before it decodes
        if looked[0] == 4:
            all_looked.set()
        return placement(digest)

    def slow_read(digest: str) -> bytes | None:
        decodes.append(digest)
        all_looked.wait(10)
        return read_block(digest)

    monkeypatch.setattr(rig.cache, "placement", counted_placement)
    monkeypatch.setattr(rig.cache, "read", slow_read)
    assert read_quarters_at_once(rig, info) == data
    assert decodes == [digest]
    assert rig.store.get_count == 0
