"""The FUSE edge: one mount's connection to the kernel. The native plane
(``cachefsd._native.Session``) reads every request on threads of its own
and answers those the kernel's tables hold the answer to (``fs.kernel``:
lookups of names it was handed, attributes of versions, opens of cached
versions, reads of blocks in verified cache files, the listings taken at
OPENDIR, the FORGETs); the rest it hands here, each
answered by ``fs.FileSystem`` in one line, in this module's protocol
(``protocol.py``), through the descriptor it came from.

Our errors become their errno through ``errors.errno_for`` here and only
here; anything else is a bug, logged with its traceback and answered EIO.
Every request that wants an answer gets exactly one: a request left
unanswered hangs its caller for good.

Workers: a pool of threads, each taking the requests handed here and
answering them; a read that waits on the network holds its thread until
the block arrives, so their number bounds the reads in flight (``serve``).
Only ``SERVING_WORKERS`` of them serve at a time: a worker about to wait
on the network gives its turn to a parked one (``turns``). One more thread
drains what the native plane reports (its reads and opens, the inodes gone, the
requests it answered) into the filesystem and the metrics (``_report``).

What the kernel is told is what lets it serve warm reads without asking:
an inode's attributes and pages are those of one object version, so
entries and attributes are cached for the metadata TTL, a directory's
entries come with their attributes (READDIRPLUS), and an open keeps the
inode's pages. Where the kernel and our privileges allow it, a file whose
content lies whole in one hot-tier file (its one block, or the whole file
made of its blocks, ``cache.whole``) is opened in passthrough: the
kernel reads that file itself, and the daemon sees no READ for it (the
native plane's opens keep the kernel's rules; a file is counted as read
at its open). Whether a mount's files are worth an OPEN each is judged
by its first opens (``passthrough.OpenSizes``), here. Without
passthrough, the kernel opens files without asking at all (no-open
support). A name whose version changed upstream is invalidated by a
thread of its own (``_Notifier``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from cachefsd import turns
from cachefsd._native import Session as NativeSession
from cachefsd.cache.blocks import FileSpan, WholeFile
from cachefsd.errors import Busy, CachefsdError, NotPermitted, ObjectChanged, errno_for
from cachefsd.fs import Attributes, FileSystem
from cachefsd.fuse import device, protocol
from cachefsd.fuse.passthrough import JUDGED_OPENS, OpenSizes
from cachefsd.fuse.protocol import Op, Request
from cachefsd.reader import Piece, close_pieces

log = logging.getLogger(__name__)

# Workers beyond those that may all be waiting on GETs (``serve``).
SPARE_WORKERS = 8
# The native plane's threads: each blocks in the disk read of the cache
# file it answers from, so several keep the disk busy while the kernel has
# reads queued (up to BACKGROUND_REQUESTS of read-ahead, plus readers').
NATIVE_WORKERS = 8
# How long the report thread waits for the native plane's next report
# before it looks whether the session ended.
REPORT_WAIT_SECONDS = 0.5
# Workers serving at once: one runs Python while the other is in a system
# call; a third only takes turns at the GIL. On 2 cores, a warm epoch of
# small files read with pages dropped went from 1,100 files/s at 950 us of
# daemon CPU a file with 20 serving workers to 2,800 at 400 us with 2.
SERVING_WORKERS = 2
# How long an unmount waits for the notifier's last notification.
NOTIFIER_STOP_SECONDS = 5.0
# The handle of an open served through (RELEASE gives it back).
_THROUGH = 1
# Linux's CAP_SYS_ADMIN, which registering a backing file needs.
_CAP_SYS_ADMIN = 21
# What the filesystems under the cache directory may stack: an overlayfs
# (a container's root) is one level.
_OVERLAYFS_MAGIC = 0x794C7630


class SessionEvents(Protocol):
    """What the FUSE edge tells the metrics."""

    def request_answered(self, operation: str, count: int = 1) -> None: ...
    def passthrough_state(self, on: bool) -> None: ...


@dataclass(frozen=True, slots=True)
class Passthrough:
    """Whether a mount serves cached files through the kernel, and why not."""

    on: bool
    why_not: str = ""

    def __str__(self) -> str:
        return "on" if self.on else f"off: {self.why_not}"


def _has_cap_sys_admin() -> bool:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> _CAP_SYS_ADMIN & 1)
    return False


def _stack_depth(directory: Path) -> int:
    """The max_stack_depth the backing files in ``directory`` need: one
    more than their filesystem's, which is 1 on overlayfs."""
    try:
        on_overlay = _statfs_type(directory) == _OVERLAYFS_MAGIC
    except OSError:
        on_overlay = True
    return 2 if on_overlay else 1


def _statfs_type(directory: Path) -> int:
    """f_type of statfs(2), which ``os.statvfs`` does not give."""
    buffer = ctypes.create_string_buffer(120)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.statfs(os.fsencode(directory), buffer) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()), str(directory))
    return int.from_bytes(buffer.raw[:8], "little")


def _set_read_ahead(mountpoint: str, nbytes: int) -> None:
    """Let the kernel read ahead ``nbytes`` of a file being read in order.

    The kernel's default (128 KiB) makes it ask for 256 KiB at a time, so a
    sequential reader costs one trip through Python per 256 KiB; with a
    block's worth of read-ahead it asks for 1 MiB (the largest read we
    allow). Needs root (sysfs); without it the default stays. Runs on its
    own thread once the mount answers: the kernel sets read-ahead from our
    answer to INIT, after we sent it."""
    try:
        device_number = os.stat(mountpoint).st_dev
        Path(f"/sys/class/bdi/{os.major(device_number)}:{os.minor(device_number)}/read_ahead_kb").write_text(
            f"{nbytes // 1024}\n"
        )
    except OSError as exc:
        log.info("kernel read-ahead left at its default: %s", exc)


def _attr(attributes: Attributes) -> protocol.Attr:
    return protocol.Attr(
        attributes.st_ino,
        attributes.size,
        attributes.mtime,
        attributes.mode,
        attributes.nlink,
        attributes.uid,
        attributes.gid,
    )


class _Notifier:
    """Tells the kernel to forget the entries ``fs`` names stale, from a
    thread of its own: a notification waits for the directory's lock,
    which the kernel holds while it waits for a lookup we are answering."""

    _STOP = (0, "")

    def __init__(self, fs: FileSystem, send: Callable[[list[bytes | memoryview]], bool]) -> None:
        self._fs = fs
        self._send = send
        self._thread = threading.Thread(target=self._run, name="cachefsd-notify", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Once the workers have ended. Bounded: a notification can wait
        on a directory's lock held by a lookup no worker will answer now,
        and the thread, a daemon one, must not hold up the unmount."""
        self._fs.stale_entries.put(self._STOP)
        self._thread.join(NOTIFIER_STOP_SECONDS)

    def _run(self) -> None:
        while (entry := self._fs.stale_entries.get()) != self._STOP:
            self.invalidate(*entry)

    def invalidate(self, parent: int, name: str) -> None:
        """Tell the kernel to forget ``name`` in ``parent`` now. From a
        request thread only where the kernel holds no directory lock (READ).
        ENOENT: the kernel does not hold it (any more)."""
        self._send([protocol.pack_inval_entry(parent, os.fsencode(name))])


class Session:
    """One mount's FUSE session: the requests it answers, and how."""

    def __init__(
        self,
        fs: FileSystem,
        mountpoint: str,
        metadata_ttl: float,
        read_ahead: int,
        on_ready: Callable[[], None],
        events: SessionEvents,
        backing_directory: Path | None,
    ) -> None:
        """``backing_directory``: where the hot tier's files lie, for
        passthrough; None when it is turned off."""
        self._fs = fs
        self._mountpoint = mountpoint
        self._ttl = metadata_ttl
        self._read_ahead = read_ahead
        self._on_ready = on_ready
        self._events = events
        self._backing_directory = backing_directory
        self.passthrough = Passthrough(False, "the kernel has not started the mount yet")
        self.mounted = False  # set once the kernel has initialised the mount
        self._no_open = False  # the kernel may open files without asking
        # The connection's descriptor and its native workers (which keep
        # the opens of its files), while serving.
        self._connection: int | None = None
        self._native: NativeSession | None = None
        # The descriptor the request a worker answers came from: its answer goes back through it.
        self._answering = threading.local()
        # Opens of staged files counted in the native plane's opens: handle
        # -> whether passed through; guarded by _staged_lock.
        self._staged_lock = threading.Lock()
        self._staged_opens: dict[int, bool] = {}
        self._open_sizes = OpenSizes(protocol.MAX_READ)
        self._stopping = False
        self._turns = threading.Semaphore(SERVING_WORKERS)  # turns at serving (``turns``)
        self._notifier = _Notifier(fs, self._send)
        self._handlers: dict[int, Callable[[Request, memoryview], None]] = {
            Op.INIT: self._init,
            Op.LOOKUP: self._lookup,
            Op.GETATTR: self._getattr,
            Op.OPEN: self._open,
            Op.READ: self._read,
            Op.RELEASE: self._release,
            Op.OPENDIR: self._opendir,
            Op.STATFS: self._statfs,
            Op.DESTROY: self._destroy,
        }
        if fs.writes is not None:
            refused = self._refuse("a bucket holds no links, symlinks or special files")
            self._handlers.update({
                Op.CREATE: self._create,
                Op.WRITE: self._write,
                Op.FLUSH: self._flush,
                Op.FSYNC: self._fsync,
                Op.FSYNCDIR: self._fsyncdir,
                Op.SETATTR: self._setattr,
                Op.MKDIR: self._mkdir,
                Op.UNLINK: self._unlink,
                Op.RMDIR: self._rmdir,
                Op.RENAME: self._rename,
                Op.RENAME2: self._rename,
                Op.LINK: refused,
                Op.SYMLINK: refused,
                Op.MKNOD: refused,
            })  # fmt: skip
        self._names = {int(op): op.name.lower() for op in Op}  # the metric's label values

    # -- serving ----------------------------------------------------------

    def serve(self, fsname: str, allow_other: bool, cold_reads: int) -> None:
        """Mount and serve until unmounted or ``stop``. Blocks the calling
        thread (one a session: a daemon serves several mounts at once).

        A read that waits on the network holds its worker until the block
        arrives, so the workers bound how many reads are in flight: as many
        as the kernel sends at once in read-ahead, or ``cold_reads`` (the
        fetch concurrency) if fewer, plus spares that serve lookups, opens
        and cached reads meanwhile; only ``SERVING_WORKERS`` of them serve
        at a time (prefetch fetches ahead on threads of its own)."""
        options = _mount_options(fsname, allow_other, writable=self._fs.writes is not None)
        connection = self._connection = device.mount(self._mountpoint, options)
        try:
            native = self._native = NativeSession(
                connection,
                self._fs.kernel,
                self._fs.writes is not None,
                NATIVE_WORKERS,
                protocol.REQUEST_BUFFER,
            )
        except OSError:
            os.close(connection)
            device.unmount(self._mountpoint)
            raise
        if self._stopping:  # stopped while mounting
            native.stop()
        self._notifier.start()
        workers = [
            threading.Thread(target=self._work, name=f"cachefsd-fuse-{number}", daemon=True)
            for number in range(min(cold_reads, protocol.BACKGROUND_REQUESTS) + SPARE_WORKERS)
        ]
        workers.append(threading.Thread(target=self._report, name="cachefsd-reports", daemon=True))
        try:
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join()
        finally:
            self.stop()
            for worker in workers:
                if worker.is_alive():
                    worker.join()
            native.join()
            self._notifier.stop()
            # Closing the last descriptor ends the connection (the native
            # workers' closed as they ended): files still open under the
            # mount fail from now on, and the unmount cannot hang.
            os.close(connection)
            device.unmount(self._mountpoint)
        if native.failure is not None:
            log.error("the FUSE session of %s failed: %s", self._mountpoint, native.failure)
        if not self.mounted:
            raise CachefsdError(f"the FUSE session of {self._mountpoint} ended before the mount was ready")
        log.info("FUSE session of %s ended", self._mountpoint)

    def stop(self) -> None:
        """End the session: every worker returns once its request is answered."""
        self._stopping = True
        if self._native is not None:
            self._native.stop()
        # Parked workers take a turn, see the end, and hand the turn on.
        self._turns.release()

    def _work(self) -> None:
        assert self._native is not None
        native = self._native
        while not self._stopping:
            self._turns.acquire()
            turns.take(self._turns.release)
            try:
                while turns.holds() and not self._stopping:
                    handed = native.next_request()
                    if handed is None:  # unmounted, or stopped
                        self.stop()
                        return
                    fd, message = handed
                    self._answering.fd = fd
                    self._dispatch(memoryview(message))
            finally:
                turns.give_up()

    def _report(self) -> None:
        """Tell the filesystem and the metrics what the native plane did,
        in the order it did it, until the session ends."""
        kernel = self._fs.kernel
        while not self._stopping:
            reads, opens, forgotten, answered = kernel.drain(REPORT_WAIT_SECONDS)
            for inode, offset, size, pid, served, seconds in reads:
                self._told(self._fs.served_natively, inode, offset, size, pid, dict(served), seconds)
            for inode, pid, tier in opens:
                self._told(self._fs.opened_natively, inode, pid, tier)
            for inode in forgotten:  # after the reads and opens: those need their inodes
                self._told(self._fs.forgotten, inode)
            for operation, count in answered:
                self._events.request_answered(operation, count)

    @staticmethod
    def _told(tell: Callable[..., None], *report: object) -> None:
        """One report told: a bug in counting it is logged, and the reports after it are still told."""
        try:
            tell(*report)
        except Exception:
            log.exception("telling what the native plane did failed: %r", report)

    def _dispatch(self, message: memoryview) -> None:
        request = protocol.parse_header(message)
        body = message[protocol.IN_HEADER.size :]
        handler = self._handlers.get(request.opcode)
        if handler is None:
            self._send([protocol.error(request.unique, errno.ENOSYS)])
            return
        try:
            handler(request, body)
        except Exception as exc:
            if not isinstance(exc, CachefsdError):
                log.exception("unexpected error in %s", self._names[request.opcode])
            answer = errno_for(exc) if isinstance(exc, CachefsdError) else errno.EIO
            self._send([protocol.error(request.unique, answer)])
        else:
            self._events.request_answered(self._names[request.opcode])

    def _send(self, parts: list[bytes | memoryview]) -> bool:
        """Write one answer (through the descriptor its request came from)
        or notification; False if its request is gone (interrupted, ENOENT)
        or the connection ended."""
        assert self._connection is not None
        try:
            os.writev(getattr(self._answering, "fd", self._connection), parts)
        except FileNotFoundError:
            return False
        except OSError as exc:
            if exc.errno not in (errno.ENODEV, errno.EBADF):
                log.warning("answering the kernel failed: %s", exc)
            return False
        return True

    # -- requests ---------------------------------------------------------

    def _init(self, request: Request, body: memoryview) -> None:
        offer = protocol.parse_init(body)
        if offer.major != protocol.MAJOR or offer.minor < protocol.MINIMUM_MINOR:
            raise CachefsdError(
                f"the kernel speaks FUSE {offer.major}.{offer.minor}: cachefsd needs 7.23 or later"
            )
        # A writable mount answers every OPEN: a write needs its handle.
        self._no_open = bool(offer.flags & protocol.NO_OPEN_SUPPORT) and self._fs.writes is None
        wanted = protocol.ASYNC_READ | protocol.DO_READDIRPLUS | protocol.PARALLEL_DIROPS | protocol.MAX_PAGES
        if self._fs.writes is not None:
            wanted |= protocol.ATOMIC_O_TRUNC | protocol.BIG_WRITES
        depth = 1
        why_not = self._passthrough_refused(offer)
        if not why_not:
            assert self._backing_directory is not None
            wanted |= protocol.PASSTHROUGH
            depth = _stack_depth(self._backing_directory)
        self._send(protocol.reply(request.unique, protocol.pack_init(offer, wanted, depth)))
        if not why_not:
            why_not = self._probe_passthrough()
        self._set_passthrough(Passthrough(not why_not, why_not))
        self.mounted = True
        threading.Thread(
            target=_set_read_ahead,
            args=(self._mountpoint, self._read_ahead),
            name="cachefsd-readahead",
            daemon=True,
        ).start()
        self._on_ready()

    def _passthrough_refused(self, offer: protocol.InitOffer) -> str:
        """Why passthrough cannot be asked for (empty: it can)."""
        if self._backing_directory is None:
            return "turned off (fuse.passthrough = false)"
        if not offer.flags & protocol.PASSTHROUGH:
            return (
                f"the kernel (FUSE {offer.major}.{offer.minor}) does not offer it (Linux 6.9 or later does)"
            )
        if not _has_cap_sys_admin():
            return "the daemon lacks CAP_SYS_ADMIN, which backing files need (run it as root)"
        return ""

    def _probe_passthrough(self) -> str:
        """Register a file of the hot tier's filesystem as a backing file
        and drop it: whether the kernel accepts the cache's files, known at
        mount rather than at the first open."""
        assert self._backing_directory is not None
        assert self._native is not None
        try:
            with tempfile.TemporaryFile(dir=self._backing_directory) as probe:
                self._native.check_backing(probe.fileno())
        except OSError as exc:
            return f"the kernel refused a cache file as a backing file: {exc.strerror or exc}"
        return ""

    def _lookup(self, request: Request, body: memoryview) -> None:
        attributes = self._fs.lookup(request.nodeid, _name(body))
        entry = protocol.pack_entry(attributes.inode, _attr(attributes), self._ttl_of(attributes))
        if not self._send(protocol.reply(request.unique, entry)):
            self._fs.forget(attributes.inode, 1)  # interrupted: the kernel holds no reference

    def _getattr(self, request: Request, body: memoryview) -> None:
        attributes = self._fs.getattr(request.nodeid)
        self._send(protocol.reply(request.unique, self._attr_out(attributes)))

    def _ttl_of(self, attributes: Attributes) -> float:
        """How long the kernel may keep ``attributes`` (and the entry that named them)."""
        return self._ttl if attributes.cacheable else 0.0

    def _attr_out(self, attributes: Attributes) -> bytes:
        return protocol.pack_attr_out(_attr(attributes), self._ttl_of(attributes))

    def _open(self, request: Request, body: memoryview) -> None:
        """What the native workers leave (``native/src/session.rs``): a
        write, a staged file, every open while the mount's files are judged,
        a first passthrough open whose whole file they were not named. With
        passthrough, by the rules of the native plane's opens; a cached
        open keeps the inode's pages (they are of one version). Without it,
        ENOSYS tells a kernel with no-open support never to send OPEN (nor
        RELEASE) again, and to keep the pages of an inode across opens."""
        assert self._native is not None
        native = self._native
        inode, pid = request.nodeid, request.pid
        if self._fs.writes is not None:
            flags, _ = protocol.OPEN_IN.unpack_from(body)
            writing = flags & os.O_ACCMODE != os.O_RDONLY or flags & os.O_TRUNC
            if writing and not self._fs.is_staged(inode):
                handle = self._open_to_stage(inode, flags)
            else:
                handle = self._fs.open(inode, flags)
            if handle is not None:
                answer = self._open_staged(inode, handle, flags)
                if not self._send(protocol.reply(request.unique, answer)):
                    self._release_staged(inode, handle)  # interrupted: nothing was opened
                return
        if self.passthrough.on and self._no_open and self._open_sizes.judging:
            self._judge(self._fs.getattr(inode).size)
        # Passthrough given up (``_judge``) while files are open in it: OPEN
        # is answered by the rules until they are all released, handing
        # over no new file. An ENOSYS now would have the kernel open such a
        # file's inode in cached mode without asking, which fails (EIO).
        if not (self.passthrough.on or native.passing_through()):
            if self._no_open:
                self._send([protocol.error(request.unique, errno.ENOSYS)])
            else:
                self._send(protocol.reply(request.unique, protocol.pack_open(0, protocol.FOPEN_KEEP_CACHE)))
            return
        on = self.passthrough.on
        backing_id = self._open_by_rules(inode, lambda: self._fs.open_through(inode, pid) if on else None)
        if backing_id is None:
            answer = protocol.pack_open(0, protocol.FOPEN_KEEP_CACHE)
        else:
            answer = protocol.pack_open(_THROUGH, protocol.FOPEN_PASSTHROUGH, backing_id)
        if not self._send(protocol.reply(request.unique, answer)):
            native.release(inode, backing_id is not None)  # interrupted: nothing was opened

    def _open_to_stage(self, inode: int, flags: int) -> int | None:
        """``fs.open`` of a version to write it (staged), unless it is open
        for reading through the kernel, on its cache file, which a writer
        must never be handed."""
        assert self._native is not None
        if not self._native.begin_writer(inode):
            raise Busy("the object is open for reading through the kernel: it is replaced once they close")
        try:
            return self._fs.open(inode, flags)
        finally:
            self._native.end_writer(inode)

    def _open_by_rules(
        self, inode: int, find: Callable[[], WholeFile | None], staged: bool = False
    ) -> int | None:
        """Open ``inode`` (a ``staged`` file's, else a version's) by the
        native plane's passthrough rules: the backing id to answer with, or
        None for a cached open. ``find`` is asked for the file only if the
        rules need one; its descriptor is closed here."""
        assert self._native is not None
        found: list[WholeFile] = []

        def look() -> tuple[int, str] | None:
            whole = find()
            if whole is None:
                return None
            found.append(whole)
            return whole.fd, whole.tier

        try:
            # Waiting for another open's find gives the turn up, as a wait
            # on another's GET does (``turns``).
            return self._native.open(inode, look, staged, turns.give_up)
        except OSError as exc:
            if exc.errno == errno.EBUSY:
                raise Busy("the file is open through the kernel on another of its files") from exc
            raise
        finally:
            for whole in found:
                os.close(whole.fd)

    def _judge(self, size: int) -> None:
        """Give up OPEN requests for good where the mount's files are too
        small for passthrough to pay (``passthrough.OpenSizes``); once
        judged worth them, the native workers answer them."""
        verdict = self._open_sizes.opened(size)
        if verdict is False:
            read = protocol.MAX_READ >> 20
            self._set_passthrough(
                Passthrough(
                    False,
                    f"most of the first {JUDGED_OPENS} files opened are of one read ({read} MiB) or less: "
                    "the kernel opens them without asking, which costs fewer requests",
                )
            )
        elif verdict:
            self._set_open_mode()

    def _set_passthrough(self, passthrough: Passthrough) -> None:
        """Passthrough is now ``passthrough``: the metrics, the log, the
        native workers and the filesystem (which makes whole files only
        for it) are told."""
        self.passthrough = passthrough
        self._fs.passthrough = passthrough.on
        self._events.passthrough_state(passthrough.on)
        self._set_open_mode()
        log.info("%s: passthrough %s", self._mountpoint, passthrough)

    def _set_open_mode(self) -> None:
        """How the native workers answer OPEN, as ``_open`` would."""
        assert self._native is not None
        if self.passthrough.on and self._no_open and self._open_sizes.judging:
            self._native.set_open_mode("python")
        elif self.passthrough.on:
            self._native.set_open_mode("through")
        else:
            self._native.set_open_mode("no-open" if self._no_open else "cached")

    def _open_staged(self, inode: int, handle: int, flags: int) -> bytes:
        """The answer to an open of a staged file: the kernel reads and
        writes the file itself where passthrough is on and staging allows
        it (``fs.staged_backing``), else the daemon serves it, a writer's
        writes by direct I/O (not first into pages of the mounted file
        that the staged file's own pages would hold again)."""
        backing_id = None
        if self.passthrough.on:
            backing_id = self._open_by_rules(inode, lambda: self._fs.staged_backing(handle), staged=True)
            with self._staged_lock:
                self._staged_opens[handle] = backing_id is not None
        if backing_id is not None:
            return protocol.pack_open(handle, protocol.FOPEN_PASSTHROUGH, backing_id)
        direct = protocol.FOPEN_DIRECT_IO if flags & os.O_ACCMODE != os.O_RDONLY else 0
        return protocol.pack_open(handle, direct)

    def _release_staged(self, inode: int, handle: int) -> None:
        with self._staged_lock:
            through = self._staged_opens.pop(handle, None)
        if through is not None and self._native is not None:
            self._native.release(inode, through)
        self._fs.release(handle)

    def _release(self, request: Request, body: memoryview) -> None:
        """A staged file's: the native workers release every other open."""
        fh, _, _, _ = protocol.RELEASE_IN.unpack_from(body)
        self._release_staged(request.nodeid, fh)
        self._send(protocol.reply(request.unique))

    def _read(self, request: Request, body: memoryview) -> None:
        _, offset, size, _, _, _, _ = protocol.READ_IN.unpack_from(body)
        try:
            pieces = self._fs.read(request.nodeid, size, offset, request.pid)
        except ObjectChanged:
            # The kernel forgets the name before it is told of the failure, so
            # an open right after it looks up the new version (SEMANTICS.md:
            # "at once"); the queued notice then finds nothing to forget.
            entry = self._fs.entry_of(request.nodeid)
            if entry is not None:
                self._notifier.invalidate(*entry)
            raise
        self._reply_pieces(request.unique, pieces)

    def _reply_pieces(self, unique: int, pieces: list[Piece]) -> None:
        """Send ``pieces`` as one answer: memory as it is, block files read
        into memory here. Then the block files' pages are dropped: the
        kernel now holds these bytes in the mounted file's own pages, and
        RAM should hold them once."""
        try:
            parts: list[bytes | memoryview] = []
            for piece in pieces:
                if isinstance(piece, FileSpan):
                    data = os.pread(piece.fd, piece.length, piece.offset)
                    if len(data) != piece.length:
                        raise CachefsdError(
                            f"a cache file is shorter than its index says ({len(data)} bytes)"
                        )
                    parts.append(data)
                else:
                    parts.append(piece)
        except BaseException:
            close_pieces(pieces)
            raise
        self._send(protocol.reply(unique, *parts))
        for piece in pieces:
            if isinstance(piece, FileSpan):
                with contextlib.suppress(OSError):
                    os.posix_fadvise(piece.fd, piece.offset, piece.length, os.POSIX_FADV_DONTNEED)
        close_pieces(pieces)

    def _opendir(self, request: Request, body: memoryview) -> None:
        handle = self._fs.opendir(request.nodeid, request.pid).handle
        if not self._send(protocol.reply(request.unique, protocol.pack_open(handle, 0))):
            self._fs.releasedir(handle)

    def _statfs(self, request: Request, body: memoryview) -> None:
        sizes = self._fs.statfs()
        answer = protocol.pack_statfs(
            sizes["f_blocks"], sizes["f_bfree"], sizes["f_bavail"], sizes["f_bsize"], sizes["f_frsize"],
            sizes["f_namemax"],
        )  # fmt: skip
        self._send(protocol.reply(request.unique, answer))

    # -- a writable mount's requests ------------------------------------

    def _refuse(self, why: str) -> Callable[[Request, memoryview], None]:
        def refuse(request: Request, body: memoryview) -> None:
            raise NotPermitted(why)

        return refuse

    def _create(self, request: Request, body: memoryview) -> None:
        flags, _, _, _ = protocol.CREATE_IN.unpack_from(body)
        name = _name(body[protocol.CREATE_IN.size :])
        attributes, handle = self._fs.create(request.nodeid, name, flags)
        entry = protocol.pack_entry(attributes.inode, _attr(attributes), self._ttl_of(attributes))
        answer = self._open_staged(attributes.inode, handle, flags)
        if not self._send(protocol.reply(request.unique, entry, answer)):
            self._release_staged(attributes.inode, handle)  # interrupted: the kernel holds neither
            self._fs.forget(attributes.inode, 1)

    def _write(self, request: Request, body: memoryview) -> None:
        fh, offset, size, _, _, _, _ = protocol.WRITE_IN.unpack_from(body)
        data = body[protocol.WRITE_IN.size : protocol.WRITE_IN.size + size]
        written = self._fs.write(fh, offset, data)
        self._send(protocol.reply(request.unique, protocol.WRITE_OUT.pack(written, 0)))

    def _flush(self, request: Request, body: memoryview) -> None:
        """A staged file's close (the native workers answer every other):
        the bytes are in the staged file already (close = durable on this
        node, as on a local disk)."""
        fh, _, _, _ = protocol.FLUSH_IN.unpack_from(body)
        self._fs.flush(fh)
        self._send(protocol.reply(request.unique))

    def _fsync(self, request: Request, body: memoryview) -> None:
        """Answered once the file is in the bucket."""
        self._fs.fsync(request.nodeid)
        self._send(protocol.reply(request.unique))

    def _fsyncdir(self, request: Request, body: memoryview) -> None:
        """A bucket has no directory to make durable: a directory's names
        are its files' keys, each in the bucket by its own file's fsync
        (and journaled on this node at once)."""
        self._send(protocol.reply(request.unique))

    def _setattr(self, request: Request, body: memoryview) -> None:
        fields = protocol.SETATTR_IN.unpack_from(body)
        valid, size, mtime, mtime_ns = fields[0], fields[3], fields[6], fields[9]
        new_size = size if valid & protocol.FATTR_SIZE else None
        new_mtime = None
        if valid & protocol.FATTR_MTIME_NOW:
            new_mtime = time.time()
        elif valid & protocol.FATTR_MTIME:
            new_mtime = mtime + mtime_ns / 1e9
        owner_or_mode = bool(valid & (protocol.FATTR_MODE | protocol.FATTR_UID | protocol.FATTR_GID))
        attributes = self._fs.setattr(request.nodeid, new_size, new_mtime, owner_or_mode)
        self._send(protocol.reply(request.unique, self._attr_out(attributes)))

    def _mkdir(self, request: Request, body: memoryview) -> None:
        attributes = self._fs.mkdir(request.nodeid, _name(body[protocol.MKDIR_IN.size :]))
        entry = protocol.pack_entry(attributes.inode, _attr(attributes), self._ttl_of(attributes))
        if not self._send(protocol.reply(request.unique, entry)):
            self._fs.forget(attributes.inode, 1)

    def _unlink(self, request: Request, body: memoryview) -> None:
        self._fs.unlink(request.nodeid, _name(body))
        self._send(protocol.reply(request.unique))

    def _rmdir(self, request: Request, body: memoryview) -> None:
        self._fs.rmdir(request.nodeid, _name(body))
        self._send(protocol.reply(request.unique))

    def _rename(self, request: Request, body: memoryview) -> None:
        if request.opcode == Op.RENAME2:
            new_parent, flags, _ = protocol.RENAME2_IN.unpack_from(body)
            names = bytes(body[protocol.RENAME2_IN.size :])
        else:
            (new_parent,) = protocol.RENAME_IN.unpack_from(body)
            flags, names = 0, bytes(body[protocol.RENAME_IN.size :])
        if flags & ~protocol.RENAME_NOREPLACE:
            raise NotPermitted("a bucket cannot exchange two names, nor leave a whiteout")
        old, new, _ = names.split(b"\0", 2)
        self._fs.rename(
            request.nodeid,
            os.fsdecode(old),
            new_parent,
            os.fsdecode(new),
            bool(flags & protocol.RENAME_NOREPLACE),
        )
        self._send(protocol.reply(request.unique))

    def _destroy(self, request: Request, body: memoryview) -> None:
        self._send(protocol.reply(request.unique))
        self.stop()


def _name(body: memoryview) -> str:
    """The NUL-terminated name a request ends with."""
    return os.fsdecode(bytes(body).split(b"\0", 1)[0])


def _mount_options(fsname: str, allow_other: bool, writable: bool) -> str:
    options = ["default_permissions", f"fsname={fsname.replace(',', '_')}", "subtype=cachefsd"]
    if not writable:
        options.insert(0, "ro")
    if allow_other:
        options.append("allow_other")
    return ",".join(options)
