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
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from cachefsd.aio import LoopThread
from cachefsd.buffers import reuse_block_buffers
from cachefsd.cache.directory import open_cache, tier_specs
from cachefsd.cache.index import Index
from cachefsd.cache.policy import PlannedUse
from cachefsd.cache.tiered import TieredCache
from cachefsd.config import FetchSettings, Settings, StoreSettings, human_bytes
from cachefsd.errors import CachefsdError
from cachefsd.fetch import Fetcher
from cachefsd.fs import FileSystem
from cachefsd.jobs import CallerJobs
from cachefsd.metrics import Metrics
from cachefsd.namespace.tree import FRESH_WAIT_SECONDS, Namespace
from cachefsd.prefetch.access import AccessModel
from cachefsd.prefetch.engine import Prefetcher
from cachefsd.reader import BlockReader
from cachefsd.store import open_store
from cachefsd.store.base import ObjectStore

log = logging.getLogger(__name__)

# Opens the source of a mount: (source URL or path, store settings, fetch settings).
StoreFactory = Callable[[str, StoreSettings, FetchSettings], ObjectStore]

# Proving the source reachable at mount: a connect timeout plus one small
# request. Longer than that and the user is better served by an error.
MOUNT_CHECK_SECONDS = 15.0


@dataclass
class Engine:
    """Everything between the FUSE layer and the bucket: what a mount serves
    from, and what ``cachefsd stage`` uses directly when no daemon runs."""

    store: ObjectStore
    cache: TieredCache
    index: Index
    reader: BlockReader
    namespace: Namespace
    metrics: Metrics
    prefetcher: Prefetcher
    model: AccessModel
    fs: FileSystem


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
    model: AccessModel,
    settings: Settings,
    listing_clock: Callable[[], float] = time.time,
    fresh_wait: float = FRESH_WAIT_SECONDS,
) -> tuple[BlockReader, Namespace, Prefetcher, FileSystem]:
    """The data path over an opened cache, from the fetcher to the
    filesystem, wired as every mount has it; ``listing_clock`` and
    ``fresh_wait`` are the namespace's (tests pass their own)."""
    fetcher = Fetcher(store, settings.fetch, metrics)
    dedup_by_etag = settings.cache.dedup_by_etag and store.content_etags
    reader = BlockReader(
        store.cache_key, settings.cache.block_size, cache, fetcher, io, metrics, dedup_by_etag
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
    prefetcher = Prefetcher(model, namespace, reader, settings.prefetch, metrics)
    fs = FileSystem(namespace, reader, os.getuid(), os.getgid(), access=prefetcher, jobs=CallerJobs())
    return reader, namespace, prefetcher, fs


@contextmanager
def engine(
    settings: Settings,
    lock_wait: float | None = None,
    mounting: bool = False,
    keep_recorded_layout: bool = False,
    store_factory: StoreFactory = open_store,
) -> Iterator[Engine]:
    """Prove the source reachable, open the cache (locks, reconcile), and
    build the data path; close it all on exit. ``mounting`` for the
    daemon's, which may drop a cache filled at another block size (an
    offline stage refuses it); ``keep_recorded_layout`` for an offline
    stage, which fills a cache as its daemon laid it out. ``store_factory``
    opens the source (tests give one over an in-memory store)."""
    reuse_block_buffers()
    metrics = Metrics(CollectorRegistry())
    model = AccessModel()
    metrics.watch_epoch(model.current, model.caller_epochs)
    planned = PlannedUse()
    io = LoopThread()
    try:
        # The source first: a mount that fails on it must not have opened
        # (and trimmed to a mistyped capacity) the cache.
        store = store_factory(settings.source, settings.store, settings.fetch)
        try:
            if not io.run(store.check(), MOUNT_CHECK_SECONDS):
                log.warning("%s holds no objects: is its prefix mistyped?", store.uri)
            with open_cache(
                settings.cache.dir,
                tier_specs(settings.cache),
                settings.cache.policy,
                model,
                metrics,
                lock_wait,
                planned,
                settings.cache.block_size,
                migrate_block_size=mounting,
                keep_recorded_layout=keep_recorded_layout,
            ) as opened:
                _warn_of_small_disks(opened.cache)
                reader, namespace, prefetcher, fs = data_path(
                    store, opened.cache, opened.index, io, metrics, model, settings
                )
                yield Engine(
                    store, opened.cache, opened.index, reader, namespace, metrics, prefetcher, model, fs
                )
        finally:
            with contextlib.suppress(CachefsdError):
                io.run(store.close(), MOUNT_CHECK_SECONDS)
    finally:
        io.stop()
