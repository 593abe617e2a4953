"""The kernel's FUSE protocol (``include/uapi/linux/fuse.h``), the part
cachefsd speaks: request and reply layouts, operation codes and flags, and
the packing of each reply. Pure functions over bytes; ``session.py`` does
the I/O.

Every structure is little-endian native layout with 64-bit alignment, as
the header pads them; ``tests/contract/test_fuse_protocol.py`` checks each
size and offset against the C header of the machine. Fields the protocol
added after 7.38 (``backing_id`` in the open reply, ``max_stack_depth`` in
the INIT reply) take the place of padding, so the layouts are the same.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

# The protocol version we speak: passthrough (backing files) came in 7.40.
MAJOR = 7
MINOR = 40
# The oldest minor we accept: the one whose INIT reply has the full layout.
MINIMUM_MINOR = 23


class Op(enum.IntEnum):
    """The operation codes answered here (others get ENOSYS). The native
    plane answers the FORGETs, INTERRUPT, READDIRPLUS and RELEASEDIR
    itself (a listing is handed to it at OPENDIR), and never hands them on."""

    LOOKUP = 1
    GETATTR = 3
    SETATTR = 4
    SYMLINK = 6
    MKNOD = 8
    MKDIR = 9
    UNLINK = 10
    RMDIR = 11
    RENAME = 12
    LINK = 13
    OPEN = 14
    READ = 15
    WRITE = 16
    STATFS = 17
    RELEASE = 18
    FSYNC = 20
    FLUSH = 25
    INIT = 26
    OPENDIR = 27
    FSYNCDIR = 30
    CREATE = 35
    DESTROY = 38
    RENAME2 = 45


# INIT flags (``flags`` holds bits 0-31, ``flags2`` bits 32-63).
ASYNC_READ = 1 << 0
ATOMIC_O_TRUNC = 1 << 3
BIG_WRITES = 1 << 5  # without it the kernel writes a page a request
DO_READDIRPLUS = 1 << 13
NO_OPEN_SUPPORT = 1 << 17
PARALLEL_DIROPS = 1 << 18
MAX_PAGES = 1 << 22
INIT_EXT = 1 << 30
PASSTHROUGH = 1 << 37

# OPEN reply flags.
FOPEN_DIRECT_IO = 1 << 0
FOPEN_KEEP_CACHE = 1 << 1
FOPEN_PASSTHROUGH = 1 << 7

# SETATTR's ``valid`` bits.
FATTR_MODE = 1 << 0
FATTR_UID = 1 << 1
FATTR_GID = 1 << 2
FATTR_SIZE = 1 << 3
FATTR_MTIME = 1 << 5
FATTR_MTIME_NOW = 1 << 8

# RENAME2 flags (``renameat2``).
RENAME_NOREPLACE = 1 << 0

# Notification codes (the ``error`` field of an unsolicited message).
NOTIFY_INVAL_ENTRY = 3

IN_HEADER = struct.Struct("<IIQQIIIHH")  # len, opcode, unique, nodeid, uid, gid, pid, total_extlen, padding
OUT_HEADER = struct.Struct("<IiQ")  # len, error, unique
INIT_IN = struct.Struct("<IIIII")  # major, minor, max_readahead, flags, flags2 (then unused)
INIT_OUT = struct.Struct("<IIIIHHIIHHII24x")
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")
ENTRY_OUT = struct.Struct("<QQQQII")  # then an ATTR
ATTR_OUT = struct.Struct("<QII")  # then an ATTR
OPEN_OUT = struct.Struct("<QIi")  # fh, open_flags, backing_id
READ_IN = struct.Struct("<QQIIQII")  # fh, offset, size, read_flags, lock_owner, flags, padding
RELEASE_IN = struct.Struct("<QIIQ")  # fh, flags, release_flags, lock_owner
FLUSH_IN = struct.Struct("<QIIQ")  # fh, unused, padding, lock_owner
OPEN_IN = struct.Struct("<II")  # flags, open_flags
CREATE_IN = struct.Struct("<IIII")  # flags, mode, umask, open_flags
MKDIR_IN = struct.Struct("<II")  # mode, umask
RENAME_IN = struct.Struct("<Q")  # newdir
RENAME2_IN = struct.Struct("<QII")  # newdir, flags, padding
# valid, padding, fh, size, lock_owner, atime, mtime, ctime, atimensec,
# mtimensec, ctimensec, mode, unused4, uid, gid, unused5
SETATTR_IN = struct.Struct("<IIQQQQQQIIIIIIII")
WRITE_IN = struct.Struct("<QQIIQII")  # fh, offset, size, write_flags, lock_owner, flags, padding
WRITE_OUT = struct.Struct("<II")  # size, padding
KSTATFS = struct.Struct("<QQQQQIIII24x")
NOTIFY_INVAL_ENTRY_OUT = struct.Struct("<QII")  # parent, namelen, flags

# The largest read the kernel asks for: MAX_PAGES pages (1 MiB).
MAX_PAGES_COUNT = 256
PAGE_SIZE = 4096
MAX_READ = MAX_PAGES_COUNT * PAGE_SIZE
# Read-ahead READs the kernel keeps in flight at once (max_background, its
# default, said explicitly), and from how many it slows new ones down.
BACKGROUND_REQUESTS = 12
CONGESTION_THRESHOLD = 9
# The largest write the kernel sends: as large as a read, so a checkpoint
# is written a MiB per request. It sizes the buffer a request is read into.
MAX_WRITE = MAX_READ
# A request buffer: the kernel refuses a read of /dev/fuse into less than a
# header, a write request's header and MAX_WRITE.
REQUEST_BUFFER = MAX_WRITE + PAGE_SIZE


@dataclass(frozen=True, slots=True)
class Request:
    """What every request says: its operation, its number (its answer's),
    the inode it is about, and the process that asked (whose job it reads for)."""

    opcode: int
    unique: int
    nodeid: int
    pid: int


def parse_header(buffer: memoryview) -> Request:
    _, opcode, unique, nodeid, _, _, pid, _, _ = IN_HEADER.unpack_from(buffer)
    return Request(opcode, unique, nodeid, pid)


def reply(unique: int, *body: bytes | memoryview) -> list[bytes | memoryview]:
    """A successful answer to request ``unique``: header and body, for one ``writev``."""
    length = OUT_HEADER.size + sum(len(part) for part in body)
    return [OUT_HEADER.pack(length, 0, unique), *body]


def error(unique: int, errno_: int) -> bytes:
    return OUT_HEADER.pack(OUT_HEADER.size, -errno_, unique)


@dataclass(frozen=True, slots=True)
class Attr:
    """What the kernel is told of an inode (``struct fuse_attr``)."""

    ino: int
    size: int
    mtime: float
    mode: int
    nlink: int
    uid: int
    gid: int


def pack_attr(attr: Attr) -> bytes:
    seconds = int(attr.mtime)
    nanoseconds = int((attr.mtime - seconds) * 1e9)
    blocks = -(-attr.size // 512)
    return ATTR.pack(
        attr.ino, attr.size, blocks, seconds, seconds, seconds,
        nanoseconds, nanoseconds, nanoseconds,
        attr.mode, attr.nlink, attr.uid, attr.gid, 0, PAGE_SIZE, 0,
    )  # fmt: skip


def _seconds(timeout: float) -> tuple[int, int]:
    whole = int(timeout)
    return whole, int((timeout - whole) * 1e9)


def pack_entry(nodeid: int, attr: Attr, timeout: float) -> bytes:
    seconds, nanoseconds = _seconds(timeout)
    return ENTRY_OUT.pack(nodeid, 0, seconds, seconds, nanoseconds, nanoseconds) + pack_attr(attr)


def pack_attr_out(attr: Attr, timeout: float) -> bytes:
    seconds, nanoseconds = _seconds(timeout)
    return ATTR_OUT.pack(seconds, nanoseconds, 0) + pack_attr(attr)


def pack_statfs(blocks: int, bfree: int, bavail: int, bsize: int, frsize: int, namelen: int) -> bytes:
    return KSTATFS.pack(blocks, bfree, bavail, 0, 0, bsize, namelen, frsize, 0)


@dataclass(frozen=True, slots=True)
class InitOffer:
    """What the kernel offers in INIT."""

    major: int
    minor: int
    max_readahead: int
    flags: int  # bits 0-63


def parse_init(body: memoryview) -> InitOffer:
    major, minor, max_readahead, flags, flags2 = INIT_IN.unpack_from(body)
    if flags & INIT_EXT:
        flags |= flags2 << 32
    return InitOffer(major, minor, max_readahead, flags)


def pack_init(offer: InitOffer, wanted: int, max_stack_depth: int) -> bytes:
    """The INIT answer: the flags of ``wanted`` the kernel offered, 1 MiB
    reads, nanosecond times; ``max_stack_depth`` when passthrough is in."""
    flags = wanted & offer.flags
    if offer.flags & INIT_EXT:
        flags |= INIT_EXT
    depth = max_stack_depth if flags & PASSTHROUGH else 0
    return INIT_OUT.pack(
        MAJOR, min(offer.minor, MINOR), offer.max_readahead, flags & 0xFFFFFFFF,
        BACKGROUND_REQUESTS, CONGESTION_THRESHOLD, MAX_WRITE, 1, MAX_PAGES_COUNT, 0, flags >> 32, depth,
    )  # fmt: skip


def pack_open(fh: int, open_flags: int, backing_id: int = 0) -> bytes:
    return OPEN_OUT.pack(fh, open_flags, backing_id)


def pack_inval_entry(parent: int, name: bytes) -> bytes:
    """A notification that ``name`` in ``parent`` is stale: header, body, name, NUL."""
    body = NOTIFY_INVAL_ENTRY_OUT.pack(parent, len(name), 0) + name + b"\0"
    return OUT_HEADER.pack(OUT_HEADER.size + len(body), NOTIFY_INVAL_ENTRY, 0) + body
