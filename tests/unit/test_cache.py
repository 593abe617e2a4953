"""The block directory: capacity, deduplication, corruption, crash reconciliation."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from cachefsd.chunks.cache import BlockCache, disk_bytes
from cachefsd.chunks.codec import content_hash, encode
from cachefsd.index import BlockRef, Index
from cachefsd.metrics import Metrics


def make_cache(root: Path, capacity: int) -> tuple[BlockCache, Index, Metrics]:
    index = Index(root / "index.sqlite")
    metrics = Metrics(CollectorRegistry())
    cache = BlockCache(root, capacity, index, metrics)
    cache.reconcile()
    return cache, index, metrics


def bytes_on_disk(root: Path) -> int:
    return sum(disk_bytes(path.stat().st_size) for path in (root / "blocks").rglob("*") if path.is_file())


def admit(cache: BlockCache, ref: BlockRef, data: bytes) -> None:
    cache.admit(ref, content_hash(data), data)


def test_admitted_block_reads_back(tmp_path: Path) -> None:
    cache, index, _ = make_cache(tmp_path, 1 << 20)
    ref = BlockRef("src", "k", "e", 0)
    admit(cache, ref, b"x" * 5000)
    assert cache.read(ref) == b"x" * 5000
    assert cache.used_bytes == disk_bytes(40 + 5000) == bytes_on_disk(tmp_path)
    files = list((tmp_path / "blocks").rglob("*"))
    assert all(path.stat().st_mode & 0o077 == 0 for path in files)
    index.close()


def test_identical_content_is_stored_once(tmp_path: Path) -> None:
    cache, index, _ = make_cache(tmp_path, 1 << 20)
    data = os.urandom(10_000)
    refs = [BlockRef("s3://a", "x", "1", 0), BlockRef("s3://b", "other/y", "2", 3)]
    for ref in refs:
        admit(cache, ref, data)
    assert bytes_on_disk(tmp_path) == disk_bytes(40 + 10_000)
    assert all(cache.read(ref) == data for ref in refs)
    index.close()


def test_corrupt_block_is_dropped_not_served(tmp_path: Path) -> None:
    cache, index, metrics = make_cache(tmp_path, 1 << 20)
    ref = BlockRef("src", "k", "e", 0)
    data = os.urandom(5000)
    admit(cache, ref, data)
    path = cache.path_of(content_hash(data))
    damaged = bytearray(path.read_bytes())
    damaged[-1] ^= 0xFF
    path.write_bytes(bytes(damaged))
    assert cache.read(ref) is None
    assert not path.exists()
    assert index.lookup(ref) is None
    assert metrics.corrupt_blocks._value.get() == 1
    assert cache.used_bytes == 0
    index.close()


def test_reconcile_after_a_crash(tmp_path: Path) -> None:
    cache, index, _ = make_cache(tmp_path, 1 << 20)
    kept = os.urandom(3000)
    admit(cache, BlockRef("src", "kept", "e", 0), kept)
    lost = os.urandom(3000)
    admit(cache, BlockRef("src", "lost", "e", 0), lost)
    index.close()
    # What a kill -9 can leave: a half-written temp file, a renamed file
    # whose row was never committed, and a row whose file is gone.
    (tmp_path / "tmp" / "deadbeef.1234").write_bytes(b"partial")
    orphan = os.urandom(3000)
    orphan_path = tmp_path / "blocks" / content_hash(orphan)[:2] / content_hash(orphan)
    orphan_path.parent.mkdir(exist_ok=True)
    orphan_path.write_bytes(encode(orphan))
    (tmp_path / "blocks" / content_hash(lost)[:2] / content_hash(lost)).unlink()

    cache, index, _ = make_cache(tmp_path, 1 << 20)
    assert list((tmp_path / "tmp").iterdir()) == []
    assert not orphan_path.exists()
    assert cache.read(BlockRef("src", "kept", "e", 0)) == kept
    assert cache.read(BlockRef("src", "lost", "e", 0)) is None
    assert cache.used_bytes == bytes_on_disk(tmp_path)
    index.close()


def test_a_smaller_capacity_on_restart_trims(tmp_path: Path) -> None:
    cache, index, _ = make_cache(tmp_path, 1 << 20)
    for i in range(10):
        admit(cache, BlockRef("src", f"k{i}", "e", 0), os.urandom(8000))
    index.close()
    cache, index, _ = make_cache(tmp_path, 3 * disk_bytes(8040))
    assert cache.used_bytes <= cache.capacity
    assert bytes_on_disk(tmp_path) <= cache.capacity
    # the most recently admitted blocks are the ones kept
    assert cache.read(BlockRef("src", "k9", "e", 0)) is not None
    index.close()


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
@given(operations, st.integers(min_value=4096, max_value=12 * 4096))
def test_capacity_is_never_exceeded_and_refcounts_stay_sane(
    ops: list[tuple[str, int, int, int]], capacity: int
) -> None:
    contents = [bytes([n]) * (1000 + 3000 * n) for n in range(4)]
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        cache, index, _ = make_cache(root, capacity)
        for op, key, content, version in ops:
            ref = BlockRef("src", f"k{key}", f"v{version}", 0)
            if op == "admit":
                admit(cache, ref, contents[content])
            elif op == "read":
                data = cache.read(ref)
                assert data is None or data in contents
            else:
                cache.release_version("src", f"k{key}", f"v{version}", block_count=1)
            assert cache.used_bytes <= capacity
            assert bytes_on_disk(root) <= capacity
            assert cache.used_bytes == bytes_on_disk(root)
        assert all(block.hash in {content_hash(c) for c in contents} for block in index.blocks())
        index.close()
