"""The composition root: the only place that builds and wires the parts.

Start-up order matters for the promise that a bad mount fails fast and
loses nothing: validate the cache directory and take its lock, reconcile the
cache, prove the source is reachable (bounded), start metrics, and only then
mount. ``ready`` is called once the kernel has initialised the mount; a
failure before that is raised to the caller, which reports it in one line.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

from prometheus_client import CollectorRegistry, start_http_server

from cachefsd.aio import LoopThread
from cachefsd.blocks import BlockReader
from cachefsd.chunks.cache import BlockCache
from cachefsd.config import Settings
from cachefsd.errors import CachefsdError, ConfigError
from cachefsd.fetch import Fetcher
from cachefsd.fs import FileSystem
from cachefsd.fuse_ops import FuseOperations, serve
from cachefsd.index import Index, IndexSchemaMismatch
from cachefsd.metrics import Metrics
from cachefsd.namespace.tree import Namespace
from cachefsd.runtime import CacheDirLock, MountState, write_state
from cachefsd.store import open_store

log = logging.getLogger(__name__)

# Proving the source reachable at mount: a connect timeout plus one small
# request. Longer than that and the user is better served by an error.
MOUNT_CHECK_SECONDS = 15.0


def _check_mountpoint(mountpoint: Path) -> None:
    if not mountpoint.is_dir():
        raise ConfigError(f"mountpoint: {mountpoint} is not a directory")
    if os.path.ismount(mountpoint):
        raise ConfigError(f"mountpoint: {mountpoint} is already a mount point")
    if any(mountpoint.iterdir()):
        raise ConfigError(f"mountpoint: {mountpoint} is not empty")


def _open_index(cache_dir: Path) -> Index:
    path = cache_dir / "index.sqlite"
    try:
        return Index(path)
    except IndexSchemaMismatch as exc:
        # The cache is advisory: an index from another version is set aside
        # (its blocks become orphans that reconcile removes), never misread.
        log.warning("%s; starting a new index", exc)
        for suffix in ("", "-wal", "-shm"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)
        return Index(path)


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
    return f"{host}:{server.server_port}"


def run(settings: Settings, ready: Callable[[], None]) -> None:
    """Mount ``settings.source`` and serve until unmounted."""
    os.umask(0o077)  # cache files and runtime state are owner-only
    mountpoint = settings.mountpoint.resolve()
    _check_mountpoint(mountpoint)
    cache_dir = settings.cache.dir
    try:
        cache_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cache.dir: cannot create {cache_dir}: {exc.strerror}") from exc
    lock = CacheDirLock(cache_dir)
    io = LoopThread()
    index = _open_index(cache_dir)
    try:
        registry = CollectorRegistry()
        metrics = Metrics(registry)
        cache = BlockCache(cache_dir, settings.cache.size, index, metrics)
        cache.reconcile()
        store = open_store(settings.source, settings.store, settings.fetch.attempt_timeout)
        try:
            io.run(store.check(), MOUNT_CHECK_SECONDS)
            fetcher = Fetcher(store, settings.fetch, metrics)
            reader = BlockReader(store.uri, settings.cache.block_size, cache, fetcher, io, metrics)

            namespace = Namespace(
                store,
                fetcher,
                io,
                index,
                settings.namespace.metadata_ttl,
                on_version_gone=reader.release_version,
            )
            metrics_addr = _start_metrics(settings, registry)
            fs = FileSystem(namespace, reader, os.getuid(), os.getgid())
            state = write_state(
                MountState(os.getpid(), str(mountpoint), store.uri, str(cache_dir), metrics_addr)
            )
            try:
                log.info(
                    "mounting %s on %s (cache %s, metrics %s)", store.uri, mountpoint, cache_dir, metrics_addr
                )
                operations = FuseOperations(fs, settings.namespace.metadata_ttl, ready)
                serve(
                    operations,
                    str(mountpoint),
                    f"cachefsd:{store.uri}",
                    settings.fuse.allow_other,
                )
                log.info("unmounted %s", mountpoint)
            finally:
                state.unlink(missing_ok=True)
        finally:
            with contextlib.suppress(CachefsdError):
                io.run(store.close(), MOUNT_CHECK_SECONDS)
        cache.save_recency()
    finally:
        index.close()
        io.stop()
        lock.release()
