"""The daemon process: the engine's data path served through a FUSE mount,
with the metrics endpoint and the control API beside it.

A failure before the kernel has initialised the mount is raised to the
caller, which reports it in one line; ``ready`` is called once it has.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import os
from collections.abc import Callable

from prometheus_client import CollectorRegistry, start_http_server

from cachefsd.config import Settings
from cachefsd.control.mounts import MountState, control_path, write_state
from cachefsd.control.server import ControlServer, MountHandlers
from cachefsd.engine import engine
from cachefsd.errors import ConfigError
from cachefsd.fuse.session import Session
from cachefsd.jobs import CallerJobs
from cachefsd.preflight import check_allow_other, check_fuse_device, check_mountpoint
from cachefsd.stats import DaemonStats, Residency

log = logging.getLogger(__name__)


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
    if not ipaddress.ip_address(str(server.server_address[0])).is_loopback:
        log.warning(
            "metrics are served beyond this node (%s): they name datasets and sizes", settings.metrics.addr
        )
    return f"{host}:{server.server_port}"


def _for_job(
    hint: Callable[[list[str], tuple[int, int] | None, str], tuple[int, int]], jobs: CallerJobs
) -> Callable[[list[str], tuple[int, int] | None, int], tuple[int, int]]:
    """``hint`` for the job of the process that sent it."""
    return lambda order, part, pid: hint(order, part, jobs.of(pid))


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
        job_hint = None if hint is None else _for_job(hint, parts.fs.jobs)
        # /stats and the metrics endpoint read the same registry; residency
        # is one cached index query shared by both.
        residency = Residency(
            functools.partial(parts.index.resident_bytes_by_prefix, parts.store.cache_key),
            [tier.name for tier in parts.cache.tiers],
        )
        parts.metrics.watch_residency(parts.store.uri, residency.rows)
        stats = DaemonStats(parts.metrics, parts.model, residency, parts.store.uri)
        stats.start()
        handlers = MountHandlers(
            parts.namespace, parts.reader, parts.cache, identity, job_hint, stats.snapshot
        )
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
            session = Session(
                parts.fs, str(mountpoint), settings.namespace.metadata_ttl, settings.cache.block_size, ready
            )
            session.serve(
                f"cachefsd:{parts.store.uri}", settings.fuse.allow_other, settings.fetch.concurrency
            )
            log.info("unmounted %s", mountpoint)
        finally:
            parts.prefetcher.stop()
            state.unlink(missing_ok=True)
            control.stop()
            stats.stop()
