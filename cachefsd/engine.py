"""The data path, built from settings: store, cache, fetcher, reader,
namespace, prefetcher and filesystem, wired once, here.

No FUSE here: the daemon serves it through a mount, an offline ``cachefsd
stage`` and the tests use it directly. Start-up order matters for the
promise that a bad mount fails fast and loses nothing: prove the source is
reachable (bounded), then validate the cache directories and take their
locks, then reconcile the cache.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from cachefsd._native import Tables
from cachefsd.aio import LoopThread
from cachefsd.buffers import reuse_block_buffers
from cachefsd.cache.blocks import BlockCache
from cachefsd.cache.directory import OpenCache, open_cache, tier_specs
from cachefsd.cache.index import Index
from cachefsd.cache.layered import LayeredCache
from cachefsd.cache.policy import PlannedUse, ReadMarks
from cachefsd.cache.recent import RecentBlocks
from cachefsd.cache.shared import SharedCache, open_shared
from cachefsd.cache.tiered import TieredCache
from cachefsd.cache.view import CacheView
from cachefsd.cache.whole import WholeFiles
from cachefsd.config import CacheSettings, FetchSettings, Settings, StoreSettings, human_bytes
from cachefsd.diagnose.ledger import MeterLedger
from cachefsd.errors import CachefsdError
from cachefsd.fetch import Fetcher
from cachefsd.fs import FileSystem, Writes
from cachefsd.jobs import CallerJobs
from cachefsd.metrics import Metrics, MountEvents, SharedFetches
from cachefsd.namespace.tree import FRESH_WAIT_SECONDS, Namespace
from cachefsd.prefetch.prefetcher import Prefetcher
from cachefsd.reader import BlockReader, ReadEvents
from cachefsd.store import open_store
from cachefsd.store.base import ObjectStore
from cachefsd.workload.model import WorkloadModel
from cachefsd.writes.bucket import Bucket
from cachefsd.writes.journal import Journal
from cachefsd.writes.staged import Staging
from cachefsd.writes.uploads import UploadEvents, Uploads

log = logging.getLogger(__name__)

# Opens the source of a mount: (source URL or path, store settings, fetch settings).
StoreFactory = Callable[[str, StoreSettings, FetchSettings], ObjectStore]

# Proving the source reachable at mount: a connect timeout plus one small
# request. Longer than that and the user is better served by an error.
MOUNT_CHECK_SECONDS = 15.0
# How long an unmount waits for the uploads due; what is left stays
# staged, and the next mount of the source uploads it.
UNMOUNT_UPLOAD_SECONDS = 60.0
# Where a hot tier keeps staged files (``writes.staged``), beside its blocks.
STAGED_DIR = "staged"


@dataclass
class Engine:
    """Everything between the FUSE layer and the bucket: what a mount serves
    from, and what ``cachefsd stage`` uses directly when no daemon runs."""

    store: ObjectStore
    cache: TieredCache
    index: Index
    reader: BlockReader
    view: CacheView  # the cache as the prefetcher, staging and the filesystem see this source's blocks
    namespace: Namespace
    metrics: Metrics
    prefetcher: Prefetcher
    model: WorkloadModel
    fs: FileSystem
    mount_events: MountEvents  # what the mount's FUSE edge and reads tell the metrics
    uploads: Uploads | None  # a writable mount's


def _warn_of_small_disks(cache: TieredCache) -> None:
    """A capacity larger than its disk is not an error (a tier holds what
    its filesystem has room for, and gains room as the disk frees up), but
    the user who asked for it should know it will not be met."""
    for tier in cache.tiers:
        limit = tier.limit()
        if limit < tier.capacity:
            log.warning(
                "%s tier: capacity %s, but the filesystem of %s has room for %s; "
                "the tier holds no more than the disk allows",
                tier.name,
                human_bytes(tier.capacity),
                tier.root,
                human_bytes(max(0, limit)),
            )


def data_path(
    store: ObjectStore,
    cache: TieredCache,
    index: Index,
    io: LoopThread,
    metrics: Metrics,
    model: WorkloadModel,
    settings: Settings,
    read_marks: ReadMarks,
    whole_files: WholeFiles,
    reads: ReadEvents | None = None,
    listing_clock: Callable[[], float] = time.time,
    fresh_wait: float = FRESH_WAIT_SECONDS,
    shared: SharedCache | None = None,
    writes: tuple[Journal, UploadEvents] | None = None,
) -> tuple[BlockReader, CacheView, Namespace, Prefetcher, FileSystem]:
    """The data path over an opened cache, from the fetcher to the
    filesystem, wired as every mount has it; ``reads`` counts its reads
    (``metrics`` when None), ``listing_clock`` and ``fresh_wait`` are the
    namespace's (tests pass their own); ``shared`` the node's shared tier;
    ``read_marks`` where reads mark the blocks another job is still to
    read, for the cache's policy; ``whole_files`` makes the whole files of
    objects read to their end (the caller starts and stops it); ``writes``
    makes the mount writable: the journal its staged files are recorded
    in, and what its uploads tell (the caller starts and stops them).
    The mount's block cache: its own recent blocks in RAM, then the
    node's local tiers, then the shared tier."""
    fetcher = Fetcher(store, settings.fetch, metrics)
    dedup_by_etag = settings.cache.dedup_by_etag and store.content_etags
    levels: list[BlockCache] = [RecentBlocks(), cache]
    if shared is not None:
        levels.append(shared)
    reader = BlockReader(
        store.cache_key,
        settings.cache.block_size,
        LayeredCache(levels),
        fetcher,
        io,
        metrics if reads is None else reads,
        dedup_by_etag,
    )
    namespace = Namespace(
        store,
        fetcher,
        io,
        index,
        settings.namespace.metadata_ttl,
        # fs is built below, before any listing is refreshed.
        on_version_gone=lambda info: fs.version_gone(info),  # noqa: PLW0108
        trust_saved=settings.namespace.trust_saved_listings,
        clock=listing_clock,
        fresh_wait=fresh_wait,
    )
    view = CacheView(store.cache_key, cache, settings.cache.block_size, whole_files)
    prefetcher = Prefetcher(model, namespace, reader, view, settings.prefetch, metrics)
    writable = None
    if writes is not None:
        journal, upload_events = writes
        staging = Staging(store.cache_key, cache.tiers[0].root / STAGED_DIR, journal, cache, view.admit_file)
        uploads = Uploads(
            store, staging, io, upload_events, settings.fetch.deadline, namespace.wrote, namespace.removed
        )
        writable = Writes(staging, uploads, Bucket(store, fetcher, io))
    fs = FileSystem(
        namespace,
        reader,
        view,
        os.getuid(),
        os.getgid(),
        access=prefetcher,
        jobs=CallerJobs(),
        read_marks=read_marks,
        kernel=Tables(settings.namespace.metadata_ttl),
        writes=writable,
    )
    return reader, view, namespace, prefetcher, fs


class NodeEpochs:
    """``EpochClock`` over the workload models of a daemon's mounts: the
    cache's policy ranks every block by one clock. Each model already
    serves several workloads the same way (its highest epoch), so the node's
    clock is the highest epoch of any mount. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._models: list[WorkloadModel] = []

    def add(self, model: WorkloadModel) -> None:
        with self._lock:
            self._models.append(model)

    def remove(self, model: WorkloadModel) -> None:
        with self._lock:
            self._models.remove(model)

    def _current_models(self) -> list[WorkloadModel]:
        with self._lock:
            return list(self._models)

    def current(self) -> int:
        return max((model.current() for model in self._current_models()), default=0)

    def job_epochs(self) -> dict[str, int]:
        """Each job (``jobs.py``) -> the highest epoch of its workloads on any mount."""
        epochs: dict[str, int] = {}
        for model in self._current_models():
            for job, epoch in model.job_epochs().items():
                epochs[job] = max(epoch, epochs.get(job, epoch))
        return epochs


class Node:
    """What all the mounts of one daemon share: the I/O loop, the metrics,
    one epoch clock, the jobs' loader meters, the plans and the marks of
    reads other jobs are still to make that the policy reads, and the cache
    (tiers, index, policy), opened once by ``opened``. ``close`` stops the loop."""

    def __init__(self) -> None:
        reuse_block_buffers()
        self.metrics = Metrics(CollectorRegistry())
        self.epochs = NodeEpochs()
        self.metrics.watch_epoch(self.epochs.current, self.epochs.job_epochs)
        self.meters = MeterLedger(self.metrics.job_reads_so_far, self.metrics)
        self.planned = PlannedUse()
        self.read_marks = ReadMarks()
        self.io = LoopThread()
        self._opened: OpenCache | None = None
        self._shared: SharedCache | None = None
        self._journal: Journal | None = None

    @property
    def cache(self) -> TieredCache:
        assert self._opened is not None, "the node's cache is not open"
        return self._opened.cache

    @property
    def index(self) -> Index:
        assert self._opened is not None, "the node's cache is not open"
        return self._opened.index

    @contextmanager
    def source(self, settings: Settings, store_factory: StoreFactory = open_store) -> Iterator[ObjectStore]:
        """The store of ``settings.source``, proved reachable (bounded), closed on exit."""
        store = store_factory(settings.source, settings.store, settings.fetch)
        try:
            if not self.io.run(store.check(), MOUNT_CHECK_SECONDS):
                log.warning("%s holds no objects: is its prefix mistyped?", store.uri)
            yield store
        finally:
            with contextlib.suppress(CachefsdError):
                self.io.run(store.close(), MOUNT_CHECK_SECONDS)

    @contextmanager
    def opened(
        self,
        cache: CacheSettings,
        lock_wait: float | None = None,
        mounting: bool = False,
        keep_recorded_layout: bool = False,
    ) -> Iterator[None]:
        """The cache open (locked, reconciled) within the block: see ``engine``."""
        with open_cache(
            cache.dir,
            tier_specs(cache),
            cache.policy,
            self.epochs,
            self.metrics,
            lock_wait,
            self.planned,
            cache.block_size,
            migrate_block_size=mounting,
            keep_recorded_layout=keep_recorded_layout,
            elsewhere=self.read_marks,
        ) as opened:
            _warn_of_small_disks(opened.cache)
            self._opened = opened
            self._journal = Journal(cache.dir)
            if cache.shared is not None:
                shared = cache.shared
                store = open_shared(shared.url, shared.endpoint_url, shared.credentials_env_prefix)
                self._shared = SharedCache(
                    store,
                    self.io,
                    cache.block_size,
                    self.metrics,
                    SharedFetches(self.metrics),
                    time.monotonic,
                )
            try:
                yield
            finally:
                if self._shared is not None:
                    self._shared.close()
                    self._shared = None
                self._journal.close()
                self._journal = None
                self._opened = None

    @contextmanager
    def mount(self, settings: Settings, store: ObjectStore) -> Iterator[Engine]:
        """The data path of one mount over the node's cache; its access
        model ticks the node's clock until the block ends."""
        model = WorkloadModel()
        events = self.metrics.for_mount(str(settings.mountpoint))
        whole_files = WholeFiles(self.cache.assemble_whole)
        assert self._journal is not None
        writes = (self._journal, events) if settings.writable else None
        reader, view, namespace, prefetcher, fs = data_path(
            store,
            self.cache,
            self.index,
            self.io,
            self.metrics,
            model,
            settings,
            self.read_marks,
            whole_files,
            events,
            shared=self._shared,
            writes=writes,
        )
        whole_files.start()
        self.epochs.add(model)
        if fs.writes is not None:
            fs.writes.staging.start(fs.writes.uploads)
            fs.writes.uploads.start()
            events.watch_writes(fs.writes.staging.staged_bytes, fs.writes.uploads.oldest_due_seconds)
        try:
            yield Engine(
                store,
                self.cache,
                self.index,
                reader,
                view,
                namespace,
                self.metrics,
                prefetcher,
                model,
                fs,
                events,
                None if fs.writes is None else fs.writes.uploads,
            )
        finally:
            if fs.writes is not None:
                self._stop_writes(fs.writes, settings)
            whole_files.stop()
            self.epochs.remove(model)
            self.metrics.forget_mount(str(settings.mountpoint))

    @staticmethod
    def _stop_writes(writes: Writes, settings: Settings) -> None:
        """Wait a while for the uploads due, then say what stays staged."""
        left = writes.uploads.stop(UNMOUNT_UPLOAD_SECONDS)
        writes.staging.close()
        if left:
            log.warning(
                "%s: %d files are not in the bucket yet and stay staged; "
                "the next mount of %s uploads them: %s",
                settings.mountpoint,
                len(left),
                settings.source,
                ", ".join(sorted(left)[:10]),
            )

    def close(self) -> None:
        self.io.stop()


@contextmanager
def open_engine(
    settings: Settings,
    lock_wait: float | None = None,
    mounting: bool = False,
    keep_recorded_layout: bool = False,
    store_factory: StoreFactory = open_store,
) -> Iterator[Engine]:
    """One mount's data path on a node of its own: prove the source
    reachable, open the cache (locks, reconcile), and build the data path;
    close it all on exit. ``mounting`` for the daemon's, which may drop a
    cache filled at another block size (an offline stage refuses it);
    ``keep_recorded_layout`` for an offline stage, which fills a cache as
    its daemon laid it out. ``store_factory`` opens the source (tests give
    one over an in-memory store)."""
    node = Node()
    try:
        # The source first: a mount that fails on it must not have opened
        # (and trimmed to a mistyped capacity) the cache.
        with (
            node.source(settings, store_factory) as store,
            node.opened(settings.cache, lock_wait, mounting, keep_recorded_layout),
            node.mount(settings, store) as parts,
        ):
            yield parts
    finally:
        node.close()
