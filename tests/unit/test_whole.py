"""Whole files: an object larger than a block, made one raw file of its
cached blocks for the kernel to read itself (``cache.whole``,
``TieredCache.assemble_whole``, ``CacheView.whole_file``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from cachefsd.cache.blocks import Version
from cachefsd.cache.codec import content_hash
from cachefsd.cache.index import WHOLE, BlockRef, Index, StoredBlock
from cachefsd.cache.policy import MinioPolicy
from cachefsd.cache.tier import disk_bytes
from cachefsd.cache.whole import WholeFiles, ends_file, worth_whole_file
from cachefsd.fs import ROOT_INODE
from cachefsd.store.base import ObjectInfo
from tests.metrics import sample
from tests.polling import wait_until
from tests.unit.conftest import BLOCK_SIZE, Rig, RigFactory, cached, joined
from tests.unit.test_cache import admit, tiered

SHARD = 3 * BLOCK_SIZE - 1000  # three blocks, the last one short


def _never() -> bool:
    return False


def _made_whole(rig: Rig) -> ObjectInfo:
    """The version of ``shard``, its blocks cached and its whole file made."""
    info = cached(rig, "shard")
    assert rig.cache.assemble_whole(rig.reader.version(info), _never)
    return info


def _whole(rig: Rig, info: ObjectInfo) -> str | None:
    return rig.cache.lookup(rig.reader.ref(info, WHOLE))


def _handed_over(rig: Rig, info: ObjectInfo) -> bytes | None:
    """The bytes of the file ``whole_file`` hands over for ``info``, if any."""
    found = rig.view.whole_file(info)
    if found is None:
        return None
    try:
        assert found.size == info.size
        return os.pread(found.fd, info.size + 1, 0)
    finally:
        os.close(found.fd)


def _temp_files(rig: Rig) -> list[Path]:
    return list((rig.cache_dir / "hot" / "tmp").iterdir())


def test_the_trigger_is_a_read_that_reaches_the_end_of_a_file_of_several_blocks() -> None:
    assert ends_file(offset=90, size=10, file_size=100)
    assert ends_file(offset=90, size=4096, file_size=100)  # the kernel asks past the end
    assert not ends_file(offset=80, size=10, file_size=100)
    assert worth_whole_file(file_size=BLOCK_SIZE + 1, block_size=BLOCK_SIZE)
    assert not worth_whole_file(file_size=BLOCK_SIZE, block_size=BLOCK_SIZE)  # its block is its file
    assert not worth_whole_file(file_size=0, block_size=BLOCK_SIZE)


def test_a_whole_file_holds_exactly_the_objects_bytes_and_is_handed_over(make_rig: RigFactory) -> None:
    data = os.urandom(SHARD)
    rig = make_rig({"shard": data})
    info = cached(rig, "shard")
    assert _handed_over(rig, info) is None  # blocks only: never block 0 as the file
    assert rig.cache.assemble_whole(rig.reader.version(info), _never)
    digest = _whole(rig, info)
    assert digest == content_hash(data)  # named by its content, as a block is
    assert rig.cache.tiers[0].path_of(digest).read_bytes() == data
    assert _handed_over(rig, info) == data
    assert sample(rig.metrics.registry, "cachefsd_whole_files_total", tier="hot") == 1
    # It stands for each of the version's blocks to the prefetcher: planned, warmed.
    assert all(rig.view.digest(info, index) == digest for index in range(3))
    assert rig.view.warm(info, 2)
    assert rig.cache.assemble_whole(rig.reader.version(info), _never)  # made once
    assert sample(rig.metrics.registry, "cachefsd_whole_files_total", tier="hot") == 1
    assert not _temp_files(rig)


def test_no_whole_file_of_a_missing_or_corrupt_block_and_nothing_left_behind(
    make_rig: RigFactory,
) -> None:
    rig = make_rig({"partly": os.urandom(SHARD), "corrupt": os.urandom(SHARD)})
    partly = rig.namespace.lookup("/partly").info
    assert partly is not None
    assert rig.reader.fetch_run_ahead(partly, [0, 1]) == {0, 1}
    assert not rig.cache.assemble_whole(rig.reader.version(partly), _never)
    corrupt = cached(rig, "corrupt")
    block = rig.view.digest(corrupt, 1)
    assert block is not None
    path = rig.cache.tiers[0].path_of(block)
    path.write_bytes(bytes(BLOCK_SIZE))  # its length, not its bytes
    hot_files = {path.name for path in (rig.cache_dir / "hot" / "blocks").rglob("*") if path.is_file()}
    assert not rig.cache.assemble_whole(rig.reader.version(corrupt), _never)
    for info in (partly, corrupt):
        assert _whole(rig, info) is None
        assert _handed_over(rig, info) is None
    assert rig.view.digest(corrupt, 1) is None  # the corrupt block was dropped, as a read drops it
    after = {path.name for path in (rig.cache_dir / "hot" / "blocks").rglob("*") if path.is_file()}
    assert after == hot_files - {block}
    assert not _temp_files(rig)
    assert sample(rig.metrics.registry, "cachefsd_whole_files_total", tier="hot") == 0


def test_no_whole_file_once_abandoned(make_rig: RigFactory) -> None:
    rig = make_rig({"shard": os.urandom(SHARD)})
    info = cached(rig, "shard")
    assert not rig.cache.assemble_whole(rig.reader.version(info), lambda: True)
    assert _whole(rig, info) is None
    assert not _temp_files(rig)


def test_a_whole_file_is_admitted_by_the_tiers_policy(make_rig: RigFactory, tmp_path: Path) -> None:
    # Room for the blocks, not for them and a copy: an LRU gives up the
    # blocks for it (their bytes are in it), a policy that keeps every
    # block refuses it.
    data = os.urandom(SHARD)
    capacity = disk_bytes(SHARD) + 3 * 4096
    rig = make_rig({"shard": data}, cache_dir=tmp_path / "lru", capacity=capacity)
    info = _made_whole(rig)
    assert _handed_over(rig, info) == data
    assert rig.cache.used_bytes <= rig.cache.capacity
    assert rig.view.digest(info, 0) == content_hash(data)
    assert rig.cache.lookup(rig.reader.ref(info, 0)) is None  # evicted for it
    keeping = make_rig({"shard": data}, cache_dir=tmp_path / "minio", capacity=capacity, policy=MinioPolicy())
    info = cached(keeping, "shard")
    assert not keeping.cache.assemble_whole(keeping.reader.version(info), _never)
    assert _whole(keeping, info) is None
    assert keeping.cache.lookup(keeping.reader.ref(info, 0)) is not None
    assert not _temp_files(keeping)


def test_an_evicted_whole_file_is_dropped_not_demoted(tmp_path: Path) -> None:
    blocks = [os.urandom(BLOCK_SIZE) for _ in range(3)]
    version = Version("src", "shard", "etag", 3 * BLOCK_SIZE, BLOCK_SIZE, False)
    with tiered(tmp_path, hot=6 * BLOCK_SIZE, warm=16 * BLOCK_SIZE) as (cache, metrics):
        for index, data in enumerate(blocks):
            admit(cache, version.ref(index), data)
        assert cache.assemble_whole(version, _never)
        whole = cache.lookup(version.ref(WHOLE))
        assert whole == content_hash(b"".join(blocks))
        assert cache.tier_of(whole) == "hot"
        demotions = sample(metrics.registry, "cachefsd_cache_demotions_total")
        # New blocks push out the oldest residents: the version's blocks (demoted), then its whole file.
        for index in range(6):
            admit(cache, BlockRef("src", "next", "etag", index), os.urandom(BLOCK_SIZE))
        assert cache.lookup(version.ref(WHOLE)) is None
        assert cache.tier_of(whole) is None
        assert not cache.tiers[1].holds(whole)
        assert not cache.tiers[1].path_of(whole).exists()
        assert sample(metrics.registry, "cachefsd_cache_demotions_total") == demotions + 3  # the blocks only
        assert all(cache.tier_of(content_hash(data)) == "warm" for data in blocks)


def test_the_block_size_check_ignores_whole_files(tmp_path: Path) -> None:
    index = Index(tmp_path / "index.sqlite")
    try:
        blocks = [os.urandom(BLOCK_SIZE), os.urandom(100)]
        for number, data in enumerate(blocks):
            stored = StoredBlock(content_hash(data), "hot", disk_bytes(len(data)), len(data), 0.0)
            index.record(BlockRef("src", "k", "e", number), stored)
        whole = b"".join(blocks)
        size = len(whole)
        index.record(
            BlockRef("src", "k", "e", WHOLE),
            StoredBlock(content_hash(whole), "hot", disk_bytes(size), size, 0.0),
        )
        assert index.filled_at(BLOCK_SIZE) is None  # no block size recorded: judged by the blocks
        assert index.filled_at(2 * BLOCK_SIZE) == 0  # the first block of two is short at that size
    finally:
        index.close()


def test_a_reopened_cache_still_hands_the_whole_file_over(make_rig: RigFactory, tmp_path: Path) -> None:
    data = os.urandom(SHARD)
    first = make_rig({"shard": data}, cache_dir=tmp_path / "cache")
    info = _made_whole(first)
    first.index.close()
    again = make_rig({"shard": data}, cache_dir=tmp_path / "cache")  # reconciled: kept, as it was
    assert _handed_over(again, info) == data
    assert again.cache.tier_of(content_hash(data)) == "hot"


def test_releasing_a_version_releases_its_whole_file(make_rig: RigFactory) -> None:
    data = os.urandom(SHARD)
    rig = make_rig({"shard": data})
    info = _made_whole(rig)
    path = rig.cache.tiers[0].path_of(content_hash(data))
    rig.cache.forget(rig.reader.version(info))
    assert _whole(rig, info) is None
    assert not path.exists()
    assert rig.cache.used_bytes == 0


def _read_to_the_end(rig: Rig, inode: int) -> bytes:
    read = b""
    while len(read) < SHARD:
        read += joined(rig.fs.read(inode, 4096 * 32, len(read), pid=os.getpid()))
    return read


def test_a_read_to_the_end_has_the_whole_file_made_for_the_next_open(make_rig: RigFactory) -> None:
    data = os.urandom(SHARD)
    rig = make_rig({"shard": data})
    rig.fs.passthrough = True  # as the FUSE edge sets it
    inode = rig.fs.lookup(ROOT_INODE, "shard").inode
    info = rig.namespace.lookup("/shard").info
    assert info is not None
    assert rig.fs.open_through(inode, pid=os.getpid()) is None  # nothing cached yet
    assert _read_to_the_end(rig, inode) == data
    version = Version(rig.reader.version(info).source, "shard", info.etag, SHARD, BLOCK_SIZE, False)
    assert not rig.whole_files.want(version)  # queued by the read
    rig.whole_files.start()
    wait_until(
        lambda: sample(rig.metrics.registry, "cachefsd_whole_files_total", tier="hot") == 1,
        "the whole file is made",
        timeout=10,
    )
    found = rig.fs.open_through(inode, pid=os.getpid())
    assert found is not None
    try:
        assert os.pread(found.fd, SHARD + 1, 0) == data
    finally:
        os.close(found.fd)


def test_no_whole_file_is_made_without_passthrough(make_rig: RigFactory) -> None:
    """Only a passthrough open reads one: made anyway, it would only take room."""
    data = os.urandom(SHARD)
    rig = make_rig({"shard": data})
    inode = rig.fs.lookup(ROOT_INODE, "shard").inode
    info = rig.namespace.lookup("/shard").info
    assert info is not None
    assert _read_to_the_end(rig, inode) == data
    version = Version(rig.reader.version(info).source, "shard", info.etag, SHARD, BLOCK_SIZE, False)
    assert rig.whole_files.want(version)  # the read did not queue it


def test_whole_files_are_made_one_version_at_a_time_each_once_and_stop_promptly() -> None:
    started: list[Version] = []
    abandoned_seen: list[bool] = []

    def assemble(version: Version, abandoned: Callable[[], bool]) -> bool:
        """Makes nothing until told to give up, as a stop tells it."""
        started.append(version)
        wait_until(abandoned, "the version being made is abandoned", timeout=10)
        abandoned_seen.append(abandoned())
        return False

    versions = [Version("src", f"k{i}", "e", 2 * BLOCK_SIZE, BLOCK_SIZE, False) for i in range(4)]
    whole_files = WholeFiles(assemble, queued_versions=2)
    whole_files.start()
    try:
        assert whole_files.want(versions[0])
        wait_until(lambda: started == versions[:1], "the first version is being made", timeout=10)
        assert not whole_files.want(versions[0])  # being made: not again
        assert whole_files.want(versions[1])
        assert not whole_files.want(versions[1])  # queued already
        assert whole_files.want(versions[2])
        assert not whole_files.want(versions[3])  # the queue is full: dropped
    finally:
        whole_files.stop()
    assert started == versions[:1]  # the queued ones were dropped
    assert abandoned_seen == [True]
    assert not whole_files.want(versions[3])


def test_a_corrupt_whole_file_is_not_handed_over_and_is_dropped(make_rig: RigFactory) -> None:
    data = os.urandom(SHARD)
    rig = make_rig({"shard": data})
    info = _made_whole(rig)
    path = rig.cache.tiers[0].path_of(content_hash(data))
    path.write_bytes(bytes(SHARD))  # its length, not its bytes: a new ctime, so checked again
    assert _handed_over(rig, info) is None
    assert _whole(rig, info) is None
    assert not path.exists()
    assert rig.view.digest(info, 0) == rig.cache.lookup(rig.reader.ref(info, 0))  # the blocks again
    assert sample(rig.metrics.registry, "cachefsd_cache_corrupt_blocks_total", tier="hot") == 1
