"""A writable filesystem over the in-memory store: staged files, their
upload, the journal across a daemon's death, and the room they take."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import pytest

from cachefsd.cache.codec import Codec
from cachefsd.cache.policy import LruPolicy
from cachefsd.cache.tier import NoRoom, Tier
from cachefsd.engine import STAGED_DIR
from cachefsd.errors import AlreadyExists, CrossDevice, NoSpace, NotEmpty, NotPermitted, ObjectNotFound
from cachefsd.fs import ROOT_INODE, FileSystem, Listing
from cachefsd.store.base import ObjectInfo
from cachefsd.store.memory import MemoryStore
from cachefsd.writes.journal import Journal
from cachefsd.writes.staged import UNFINISHED_DIR
from tests.unit.conftest import BLOCK_SIZE, Rig, RigFactory, joined, looked_up

pytestmark = pytest.mark.timeout(60)


def _write(fs: FileSystem, path: str, data: bytes, parent: int = ROOT_INODE) -> int:
    """Create ``path`` (in ``parent``), write ``data`` and close it; its inode."""
    attributes, handle = fs.create(parent, path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    for offset in range(0, len(data), 100_000):
        fs.write(handle, offset, memoryview(data[offset : offset + 100_000]))
    fs.release(handle)
    return attributes.inode


def _synced(rig: Rig) -> None:
    assert rig.fs.writes is not None
    _, failed = rig.fs.writes.uploads.wait(None, 30.0)
    assert not failed


def _staged_files(rig: Rig) -> list[str]:
    directory = rig.cache_dir / "hot" / STAGED_DIR
    return sorted(entry.name for entry in directory.iterdir() if entry.name != UNFINISHED_DIR)


def test_a_written_file_reads_back_then_is_uploaded_and_cached_as_blocks(make_rig: RigFactory) -> None:
    rig = make_rig(writable=True)
    data = os.urandom(3 * BLOCK_SIZE + 17)
    inode = _write(rig.fs, "model.pt", data)
    assert joined(rig.fs.read(inode, len(data), 0, os.getpid())) == data
    assert rig.fs.getattr(inode).size == len(data)
    _synced(rig)
    assert rig.store.get("model.pt") == data
    assert _staged_files(rig) == []
    info = rig.namespace.lookup("/model.pt").info
    assert info is not None
    assert info.size == len(data)
    assert all(rig.view.digest(info, index) is not None for index in range(4))
    gets = rig.faulty.calls
    assert joined(rig.fs.read(looked_up(rig.fs, "model.pt").inode, len(data), 0, os.getpid())) == data
    assert rig.faulty.calls == gets  # read back from the cache
    # A handle open on the staged inode reads the uploaded version.
    assert joined(rig.fs.read(inode, 100, 5, os.getpid())) == data[5:105]


def names(listing: Listing) -> set[str]:
    return {name for name, _ in listing.entries}


def test_listings_show_staged_files_and_local_directories(make_rig: RigFactory) -> None:
    rig = make_rig({"remote/a.bin": b"a"}, writable=True)
    ckpt = rig.fs.mkdir(ROOT_INODE, "ckpt")
    _write(rig.fs, "w.bin", b"w", parent=ckpt.inode)
    remote = looked_up(rig.fs, "remote")
    _write(rig.fs, "b.bin", b"b", parent=remote.inode)
    assert names(rig.fs.opendir(ROOT_INODE, os.getpid())) == {".", "..", "ckpt", "remote"}
    assert names(rig.fs.opendir(remote.inode, os.getpid())) == {".", "..", "a.bin", "b.bin"}
    with pytest.raises(AlreadyExists):
        rig.fs.mkdir(ROOT_INODE, "ckpt")
    with pytest.raises(NotEmpty):
        rig.fs.rmdir(ROOT_INODE, "ckpt")
    _synced(rig)
    assert rig.store.get("ckpt/w.bin") == b"w"
    assert names(rig.fs.opendir(ckpt.inode, os.getpid())) == {".", "..", "w.bin"}


def test_rename_of_a_staged_file_uploads_it_under_its_new_name_only(make_rig: RigFactory) -> None:
    rig = make_rig({"final": b"old"}, writable=True)
    _write(rig.fs, "final.tmp", b"new")
    rig.fs.rename(ROOT_INODE, "final.tmp", ROOT_INODE, "final", no_replace=False)
    _synced(rig)
    assert rig.store.get("final") == b"new"
    assert rig.store.keys() == ["final"]
    with pytest.raises(ObjectNotFound):
        rig.fs.lookup(ROOT_INODE, "final.tmp")


def test_an_uploaded_object_renamed_is_copied_and_deleted_unlinked_is_deleted(make_rig: RigFactory) -> None:
    rig = make_rig({"a": b"1", "b": b"2", "d/x": b"x"}, writable=True)
    rig.fs.rename(ROOT_INODE, "a", ROOT_INODE, "c", no_replace=False)
    assert sorted(rig.store.keys()) == ["b", "c", "d/x"]
    rig.fs.unlink(ROOT_INODE, "b")
    assert sorted(rig.store.keys()) == ["c", "d/x"]
    with pytest.raises(AlreadyExists):
        rig.fs.rename(ROOT_INODE, "c", ROOT_INODE, "d", no_replace=True)
    with pytest.raises(CrossDevice):
        rig.fs.rename(ROOT_INODE, "d", ROOT_INODE, "e", no_replace=False)


def test_an_uploaded_object_is_replaced_whole_never_in_part(make_rig: RigFactory) -> None:
    rig = make_rig({"data": b"0123456789"}, writable=True)
    inode = looked_up(rig.fs, "data").inode
    assert rig.fs.open(inode, os.O_RDONLY) is None  # a read: the cache's, as ever
    with pytest.raises(NotPermitted):
        rig.fs.open(inode, os.O_RDWR)
    with pytest.raises(NotPermitted):
        rig.fs.setattr(inode, 3, None, mode_change=False)
    with pytest.raises(NotPermitted):
        rig.fs.setattr(inode, None, None, mode_change=True)
    handle = rig.fs.open(inode, os.O_WRONLY | os.O_TRUNC)
    assert handle is not None
    rig.fs.write(handle, 0, memoryview(b"new"))
    assert rig.fs.getattr(inode).size == 3
    rig.fs.release(handle)
    _synced(rig)
    assert rig.store.get("data") == b"new"


def test_fsync_uploads_an_open_file_and_returns_once_it_is_in_the_store(make_rig: RigFactory) -> None:
    rig = make_rig(writable=True)
    attributes, handle = rig.fs.create(ROOT_INODE, "f", os.O_WRONLY | os.O_CREAT)
    rig.fs.write(handle, 0, memoryview(b"first"))
    rig.fs.fsync(attributes.inode)
    assert rig.store.get("f") == b"first"
    rig.fs.write(handle, 5, memoryview(b" second"))
    rig.fs.release(handle)
    _synced(rig)
    assert rig.store.get("f") == b"first second"


def test_sync_waits_for_a_close_whose_release_is_still_on_its_way(make_rig: RigFactory) -> None:
    """close(2) returns once the kernel has the flush answered; the
    release follows. A sync in between counts the file as closed."""
    rig = make_rig(writable=True)
    uploads = rig.fs.writes.uploads if rig.fs.writes else None
    assert uploads is not None
    _, handle = rig.fs.create(ROOT_INODE, "ckpt", os.O_WRONLY | os.O_CREAT)
    rig.fs.write(handle, 0, memoryview(b"state"))
    rig.fs.flush(handle)
    results: list[tuple[int, dict[str, str]]] = []
    sync = threading.Thread(target=lambda: results.append(uploads.wait(None, 30.0)))
    sync.start()
    rig.fs.release(handle)
    sync.join(60)
    assert results == [(1, {})]
    assert rig.store.get("ckpt") == b"state"


def test_a_failing_store_keeps_the_file_staged_and_names_it_until_it_answers(make_rig: RigFactory) -> None:
    rig = make_rig(writable=True)
    assert rig.fs.writes is not None
    rig.namespace.listdir("/")  # listed before the store fails: only the upload meets the fault
    rig.faulty.faults.failures_left = 1000
    _write(rig.fs, "ckpt", b"precious")
    _, failed = rig.fs.writes.uploads.wait(None, 30.0)
    assert list(failed) == ["ckpt"]
    assert rig.fs.writes.uploads.failing() == 1
    assert joined(rig.fs.read(looked_up(rig.fs, "ckpt").inode, 100, 0, os.getpid())) == b"precious"
    rig.faulty.faults.failures_left = 0
    _synced(rig)
    assert rig.store.get("ckpt") == b"precious"


def test_a_restart_uploads_what_was_closed_and_sets_aside_what_was_not(
    make_rig: RigFactory, tmp_path: Path
) -> None:
    store = MemoryStore()
    cache_dir = tmp_path / "cache"
    first = make_rig(store=store, cache_dir=cache_dir, writable=True)
    first.namespace.listdir("/")
    first.faulty.faults.hang = True
    _write(first.fs, "closed.pt", b"whole checkpoint")
    _, handle = first.fs.create(ROOT_INODE, "open.pt", os.O_WRONLY | os.O_CREAT)
    first.fs.write(handle, 0, memoryview(b"half"))
    first.close()  # the daemon's end, as after a kill: nothing reached the store
    assert store.keys() == []
    # A file whose row went (uploaded, or unlinked) just before the end.
    stray = cache_dir / "hot" / STAGED_DIR / ("0" * 32)
    stray.write_bytes(b"uploaded already")

    second = make_rig(store=store, cache_dir=cache_dir, writable=True)
    _synced(second)
    assert store.get("closed.pt") == b"whole checkpoint"
    assert store.keys() == ["closed.pt"]
    (kept,) = (cache_dir / "hot" / STAGED_DIR / UNFINISHED_DIR).iterdir()
    assert kept.name.endswith("-open.pt")
    assert kept.read_bytes() == b"half"
    assert _staged_files(second) == []
    assert not stray.exists()
    assert Journal(cache_dir).pending(store.cache_key) == []


def test_staged_bytes_are_never_evicted_and_a_write_past_the_room_is_refused(make_rig: RigFactory) -> None:
    rig = make_rig({"cached": os.urandom(4 * BLOCK_SIZE)}, capacity=8 * BLOCK_SIZE, writable=True)
    info = rig.namespace.lookup("/cached").info
    assert info is not None
    assert rig.reader.fetch_run_ahead(info, range(4)) == set(range(4))
    rig.namespace.listdir("/")
    rig.faulty.faults.hang = True  # nothing leaves the hot tier by upload
    _, handle = rig.fs.create(ROOT_INODE, "big", os.O_WRONLY | os.O_CREAT)
    rig.fs.write(handle, 0, memoryview(os.urandom(6 * BLOCK_SIZE)))
    # The cached blocks made room: evicted, the staged bytes kept.
    assert rig.cache.tiers[0].used_bytes <= 2 * BLOCK_SIZE
    with pytest.raises(NoSpace):
        rig.fs.write(handle, 6 * BLOCK_SIZE, memoryview(os.urandom(3 * BLOCK_SIZE)))
    rig.fs.release(handle)
    rig.fs.unlink(ROOT_INODE, "big")
    assert rig.cache.tiers[0].reserved_bytes == 0


def test_a_tier_reserves_room_by_evicting_and_refuses_more_than_its_capacity(tmp_path: Path) -> None:
    tier = Tier("hot", tmp_path / "hot", 4096 * 4, Codec.RAW, LruPolicy())
    for name in ("a" * 32, "b" * 32):
        tier.add(name, 4096)
    assert tier.reserve(4096 * 3) == ["a" * 32]
    with pytest.raises(NoRoom):
        tier.reserve(4096 * 2)
    assert tier.reserved_bytes == 4096 * 3
    tier.unreserve(4096 * 3)
    assert tier.reserve(4096 * 2) == []


def test_concurrent_writers_of_separate_files_all_arrive(make_rig: RigFactory) -> None:
    rig = make_rig(writable=True)
    files = {f"rank{rank}.distcp": os.urandom(2 * BLOCK_SIZE + rank) for rank in range(8)}
    threads = [threading.Thread(target=_write, args=(rig.fs, name, data)) for name, data in files.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    _synced(rig)
    assert {name: rig.store.get(name) for name in files} == files


class _AnswersLate(MemoryStore):
    """A store whose uploads land at once, but are answered only once
    ``answer`` is set: a request in flight when its file is renamed."""

    def __init__(self) -> None:
        super().__init__({})
        self.landed = threading.Event()
        self.answer = threading.Event()

    async def put_file(self, key: str, path: Path) -> ObjectInfo:
        info = await super().put_file(key, path)
        self.landed.set()
        while not self.answer.is_set():
            await asyncio.sleep(0.005)  # the event is set from the test's thread
        return info


def test_a_file_renamed_as_its_upload_lands_is_not_left_under_its_old_name(make_rig: RigFactory) -> None:
    store = _AnswersLate()
    rig = make_rig(store=store, writable=True)
    _write(rig.fs, "step.tmp", b"state")
    assert store.landed.wait(30)  # in the bucket, its answer held back
    rig.fs.rename(ROOT_INODE, "step.tmp", ROOT_INODE, "step", no_replace=False)
    store.answer.set()
    _synced(rig)
    assert store.keys() == ["step"]
    assert store.get("step") == b"state"
    with pytest.raises(ObjectNotFound):
        rig.fs.lookup(ROOT_INODE, "step.tmp")
