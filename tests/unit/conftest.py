"""In-process rigs over the in-memory store: every layer real except the bucket."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from cachefsd.aio import LoopThread
from cachefsd.cache.blocks import FileSpan
from cachefsd.cache.codec import Codec
from cachefsd.cache.index import Index
from cachefsd.cache.maintenance import reconcile
from cachefsd.cache.policy import EvictionPolicy, LruPolicy, PlannedUse, ReadMarks
from cachefsd.cache.shared import SharedCache
from cachefsd.cache.tier import Tier
from cachefsd.cache.tiered import CacheTuning, TieredCache
from cachefsd.cache.view import CacheView
from cachefsd.cache.whole import WholeFiles
from cachefsd.config import FetchSettings, Settings
from cachefsd.engine import data_path
from cachefsd.fs import ROOT_INODE, Attributes, FileSystem
from cachefsd.metrics import Metrics, SharedFetches
from cachefsd.namespace.tree import Namespace
from cachefsd.reader import BlockReader, Piece, close_pieces
from cachefsd.store.base import ObjectInfo, ObjectStore
from cachefsd.store.faulty import FaultyStore
from cachefsd.store.memory import MemoryStore
from cachefsd.workload.model import WorkloadModel
from cachefsd.writes.journal import Journal

BLOCK_SIZE = 64 << 10
FAST_FETCH = FetchSettings(deadline=2.0, attempt_timeout=0.5, backoff_initial=0.01, backoff_max=0.05)
# How long a lookup of an expired listing waits for its refresh, in tests: a
# refresh from the in-memory store always comes sooner, even on a loaded
# machine, so a test that the store answers does not depend on timing.
TEST_FRESH_WAIT_SECONDS = 30.0
DAEMON_CACHE_TUNING = CacheTuning()


def joined(pieces: list[Piece]) -> bytes:
    """The bytes a reader would get: memory pieces as they are, file pieces
    read from their descriptor (which is then closed, as the FUSE edge does)."""
    try:
        return b"".join(
            os.pread(piece.fd, piece.length, piece.offset) if isinstance(piece, FileSpan) else piece
            for piece in pieces
        )
    finally:
        close_pieces(pieces)


def looked_up(fs: FileSystem, path: str) -> Attributes:
    """``path`` resolved as the kernel does, one LOOKUP a name from the
    root: the file (or directory) it ends at, referenced once more."""
    attributes = fs.getattr(ROOT_INODE)
    for name in path.strip("/").split("/"):
        attributes = fs.lookup(attributes.inode, name)
    return attributes


def read_path(fs: FileSystem, path: str, size: int, offset: int = 0) -> bytes:
    """A read of ``path`` as a reader that opens, reads and closes it causes:
    a lookup, the read, and the kernel's forget once it drops the inode."""
    ino = looked_up(fs, path).inode
    try:
        return joined(fs.read(ino, size, offset, os.getpid()))
    finally:
        fs.forget(ino, 1)


def cached(rig: Rig, key: str) -> ObjectInfo:
    """``key``'s version, every block of it brought into the cache."""
    info = rig.namespace.lookup(f"/{key}").info
    assert info is not None
    blocks = range(-(-info.size // BLOCK_SIZE))
    assert rig.reader.fetch_run_ahead(info, blocks) == set(blocks)
    return info


def read_concurrently(rig: Rig, gate: threading.Event, monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Eight reads of block 0 of ``/f``, the bucket held at ``gate`` until
    all of them have asked for the block."""
    info = rig.namespace.lookup("/f").info
    assert info is not None
    arrived = threading.Semaphore(0)
    share = rig.reader._in_flight.do

    def counted(*args: Any, **kwargs: Any) -> Any:
        arrived.release()
        return share(*args, **kwargs)

    monkeypatch.setattr(rig.reader._in_flight, "do", counted)
    results: list[bytes] = []
    threads = [
        threading.Thread(target=lambda: results.append(joined(rig.reader.read(info, 0, BLOCK_SIZE))))
        for _ in range(8)
    ]
    for thread in threads:
        thread.start()
    try:
        for _ in threads:
            assert arrived.acquire(timeout=10), "a reader never asked for the block"
    finally:
        gate.set()
    for thread in threads:
        thread.join(10)
    return results


class Clock:
    """A settable clock: listings' TTLs, the prefetcher's retries and bandwidth."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Rig:
    store: MemoryStore
    faulty: FaultyStore
    index: Index
    cache: TieredCache
    metrics: Metrics
    reader: BlockReader
    view: CacheView
    namespace: Namespace
    fs: FileSystem
    clock: Clock
    cache_dir: Path
    model: WorkloadModel
    whole_files: WholeFiles  # not started: a test that wants whole files starts it
    shared: SharedCache | None = None
    journal: Journal | None = None  # a writable rig's (its uploads are started)

    def close(self) -> None:
        """What the rig started and opened, stopped and closed (a writable
        rig's staged files stay, as at an unmount)."""
        self.whole_files.stop()
        if self.fs.writes is not None:
            self.fs.writes.uploads.stop(0.0)
            self.fs.writes.staging.close()
        if self.journal is not None:
            self.journal.close()
        if self.shared is not None:
            self.shared.close()
        self.index.close()


RigFactory = Callable[..., Rig]


@pytest.fixture(name="io")
def fixture_io() -> Iterator[LoopThread]:
    loop = LoopThread()
    yield loop
    loop.stop()


def build_rig(
    io: LoopThread,
    cache_dir: Path,
    objects: dict[str, bytes] | None = None,
    capacity: int = 64 << 20,
    store: MemoryStore | None = None,
    ttl: float = 60.0,
    trust_saved_listings: bool = False,
    policy: EvictionPolicy | None = None,
    planned: PlannedUse | None = None,
    codec: Codec = Codec.RAW,
    fetch: FetchSettings = FAST_FETCH,
    fresh_wait: float = TEST_FRESH_WAIT_SECONDS,
    cache_tuning: CacheTuning = DAEMON_CACHE_TUNING,
    read_marks: ReadMarks | None = None,
    shared_store: ObjectStore | None = None,
    writable: bool = False,
) -> Rig:
    """The whole read path over a ``MemoryStore``, its cache in ``cache_dir``,
    its I/O on ``io``, with a shared tier in ``shared_store`` if given; the
    caller closes it (``Rig.close``). ``writable``: its filesystem
    takes writes, staged and uploaded to the store. ``read_marks``:
    where reads mark blocks other jobs are still to read, if ``policy`` was
    given them. For tests that cannot take fixtures (hypothesis state
    machines); others use ``make_rig``."""
    store = store or MemoryStore(objects or {})
    faulty = FaultyStore(store)
    cache_dir.mkdir(exist_ok=True)
    index = Index(cache_dir / "index.sqlite")
    metrics = Metrics(CollectorRegistry())
    cache = TieredCache(
        [Tier("hot", cache_dir / "hot", capacity, codec, LruPolicy() if policy is None else policy)],
        index,
        metrics,
        planned,
        cache_tuning,
    )
    reconcile(cache)
    index.start_serving()  # as open_cache does
    settings = Settings(
        source=str(cache_dir),
        mountpoint=cache_dir / "mnt",
        cache={"dir": cache_dir, "block_size": BLOCK_SIZE},
        fetch=fetch,
        namespace={"metadata_ttl": ttl, "trust_saved_listings": trust_saved_listings},
    )
    clock = Clock()
    model = WorkloadModel()
    shared = None
    if shared_store is not None:
        shared = SharedCache(shared_store, io, BLOCK_SIZE, metrics, SharedFetches(metrics), time.monotonic)
    whole_files = WholeFiles(cache.assemble_whole)
    journal = Journal(cache_dir) if writable else None
    reader, view, namespace, _, fs = data_path(
        faulty,
        cache,
        index,
        io,
        metrics,
        model,
        settings,
        read_marks or ReadMarks(),
        whole_files,
        listing_clock=clock,
        fresh_wait=fresh_wait,
        shared=shared,
        writes=None if journal is None else (journal, metrics.for_mount(str(settings.mountpoint))),
    )
    if fs.writes is not None:
        fs.writes.staging.start(fs.writes.uploads)
        fs.writes.uploads.start()
    return Rig(
        store,
        faulty,
        index,
        cache,
        metrics,
        reader,
        view,
        namespace,
        fs,
        clock,
        cache_dir,
        model,
        whole_files,
        shared,
        journal,
    )


@pytest.fixture(name="make_rig")
def fixture_make_rig(tmp_path: Path, io: LoopThread) -> Iterator[RigFactory]:
    """``make_rig(objects, cache_dir=..., **build_rig's options)``: the
    whole read path over a ``MemoryStore``, in ``tmp_path`` unless told;
    indexes and shared tiers are closed at teardown."""
    rigs: list[Rig] = []

    def make(objects: dict[str, bytes] | None = None, cache_dir: Path | None = None, **options: Any) -> Rig:
        rig = build_rig(io, cache_dir or tmp_path / "cache", objects, **options)
        rigs.append(rig)
        return rig

    yield make
    for rig in rigs:
        rig.close()
