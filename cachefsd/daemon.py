"""The daemon process: one node (the cache, metrics, one epoch clock) and
the mounts it serves, each a FUSE session on a thread of its own with its
control socket and state file beside it.

The mounts a daemon starts with are mounted in order; more join later
through the control API (``cachefsd mount`` on a cache directory this
daemon serves), and an unmount detaches one. The process ends with its
last mount. SIGTERM, SIGINT and SIGHUP end every session.

A failure before a mount is ready is raised to whoever asked for it,
which reports it in one line; ``ready`` is called once every starting
mount is.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from types import FrameType

from prometheus_client import CollectorRegistry, start_http_server

from cachefsd.config import NODE_SETTINGS, Settings, node_conflicts
from cachefsd.control.answers import NodeFacts, NodeMount
from cachefsd.control.mounts import MountState, control_path, remove_state, write_state
from cachefsd.control.server import ControlServer, MountHandlers
from cachefsd.diagnose.service import CacheFacts, Diagnosis
from cachefsd.engine import Node
from cachefsd.errors import CachefsdError, ConfigError
from cachefsd.fuse.session import Session
from cachefsd.jobs import CallerJobs
from cachefsd.preflight import check_mounts
from cachefsd.stats import DaemonStats, Residency
from cachefsd.store.base import ObjectStore

log = logging.getLogger(__name__)

# The longest a mount may take to be ready once its source answered (the
# cache is already open): the kernel's INIT comes within milliseconds.
SESSION_READY_SECONDS = 60.0
# How long a stopping session may take beyond its fetch deadline (it joins
# its workers, and a worker in a read waits for its block up to that
# deadline) before the daemon stops waiting and logs it.
SESSION_STOP_MARGIN_SECONDS = 10.0


def _start_metrics(settings: Settings, registry: CollectorRegistry) -> str | None:
    """Serve metrics; ``None`` when disabled. An address the user chose must
    work or the mount fails; the default one may be taken by another daemon
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


class _Mount:
    """One mount of the daemon: what it opened (``resources``, closed when
    its session ends), and its session on a thread of its own."""

    def __init__(
        self,
        settings: Settings,
        session: Session,
        ready: threading.Event,
        resources: ExitStack,
        state: MountState,
        ended: Callable[[_Mount], None],
    ) -> None:
        """``ended`` is called once the session has ended and ``resources`` are closed."""
        self.settings = settings
        self.mountpoint = settings.mountpoint
        self.session = session
        self.ready = ready  # set by the kernel's INIT, or when the session ends
        self.resources = resources
        self.state = state
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=self._serve, name=f"cachefsd-session:{self.mountpoint}")
        self._ended = ended

    def _serve(self) -> None:
        try:
            self.session.serve(
                f"cachefsd:{self.state.source}",
                self.settings.fuse.allow_other,
                self.settings.fetch.concurrency,
            )
            log.info("unmounted %s", self.mountpoint)
        except BaseException as exc:  # told to whoever waits for ``ready``, or logged
            self.failure = exc
            if self.ready.is_set():
                log.exception("the session of %s failed", self.mountpoint)
        finally:
            try:
                self.resources.close()
            except Exception:
                log.exception("closing the mount of %s failed", self.mountpoint)
            finally:
                self.ready.set()
                self._ended(self)


class Daemon:
    """The mounts of one node, attached and detached while it runs.
    ``attach`` is called on the main thread at start and on control-server
    threads after; the mounts table is guarded by ``_lock``."""

    def __init__(self, settings: Settings, node: Node, metrics_addr: str | None) -> None:
        self.settings = settings  # the daemon's own: cache, metrics and log are every mount's
        self._node = node
        self._metrics_addr = metrics_addr
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._mounts: dict[Path, _Mount] = {}
        self._attaching_at: set[Path] = set()  # attaches under way: the daemon does not end under them
        self._closing = False

    def attach(self, settings: Settings, source: tuple[ExitStack, ObjectStore] | None = None) -> MountState:
        """Mount ``settings`` on this node and return once the kernel has
        initialised it; raises (``ConfigError`` naming the setting) when it
        cannot be. ``source``: its store already opened and checked (the
        first mount, checked before the cache was opened), and what closes it."""
        opened = ExitStack()  # what the mount takes over once it is built
        try:
            if source is not None:
                opened.enter_context(source[0])
            conflicts = node_conflicts(self.settings, settings)
            if conflicts:
                raise ConfigError(
                    f"{conflicts[0]} (pid {os.getpid()}, cache {self.settings.cache.dir}): "
                    "a mount joining a running daemon shares its cache, metrics and log; "
                    "leave the setting out, or give another --cache-dir"
                )
            # What it left at its defaults is the daemon's too: blocks of one
            # cache are read at one size, whoever mounts.
            node = {key: getattr(self.settings, key) for key in NODE_SETTINGS}
            settings = settings.model_copy(update=node)
            mountpoint = settings.mountpoint
            with self._attaching(mountpoint):
                check_mounts([settings])
                store = opened.enter_context(self._node.source(settings)) if source is None else source[1]
                state = self._start(self._open(settings, store, opened))
        finally:
            opened.close()
        return state

    @contextlib.contextmanager
    def _attaching(self, mountpoint: Path) -> Iterator[None]:
        """While a mount is being attached: its mountpoint is taken, and the
        daemon does not end under it."""
        with self._lock:
            if self._closing:
                raise self._stopping()
            if mountpoint in self._mounts or mountpoint in self._attaching_at:
                raise ConfigError(
                    f"mountpoint: {mountpoint} is already mounted by cachefsd (pid {os.getpid()})"
                )
            self._attaching_at.add(mountpoint)
        try:
            yield
        finally:
            with self._changed:
                self._attaching_at.discard(mountpoint)
                self._changed.notify_all()

    def _stopping(self) -> CachefsdError:
        return CachefsdError(f"the daemon of {self.settings.cache.dir} is stopping: mount again")

    def _start(self, mount: _Mount) -> MountState:
        # A stop that came while the mount was being built finds it served
        # (the table and its thread together), or the mount never starts.
        with self._lock:
            refused = self._closing
            if not refused:
                self._mounts[mount.mountpoint] = mount
                mount.thread.start()
        if refused:
            mount.resources.close()
            raise self._stopping()
        if not mount.ready.wait(SESSION_READY_SECONDS):
            self._stop(mount)
            raise CachefsdError(
                f"the kernel did not initialise {mount.mountpoint} within {SESSION_READY_SECONDS:g}s"
            )
        if mount.failure is not None:
            raise mount.failure
        log.info(
            "mounted %s on %s (tiers %s, metrics %s)",
            mount.state.source,
            mount.mountpoint,
            ", ".join(f"{tier.name} {tier.root} {tier.capacity}B" for tier in self._node.cache.tiers),
            self._metrics_addr,
        )
        return mount.state

    def _open(self, settings: Settings, store: ObjectStore, opened: ExitStack) -> _Mount:
        """Everything one mount serves from, started, and its session (not
        yet serving); takes over what ``opened`` holds."""
        mountpoint = settings.mountpoint
        resources = ExitStack()
        try:
            state = MountState(
                os.getpid(),
                str(mountpoint),
                store.uri,
                str(self.settings.cache.dir),
                self._metrics_addr,
                str(control_path(mountpoint)),
            )
            # The state file goes last, so that ``cachefsd unmount``, which
            # waits for it to go, returns once everything here is closed.
            resources.callback(remove_state, state)
            resources.enter_context(opened.pop_all())
            parts = resources.enter_context(self._node.mount(settings, store))
            if settings.prefetch.enabled:
                parts.prefetcher.start()
            resources.callback(parts.prefetcher.stop)
            # /stats and the metrics endpoint read the same registry;
            # residency is one cached index query shared by both.
            residency = Residency(
                functools.partial(parts.index.resident_bytes_by_prefix, parts.store.cache_key),
                [tier.name for tier in parts.cache.tiers],
            )
            parts.metrics.watch_residency(str(mountpoint), parts.store.uri, residency.rows)
            ready = threading.Event()
            session = Session(
                parts.fs,
                str(mountpoint),
                settings.namespace.metadata_ttl,
                settings.cache.block_size,
                ready.set,
                parts.mount_events,
                parts.cache.tiers[0].root if settings.fuse.passthrough else None,
            )
            stats = DaemonStats(
                parts.metrics,
                parts.model,
                residency,
                parts.store.uri,
                str(mountpoint),
                self.node_stats,
                lambda: str(session.passthrough),
                writes=parts.fs.writes,
            )
            stats.start()
            resources.callback(stats.stop)
            hint = parts.prefetcher.hint if settings.prefetch.enabled else None
            handlers = MountHandlers(
                parts.namespace,
                parts.reader,
                parts.view,
                parts.cache,
                state,
                stats.snapshot,
                None if hint is None else _for_job(hint, parts.fs.jobs),
                node=self,
                diagnosis=Diagnosis(
                    self._node.meters,
                    parts.fs.jobs,
                    parts.model.observed,
                    str(mountpoint),
                    CacheFacts(
                        lambda: parts.cache.capacity, settings.cache.policy, settings.cache.block_size
                    ),
                ),
                uploads=parts.uploads,
            )
            # The control API starts before the state file names its socket,
            # and stops before the data path closes.
            control = ControlServer(control_path(mountpoint), handlers)
            control.start()
            resources.callback(control.stop)
            write_state(state)
        except BaseException:
            resources.close()
            raise
        return _Mount(settings, session, ready, resources, state, self._ended)

    def _ended(self, mount: _Mount) -> None:
        with self._changed:
            if self._mounts.get(mount.mountpoint) is mount:
                del self._mounts[mount.mountpoint]
            self._changed.notify_all()

    def detach(self, mountpoint: str) -> None:
        """End the session of ``mountpoint`` (the mount a joining command
        gave up on): it is unmounted lazily, as by SIGTERM."""
        with self._lock:
            mount = self._mounts.get(Path(mountpoint))
        if mount is not None:
            self._stop(mount)

    def stop_all(self) -> None:
        """End every session (a signal, or the mounting command is gone)."""
        with self._lock:
            self._closing = True
            mounts = list(self._mounts.values())
        for mount in mounts:
            threading.Thread(target=self._stop, args=(mount,), name="cachefsd-stop", daemon=True).start()

    @staticmethod
    def _stop(mount: _Mount) -> None:
        bound = mount.settings.fetch.deadline + SESSION_STOP_MARGIN_SECONDS
        mount.session.stop()
        mount.thread.join(bound)
        if mount.thread.is_alive():
            log.warning("the session of %s did not stop within %gs", mount.mountpoint, bound)

    def serve(self) -> None:
        """Until the last mount has ended (no attach under way)."""
        with self._changed:
            while self._mounts or self._attaching_at:
                self._changed.wait()
            self._closing = True

    def node_stats(self) -> NodeFacts:
        """What ``stats`` shows of the node beside one mount's own."""
        with self._lock:
            mounts = [
                NodeMount(mountpoint=str(path), source=mount.state.source)
                for path, mount in self._mounts.items()
            ]
        return NodeFacts(
            pid=os.getpid(),
            cache_dir=str(self.settings.cache.dir),
            metrics_addr=self._metrics_addr,
            mounts=sorted(mounts, key=lambda mount: mount.mountpoint),
        )


def run(mounts: list[Settings], ready: Callable[[], None]) -> None:
    """Mount each of ``mounts`` on one node (the first one's cache, metrics
    and log settings are all of theirs) and serve until the last is unmounted."""
    settings = mounts[0]
    check_mounts(mounts)
    node = Node()
    try:
        with ExitStack() as first_source:
            # The first source before the cache: a mount that fails on it
            # must not have opened (and trimmed to a mistyped capacity) the cache.
            store = first_source.enter_context(node.source(settings))
            with node.opened(settings.cache, mounting=True):
                daemon = Daemon(settings, node, _start_metrics(settings, node.metrics.registry))
                _serve(daemon, mounts, (first_source.pop_all(), store), ready)
    finally:
        node.close()


def _serve(
    daemon: Daemon,
    mounts: list[Settings],
    first_source: tuple[ExitStack, ObjectStore],
    ready: Callable[[], None],
) -> None:
    def stop(signum: int, frame: FrameType | None) -> None:
        # On a thread: the main thread may hold the daemon's lock right now.
        log.info("%s: unmounting every mount", signal.Signals(signum).name)
        threading.Thread(target=daemon.stop_all, name="cachefsd-stop", daemon=True).start()

    previous = {
        signum: signal.signal(signum, stop) for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    }
    try:
        try:
            daemon.attach(mounts[0], first_source)
            for each in mounts[1:]:
                daemon.attach(each)
        except BaseException:
            daemon.stop_all()
            daemon.serve()
            raise
        ready()
        daemon.serve()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
