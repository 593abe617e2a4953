"""The FUSE edge: a libfuse low-level session whose requests go to
``fs.FileSystem``, one line each, and whose answers go back to the kernel.

Our errors become their errno through ``errors.errno_for`` here and only
here; anything else is a bug, logged with its traceback and answered EIO.
Every request is answered exactly once, whatever happens: a request left
unanswered hangs its caller for good.

What the kernel is told, at INIT and in each answer, is what lets it serve
warm reads without asking: an inode's attributes and pages are those of one
object version, so the kernel opens files without an OPEN request (no-open
support: it keeps each inode's pages across opens), caches entries and
attributes for the metadata TTL, and gets a directory's entries with their
attributes in one request (READDIRPLUS) so a loader's scan fills its
dentries. A name whose version changed upstream is invalidated by a thread
of its own (``_Notifier``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import logging
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, ParamSpec

from cachefsd.buffers import address
from cachefsd.cache.blocks import FileSpan
from cachefsd.errors import CachefsdError, ObjectChanged, errno_for
from cachefsd.fs import Attributes, FileSystem
from cachefsd.fuse import lowlevel as ll
from cachefsd.reader import Piece, close_pieces

log = logging.getLogger(__name__)

# libfuse workers beyond those that may all be waiting on GETs (``serve``).
SPARE_WORKERS = 8
# How long an unmount waits for the notifier's last notification.
NOTIFIER_STOP_SECONDS = 5.0

P = ParamSpec("P")

_worker = threading.local()


def _keep_thread_state() -> None:
    """Give the calling libfuse worker thread a Python thread state for good.

    libfuse's workers are C threads: for each callback ctypes creates a
    thread state and deletes it on return, and with it the state's frame
    stack, an mmap'd chunk whose munmap stops every other CPU to flush its
    TLB: a third of the daemon's CPU on small files. One extra
    ``PyGILState_Ensure``, never released, keeps the state (and this
    thread-local) alive. libfuse >= 3.12 never retires its workers (at most
    ``max_threads``, see ``serve``), so this holds at most that many states a
    session; those of a session that ended (a mount detached from a daemon
    that serves on) stay, some KiB each."""
    if not getattr(_worker, "kept", False):
        ctypes.pythonapi.PyGILState_Ensure()
        _worker.kept = True


def _answered(handler: Callable[P, None]) -> Callable[P, None]:
    """Run a request handler whose first argument is the request; answer
    it with the errno of whatever it raised."""

    @functools.wraps(handler)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> None:
        _keep_thread_state()
        try:
            handler(*args, **kwargs)
        except CachefsdError as exc:
            ll.lib.fuse_reply_err(args[1], errno_for(exc))
        except Exception:
            log.exception("unexpected error in %s", handler.__name__)
            ll.lib.fuse_reply_err(args[1], errno.EIO)

    return wrapper


def _fill(target: ll.Stat, attributes: Attributes) -> None:
    seconds = int(attributes.mtime)
    nanoseconds = int((attributes.mtime - seconds) * 1e9)
    target.st_ino = attributes.st_ino
    target.st_mode = attributes.mode
    target.st_nlink = attributes.nlink
    target.st_uid = attributes.uid
    target.st_gid = attributes.gid
    target.st_size = attributes.size
    target.st_blocks = -(-attributes.size // 512)
    target.st_atime = target.st_mtime = target.st_ctime = seconds
    target.st_atime_nsec = target.st_mtime_nsec = target.st_ctime_nsec = nanoseconds


def _reply_pieces(request: int, pieces: list[Piece]) -> None:
    """Send ``pieces`` as one reply: memory as it is, block files by their
    descriptor, which libfuse reads in C before this returns. Then the
    block files' pages are dropped: the kernel now holds these bytes in
    the mounted file's own pages, and RAM should hold them once."""
    vector = ll.bufvec_type(max(len(pieces), 1))()
    vector.count = len(pieces)
    for slot, piece in zip(vector.buf, pieces, strict=False):
        if isinstance(piece, FileSpan):
            slot.size, slot.fd, slot.pos = piece.length, piece.fd, piece.offset
            slot.flags = ll.BUF_IS_FD | ll.BUF_FD_SEEK | ll.BUF_FD_RETRY
        else:
            slot.size, slot.mem, slot.fd = len(piece), address(piece), -1
    try:
        ll.lib.fuse_reply_data(request, ctypes.byref(vector), 0)
    finally:
        # Answered: nothing here may raise, or the request would be answered twice.
        for piece in pieces:
            if isinstance(piece, FileSpan):
                with contextlib.suppress(OSError):
                    os.posix_fadvise(piece.fd, piece.offset, piece.length, os.POSIX_FADV_DONTNEED)
        close_pieces(pieces)


class _Notifier:
    """Tells the kernel to forget the entries ``fs`` names stale, from a
    thread of its own: a notification waits for the directory's lock,
    which the kernel holds while it waits for a lookup we are answering."""

    _STOP = (0, "")

    def __init__(self, fs: FileSystem, session: int) -> None:
        self._fs = fs
        self._session = session
        self._thread = threading.Thread(target=self._run, name="cachefsd-notify", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Once the session loop has ended. Bounded: a notification can wait
        on a directory's lock held by a lookup no worker will answer now,
        and the thread, a daemon one, must not hold up the unmount."""
        self._fs.stale_entries.put(self._STOP)
        self._thread.join(NOTIFIER_STOP_SECONDS)

    def _run(self) -> None:
        while (entry := self._fs.stale_entries.get()) != self._STOP:
            self.invalidate(*entry)

    def invalidate(self, parent: int, name: str) -> None:
        """Tell the kernel to forget ``name`` in ``parent`` now. From a
        request thread only where the kernel holds no directory lock (READ)."""
        encoded = os.fsencode(name)
        result = ll.lib.fuse_lowlevel_notify_inval_entry(self._session, parent, encoded, len(encoded))
        if result < 0 and result != -errno.ENOENT:  # ENOENT: the kernel does not hold it (any more)
            log.debug("could not invalidate %r in inode %d: %s", name, parent, os.strerror(-result))


def _set_read_ahead(mountpoint: str, nbytes: int) -> None:
    """Let the kernel read ahead ``nbytes`` of a file being read in order.

    The kernel's default (128 KiB) makes it ask for 256 KiB at a time, so a
    sequential reader costs one trip through Python per 256 KiB; with a
    block's worth of read-ahead it asks for 1 MiB (libfuse's largest
    request). Needs root (sysfs); without it the default stays. Runs on its
    own thread once the mount answers: the kernel sets read-ahead from
    libfuse's reply to INIT, after the init callback has returned."""
    try:
        device = os.stat(mountpoint).st_dev
        Path(f"/sys/class/bdi/{os.major(device)}:{os.minor(device)}/read_ahead_kb").write_text(
            f"{nbytes // 1024}\n"
        )
    except OSError as exc:
        log.info("kernel read-ahead left at its default: %s", exc)


class Session:
    """One mount's FUSE session: the operations table libfuse calls, and
    what they answer with."""

    def __init__(
        self,
        fs: FileSystem,
        mountpoint: str,
        metadata_ttl: float,
        read_ahead: int,
        on_ready: Callable[[], None],
    ) -> None:
        self._fs = fs
        self._mountpoint = mountpoint
        self._ttl = metadata_ttl
        self._read_ahead = read_ahead
        self._on_ready = on_ready
        self._no_open = False  # the kernel opens files without asking (set at INIT)
        self.mounted = False  # set once the kernel has initialised the mount
        self._callbacks = {
            "init": ll.INIT(self._init),
            "lookup": ll.LOOKUP(self._lookup),
            "forget": ll.FORGET(self._forget),
            "forget_multi": ll.FORGET_MULTI(self._forget_multi),
            "getattr": ll.INODE_FILE(self._getattr),
            "open": ll.INODE_FILE(self._open),
            "read": ll.READ(self._read),
            "opendir": ll.INODE_FILE(self._opendir),
            "readdirplus": ll.READ(self._readdirplus),
            "releasedir": ll.INODE_FILE(self._releasedir),
            "statfs": ll.STATFS(self._statfs),
        }
        self._notifier: _Notifier | None = None  # while the session loop runs
        # The session and the thread running its loop, while it runs
        # (``stop``); guarded by ``_running_lock``.
        self._running_lock = threading.Lock()
        self._running: tuple[int, int] | None = None
        self.operations = ll.Operations()
        for name, callback in self._callbacks.items():
            setattr(self.operations, name, ctypes.cast(callback, ctypes.c_void_p))

    def _init(self, userdata: int, conn_pointer: Any) -> None:
        _keep_thread_state()
        conn = conn_pointer.contents
        self._no_open = bool(conn.capable & ll.CAP_NO_OPEN_SUPPORT)
        wanted = ll.CAP_READDIRPLUS | ll.CAP_PARALLEL_DIROPS | ll.CAP_ASYNC_READ
        conn.want |= wanted & conn.capable
        # READDIRPLUS always, not when the kernel guesses a scan will stat;
        # attributes never change under an inode, so no page invalidation on
        # them either.
        conn.want &= ~(ll.CAP_READDIRPLUS_AUTO | ll.CAP_AUTO_INVAL_DATA)
        self.mounted = True
        threading.Thread(
            target=_set_read_ahead,
            args=(self._mountpoint, self._read_ahead),
            name="cachefsd-readahead",
            daemon=True,
        ).start()
        self._on_ready()

    def _entry(self, attributes: Attributes) -> ll.EntryParam:
        entry = ll.EntryParam(ino=attributes.inode, attr_timeout=self._ttl, entry_timeout=self._ttl)
        _fill(entry.attr, attributes)
        return entry

    @_answered
    def _lookup(self, request: int, parent: int, name: bytes) -> None:
        attributes = self._fs.lookup(parent, os.fsdecode(name))
        if ll.lib.fuse_reply_entry(request, ctypes.byref(self._entry(attributes))) != 0:
            self._fs.forget(attributes.inode, 1)  # interrupted: the kernel holds no reference

    def _forget(self, request: int, ino: int, count: int) -> None:
        self._forgotten(request, [(ino, count)])

    def _forget_multi(self, request: int, count: int, forgets: Any) -> None:
        self._forgotten(request, [(forgets[index].ino, forgets[index].nlookup) for index in range(count)])

    def _forgotten(self, request: int, references: list[tuple[int, int]]) -> None:
        """FORGET has no answer, but libfuse must be told the request is
        done with, whatever happens."""
        _keep_thread_state()
        try:
            for ino, count in references:
                self._fs.forget(ino, count)
        finally:
            ll.lib.fuse_reply_none(request)

    @_answered
    def _getattr(self, request: int, ino: int, fi: Any) -> None:
        attributes = ll.Stat()
        _fill(attributes, self._fs.getattr(ino))
        ll.lib.fuse_reply_attr(request, ctypes.byref(attributes), self._ttl)

    @_answered
    def _open(self, request: int, ino: int, fi: Any) -> None:
        """Answered once: ENOSYS tells a kernel with no-open support never
        to send OPEN (nor RELEASE) again, and to keep the pages of an inode
        across opens; one without it keeps them because we say so."""
        if self._no_open:
            ll.lib.fuse_reply_err(request, errno.ENOSYS)
            return
        fi.contents.keep_cache = 1
        ll.lib.fuse_reply_open(request, fi)

    @_answered
    def _read(self, request: int, ino: int, size: int, offset: int, fi: Any) -> None:
        try:
            pieces = self._fs.read(ino, size, offset, ll.lib.fuse_req_ctx(request).contents.pid)
        except ObjectChanged:
            # The kernel forgets the name before it is told of the failure, so
            # an open right after it looks up the new version (SEMANTICS.md:
            # "at once"); the queued notice then finds nothing to forget.
            entry = self._fs.entry_of(ino)
            if entry is not None and self._notifier is not None:
                self._notifier.invalidate(*entry)
            raise
        _reply_pieces(request, pieces)

    @_answered
    def _opendir(self, request: int, ino: int, fi: Any) -> None:
        fi.contents.fh = self._fs.opendir(ino, ll.lib.fuse_req_ctx(request).contents.pid)
        if ll.lib.fuse_reply_open(request, fi) != 0:
            self._fs.releasedir(fi.contents.fh)

    @_answered
    def _readdirplus(self, request: int, ino: int, size: int, offset: int, fi: Any) -> None:
        """As many entries from ``offset`` as fit in ``size`` bytes, each
        with its attributes; each entry sent is a reference the kernel holds."""
        handle = fi.contents.fh
        entries = self._fs.readdir(handle)
        buffer = ctypes.create_string_buffer(size)
        used = 0
        sent: list[int] = []
        for index in range(offset, len(entries)):
            entry = entries[index]
            name = os.fsencode(entry.name)
            needed = ll.lib.fuse_add_direntry_plus(request, None, 0, name, None, 0)
            if used + needed > size:
                break
            attributes = self._fs.remember(handle, entry)
            if entry.name not in (".", ".."):
                sent.append(attributes.inode)
            ll.lib.fuse_add_direntry_plus(
                request,
                ctypes.addressof(buffer) + used,
                size - used,
                name,
                ctypes.byref(self._entry(attributes)),
                index + 1,
            )
            used += needed
        if ll.lib.fuse_reply_buf(request, buffer, used) != 0:
            for inode in sent:  # interrupted: the kernel holds none of them
                self._fs.forget(inode, 1)

    @_answered
    def _releasedir(self, request: int, ino: int, fi: Any) -> None:
        self._fs.releasedir(fi.contents.fh)
        ll.lib.fuse_reply_err(request, 0)

    @_answered
    def _statfs(self, request: int, ino: int) -> None:
        sizes = ll.StatVfs(**self._fs.statfs())
        ll.lib.fuse_reply_statfs(request, ctypes.byref(sizes))

    def serve(self, fsname: str, allow_other: bool, cold_reads: int) -> None:
        """Mount and serve until unmounted or ``stop``. Blocks the calling
        thread (one a session: a daemon serves several mounts at once).

        A read that waits on the network holds its libfuse worker until the
        block arrives, so the workers bound how many reads are in flight:
        ``cold_reads`` of them (the fetch concurrency), plus spares that
        serve lookups and cached reads meanwhile."""
        argv = (ctypes.c_char_p * 4)(b"cachefsd", b"-o", _mount_options(fsname, allow_other), None)
        args = ll.Args(3, argv, 0)
        handle = ll.lib.fuse_session_new(
            ctypes.byref(args), ctypes.byref(self.operations), ctypes.sizeof(ll.Operations), None
        )
        if not handle:
            raise CachefsdError(f"libfuse could not start a session for {self._mountpoint}: invalid options")
        try:
            if ll.lib.fuse_session_mount(handle, os.fsencode(self._mountpoint)) != 0:
                raise CachefsdError(
                    f"the mount of {self._mountpoint} was refused (fusermount3 says why in the log)"
                )
            try:
                self._loop(handle, cold_reads + SPARE_WORKERS)
            finally:
                ll.lib.fuse_session_unmount(handle)
        finally:
            ll.lib.fuse_session_destroy(handle)

    def _loop(self, handle: int, workers: int) -> None:
        notifier = self._notifier = _Notifier(self._fs, handle)
        notifier.start()
        config = ll.lib.fuse_loop_cfg_create()
        ll.lib.fuse_loop_cfg_set_max_threads(config, workers)
        ll.lib.fuse_loop_cfg_set_idle_threads(config, workers)
        with self._running_lock:
            self._running = (handle, threading.get_ident())
        try:
            result = ll.lib.fuse_session_loop_mt_312(handle, config)
        finally:
            with self._running_lock:
                self._running = None
            ll.lib.fuse_loop_cfg_destroy(config)
            notifier.stop()
        if not self.mounted:
            raise CachefsdError(f"the FUSE session of {self._mountpoint} ended before the mount was ready")
        log.info("FUSE session of %s ended (libfuse code %d)", self._mountpoint, result)

    def stop(self) -> None:
        """Ask the loop to end, as libfuse's signal handler does: the
        session is marked exited and the thread waiting in the loop is
        woken by ``WAKE_SIGNAL``; the mount is then detached lazily (files
        still open under it get ENOTCONN). A wake-up that comes just before
        the loop waits is lost: call again until ``serve`` has returned."""
        with self._running_lock:
            if self._running is None:
                return
            handle, thread = self._running
            ll.lib.fuse_session_exit(handle)
            signal.pthread_kill(thread, WAKE_SIGNAL)


# Wakes a session's loop thread out of its wait (``Session.stop``). Not a
# signal anyone sends a daemon for another purpose.
WAKE_SIGNAL = signal.SIGUSR1


def install_wake_handler() -> None:
    """Give ``WAKE_SIGNAL`` a handler that does nothing (its default kills
    the process): what matters is that it interrupts the loop's wait. Only
    the main thread may set handlers."""
    signal.signal(WAKE_SIGNAL, lambda signum, frame: None)


def _mount_options(fsname: str, allow_other: bool) -> bytes:
    options = ["ro", "default_permissions", f"fsname={fsname.replace(',', '_')}", "subtype=cachefsd"]
    if allow_other:
        options.append("allow_other")
    return ",".join(options).encode()
