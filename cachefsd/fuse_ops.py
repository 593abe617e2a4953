"""The FUSE edge: the only module that imports mfusepy.

One line per operation into ``fs.FileSystem``, plus errno translation: our
errors become their errno through ``errors.errno_for``; anything else is a
bug, logged with its traceback and answered with EIO (never mfusepy's
catch-all EINVAL).
"""

from __future__ import annotations

import ctypes.util
import errno
import functools
import logging
import os
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from cachefsd.errors import CachefsdError, errno_for
from cachefsd.fs import Attributes, FileSystem

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

P = ParamSpec("P")
R = TypeVar("R")


def _translated(operation: Callable[P, R]) -> Callable[P, R]:
    @functools.wraps(operation)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
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
    }


class FuseOperations(mfusepy.Operations):
    """Kernel-facing options are set in ``init_with_config``: attribute and
    entry timeouts equal the metadata TTL (the kernel asks again exactly when
    our listing may have changed). Whether the page cache is kept across
    opens is decided per open by ``fs.open`` from the object version, not by
    libfuse's ``auto_cache``, which compares mtime and size: S3 mtimes have
    one-second resolution and an overwrite may keep the size.

    Runs with mfusepy's ``raw_fi``: file operations receive the kernel's
    ``fuse_file_info`` so ``open`` can set ``keep_cache`` and ``direct_io``."""

    use_ns = False

    def __init__(self, fs: FileSystem, metadata_ttl: float, on_ready: Callable[[], None]) -> None:
        self._fs = fs
        self._metadata_ttl = metadata_ttl
        self._on_ready = on_ready
        self.mounted = False  # set once the kernel has initialised the mount

    def init_with_config(self, conn_info: Any, config_3: Any) -> None:
        if config_3 is not None:
            config_3.attr_timeout = self._metadata_ttl
            config_3.entry_timeout = self._metadata_ttl
            config_3.negative_timeout = self._metadata_ttl
            config_3.auto_cache = 0
            config_3.kernel_cache = 0
        self.mounted = True
        self._on_ready()

    @_translated
    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        return _stat(self._fs.getattr(path))

    @_translated
    def readdir(self, path: str, fh: int) -> list[tuple[str, int, int]]:
        return [(name, mode, 0) for name, mode in self._fs.readdir(path)]

    @_translated
    def open(self, path: str, fi: Any) -> int:
        opened = self._fs.open(path, fi.flags)
        fi.fh, fi.keep_cache, fi.direct_io = opened.handle, opened.keep_cache, opened.direct_io
        return 0

    @_translated
    def read(self, path: str, size: int, offset: int, fi: Any) -> bytes:
        return self._fs.read(fi.fh, size, offset)

    @_translated
    def release(self, path: str, fi: Any) -> int:
        self._fs.release(fi.fh)
        return 0

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


def serve(operations: FuseOperations, mountpoint: str, fsname: str, allow_other: bool) -> None:
    """Mount and serve until unmounted (or SIGTERM/SIGINT, which libfuse
    turns into a clean unmount). Blocks the calling thread."""
    options: dict[str, Any] = {
        "foreground": True,
        "ro": True,
        "default_permissions": True,
        "fsname": fsname.replace(",", "_"),
        "subtype": "cachefsd",
    }
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
            raise
        log.info("FUSE session ended by a signal (libfuse code %d)", FUSE_MAIN_LOOP_ENDED)
