"""The inode table without a mount: one inode per object version, the
kernel's references, stale names, and directory listings."""

from __future__ import annotations

import logging
import os
import stat

import pytest

from cachefsd.errors import (
    BadFileHandle,
    IsADirectory,
    NotADirectory,
    ObjectChanged,
    ObjectNotFound,
    UnknownInode,
)
from cachefsd.fs import ROOT_INODE, FileSystem
from cachefsd.store.base import ObjectInfo
from tests.unit.conftest import BLOCK_SIZE, EngineFactory, joined, looked_up, read_path


def stale_entries(fs: FileSystem) -> list[tuple[int, str]]:
    """What the FUSE edge would tell the kernel to forget, drained."""
    entries = []
    while not fs.stale_entries.empty():
        entries.append(fs.stale_entries.get())
    return entries


def test_attributes(make_engine: EngineFactory) -> None:
    engine = make_engine({"d/f": b"12345"})
    directory = looked_up(engine.fs, "/d")
    assert stat.S_ISDIR(directory.mode)
    file = engine.fs.lookup(directory.node, "f")
    assert stat.S_ISREG(file.mode)
    assert file.size == 5
    assert file.mode & 0o222 == 0
    assert engine.fs.getattr(file.node) == file
    assert len({ROOT_INODE, directory.node, file.node}) == 3
    with pytest.raises(IsADirectory):
        engine.fs.read(directory.node, 1, 0, os.getpid())
    with pytest.raises(ObjectNotFound):
        engine.fs.lookup(directory.node, "nope")
    with pytest.raises(NotADirectory):
        engine.fs.lookup(file.node, "below-a-file")


def test_a_directory_keeps_its_inode_and_a_version_its_own(make_engine: EngineFactory) -> None:
    engine = make_engine({"d/f": b"one"}, ttl=5)
    first = looked_up(engine.fs, "/d/f")
    assert looked_up(engine.fs, "/d/f").node == first.node  # the same version, the same inode
    directory = looked_up(engine.fs, "/d").node
    engine.store.put("d/f", b"two")
    engine.clock.now += 6
    second = looked_up(engine.fs, "/d/f")
    assert second.node != first.node
    assert second.ino != first.ino
    assert looked_up(engine.fs, "/d").node == directory
    assert engine.fs.getattr(first.node).size == 3  # what the kernel holds of the old one does not change


def test_an_inode_reads_only_its_version(make_engine: EngineFactory) -> None:
    old = os.urandom(3 * BLOCK_SIZE)
    engine = make_engine({"f": old})
    ino = looked_up(engine.fs, "/f").node
    assert joined(engine.fs.read(ino, BLOCK_SIZE, 0, os.getpid())) == old[:BLOCK_SIZE]
    new = os.urandom(3 * BLOCK_SIZE)
    engine.store.put("f", new)
    # The cached block is still the looked-up version's; an uncached one
    # cannot be fetched for that version any more, so the read fails, never mixes.
    assert joined(engine.fs.read(ino, BLOCK_SIZE, 0, os.getpid())) == old[:BLOCK_SIZE]
    with pytest.raises(ObjectChanged):
        joined(engine.fs.read(ino, BLOCK_SIZE, BLOCK_SIZE, os.getpid()))
    # The failure dropped the stale listing and names the entry for the
    # kernel to forget: the next lookup finds the new version, as a new inode.
    assert stale_entries(engine.fs) == [(ROOT_INODE, "f")]
    fresh = looked_up(engine.fs, "/f").node
    assert fresh != ino
    assert joined(engine.fs.read(fresh, 3 * BLOCK_SIZE, 0, os.getpid())) == new


def test_a_version_replaced_upstream_keeps_its_blocks_until_the_kernel_forgets_its_inode(
    make_engine: EngineFactory,
) -> None:
    """A loader's open shard or an mmap holds the inode: its cached bytes
    stay readable after a refresh shows the overwrite, and are released
    when the kernel drops its last reference."""
    old = os.urandom(2 * BLOCK_SIZE)
    engine = make_engine({"f": old}, ttl=5)
    ino = looked_up(engine.fs, "/f").node
    assert joined(engine.fs.read(ino, len(old), 0, os.getpid())) == old
    gets = engine.store.get_count
    engine.store.put("f", os.urandom(2 * BLOCK_SIZE))
    engine.clock.now += 10
    newer = looked_up(engine.fs, "/f").node  # the refresh that finds the overwrite
    assert stale_entries(engine.fs) == [(ROOT_INODE, "f")]
    assert joined(engine.fs.read(ino, len(old), 0, os.getpid())) == old
    assert engine.store.get_count == gets  # from the cache, not a failed GET of a gone version
    assert len(engine.index.blocks()) == 2
    engine.fs.forget(newer, 1)
    assert len(engine.index.blocks()) == 2
    engine.fs.forget(ino, 1)
    assert engine.index.blocks() == []  # released with the kernel's last reference
    with pytest.raises(UnknownInode):
        engine.fs.read(ino, 1, 0, os.getpid())


def test_a_version_nobody_holds_is_released_when_it_is_gone(make_engine: EngineFactory) -> None:
    data = os.urandom(2 * BLOCK_SIZE)
    engine = make_engine({"f": data, "g": b"g"}, ttl=5)
    assert read_path(engine.fs, "/f", len(data)) == data
    engine.store.delete("f")
    engine.clock.now += 10
    engine.fs.opendir(ROOT_INODE, os.getpid())  # the refresh that finds it gone
    assert engine.index.blocks() == []
    assert stale_entries(engine.fs) == []  # the kernel held no name of it


def test_a_version_gone_and_listed_again_keeps_its_blocks(make_engine: EngineFactory) -> None:
    """Deleted while held, then uploaded again with the same content (the
    same etag): the same inode again, and the kernel's last forget of it
    must not release the current version."""
    data = os.urandom(2 * BLOCK_SIZE)
    engine = make_engine({"f": data, "g": b"g"}, ttl=5)
    ino = looked_up(engine.fs, "/f").node
    assert joined(engine.fs.read(ino, len(data), 0, os.getpid())) == data
    engine.store.delete("f")
    engine.clock.now += 10
    engine.fs.opendir(ROOT_INODE, os.getpid())  # the refresh that finds it gone
    engine.store.put("f", data)
    engine.clock.now += 10
    assert looked_up(engine.fs, "/f").node == ino
    engine.fs.forget(ino, 2)
    assert len(engine.index.blocks()) == 2
    assert read_path(engine.fs, "/f", len(data)) == data


def test_an_inode_of_a_gone_version_fails_its_next_reads_without_asking_the_store(
    make_engine: EngineFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """Each read was a GET answered 412, a warning and a listing dropped
    and saved again: 156 a second from one reader."""
    data = os.urandom(3 * BLOCK_SIZE)
    engine = make_engine({"d/f": data})
    ino = looked_up(engine.fs, "/d/f").node
    engine.store.put("d/f", b"replaced")
    gets = engine.store.get_count
    with caplog.at_level(logging.WARNING):
        for offset in (BLOCK_SIZE, 2 * BLOCK_SIZE, BLOCK_SIZE):
            with pytest.raises(ObjectChanged):
                engine.fs.read(ino, BLOCK_SIZE, offset, os.getpid())
    assert engine.store.get_count == gets + 1
    assert len([record for record in caplog.records if "failed" in record.message]) == 1
    engine.fs.forget(ino, 1)
    engine.store.put("d/f", data)  # the same content again: the same version, back
    engine.clock.now += 3600
    assert read_path(engine.fs, "/d/f", 3 * BLOCK_SIZE) == data


def test_reading_a_deleted_object_fails_as_changed_and_drops_the_listing(make_engine: EngineFactory) -> None:
    data = os.urandom(2 * BLOCK_SIZE)
    engine = make_engine({"f": data, "g": b"g"})
    ino = looked_up(engine.fs, "/f").node
    assert joined(engine.fs.read(ino, BLOCK_SIZE, 0, os.getpid())) == data[:BLOCK_SIZE]
    engine.store.delete("f")
    with pytest.raises(ObjectChanged):  # EIO, as for an overwrite; not ENOENT from read()
        engine.fs.read(ino, BLOCK_SIZE, BLOCK_SIZE, os.getpid())
    assert (
        joined(engine.fs.read(ino, BLOCK_SIZE, 0, os.getpid())) == data[:BLOCK_SIZE]
    )  # what is cached still reads
    with pytest.raises(ObjectNotFound):  # the next lookup is told at once, within the metadata TTL
        looked_up(engine.fs, "/f")
    assert looked_up(engine.fs, "/g").size == 1


def test_an_inode_lives_while_the_kernel_references_it(make_engine: EngineFactory) -> None:
    engine = make_engine({"f": b"x"})
    first = looked_up(engine.fs, "/f")
    ino = first.node
    assert looked_up(engine.fs, "/f").node == ino
    engine.fs.forget(ino, 1)
    assert joined(engine.fs.read(ino, 1, 0, os.getpid())) == b"x"
    engine.fs.forget(ino, 1)
    with pytest.raises(UnknownInode):
        engine.fs.getattr(ino)
    engine.fs.forget(ino, 1)  # a late forget of a dropped inode changes nothing
    again = looked_up(engine.fs, "/f")
    assert again.node != ino  # the kernel's numbers are never reused
    assert again.ino == first.ino  # what stat shows stays (du, tar and rsync key on it)


def test_a_listing_is_read_whole_from_one_handle(make_engine: EngineFactory) -> None:
    """The kernel reads a directory in pieces, by offset: each piece comes
    from the listing its opendir took, whatever the bucket does meanwhile."""
    engine = make_engine({"d/a": b"a", "d/e/x": b"x"}, ttl=5)
    directory = looked_up(engine.fs, "/d").node
    handle = engine.fs.opendir(directory, os.getpid())
    engine.store.put("d/b", b"b")
    engine.clock.now += 10
    entries = engine.fs.readdir(handle)
    assert [entry.name for entry in entries[:2]] == [".", ".."]
    assert sorted((entry.name, entry.info is None) for entry in entries[2:]) == [("a", False), ("e", True)]
    assert engine.fs.remember(handle, entries[0]).node == directory
    assert engine.fs.remember(handle, entries[1]).node == ROOT_INODE
    engine.fs.releasedir(handle)
    with pytest.raises(BadFileHandle):
        engine.fs.readdir(handle)
    again = engine.fs.opendir(directory, os.getpid())
    assert sorted(entry.name for entry in engine.fs.readdir(again)) == [".", "..", "a", "b", "e"]


def test_an_entry_sent_with_its_attributes_is_a_reference(make_engine: EngineFactory) -> None:
    """READDIRPLUS: the kernel holds each entry (but . and ..) as if looked up."""
    engine = make_engine({"a": b"a"})
    handle = engine.fs.opendir(ROOT_INODE, os.getpid())
    entries = {entry.name: entry for entry in engine.fs.readdir(handle)}
    file = engine.fs.remember(handle, entries["a"])
    assert file == looked_up(engine.fs, "/a")
    engine.fs.forget(file.node, 1)
    assert engine.fs.getattr(file.node) == file
    engine.fs.forget(file.node, 1)
    with pytest.raises(UnknownInode):
        engine.fs.getattr(file.node)
    engine.fs.remember(handle, entries["."])
    engine.fs.forget(ROOT_INODE, 1)  # a directory's inode is its path's for good
    assert engine.fs.getattr(ROOT_INODE).node == ROOT_INODE


def test_looking_up_a_cached_sample_starts_loading_its_block(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file of one block is read whole right after its lookup (the
    kernel's open): its block file is warmed then, so that the cache disk's
    read overlaps the round trip. A larger file's first read may be
    anywhere (a footer): not warmed."""
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
        looked_up(engine.fs, "/" + key)
    assert warmed == [("sample", 0, True, True)]


def test_a_read_at_the_start_of_a_file_is_its_open(make_engine: EngineFactory) -> None:
    """The kernel opens without asking: the access model learns of an open
    from the read of a file's first bytes, once per read from 0."""
    engine = make_engine({"f": os.urandom(2 * BLOCK_SIZE)})
    ino = looked_up(engine.fs, "/f").node
    job = engine.fs.jobs.of(os.getpid())  # the read's caller's
    joined(engine.fs.read(ino, BLOCK_SIZE, BLOCK_SIZE, os.getpid()))
    assert engine.model.read_this_epoch("f", job) == set()
    joined(engine.fs.read(ino, BLOCK_SIZE, 0, os.getpid()))
    assert engine.model.read_this_epoch("f", job) == {"f"}
    assert engine.model.read_this_epoch("f") == set()  # another job's epoch


def test_df_shows_the_cache_capacity_and_its_room(make_engine: EngineFactory) -> None:
    """With no size at all, ``df`` left the mount out of its list."""
    data = os.urandom(3 * BLOCK_SIZE)
    engine = make_engine({"f": data}, capacity=64 * BLOCK_SIZE)
    before = engine.fs.statfs()
    assert before["f_frsize"] * before["f_blocks"] == 64 * BLOCK_SIZE
    assert before["f_bsize"] == before["f_frsize"]
    assert read_path(engine.fs, "/f", len(data)) == data
    after = engine.fs.statfs()
    assert after["f_bavail"] == after["f_bfree"] < before["f_bfree"]
