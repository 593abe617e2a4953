"""The inode table without a mount: one inode per object version, the
kernel's references, stale names, and directory listings."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from cachefsd.cache.policy import EpochAwarePolicy, ReadMarks
from cachefsd.cache.tier import disk_bytes
from cachefsd.errors import (
    IsADirectory,
    NotADirectory,
    ObjectChanged,
    ObjectNotFound,
    UnknownInode,
)
from cachefsd.fs import ROOT_INODE, FileSystem
from cachefsd.jobs import UNKNOWN_JOB, CallerJobs
from cachefsd.metrics import value_of
from cachefsd.store.base import ObjectInfo
from cachefsd.workload.model import WorkloadModel
from tests.unit.conftest import BLOCK_SIZE, RigFactory, joined, looked_up, read_path


def stale_entries(fs: FileSystem) -> list[tuple[int, str]]:
    """What the FUSE edge would tell the kernel to forget, drained."""
    entries = []
    while not fs.stale_entries.empty():
        entries.append(fs.stale_entries.get())
    return entries


def test_attributes(make_rig: RigFactory) -> None:
    rig = make_rig({"d/f": b"12345"})
    directory = looked_up(rig.fs, "/d")
    assert stat.S_ISDIR(directory.mode)
    file = rig.fs.lookup(directory.inode, "f")
    assert stat.S_ISREG(file.mode)
    assert file.size == 5
    assert file.mode & 0o222 == 0
    assert rig.fs.getattr(file.inode) == file
    assert len({ROOT_INODE, directory.inode, file.inode}) == 3
    with pytest.raises(IsADirectory):
        rig.fs.read(directory.inode, 1, 0, os.getpid())
    with pytest.raises(ObjectNotFound):
        rig.fs.lookup(directory.inode, "nope")
    with pytest.raises(NotADirectory):
        rig.fs.lookup(file.inode, "below-a-file")


def test_a_directory_keeps_its_inode_and_a_version_its_own(make_rig: RigFactory) -> None:
    rig = make_rig({"d/f": b"one"}, ttl=5)
    first = looked_up(rig.fs, "/d/f")
    assert looked_up(rig.fs, "/d/f").inode == first.inode  # the same version, the same inode
    directory = looked_up(rig.fs, "/d").inode
    rig.store.put("d/f", b"two")
    rig.clock.now += 6
    second = looked_up(rig.fs, "/d/f")
    assert second.inode != first.inode
    assert second.st_ino != first.st_ino
    assert looked_up(rig.fs, "/d").inode == directory
    assert rig.fs.getattr(first.inode).size == 3  # what the kernel holds of the old one does not change


def test_an_inode_reads_only_its_version(make_rig: RigFactory) -> None:
    old = os.urandom(3 * BLOCK_SIZE)
    rig = make_rig({"f": old})
    ino = looked_up(rig.fs, "/f").inode
    assert joined(rig.fs.read(ino, BLOCK_SIZE, 0, os.getpid())) == old[:BLOCK_SIZE]
    new = os.urandom(3 * BLOCK_SIZE)
    rig.store.put("f", new)
    # The cached block is still the looked-up version's; an uncached one
    # cannot be fetched for that version any more, so the read fails, never mixes.
    assert joined(rig.fs.read(ino, BLOCK_SIZE, 0, os.getpid())) == old[:BLOCK_SIZE]
    with pytest.raises(ObjectChanged):
        joined(rig.fs.read(ino, BLOCK_SIZE, BLOCK_SIZE, os.getpid()))
    # The failure dropped the stale listing and names the entry for the
    # kernel to forget: the next lookup finds the new version, as a new inode.
    assert stale_entries(rig.fs) == [(ROOT_INODE, "f")]
    fresh = looked_up(rig.fs, "/f").inode
    assert fresh != ino
    assert joined(rig.fs.read(fresh, 3 * BLOCK_SIZE, 0, os.getpid())) == new


def test_a_version_replaced_upstream_keeps_its_blocks_until_the_kernel_forgets_its_inode(
    make_rig: RigFactory,
) -> None:
    """A loader's open shard or an mmap holds the inode: its cached bytes
    stay readable after a refresh shows the overwrite, and are released
    when the kernel drops its last reference."""
    old = os.urandom(2 * BLOCK_SIZE)
    rig = make_rig({"f": old}, ttl=5)
    ino = looked_up(rig.fs, "/f").inode
    assert joined(rig.fs.read(ino, len(old), 0, os.getpid())) == old
    gets = rig.store.get_count
    rig.store.put("f", os.urandom(2 * BLOCK_SIZE))
    rig.clock.now += 10
    newer = looked_up(rig.fs, "/f").inode  # the refresh that finds the overwrite
    assert stale_entries(rig.fs) == [(ROOT_INODE, "f")]
    assert joined(rig.fs.read(ino, len(old), 0, os.getpid())) == old
    assert rig.store.get_count == gets  # from the cache, not a failed GET of a gone version
    assert len(rig.index.blocks()) == 2
    rig.fs.forget(newer, 1)
    assert len(rig.index.blocks()) == 2
    rig.fs.forget(ino, 1)
    assert rig.index.blocks() == []  # released with the kernel's last reference
    with pytest.raises(UnknownInode):
        rig.fs.read(ino, 1, 0, os.getpid())


def test_a_version_nobody_holds_is_released_when_it_is_gone(make_rig: RigFactory) -> None:
    data = os.urandom(2 * BLOCK_SIZE)
    rig = make_rig({"f": data, "g": b"g"}, ttl=5)
    assert read_path(rig.fs, "/f", len(data)) == data
    rig.store.remove("f")
    rig.clock.now += 10
    rig.fs.opendir(ROOT_INODE, os.getpid())  # the refresh that finds it gone
    assert rig.index.blocks() == []
    # Its inode was kept by its fresh name in the native plane, which drops
    # it now; the kernel is told to forget the name too, whether it holds it or not.
    assert stale_entries(rig.fs) == [(ROOT_INODE, "f")]


def test_a_version_gone_and_listed_again_keeps_its_blocks(make_rig: RigFactory) -> None:
    """Deleted while held, then uploaded again with the same content (the
    same etag): the same inode again, and the kernel's last forget of it
    must not release the current version."""
    data = os.urandom(2 * BLOCK_SIZE)
    rig = make_rig({"f": data, "g": b"g"}, ttl=5)
    ino = looked_up(rig.fs, "/f").inode
    assert joined(rig.fs.read(ino, len(data), 0, os.getpid())) == data
    rig.store.remove("f")
    rig.clock.now += 10
    rig.fs.opendir(ROOT_INODE, os.getpid())  # the refresh that finds it gone
    rig.store.put("f", data)
    rig.clock.now += 10
    assert looked_up(rig.fs, "/f").inode == ino
    rig.fs.forget(ino, 2)
    assert len(rig.index.blocks()) == 2
    assert read_path(rig.fs, "/f", len(data)) == data


def test_an_inode_of_a_gone_version_fails_its_next_reads_without_asking_the_store(
    make_rig: RigFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """Each read was a GET answered 412, a warning and a listing dropped
    and saved again: 156 a second from one reader."""
    data = os.urandom(3 * BLOCK_SIZE)
    rig = make_rig({"d/f": data})
    ino = looked_up(rig.fs, "/d/f").inode
    rig.store.put("d/f", b"replaced")
    gets = rig.store.get_count
    with caplog.at_level(logging.WARNING):
        for offset in (BLOCK_SIZE, 2 * BLOCK_SIZE, BLOCK_SIZE):
            with pytest.raises(ObjectChanged):
                rig.fs.read(ino, BLOCK_SIZE, offset, os.getpid())
    assert rig.store.get_count == gets + 1
    assert len([record for record in caplog.records if "failed" in record.message]) == 1
    rig.fs.forget(ino, 1)
    rig.store.put("d/f", data)  # the same content again: the same version, back
    rig.clock.now += 3600
    assert read_path(rig.fs, "/d/f", 3 * BLOCK_SIZE) == data


def test_reading_a_deleted_object_fails_as_changed_and_drops_the_listing(make_rig: RigFactory) -> None:
    data = os.urandom(2 * BLOCK_SIZE)
    rig = make_rig({"f": data, "g": b"g"})
    ino = looked_up(rig.fs, "/f").inode
    assert joined(rig.fs.read(ino, BLOCK_SIZE, 0, os.getpid())) == data[:BLOCK_SIZE]
    rig.store.remove("f")
    with pytest.raises(ObjectChanged):  # EIO, as for an overwrite; not ENOENT from read()
        rig.fs.read(ino, BLOCK_SIZE, BLOCK_SIZE, os.getpid())
    assert (
        joined(rig.fs.read(ino, BLOCK_SIZE, 0, os.getpid())) == data[:BLOCK_SIZE]
    )  # what is cached still reads
    with pytest.raises(ObjectNotFound):  # the next lookup is told at once, within the metadata TTL
        looked_up(rig.fs, "/f")
    assert looked_up(rig.fs, "/g").size == 1


def name_expired(fs: FileSystem, parent: int, name: str) -> None:
    """What the native plane reports once ``name``'s TTL passed: the inodes it kept alone are gone."""
    for inode in fs.kernel.drop_name(parent, os.fsencode(name)):
        fs.forgotten(inode)


def test_an_inode_lives_while_the_kernel_references_it_or_its_name_is_fresh(make_rig: RigFactory) -> None:
    """Dropped by the kernel early (memory pressure, drop_caches) while the
    name that found it is fresh, an inode stays, and a lookup of the name
    gets it again; once neither keeps it, it is gone."""
    rig = make_rig({"f": b"x"})
    first = looked_up(rig.fs, "/f")
    ino = first.inode
    assert looked_up(rig.fs, "/f").inode == ino
    rig.fs.forget(ino, 1)
    assert joined(rig.fs.read(ino, 1, 0, os.getpid())) == b"x"
    rig.fs.forget(ino, 1)
    assert rig.fs.getattr(ino) == first  # kept by its name
    assert looked_up(rig.fs, "/f").inode == ino
    rig.fs.forget(ino, 1)
    name_expired(rig.fs, ROOT_INODE, "f")
    with pytest.raises(UnknownInode):
        rig.fs.getattr(ino)
    rig.fs.forget(ino, 1)  # a late forget of a dropped inode changes nothing
    again = looked_up(rig.fs, "/f")
    assert again.inode != ino  # the kernel's numbers are never reused
    assert again.st_ino == first.st_ino  # what stat shows stays (du, tar and rsync key on it)


def test_an_inode_referenced_but_renamed_away_stays_until_forgotten(make_rig: RigFactory) -> None:
    """A name that now leads to another version frees an unreferenced inode
    at once, and a referenced one at its last forget."""
    rig = make_rig({"f": b"x", "g": b"g"}, ttl=5)
    held = looked_up(rig.fs, "/f").inode
    assert joined(rig.fs.read(held, 1, 0, os.getpid())) == b"x"
    rig.store.put("f", b"y")
    rig.clock.now += 10
    newer = looked_up(rig.fs, "/f")
    assert newer.inode != held
    assert joined(rig.fs.read(held, 1, 0, os.getpid())) == b"x"  # an open file reads its version
    rig.fs.forget(held, 1)
    with pytest.raises(UnknownInode):
        rig.fs.getattr(held)
    assert rig.fs.getattr(newer.inode).size == 1


def test_a_listing_is_taken_whole_at_its_opendir(make_rig: RigFactory) -> None:
    """The kernel reads a directory in pieces, by offset: each piece comes
    from the listing its opendir took (handed whole to the native plane),
    whatever the bucket does meanwhile."""
    rig = make_rig({"d/a": b"a", "d/e/x": b"x"}, ttl=5)
    directory = looked_up(rig.fs, "/d").inode
    listing = rig.fs.opendir(directory, os.getpid())
    rig.store.put("d/b", b"b")
    rig.clock.now += 10
    names = [name for name, _ in listing.entries]
    assert names[:2] == [".", ".."]
    assert sorted(names[2:]) == ["a", "e"]
    attributes = dict(listing.entries)
    assert (attributes["."].inode, attributes[".."].inode) == (directory, ROOT_INODE)
    assert attributes["a"].size == 1
    again = rig.fs.opendir(directory, os.getpid())
    assert sorted(name for name, _ in again.entries) == [".", "..", "a", "b", "e"]


def test_a_listings_inodes_stay_while_it_is_open_then_only_those_held(make_rig: RigFactory) -> None:
    """Every entry's inode is made at OPENDIR; the kernel may read any of
    them until RELEASEDIR, then those it was not sent (nor looked up) go."""
    rig = make_rig({"a": b"a", "b": b"b"})
    listing = rig.fs.opendir(ROOT_INODE, os.getpid())
    entries = dict(listing.entries)
    held = looked_up(rig.fs, "/b")
    assert held == entries["b"]
    assert rig.fs.getattr(entries["a"].inode) == entries["a"]
    rig.fs.releasedir(listing.handle)
    with pytest.raises(UnknownInode):
        rig.fs.getattr(entries["a"].inode)
    assert rig.fs.getattr(held.inode) == held
    assert rig.fs.getattr(ROOT_INODE).inode == ROOT_INODE  # a directory's inode is its path's for good


def test_looking_up_a_cached_sample_starts_loading_its_block(
    make_rig: RigFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file of one block is read whole right after its lookup (the
    kernel's open): its block file is warmed then, so that the cache disk's
    read overlaps the round trip. A larger file's first read may be
    anywhere (a footer): not warmed."""
    rig = make_rig({"sample": os.urandom(BLOCK_SIZE), "shard": os.urandom(2 * BLOCK_SIZE)})
    for key, blocks in (("sample", 1), ("shard", 2)):
        info = rig.namespace.lookup("/" + key).info
        assert info is not None
        for index in range(blocks):
            assert rig.reader.fetch_run_ahead(info, range(index, index + 1)) == {index}
    warm = rig.view.warm
    warmed: list[tuple[str, int, bool, bool]] = []

    def recorded_warm(info: ObjectInfo, index: int, hold: bool = False) -> bool:
        warmed.append((info.key, index, hold, warm(info, index, hold)))
        return warmed[-1][3]

    monkeypatch.setattr(rig.view, "warm", recorded_warm)
    for key in ("sample", "shard"):
        looked_up(rig.fs, "/" + key)
    assert warmed == [("sample", 0, True, True)]


def opened_this_epoch(model: WorkloadModel, job: str) -> list[str]:
    """The files ``job`` opened this epoch, in order (its first epoch: nothing replays yet)."""
    observed = model.observed(job, max_files=1_000)
    return [] if observed is None else observed.order


def test_a_read_at_the_start_of_a_file_is_its_open(make_rig: RigFactory) -> None:
    """The kernel opens without asking: the workload model learns of an open
    from the read of a file's first bytes, once per read from 0."""
    rig = make_rig({"f": os.urandom(2 * BLOCK_SIZE)})
    ino = looked_up(rig.fs, "/f").inode
    job = rig.fs.jobs.of(os.getpid())  # the read's caller's
    joined(rig.fs.read(ino, BLOCK_SIZE, BLOCK_SIZE, os.getpid()))
    assert opened_this_epoch(rig.model, job) == []
    joined(rig.fs.read(ino, BLOCK_SIZE, 0, os.getpid()))
    assert opened_this_epoch(rig.model, job) == ["f"]
    assert opened_this_epoch(rig.model, UNKNOWN_JOB) == []  # another job's epoch


def test_an_open_through_the_cache_file_counts_as_a_read_of_the_whole_file(make_rig: RigFactory) -> None:
    """Passthrough: the kernel reads the cache file itself and asks nothing
    more, so the open is the file's open and its whole read, for the
    workload model and the metrics; nothing is counted when there is no
    file to hand over."""
    sample, shard = os.urandom(BLOCK_SIZE // 2), os.urandom(2 * BLOCK_SIZE)
    rig = make_rig({"sample": sample, "shard": shard})
    job = rig.fs.jobs.of(os.getpid())
    sample_inode = looked_up(rig.fs, "/sample").inode
    assert rig.fs.open_through(sample_inode, os.getpid()) is None  # not cached yet
    assert opened_this_epoch(rig.model, job) == []
    joined(rig.fs.read(sample_inode, len(sample), 0, os.getpid()))  # cold: now cached whole
    assert opened_this_epoch(rig.model, job) == ["sample"]
    served = value_of(rig.metrics.served_bytes, tier="hot")
    found = rig.fs.open_through(sample_inode, os.getpid())
    assert found is not None
    try:
        assert os.pread(found.fd, len(sample) + 1, 0) == sample
    finally:
        os.close(found.fd)
    assert value_of(rig.metrics.served_bytes, tier="hot") - served == len(sample)
    shard_inode = looked_up(rig.fs, "/shard").inode
    joined(rig.fs.read(shard_inode, len(shard), 0, os.getpid()))
    assert rig.fs.open_through(shard_inode, os.getpid()) is None  # two block files: neither is the file


def test_df_shows_the_cache_capacity_and_its_room(make_rig: RigFactory) -> None:
    """With no size at all, ``df`` left the mount out of its list."""
    data = os.urandom(3 * BLOCK_SIZE)
    rig = make_rig({"f": data}, capacity=64 * BLOCK_SIZE)
    before = rig.fs.statfs()
    assert before["f_frsize"] * before["f_blocks"] == 64 * BLOCK_SIZE
    assert before["f_bsize"] == before["f_frsize"]
    assert read_path(rig.fs, "/f", len(data)) == data
    after = rig.fs.statfs()
    assert after["f_bavail"] == after["f_bfree"] < before["f_bfree"]


class FirstEpoch:
    """An ``EpochClock`` that stays in epoch 0."""

    def current(self) -> int:
        return 0


@pytest.mark.parametrize("marked", [True, False])
def test_a_block_another_job_is_still_to_read_outlives_one_nobody_needs(
    make_rig: RigFactory, tmp_path: Path, marked: bool
) -> None:
    """Two jobs (a sweep) read one dataset: a read of a file the other job
    is still to read marks its blocks, and the epoch-aware policy keeps
    them over a block both have read, which without the marks it would
    have evicted first (it was read earlier)."""
    marks = ReadMarks()
    policy = EpochAwarePolicy(FirstEpoch(), elsewhere=marks if marked else None)
    files = {f"d/f{number}": os.urandom(BLOCK_SIZE) for number in range(3)}
    rig = make_rig(files, capacity=2 * disk_bytes(BLOCK_SIZE), policy=policy, read_marks=marks)
    proc = tmp_path / "proc"
    for pid in (100, 200):  # job a: pid 100; job b: pid 200, each the leader of its group
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "stat").write_text(f"{pid} (python) S 1 {pid} 1 0 -1 4194560 0 0 0 0")
    rig.fs.jobs = CallerJobs(proc)
    listing = rig.fs.opendir(looked_up(rig.fs, "/d").inode, 100)
    rig.fs.opendir(looked_up(rig.fs, "/d").inode, 200)
    rig.fs.releasedir(listing.handle)

    def read(path: str, pid: int) -> None:
        inode = looked_up(rig.fs, path).inode
        assert joined(rig.fs.read(inode, BLOCK_SIZE, 0, pid)) == files[path.lstrip("/")]

    read("/d/f0", 100)  # a's first read: b reads nothing yet
    read("/d/f1", 200)  # a is still to read f1: marked
    read("/d/f0", 200)  # both have read f0: nobody needs it
    read("/d/f2", 100)  # the cache is full: one of f0, f1 goes
    infos = {path: rig.namespace.lookup(f"/{path}").info for path in files}
    kept = {path for path, info in infos.items() if info is not None and rig.view.digest(info, 0) is not None}
    assert kept == ({"d/f1", "d/f2"} if marked else {"d/f0", "d/f2"})
