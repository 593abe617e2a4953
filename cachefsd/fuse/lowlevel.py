"""A ctypes binding of the part of libfuse 3's low-level API cachefsd uses.

Only declarations: the C structures and functions of ``fuse_lowlevel.h``
and ``fuse_common.h`` (libfuse 3.12 or later) that ``session.py`` calls.
ctypes and not a compiled module (pyfuse3): ``pip install`` needs no
compiler and no libfuse3-dev, and the libfuse worker threads call Python
directly, so a read that waits on the network holds its worker and not an
event loop (see ``session.py``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import platform
from typing import Any

from cachefsd.errors import CachefsdError

_path = ctypes.util.find_library("fuse3")
if _path is None:
    raise CachefsdError("libfuse3 is not installed: install the fuse3 package (apt-get install fuse3)")
lib = ctypes.CDLL(_path, use_errno=True)

# fuse_loop_cfg_* and fuse_session_loop_mt_312 appeared in 3.12.
MINIMUM_VERSION = 312
lib.fuse_version.restype = ctypes.c_int
VERSION: int = lib.fuse_version()
if VERSION < MINIMUM_VERSION:
    raise CachefsdError(f"libfuse {VERSION // 100}.{VERSION % 100} is too old: cachefsd needs 3.12 or later")

# fuse_conn_info.capable / want (fuse_common.h).
CAP_ASYNC_READ = 1 << 0
CAP_SPLICE_WRITE = 1 << 7
CAP_SPLICE_MOVE = 1 << 8
CAP_AUTO_INVAL_DATA = 1 << 12
CAP_READDIRPLUS = 1 << 13
CAP_READDIRPLUS_AUTO = 1 << 14
CAP_NO_OPEN_SUPPORT = 1 << 17
CAP_PARALLEL_DIROPS = 1 << 18

# fuse_buf_flags: the buffer is a file descriptor, read at ``pos``, retried
# on short reads.
BUF_IS_FD = 1 << 1
BUF_FD_SEEK = 1 << 2
BUF_FD_RETRY = 1 << 3


# ``struct stat`` of each ABI the binding knows (only the fields libfuse sends).
_X86_64_STAT: tuple[tuple[str, Any], ...] = (
    ("st_dev", ctypes.c_uint64),
    ("st_ino", ctypes.c_uint64),
    ("st_nlink", ctypes.c_uint64),
    ("st_mode", ctypes.c_uint32),
    ("st_uid", ctypes.c_uint32),
    ("st_gid", ctypes.c_uint32),
    ("_pad0", ctypes.c_int32),
    ("st_rdev", ctypes.c_uint64),
    ("st_size", ctypes.c_int64),
    ("st_blksize", ctypes.c_int64),
    ("st_blocks", ctypes.c_int64),
    ("st_atime", ctypes.c_int64),
    ("st_atime_nsec", ctypes.c_int64),
    ("st_mtime", ctypes.c_int64),
    ("st_mtime_nsec", ctypes.c_int64),
    ("st_ctime", ctypes.c_int64),
    ("st_ctime_nsec", ctypes.c_int64),
    ("_reserved", ctypes.c_int64 * 3),
)
_AARCH64_STAT: tuple[tuple[str, Any], ...] = (
    ("st_dev", ctypes.c_uint64),
    ("st_ino", ctypes.c_uint64),
    ("st_mode", ctypes.c_uint32),
    ("st_nlink", ctypes.c_uint32),
    ("st_uid", ctypes.c_uint32),
    ("st_gid", ctypes.c_uint32),
    ("st_rdev", ctypes.c_uint64),
    ("_pad1", ctypes.c_uint64),
    ("st_size", ctypes.c_int64),
    ("st_blksize", ctypes.c_int32),
    ("_pad2", ctypes.c_int32),
    ("st_blocks", ctypes.c_int64),
    ("st_atime", ctypes.c_int64),
    ("st_atime_nsec", ctypes.c_int64),
    ("st_mtime", ctypes.c_int64),
    ("st_mtime_nsec", ctypes.c_int64),
    ("st_ctime", ctypes.c_int64),
    ("st_ctime_nsec", ctypes.c_int64),
    ("_reserved", ctypes.c_int32 * 2),
)
_STAT_BY_MACHINE = {"x86_64": _X86_64_STAT, "aarch64": _AARCH64_STAT}
if platform.machine() not in _STAT_BY_MACHINE:
    raise CachefsdError(f"cachefsd's FUSE binding knows no struct stat for {platform.machine()}")


class Stat(ctypes.Structure):
    """``struct stat`` of this machine."""

    _fields_ = _STAT_BY_MACHINE[platform.machine()]


class StatVfs(ctypes.Structure):
    """``struct statvfs`` (64-bit Linux)."""

    _fields_ = (
        ("f_bsize", ctypes.c_ulong),
        ("f_frsize", ctypes.c_ulong),
        ("f_blocks", ctypes.c_uint64),
        ("f_bfree", ctypes.c_uint64),
        ("f_bavail", ctypes.c_uint64),
        ("f_files", ctypes.c_uint64),
        ("f_ffree", ctypes.c_uint64),
        ("f_favail", ctypes.c_uint64),
        ("f_fsid", ctypes.c_ulong),
        ("f_flag", ctypes.c_ulong),
        ("f_namemax", ctypes.c_ulong),
        ("_spare", ctypes.c_int * 6),
    )


class EntryParam(ctypes.Structure):
    """``struct fuse_entry_param``: a LOOKUP's answer."""

    _fields_ = (
        ("ino", ctypes.c_uint64),
        ("generation", ctypes.c_uint64),
        ("attr", Stat),
        ("attr_timeout", ctypes.c_double),
        ("entry_timeout", ctypes.c_double),
    )


class FileInfo(ctypes.Structure):
    """``struct fuse_file_info``."""

    _fields_ = (
        ("flags", ctypes.c_int),
        ("writepage", ctypes.c_uint, 1),
        ("direct_io", ctypes.c_uint, 1),
        ("keep_cache", ctypes.c_uint, 1),
        ("flush", ctypes.c_uint, 1),
        ("nonseekable", ctypes.c_uint, 1),
        ("flock_release", ctypes.c_uint, 1),
        ("cache_readdir", ctypes.c_uint, 1),
        ("noflush", ctypes.c_uint, 1),
        ("_padding", ctypes.c_uint, 24),
        ("_padding2", ctypes.c_uint, 32),
        ("fh", ctypes.c_uint64),
        ("lock_owner", ctypes.c_uint64),
        ("poll_events", ctypes.c_uint32),
    )


class ConnInfo(ctypes.Structure):
    """``struct fuse_conn_info``: what the kernel offers and what we want."""

    _fields_ = (
        ("proto_major", ctypes.c_uint),
        ("proto_minor", ctypes.c_uint),
        ("max_write", ctypes.c_uint),
        ("max_read", ctypes.c_uint),
        ("max_readahead", ctypes.c_uint),
        ("capable", ctypes.c_uint),
        ("want", ctypes.c_uint),
        ("max_background", ctypes.c_uint),
        ("congestion_threshold", ctypes.c_uint),
        ("time_gran", ctypes.c_uint),
        ("_reserved", ctypes.c_uint * 22),
    )


class Ctx(ctypes.Structure):
    """``struct fuse_ctx``: who sent a request."""

    _fields_ = (
        ("uid", ctypes.c_uint32),
        ("gid", ctypes.c_uint32),
        ("pid", ctypes.c_int32),
        ("umask", ctypes.c_uint32),
    )


class ForgetData(ctypes.Structure):
    """``struct fuse_forget_data``: one inode of a FORGET_MULTI."""

    _fields_ = (("ino", ctypes.c_uint64), ("nlookup", ctypes.c_uint64))


class Buf(ctypes.Structure):
    """``struct fuse_buf``."""

    _fields_ = (
        ("size", ctypes.c_size_t),
        # enum fuse_buf_flags: GCC gives an enum with no negative value the type unsigned int.
        ("flags", ctypes.c_uint),
        ("mem", ctypes.c_void_p),
        ("fd", ctypes.c_int),
        ("pos", ctypes.c_int64),
    )


class BufVec(ctypes.Structure):
    """``struct fuse_bufvec`` as C declares it: one buffer, which callers
    over-allocate (``bufvec_type``)."""

    _fields_ = (
        ("count", ctypes.c_size_t),
        ("idx", ctypes.c_size_t),
        ("off", ctypes.c_size_t),
        ("buf", Buf * 1),
    )


@functools.cache
def bufvec_type(count: int) -> type[ctypes.Structure]:
    """``struct fuse_bufvec`` with room for ``count`` buffers."""
    return type(
        f"BufVec{count}", (ctypes.Structure,), {"_fields_": (*BufVec._fields_[:-1], ("buf", Buf * count))}
    )


class Args(ctypes.Structure):
    """``struct fuse_args``."""

    _fields_ = (
        ("argc", ctypes.c_int),
        ("argv", ctypes.POINTER(ctypes.c_char_p)),
        ("allocated", ctypes.c_int),
    )


_req = ctypes.c_void_p
_ino = ctypes.c_uint64
_fi = ctypes.POINTER(FileInfo)

INIT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ConnInfo))
LOOKUP = ctypes.CFUNCTYPE(None, _req, _ino, ctypes.c_char_p)
FORGET = ctypes.CFUNCTYPE(None, _req, _ino, ctypes.c_uint64)
FORGET_MULTI = ctypes.CFUNCTYPE(None, _req, ctypes.c_size_t, ctypes.POINTER(ForgetData))
INODE_FILE = ctypes.CFUNCTYPE(None, _req, _ino, _fi)  # getattr, open, opendir, releasedir
READ = ctypes.CFUNCTYPE(None, _req, _ino, ctypes.c_size_t, ctypes.c_int64, _fi)  # read, readdirplus
STATFS = ctypes.CFUNCTYPE(None, _req, _ino)

# ``struct fuse_lowlevel_ops``, in its order; unset operations stay NULL and
# libfuse answers them ENOSYS (the read-only mount refuses writes before).
OPERATIONS = (
    "init", "destroy", "lookup", "forget", "getattr", "setattr", "readlink", "mknod", "mkdir",
    "unlink", "rmdir", "symlink", "rename", "link", "open", "read", "write", "flush", "release",
    "fsync", "opendir", "readdir", "releasedir", "fsyncdir", "statfs", "setxattr", "getxattr",
    "listxattr", "removexattr", "access", "create", "getlk", "setlk", "bmap", "ioctl", "poll",
    "write_buf", "retrieve_reply", "forget_multi", "flock", "fallocate", "readdirplus",
    "copy_file_range", "lseek",
)  # fmt: skip


class Operations(ctypes.Structure):
    """``struct fuse_lowlevel_ops``: a function pointer per operation."""

    _fields_ = tuple((name, ctypes.c_void_p) for name in OPERATIONS)


def _declare(name: str, restype: type | None, *argtypes: type) -> None:
    function = getattr(lib, name)
    function.restype = restype
    function.argtypes = list(argtypes)


_p = ctypes.c_void_p
_declare("fuse_session_new", _p, ctypes.POINTER(Args), ctypes.POINTER(Operations), ctypes.c_size_t, _p)
_declare("fuse_session_mount", ctypes.c_int, _p, ctypes.c_char_p)
_declare("fuse_session_loop_mt_312", ctypes.c_int, _p, _p)
_declare("fuse_session_exit", None, _p)
_declare("fuse_session_unmount", None, _p)
_declare("fuse_session_destroy", None, _p)
_declare("fuse_loop_cfg_create", _p)
_declare("fuse_loop_cfg_destroy", None, _p)
_declare("fuse_loop_cfg_set_max_threads", None, _p, ctypes.c_uint)
_declare("fuse_loop_cfg_set_idle_threads", None, _p, ctypes.c_uint)
_declare("fuse_req_ctx", ctypes.POINTER(Ctx), _req)
_declare("fuse_reply_err", ctypes.c_int, _req, ctypes.c_int)
_declare("fuse_reply_none", None, _req)
_declare("fuse_reply_entry", ctypes.c_int, _req, ctypes.POINTER(EntryParam))
_declare("fuse_reply_attr", ctypes.c_int, _req, ctypes.POINTER(Stat), ctypes.c_double)
_declare("fuse_reply_open", ctypes.c_int, _req, _fi)
_declare("fuse_reply_buf", ctypes.c_int, _req, _p, ctypes.c_size_t)
_declare("fuse_reply_data", ctypes.c_int, _req, _p, ctypes.c_int)
_declare("fuse_reply_statfs", ctypes.c_int, _req, ctypes.POINTER(StatVfs))
_declare(
    "fuse_add_direntry_plus",
    ctypes.c_size_t,
    _req,
    _p,
    ctypes.c_size_t,
    ctypes.c_char_p,
    ctypes.POINTER(EntryParam),
    ctypes.c_int64,
)
_declare("fuse_lowlevel_notify_inval_entry", ctypes.c_int, _p, _ino, ctypes.c_char_p, ctypes.c_size_t)
