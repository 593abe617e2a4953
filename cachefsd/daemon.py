"""The composition root: the only place that builds and wires the parts.

Start-up order matters for the promise that a bad mount fails fast and
loses nothing: validate the cache directories and take their locks,
reconcile the cache, prove the source is reachable (bounded), start
metrics, and only then mount. ``ready`` is called once the kernel has initialised the mount; a
failure before that is raised to the caller, which reports it in one line.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, start_http_server

from cachefsd.aio import LoopThread
from cachefsd.blocks import BlockReader
from cachefsd.cachedir import open_cache, tier_specs
from cachefsd.chunks.cache import TieredCache
from cachefsd.chunks.policy import PlannedUse
from cachefsd.config import Settings, human_bytes
from cachefsd.control import ControlServer, control_path
from cachefsd.errors import CachefsdError, ConfigError
from cachefsd.fetch import Fetcher
from cachefsd.fs import FileSystem
from cachefsd.fuse_ops import FuseOperations, serve
from cachefsd.index import Index
from cachefsd.metrics import Metrics
from cachefsd.namespace.tree import Namespace
from cachefsd.prefetch.access import AccessModel
from cachefsd.prefetch.engine import Prefetcher
from cachefsd.runtime import MountState, check_allow_other, check_fuse_device, check_mountpoint, write_state
from cachefsd.stage import MountHandlers
from cachefsd.stats import DaemonStats, Residency
from cachefsd.store import open_store
from cachefsd.store.base import ObjectStore

log = logging.getLogger(__name__)

# Proving the source reachable at mount: a connect timeout plus one small
# request. Longer than that and the user is better served by an error.
MOUNT_CHECK_SECONDS = 15.0


def _start_metrics(settings: Settings, registry: CollectorRegistry) -> str | None:
    """Serve metrics; ``None`` when disabled. An address the user chose must
    work or the mount fails; the default one may be taken by another mount
    on this node, which then runs without metrics rather than not at all."""
    if not settings.metrics.enabled:
        return None
    host, _, port = settings.metrics.addr.rpartition(":")
    try:
        server, _ = start_http_server(int(port), addr=host.strip("[]"), registry=registry)
    except OSError as exc:
        if "addr" in settings.metrics.model_fields_set:
            raise ConfigError(
                f"metrics.addr: cannot listen on {settings.metrics.addr}: {exc.strerror}"
            ) from exc
        log.warning(
            "metrics disabled: default address %s is in use (%s); set --metrics-addr",
            settings.metrics.addr,
            exc.strerror,
        )
        return None
    if not ipaddress.ip_address(server.server_address[0]).is_loopback:
        log.warning(
            "metrics are served beyond this node (%s): they name datasets and sizes", settings.metrics.addr
        )
    return f"{host}:{server.server_port}"


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


@contextmanager
def engine(
    settings: Settings,
    lock_wait: float | None = None,
    mounting: bool = False,
    keep_recorded_layout: bool = False,
) -> Iterator[Engine]:
    """Prove the source reachable, open the cache (locks, reconcile), and
    build the data path; close it all on exit. ``mounting`` for the
    daemon's, which may drop a cache filled at another block size (an
    offline stage refuses it); ``keep_recorded_layout`` for an offline
    stage, which fills a cache as its daemon laid it out."""
    metrics = Metrics(CollectorRegistry())
    model = AccessModel()
    metrics.watch_epoch(model.current)
    planned = PlannedUse()
    io = LoopThread()
    try:
        # The source first: a mount that fails on it must not have opened
        # (and trimmed to a mistyped capacity) the cache.
        store = open_store(settings.source, settings.store, settings.fetch.attempt_timeout)
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
                fetcher = Fetcher(store, settings.fetch, metrics)
                dedup_by_etag = settings.cache.dedup_by_etag and store.content_etags
                reader = BlockReader(
                    store.cache_key,
                    settings.cache.block_size,
                    opened.cache,
                    fetcher,
                    io,
                    metrics,
                    dedup_by_etag,
                )
                namespace = Namespace(
                    store,
                    fetcher,
                    io,
                    opened.index,
                    settings.namespace.metadata_ttl,
                    # fs is built below, before any listing is refreshed.
                    on_version_replaced=lambda info: fs.version_replaced(info),  # noqa: PLW0108
                    on_version_gone=lambda info: fs.version_gone(info),  # noqa: PLW0108
                )
                prefetcher = Prefetcher(model, namespace, reader, settings.prefetch, metrics)
                fs = FileSystem(namespace, reader, os.getuid(), os.getgid(), access=prefetcher)
                yield Engine(
                    store, opened.cache, opened.index, reader, namespace, metrics, prefetcher, model, fs
                )
        finally:
            with contextlib.suppress(CachefsdError):
                io.run(store.close(), MOUNT_CHECK_SECONDS)
    finally:
        io.stop()


def run(settings: Settings, ready: Callable[[], None]) -> None:
    """Mount ``settings.source`` and serve until unmounted."""
    mountpoint = settings.mountpoint.resolve()
    check_fuse_device()
    check_allow_other(settings.fuse.allow_other)
    check_mountpoint(mountpoint, settings.cache.directories())
    with engine(settings, mounting=True) as parts:
        metrics_addr = _start_metrics(settings, parts.metrics.registry)
        if settings.prefetch.enabled:
            parts.prefetcher.start()
        # The control API starts before the state file names its socket, and
        # stops before the engine closes.
        identity = {"pid": os.getpid(), "mountpoint": str(mountpoint), "source": parts.store.uri}
        hint = parts.prefetcher.hint if settings.prefetch.enabled else None
        # /stats and the metrics endpoint read the same registry; residency
        # is one cached index query shared by both.
        residency = Residency(
            functools.partial(parts.index.resident_bytes_by_prefix, parts.store.cache_key),
            [tier.name for tier in parts.cache.tiers],
        )
        parts.metrics.watch_residency(parts.store.uri, residency.rows)
        stats = DaemonStats(parts.metrics, parts.model, residency, parts.store.uri)
        stats.start()
        handlers = MountHandlers(parts.namespace, parts.reader, parts.cache, identity, hint, stats.snapshot)
        control = ControlServer(control_path(mountpoint), handlers)
        control.start()
        state = write_state(
            MountState(
                os.getpid(),
                str(mountpoint),
                parts.store.uri,
                str(settings.cache.dir),
                metrics_addr,
                str(control.path),
            )
        )
        try:
            log.info(
                "mounting %s on %s (tiers %s, metrics %s)",
                parts.store.uri,
                mountpoint,
                ", ".join(f"{tier.name} {tier.root} {tier.capacity}B" for tier in parts.cache.tiers),
                metrics_addr,
            )
            operations = FuseOperations(
                parts.fs, str(mountpoint), settings.namespace.metadata_ttl, settings.cache.block_size, ready
            )
            serve(
                operations,
                str(mountpoint),
                f"cachefsd:{parts.store.uri}",
                settings.fuse.allow_other,
                settings.fetch.concurrency,
            )
            log.info("unmounted %s", mountpoint)
        finally:
            parts.prefetcher.stop()
            state.unlink(missing_ok=True)
            control.stop()
            stats.stop()
