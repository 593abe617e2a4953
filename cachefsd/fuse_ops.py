"""The FUSE edge: the only module that imports mfusepy.

One line per operation into ``fs.FileSystem``, plus errno translation: our
errors become their errno through ``errors.errno_for``; anything else is a
bug, logged with its traceback and answered with EIO (never mfusepy's
catch-all EINVAL).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from cachefsd.errors import CachefsdError, errno_for
from cachefsd.fs import Attributes, FileSystem, StaleSize
from cachefsd.reader import FileSpan, Piece

# mfusepy binds libfuse 2 when both are installed (rclone and s3fs pull in
# libfuse2), and libfuse 2 ignores the kernel cache settings and the larger
# requests we rely on. Point it at libfuse 3 before it loads.
_LIBFUSE3 = ctypes.util.find_library("fuse3")
if _LIBFUSE3 is None:
    raise CachefsdError("libfuse3 is not installed: install the fuse3 package (apt-get install fuse3)")
os.environ.setdefault("FUSE_LIBRARY_PATH", _LIBFUSE3)

import mfusepy  # noqa: E402 - must follow the library choice above

log = logging.getLogger(__name__)

# fuse_main()'s return code when its session loop ended with an error (helper.c).
FUSE_MAIN_LOOP_ENDED = 8
# What fuse_main()'s other return codes mean (helper.c); the reason itself,
# if any, is on the daemon's stderr (its log), from libfuse or fusermount3.
_FUSE_MAIN_FAILURES = {
    1: "invalid mount options",
    2: "no mountpoint",
    3: "the FUSE session could not be set up",
    4: "the mount was refused (fusermount3 says why in the log)",
    5: "it could not go to the background",
    6: "its signal handlers could not be set",
    7: "the filesystem failed to start",
    FUSE_MAIN_LOOP_ENDED: "the session ended before the mount was ready",
}
# libfuse workers beyond those that may all be waiting on GETs (``serve``).
SPARE_WORKERS = 8

P = ParamSpec("P")
R = TypeVar("R")

_worker = threading.local()


def _keep_thread_state() -> None:
    """Give the calling libfuse worker thread a Python thread state for good.

    libfuse's workers are C threads: for each callback ctypes creates a
    thread state and deletes it on return, and with it the state's frame
    stack, an mmap'd chunk whose munmap stops every other CPU to flush its
    TLB. That was four mmap/munmap pairs for every small file read (LOOKUP,
    OPEN, READ, RELEASE) and a third of the daemon's CPU. One extra
    ``PyGILState_Ensure``, never released, keeps the state (and this
    thread-local) alive. libfuse >= 3.12 never retires its workers (at
    most ``max_threads``, see ``serve``), so this holds at most that many
    states."""
    if not getattr(_worker, "kept", False):
        ctypes.pythonapi.PyGILState_Ensure()
        _worker.kept = True


def _translated(operation: Callable[P, R]) -> Callable[P, R]:
    @functools.wraps(operation)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        _keep_thread_state()
        _close_previous_spans()
        try:
            return operation(*args, **kwargs)
        except CachefsdError as exc:
            raise mfusepy.FuseOSError(errno_for(exc)) from exc
        except mfusepy.FuseOSError:
            raise
        except Exception as exc:
            log.exception("unexpected error in %s", operation.__name__)
            raise mfusepy.FuseOSError(errno.EIO) from exc

    return wrapper


_libc = ctypes.CDLL(None, use_errno=True)
_libfuse = ctypes.CDLL(os.environ["FUSE_LIBRARY_PATH"])  # the library mfusepy loaded
_libfuse.fuse_get_context.restype = ctypes.POINTER(mfusepy.fuse_context)
_libfuse.fuse_invalidate_path.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_libfuse.fuse_invalidate_path.restype = ctypes.c_int
_libc.malloc.restype = ctypes.c_void_p
_libc.malloc.argtypes = [ctypes.c_size_t]

# fuse_buf_flags (fuse_common.h): the buffer is a file descriptor, read it at
# ``pos`` (pread), and retry short reads.
_FUSE_BUF_IS_FD = 1 << 1
_FUSE_BUF_FD_SEEK = 1 << 2
_FUSE_BUF_FD_RETRY = 1 << 3
_FD_FLAGS = _FUSE_BUF_IS_FD | _FUSE_BUF_FD_SEEK | _FUSE_BUF_FD_RETRY

# libfuse reads a span's descriptor after read_buf has returned, when the
# same worker thread sends the reply. So a thread's descriptors are closed
# when it comes back with its next operation of any kind, never sooner: a
# reply slowed by a busy cache disk must not have its descriptor closed, and
# its number reused by another block file, under it (wrong bytes). Workers
# are never retired (``serve``; libfuse < 3.12 has no cap and may retire
# one, whose last descriptors then stay open), so at most one reply's
# descriptors stay open per idle worker.
_open_spans: dict[int, list[int]] = {}  # thread id -> the descriptors of its last reply
_open_spans_lock = threading.Lock()


class _Buf(ctypes.Structure):
    """``struct fuse_buf``."""

    _fields_ = (
        ("size", ctypes.c_size_t),
        ("flags", ctypes.c_int),
        ("mem", ctypes.c_void_p),
        ("fd", ctypes.c_int),
        ("pos", ctypes.c_int64),
    )


@functools.cache
def _bufvec_type(count: int) -> type[ctypes.Structure]:
    """``struct fuse_bufvec`` with room for ``count`` buffers (C declares a
    one-element array and over-allocates; mfusepy's declaration is a pointer)."""
    return type(
        f"_BufVec{count}",
        (ctypes.Structure,),
        {
            "_fields_": (
                ("count", ctypes.c_size_t),
                ("idx", ctypes.c_size_t),
                ("off", ctypes.c_size_t),
                ("buf", _Buf * count),
            )
        },
    )


def _malloc(size: int) -> int:
    address = _libc.malloc(max(size, 1))
    if not address:
        raise MemoryError("malloc failed")
    return int(address)


def _bufvec(pieces: list[Piece]) -> Any:
    """A ``fuse_bufvec`` for libfuse to send and then ``free()``: memory
    pieces are copied once into malloc'd buffers, file pieces are passed as
    descriptors that libfuse reads without Python."""
    fds = [piece.fd for piece in pieces if isinstance(piece, FileSpan)]
    if fds:
        with _open_spans_lock:
            _open_spans[threading.get_ident()] = fds
    vector_type = _bufvec_type(max(len(pieces), 1))
    vector = vector_type.from_address(_malloc(ctypes.sizeof(vector_type)))
    ctypes.memset(ctypes.addressof(vector), 0, ctypes.sizeof(vector_type))
    vector.count = len(pieces)
    for slot, piece in zip(vector.buf, pieces, strict=False):
        if isinstance(piece, FileSpan):
            slot.size, slot.flags, slot.fd, slot.pos = piece.length, _FD_FLAGS, piece.fd, piece.offset
        else:
            memory = _malloc(len(piece))
            ctypes.memmove(memory, piece, len(piece))
            slot.size, slot.mem, slot.fd = len(piece), memory, -1
    return ctypes.cast(ctypes.addressof(vector), ctypes.POINTER(mfusepy.fuse_bufvec))


def _close_previous_spans() -> None:
    """The calling worker's last reply has been sent: close its descriptors."""
    with _open_spans_lock:
        fds = _open_spans.pop(threading.get_ident(), ())
    for fd in fds:
        os.close(fd)


def _close_all_spans() -> None:
    """Once the session has ended, when no reply is being sent."""
    with _open_spans_lock:
        fds = [fd for spans in _open_spans.values() for fd in spans]
        _open_spans.clear()
    for fd in fds:
        os.close(fd)


def _invalidate_attributes(path: str) -> None:
    """Have the kernel drop the attributes (and pages) it holds for
    ``path``, so its next stat asks us. Called inside OPEN or RELEASE, so
    only when no handle of the file reads through the page cache
    (``fs.open``): dropping pages waits for those being read in, and only
    such a handle reads them in."""
    fuse = _libfuse.fuse_get_context().contents.fuse
    result = _libfuse.fuse_invalidate_path(fuse, os.fsencode(path))
    if result < 0:  # not in libfuse's node table: the kernel holds nothing
        log.debug("no kernel attributes of %s to invalidate: %s", path, os.strerror(-result))


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


def _stat(attributes: Attributes) -> dict[str, Any]:
    return {
        "st_mode": attributes.mode,
        "st_size": attributes.size,
        "st_nlink": attributes.nlink,
        "st_uid": attributes.uid,
        "st_gid": attributes.gid,
        "st_mtime": attributes.mtime,
        "st_ctime": attributes.mtime,
        "st_atime": attributes.mtime,
        "st_blocks": -(-attributes.size // 512),
        "st_ino": attributes.ino,
    }


class FuseOperations(mfusepy.Operations):  # type: ignore[misc]  # mfusepy ships no type hints
    """Kernel-facing options are set in ``init_with_config``: attribute and
    entry timeouts equal the metadata TTL, and "no such file" is not cached
    by the kernel. Whether the page cache is kept across
    opens is decided per open by ``fs.open`` from the object version, not by
    libfuse's ``auto_cache``, which compares mtime and size: S3 mtimes have
    one-second resolution and an overwrite may keep the size.

    Runs with mfusepy's ``raw_fi``: file operations receive the kernel's
    ``fuse_file_info`` so ``open`` can set ``keep_cache`` and ``direct_io``."""

    use_ns = False

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
        self._metadata_ttl = metadata_ttl
        self._read_ahead = read_ahead
        self._on_ready = on_ready
        self.mounted = False  # set once the kernel has initialised the mount

    def init_with_config(self, conn_info: Any, config_3: Any) -> None:
        if config_3 is not None:
            config_3.attr_timeout = self._metadata_ttl
            config_3.entry_timeout = self._metadata_ttl
            # "No such file" is answered from the listing in memory, cheaply;
            # cached by the kernel for a TTL of its own (counted from its
            # lookup, not from our listing), a new object would stay hidden
            # after ``ls`` shows it, for up to twice the TTL.
            config_3.negative_timeout = 0
            config_3.auto_cache = 0
            config_3.kernel_cache = 0
            config_3.use_ino = 1  # ours (``names.inode_number``), stable, and the same in readdir
        self.mounted = True
        threading.Thread(
            target=_set_read_ahead,
            args=(self._mountpoint, self._read_ahead),
            name="cachefsd-readahead",
            daemon=True,
        ).start()
        self._on_ready()

    @_translated
    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        return _stat(self._fs.getattr(path))

    @_translated
    def readdir(self, path: str, fh: int) -> list[tuple[str, dict[str, int], int]]:
        return [(name, {"st_mode": mode, "st_ino": ino}, 0) for name, mode, ino in self._fs.readdir(path)]

    @_translated
    def open(self, path: str, fi: Any) -> int:
        opened = self._fs.open(path, fi.flags)
        if opened.invalidate_attributes is not None:
            self._drop_attributes(path, opened.invalidate_attributes)
        fi.fh, fi.keep_cache, fi.direct_io = opened.handle, opened.keep_cache, opened.direct_io
        return 0

    @_translated
    def read_buf(self, path: str, bufpp: Any, size: int, offset: int, fi: Any) -> int:
        bufpp[0] = _bufvec(self._fs.read(fi.fh, size, offset))
        return 0

    @_translated
    def release(self, path: str, fi: Any) -> int:
        stale = self._fs.release(fi.fh)
        if stale is not None:
            self._drop_attributes(path, stale)
        return 0

    def _drop_attributes(self, path: str, stale: StaleSize) -> None:
        """Have the kernel drop what ``stale`` is about, then say it is gone."""
        if path:  # else libfuse knows the node no more: the kernel holds nothing
            _invalidate_attributes(path)
        self._fs.attributes_dropped(stale)

    @_translated
    def statfs(self, path: str) -> dict[str, int]:
        return self._fs.statfs()

    # Every write path: EROFS, and nothing reaches the bucket.
    @_translated
    def create(self, path: str, mode: int, fi: Any = None) -> int:
        self._fs.refuse_write(path)

    @_translated
    def write(self, path: str, data: bytes, offset: int, fi: Any) -> int:
        self._fs.refuse_write(path)

    @_translated
    def truncate(self, path: str, length: int, fi: Any = None) -> int:
        self._fs.refuse_write(path)

    @_translated
    def mkdir(self, path: str, mode: int) -> int:
        self._fs.refuse_write(path)

    @_translated
    def mknod(self, path: str, mode: int, dev: int) -> int:
        self._fs.refuse_write(path)

    @_translated
    def rmdir(self, path: str) -> int:
        self._fs.refuse_write(path)

    @_translated
    def unlink(self, path: str) -> int:
        self._fs.refuse_write(path)

    @_translated
    def rename(self, old: str, new: str) -> int:
        self._fs.refuse_write(old)

    @_translated
    def link(self, target: str, source: str) -> int:
        self._fs.refuse_write(target)

    @_translated
    def symlink(self, target: str, source: str) -> int:
        self._fs.refuse_write(target)

    @_translated
    def chmod(self, path: str, mode: int) -> int:
        self._fs.refuse_write(path)

    @_translated
    def chown(self, path: str, uid: int, gid: int) -> int:
        self._fs.refuse_write(path)

    @_translated
    def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
        self._fs.refuse_write(path)

    @_translated
    def setxattr(self, path: str, name: str, value: bytes, options: int, position: int = 0) -> int:
        self._fs.refuse_write(path)

    @_translated
    def removexattr(self, path: str, name: str) -> int:
        self._fs.refuse_write(path)


def serve(
    operations: FuseOperations, mountpoint: str, fsname: str, allow_other: bool, cold_reads: int
) -> None:
    """Mount and serve until unmounted (or SIGTERM/SIGINT, which libfuse
    turns into a clean unmount). Blocks the calling thread.

    A read that waits on the network holds its libfuse worker until the
    block arrives, so the workers bound how many reads are in flight:
    ``cold_reads`` of them (the fetch concurrency), plus spares that serve
    lookups and cached reads meanwhile. libfuse's own default is 10, which
    made a loader with 16 workers wait in two waves on a cold epoch."""
    workers = cold_reads + SPARE_WORKERS
    options: dict[str, Any] = {
        "foreground": True,
        "ro": True,
        "default_permissions": True,
        "fsname": fsname.replace(",", "_"),
        "subtype": "cachefsd",
        # Keep idle workers (left unset, libfuse 3.14 also logs "Ignoring
        # invalid max threads value 4294967295").
        "max_idle_threads": workers,
    }
    if (mfusepy.fuse_version_major, mfusepy.fuse_version_minor) >= (3, 12):
        options["max_threads"] = workers  # before 3.12 there is no cap, nor this option
    if allow_other:
        options["allow_other"] = True
    try:
        mfusepy.FUSE(operations, mountpoint, raw_fi=True, **options)
    except RuntimeError as exc:
        # libfuse >= 3.12 ends the session loop of a SIGTERM/SIGINT/SIGHUP
        # with the signal as its error, so fuse_main returns 8 ("loop
        # failed") after what was an orderly unmount; mfusepy raises that
        # code. Codes 1-7 are failures to mount and stay errors.
        if exc.args != (FUSE_MAIN_LOOP_ENDED,) or not operations.mounted:
            code = exc.args[0] if exc.args else None
            reason = _FUSE_MAIN_FAILURES.get(code, "it failed") if isinstance(code, int) else "it failed"
            raise CachefsdError(f"libfuse could not mount {mountpoint}: {reason} (code {code})") from exc
        log.info("FUSE session ended by a signal (libfuse code %d)", FUSE_MAIN_LOOP_ENDED)
    finally:
        _close_all_spans()
