"""Filesystem semantics without a mount: read-only, pinned versions, handles."""

from __future__ import annotations

import logging
import os
import stat

import pytest

from cachefsd.errors import BadFileHandle, IsADirectory, ObjectChanged, ObjectNotFound, ReadOnly
from cachefsd.fs import StaleSize
from cachefsd.store.base import ObjectInfo
from tests.unit.conftest import BLOCK_SIZE, Engine, EngineFactory, joined


@pytest.mark.parametrize(
    "flags", [os.O_WRONLY, os.O_RDWR, os.O_RDONLY | os.O_CREAT, os.O_RDONLY | os.O_TRUNC]
)
def test_opening_for_write_is_refused(make_engine: EngineFactory, flags: int) -> None:
    engine = make_engine({"f": b"x"})
    with pytest.raises(ReadOnly):
        engine.fs.open("/f", flags)


def test_opening_read_only_for_append_reads(make_engine: EngineFactory) -> None:
    """O_APPEND writes nothing through a read-only descriptor; the kernel's
    own read-only filesystems open it."""
    engine = make_engine({"f": b"x"})
    handle = engine.fs.open("/f", os.O_RDONLY | os.O_APPEND).handle
    assert joined(engine.fs.read(handle, 1, 0)) == b"x"


def test_attributes(make_engine: EngineFactory) -> None:
    engine = make_engine({"d/f": b"12345"})
    directory = engine.fs.getattr("/d")
    assert stat.S_ISDIR(directory.mode)
    file = engine.fs.getattr("/d/f")
    assert stat.S_ISREG(file.mode)
    assert file.size == 5
    assert file.mode & 0o222 == 0
    assert ("f", file.mode, file.ino) in engine.fs.readdir("/d")  # the inode number of stat, in readdir too
    with pytest.raises(IsADirectory):
        engine.fs.open("/d", os.O_RDONLY)
    with pytest.raises(ObjectNotFound):
        engine.fs.getattr("/d/nope")


def test_a_handle_stays_on_the_version_it_opened(make_engine: EngineFactory) -> None:
    old = os.urandom(3 * BLOCK_SIZE)
    engine = make_engine({"f": old})
    handle = engine.fs.open("/f", os.O_RDONLY).handle
    assert joined(engine.fs.read(handle, BLOCK_SIZE, 0)) == old[:BLOCK_SIZE]
    new = os.urandom(3 * BLOCK_SIZE)
    engine.store.put("f", new)
    # The cached block is still the opened version's; an uncached one cannot
    # be fetched for that version any more, so the read fails, never mixes.
    assert joined(engine.fs.read(handle, BLOCK_SIZE, 0)) == old[:BLOCK_SIZE]
    with pytest.raises(ObjectChanged):
        joined(engine.fs.read(handle, BLOCK_SIZE, BLOCK_SIZE))
    engine.fs.release(handle)
    # The failure dropped the stale listing: a new open sees the new version.
    fresh = engine.fs.open("/f", os.O_RDONLY).handle
    assert joined(engine.fs.read(fresh, 3 * BLOCK_SIZE, 0)) == new


def released_as_fuse_does(engine: Engine, handle: int) -> StaleSize | None:
    """``release``, then what the FUSE layer does with its answer: the
    kernel's attributes dropped, then ``attributes_dropped`` (which releases
    a gone version's blocks)."""
    stale = engine.fs.release(handle)
    if stale is not None:
        engine.fs.attributes_dropped(stale)
    return stale


def test_a_version_replaced_upstream_keeps_its_cached_blocks_while_a_handle_reads_it(
    make_engine: EngineFactory,
) -> None:
    """A refreshed listing that shows an overwrite released the old
    version's blocks at once: a handle still pinned to it (a loader's open
    shard, an mmap) then got EIO for bytes that had been on local disk."""
    old = os.urandom(2 * BLOCK_SIZE)
    engine = make_engine({"f": old}, ttl=5)
    handle = engine.fs.open("/f", os.O_RDONLY).handle
    assert joined(engine.fs.read(handle, len(old), 0)) == old
    gets = engine.store.get_count
    engine.store.put("f", os.urandom(2 * BLOCK_SIZE))
    engine.clock.now += 10
    engine.fs.getattr("/f")  # the refresh that finds the overwrite
    assert joined(engine.fs.read(handle, len(old), 0)) == old
    assert engine.store.get_count == gets  # from the cache, not a failed GET of a gone version
    assert len(engine.index.blocks()) == 2
    stale = engine.fs.release(handle)
    assert stale is not None
    assert len(engine.index.blocks()) == 2  # not before the kernel's attributes are dropped
    engine.fs.attributes_dropped(stale)  # as the FUSE layer does, once it has
    assert engine.index.blocks() == []  # released with its last handle


def test_a_version_gone_and_listed_again_keeps_its_blocks_when_its_old_handle_closes(
    make_engine: EngineFactory,
) -> None:
    """Deleted while open, then uploaded again with the same content (the
    same etag): the old handle's close must not release the current version."""
    data = os.urandom(2 * BLOCK_SIZE)
    engine = make_engine({"f": data, "g": b"g"}, ttl=5)
    handle = engine.fs.open("/f", os.O_RDONLY).handle
    assert joined(engine.fs.read(handle, len(data), 0)) == data
    engine.store.delete("f")
    engine.clock.now += 10
    engine.fs.readdir("/")  # the refresh that finds it gone
    engine.store.put("f", data)
    engine.clock.now += 10
    again = engine.fs.open("/f", os.O_RDONLY).handle
    assert joined(engine.fs.read(again, len(data), 0)) == data
    engine.fs.release(again)
    released_as_fuse_does(engine, handle)
    assert len(engine.index.blocks()) == 2


def test_a_handle_on_a_gone_version_fails_its_next_reads_without_asking_the_store(
    make_engine: EngineFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """Each read was a GET answered 412, a warning and a listing dropped
    and saved again: 156 a second from one reader."""
    data = os.urandom(3 * BLOCK_SIZE)
    engine = make_engine({"d/f": data})
    handle = engine.fs.open("/d/f", os.O_RDONLY).handle
    engine.store.put("d/f", b"replaced")
    gets = engine.store.get_count
    with caplog.at_level(logging.WARNING):
        for offset in (BLOCK_SIZE, 2 * BLOCK_SIZE, BLOCK_SIZE):
            with pytest.raises(ObjectChanged):
                engine.fs.read(handle, BLOCK_SIZE, offset)
    assert engine.store.get_count == gets + 1
    assert len([record for record in caplog.records if "failed" in record.message]) == 1
    engine.fs.release(handle)
    engine.store.put("d/f", data)  # the same content again: the same version, back
    engine.clock.now += 3600
    again = engine.fs.open("/d/f", os.O_RDONLY).handle
    assert joined(engine.fs.read(again, 3 * BLOCK_SIZE, 0)) == data


def test_reading_a_deleted_object_fails_as_changed_and_drops_the_listing(make_engine: EngineFactory) -> None:
    data = os.urandom(2 * BLOCK_SIZE)
    engine = make_engine({"f": data, "g": b"g"})
    handle = engine.fs.open("/f", os.O_RDONLY).handle
    assert joined(engine.fs.read(handle, BLOCK_SIZE, 0)) == data[:BLOCK_SIZE]
    engine.store.delete("f")
    with pytest.raises(ObjectChanged):  # EIO, as for an overwrite; not ENOENT from read()
        engine.fs.read(handle, BLOCK_SIZE, BLOCK_SIZE)
    assert joined(engine.fs.read(handle, BLOCK_SIZE, 0)) == data[:BLOCK_SIZE]  # what is cached still reads
    engine.fs.release(handle)
    with pytest.raises(ObjectNotFound):  # the next open is told at once, within the metadata TTL
        engine.fs.open("/f", os.O_RDONLY)
    assert engine.fs.getattr("/g").size == 1


def test_reading_a_released_handle_fails(make_engine: EngineFactory) -> None:
    engine = make_engine({"f": b"x"})
    handle = engine.fs.open("/f", os.O_RDONLY).handle
    engine.fs.release(handle)
    with pytest.raises(BadFileHandle):
        joined(engine.fs.read(handle, 1, 0))


def test_the_page_cache_is_kept_only_for_the_version_it_holds(make_engine: EngineFactory) -> None:
    engine = make_engine({"f": b"version one"}, ttl=5)
    first = engine.fs.open("/f", os.O_RDONLY)
    assert not first.keep_cache  # nothing known about the kernel's pages yet
    engine.fs.release(first.handle)
    again = engine.fs.open("/f", os.O_RDONLY)
    assert again.keep_cache
    assert not again.direct_io
    engine.fs.release(again.handle)

    engine.store.put("f", b"version two")  # same size, and possibly the same mtime
    engine.clock.now += 6
    changed = engine.fs.open("/f", os.O_RDONLY)
    assert not changed.keep_cache  # the kernel must drop version one's pages
    engine.fs.release(changed.handle)


def test_a_new_version_opened_beside_an_old_one_bypasses_the_page_cache(make_engine: EngineFactory) -> None:
    engine = make_engine({"f": b"version one"}, ttl=5)
    old = engine.fs.open("/f", os.O_RDONLY)
    engine.store.put("f", b"version two")
    engine.clock.now += 6
    new = engine.fs.open("/f", os.O_RDONLY)
    assert new.direct_io
    assert not new.keep_cache
    # The old handle may have reads in flight: dropping the kernel's
    # attributes (and pages) now would wait for them; its release does it.
    assert new.invalidate_attributes is None
    assert joined(engine.fs.read(new.handle, 100, 0)) == b"version two"
    assert released_as_fuse_does(engine, old.handle) is not None
    assert engine.fs.release(new.handle) is None
    engine.fs.getattr("/f")  # the kernel's lookup: its own TTL is past too
    # The old version's pages may still be in the kernel: not kept.
    after = engine.fs.open("/f", os.O_RDONLY)
    assert not after.keep_cache
    assert not after.direct_io


def test_opening_a_cached_sample_starts_loading_its_block(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file of one block is read whole right after its open: its block
    file is warmed then, so that the cache disk's read overlaps the round
    trip. A larger file's first read may be anywhere (a footer): not warmed."""
    engine = make_engine({"sample": os.urandom(BLOCK_SIZE), "shard": os.urandom(2 * BLOCK_SIZE)})
    for key, blocks in (("sample", 1), ("shard", 2)):
        info = engine.namespace.lookup("/" + key).info
        assert info is not None
        for index in range(blocks):
            assert engine.reader.fetch_run_ahead(info, range(index, index + 1)) == {index}
    warm = engine.reader.warm
    warmed: list[tuple[str, int, bool, bool]] = []

    def recorded_warm(info: ObjectInfo, index: int, hold: bool = False) -> bool:
        warmed.append((info.key, index, hold, warm(info, index, hold)))
        return warmed[-1][3]

    monkeypatch.setattr(engine.reader, "warm", recorded_warm)
    for key in ("sample", "shard"):
        engine.fs.release(engine.fs.open("/" + key, os.O_RDONLY).handle)
    assert warmed == [("sample", 0, True, True)]


def test_a_version_whose_size_the_kernel_lacks_is_opened_around_the_page_cache(
    make_engine: EngineFactory,
) -> None:
    """The kernel keeps the size getattr gave it for its own TTL; our listing
    may expire sooner. An open of the newer version then tells the kernel to
    drop that size and reads around the page cache, which clamps to it."""
    engine = make_engine({"f": b"short"}, ttl=5)
    assert engine.fs.getattr("/f").size == 5
    engine.store.put("f", b"a longer version")
    engine.clock.now += 6
    stale = engine.fs.open("/f", os.O_RDONLY)
    assert stale.invalidate_attributes is not None
    assert (stale.direct_io, stale.keep_cache) == (True, False)
    # Until the FUSE layer says the kernel dropped them, opens stay around
    # the page cache (one in between read at the old size).
    meanwhile = engine.fs.open("/f", os.O_RDONLY)
    assert meanwhile.direct_io
    engine.fs.release(meanwhile.handle)
    engine.fs.attributes_dropped(stale.invalidate_attributes)
    assert joined(engine.fs.read(stale.handle, 100, 0)) == b"a longer version"
    engine.fs.release(stale.handle)
    # Once invalidated, the kernel's next stat asks again, and learns the size.
    assert engine.fs.getattr("/f").size == 16
    fresh = engine.fs.open("/f", os.O_RDONLY)
    assert (fresh.invalidate_attributes, fresh.direct_io) == (None, False)
    engine.fs.release(fresh.handle)


def test_a_getattr_reply_is_not_taken_for_the_kernel_having_the_new_size(make_engine: EngineFactory) -> None:
    """The kernel discards an attribute reply that raced another update, and
    keeps the old size: a read through the page cache was then cut at it.
    Only dropping the kernel's attributes ends the stale size."""
    engine = make_engine({"f": b"short"}, ttl=5)
    engine.fs.getattr("/f")
    engine.store.put("f", b"a longer version")
    engine.clock.now += 6
    assert engine.fs.getattr("/f").size == 16  # a reply the kernel may discard
    stale = engine.fs.open("/f", os.O_RDONLY)
    assert stale.invalidate_attributes is not None
    assert stale.direct_io
    engine.fs.release(stale.handle)
    engine.fs.attributes_dropped(stale.invalidate_attributes)
    fresh = engine.fs.open("/f", os.O_RDONLY)  # after the invalidation
    assert (fresh.invalidate_attributes, fresh.direct_io) == (None, False)
    engine.fs.release(fresh.handle)


def test_df_shows_the_cache_capacity_and_its_room(make_engine: EngineFactory) -> None:
    """With no size at all, ``df`` left the mount out of its list."""
    data = os.urandom(3 * BLOCK_SIZE)
    engine = make_engine({"f": data}, capacity=64 * BLOCK_SIZE)
    before = engine.fs.statfs()
    assert before["f_frsize"] * before["f_blocks"] == 64 * BLOCK_SIZE
    assert before["f_bsize"] == before["f_frsize"]
    handle = engine.fs.open("/f", os.O_RDONLY).handle
    assert joined(engine.fs.read(handle, len(data), 0)) == data
    after = engine.fs.statfs()
    assert after["f_bavail"] == after["f_bfree"] < before["f_bfree"]
