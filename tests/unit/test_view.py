"""The cache as the prefetcher, staging and the filesystem see one source's blocks (``cache.view``)."""

from __future__ import annotations

import dataclasses
import fcntl
import os
from pathlib import Path

from cachefsd.cache.codec import Codec
from cachefsd.cache.policy import PlannedUse
from tests.metrics import sample
from tests.unit.conftest import BLOCK_SIZE, Rig, RigFactory, cached, joined


def test_the_view_finds_a_versions_blocks_and_plans_and_warms_only_cached_ones(make_rig: RigFactory) -> None:
    planned = PlannedUse()
    rig = make_rig({"f": os.urandom(2 * BLOCK_SIZE)}, planned=planned)
    info = rig.namespace.lookup("/f").info
    assert info is not None
    assert rig.view.digest(info, 0) is None
    assert rig.view.residency(info, 0) is None
    assert rig.view.plan(info, 0, 5.0) is None  # nothing cached: nothing planned
    assert not rig.view.warm(info, 0)
    assert rig.view.usage() == (rig.cache.capacity, 0)
    assert rig.reader.fetch_run_ahead(info, range(2)) == {0, 1}
    digest = rig.view.digest(info, 0)
    assert digest is not None
    assert digest == rig.cache.lookup(rig.reader.ref(info, 0))  # named as the read path names it
    assert rig.view.residency(info, 0) == "hot"
    assert rig.view.digest(dataclasses.replace(info, etag="another version"), 0) is None
    assert rig.view.plan(info, 0, 5.0) == digest
    assert planned.next_use(digest) == 5.0
    rig.view.unplan(digest)
    assert planned.next_use(digest) is None
    assert rig.view.warm(info, 1, hold=True)
    assert rig.view.usage() == (rig.cache.capacity, rig.cache.used_bytes)
    assert rig.view.room() == rig.cache.room()


def _hashed(rig: Rig) -> float:
    """Bytes the hot tier read back to verify (``tier_read``)."""
    return rig.metrics.registry.get_sample_value("cachefsd_tier_read_bytes_total", {"tier": "hot"}) or 0.0


def test_a_hot_tiers_files_are_the_blocks_bare_content(make_rig: RigFactory) -> None:
    """No header: the kernel, handed a hot file as an object's (FUSE
    passthrough), takes end of file from it."""
    data = os.urandom(2 * BLOCK_SIZE + 1000)
    rig = make_rig({"f": data})
    info = cached(rig, "f")
    for index in range(3):
        digest = rig.view.digest(info, index)
        assert digest is not None
        assert (
            rig.cache.tiers[0].path_of(digest).read_bytes()
            == data[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE]
        )


def test_an_object_of_one_hot_block_is_handed_over_as_its_file(make_rig: RigFactory) -> None:
    objects = {"one": os.urandom(BLOCK_SIZE), "small": os.urandom(1000)}
    planned = PlannedUse()
    rig = make_rig(
        {**objects, "two": os.urandom(BLOCK_SIZE + 1), "uncached": b"u", "empty": b""}, planned=planned
    )
    for key, data in objects.items():
        info = cached(rig, key)
        digest = rig.view.plan(info, 0, 5.0)
        assert digest is not None
        whole = rig.view.whole_file(info)
        assert whole is not None
        try:
            assert (whole.tier, whole.size) == ("hot", len(data))
            assert os.fstat(whole.fd).st_size == len(data)
            assert os.pread(whole.fd, len(data) + 1, 0) == data  # exactly the object's bytes, from 0
            assert fcntl.fcntl(whole.fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
        finally:
            os.close(whole.fd)
        assert planned.next_use(digest) is None  # a read of the block, as its policy counts it
        assert rig.view.whole_file(dataclasses.replace(info, etag="another version")) is None
    two = cached(rig, "two")
    assert rig.view.residency(two, 0) == rig.view.residency(two, 1) == "hot"
    assert rig.view.whole_file(two) is None  # two blocks: no one file holds it
    for key in ("uncached", "empty"):
        info = rig.namespace.lookup(f"/{key}").info
        assert info is not None
        assert rig.view.whole_file(info) is None


def test_a_compressed_tiers_block_is_not_handed_over(make_rig: RigFactory) -> None:
    rig = make_rig({"f": b"compressible " * 1000}, codec=Codec.LZ4)
    info = cached(rig, "f")
    assert rig.view.residency(info, 0) == "hot"
    assert rig.view.whole_file(info) is None


def test_a_corrupt_hot_file_is_not_handed_over_and_is_dropped(make_rig: RigFactory, tmp_path: Path) -> None:
    data = os.urandom(5000)
    rig = make_rig({"f": data}, cache_dir=tmp_path / "cache")
    digest = rig.view.digest(cached(rig, "f"), 0)
    assert digest is not None
    path = rig.cache.tiers[0].path_of(digest)
    with open(path, "r+b") as block_file:  # in place: same size, the file as start-up finds it
        block_file.seek(2500)
        block_file.write(bytes([data[2500] ^ 0xFF]))
    restarted = make_rig(cache_dir=tmp_path / "cache", store=rig.store)  # nothing checked yet
    info = restarted.namespace.lookup("/f").info
    assert info is not None
    assert restarted.view.digest(info, 0) == digest
    assert restarted.view.whole_file(info) is None
    assert restarted.view.digest(info, 0) is None
    assert not path.exists()
    assert sample(restarted.metrics.registry, "cachefsd_cache_corrupt_blocks_total", tier="hot") == 1
    assert restarted.cache.used_bytes == 0


def test_a_file_is_hashed_once_per_daemon_and_again_when_it_changes(
    make_rig: RigFactory, tmp_path: Path
) -> None:
    """As for reads of its parts (``raw_hit``, one code path): a file this
    daemon wrote, or hashed as the file it now is (device, inode, ctime),
    is handed over without being read again."""
    data = os.urandom(5000)
    rig = make_rig({"f": data}, cache_dir=tmp_path / "cache")
    info = cached(rig, "f")

    def handed_over(rig: Rig) -> bytes:
        whole = rig.view.whole_file(info)
        assert whole is not None
        try:
            return os.pread(whole.fd, whole.size + 1, 0)
        finally:
            os.close(whole.fd)

    assert handed_over(rig) == data
    assert _hashed(rig) == 0  # written from verified bytes by this daemon
    restarted = make_rig(cache_dir=tmp_path / "cache", store=rig.store)
    assert handed_over(restarted) == data
    assert _hashed(restarted) == len(data)
    assert handed_over(restarted) == data
    assert joined(restarted.reader.read(info, 0, len(data))) == data  # a read of it: checked already
    assert _hashed(restarted) == len(data)
    digest = restarted.view.digest(info, 0)
    assert digest is not None
    path = restarted.cache.tiers[0].path_of(digest)
    copy = path.with_name("copy")
    copy.write_bytes(path.read_bytes())
    copy.replace(path)  # the same bytes in another file: hashed again
    assert handed_over(restarted) == data
    assert _hashed(restarted) == 2 * len(data)


def test_a_hot_file_longer_than_its_block_is_not_handed_over(make_rig: RigFactory) -> None:
    """Its block's bytes first, it passes a hash of the block's length; the
    kernel would serve the rest too, taking end of file from the file."""
    data = os.urandom(BLOCK_SIZE)  # whole allocation units: a longer file's first read has its length
    rig = make_rig({"f": data})
    info = cached(rig, "f")
    digest = rig.view.digest(info, 0)
    assert digest is not None
    path = rig.cache.tiers[0].path_of(digest)
    longer = path.with_name("longer")
    longer.write_bytes(data + b"trailing bytes")
    longer.replace(path)  # another file: checked again
    assert rig.view.whole_file(info) is None
    assert not path.exists()
    assert sample(rig.metrics.registry, "cachefsd_cache_corrupt_blocks_total", tier="hot") == 1


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_pages_are_warmed_only_where_the_kernel_reads_cache_files_through_the_page_cache(
    make_rig: RigFactory,
) -> None:
    """Without passthrough the native plane reads a verified hot file past
    the page cache: warming it would read it from disk twice, so it is
    not warmed (nor its descriptor held for the open to come)."""
    rig = make_rig({"f": os.urandom(BLOCK_SIZE // 2)})
    info = rig.namespace.lookup("/f").info
    assert info is not None
    assert rig.reader.fetch_run_ahead(info, range(1)) == {0}
    assert rig.cache.verified_file(rig.view.digest(info, 0) or "") is not None  # written here: verified
    rig.fs.passthrough = False
    before = _open_descriptors()
    assert rig.view.warm(info, 0, hold=True)  # cached, all the same
    rig.view.warm_file(info)
    assert _open_descriptors() == before
    rig.fs.passthrough = True
    rig.view.warm_file(info)
    assert _open_descriptors() == before + 1  # warmed, its descriptor held for the open
