"""Filesystem semantics in plain Python types: what a path is, what its
attributes are, what an open handle reads. No FUSE here, so unit tests drive
it directly; fuse_ops.py only translates.

An open file is pinned to the object version (etag) its path had at open:
every read through that handle returns bytes of that version or fails, so a
reader never sees a mix of old and new bytes. If the object changes upstream
while the handle is open and a block of the old version is not cached, the
read fails with EIO and the listing is dropped so the next open sees the new
version (SEMANTICS.md).

The kernel page cache is per path, not per version, so ``open`` also decides
how the kernel may use it: keep its pages only when they can only be of the
version being opened (``keep_cache``); otherwise drop them; and while another
version of the same path is still open, bypass the page cache for the new
handle (``direct_io``) so neither version's pages are seen through the other.
"""

from __future__ import annotations

import itertools
import os
import stat
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import NoReturn, Protocol

from cachefsd.errors import BadFileHandle, IsADirectory, ObjectChanged, ReadOnly
from cachefsd.namespace.names import inode_number
from cachefsd.namespace.tree import Namespace
from cachefsd.reader import BlockReader, Piece
from cachefsd.store.base import ObjectInfo

# O_APPEND is not among them: with O_RDONLY it writes nothing, and a read-only
# filesystem of the kernel's own (a tmpfs mounted ro) opens it.
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC
DIR_MODE = stat.S_IFDIR | 0o555
FILE_MODE = stat.S_IFREG | 0o444


class AccessEvents(Protocol):
    """What the access model learns from (prefetch/engine.py implements it)."""

    def opened(self, info: ObjectInfo) -> None: ...
    def read(self, info: ObjectInfo, offset: int, size: int) -> None: ...
    def listed(self, entries: dict[str, ObjectInfo | None], directory: str) -> None: ...


@dataclass(frozen=True, slots=True)
class StaleSize:
    """The kernel may hold the size of version ``etag`` of ``key``: the FUSE
    layer drops its attributes of the path, then says so
    (``FileSystem.attributes_dropped``). Until then the path stays marked:
    an open in between read through the page cache, at the old size."""

    key: str
    etag: str
    # A version gone upstream whose last handle this was: its blocks are
    # released after the attributes are dropped. Released before, on the
    # libfuse worker, a fresh open after the close often came first, and
    # was shown the old size.
    gone: ObjectInfo | None = None


@dataclass(frozen=True, slots=True)
class OpenFile:
    handle: int
    keep_cache: bool  # the kernel's cached pages of this path are of this version
    direct_io: bool  # stay out of the page cache: another version is open, or the size is stale
    # The kernel may hold an older version's size: drop its attributes now
    # (only when no other handle of the path is open, see ``open``).
    invalidate_attributes: StaleSize | None = None


@dataclass(frozen=True, slots=True)
class Attributes:
    mode: int
    size: int
    mtime: float
    uid: int
    gid: int
    nlink: int
    ino: int


class FileSystem:
    """The mount's semantics: paths through the namespace, handles pinned to a version, reads
    through the reader."""

    def __init__(
        self,
        namespace: Namespace,
        reader: BlockReader,
        uid: int,
        gid: int,
        access: AccessEvents,
    ) -> None:
        self._namespace = namespace
        self._access = access
        self._reader = reader
        self._uid = uid
        self._gid = gid
        self._mounted_at = time.time()
        # _lock guards the maps below.
        self._lock = threading.Lock()
        self._handles: dict[int, ObjectInfo] = {}
        self._open_versions: dict[str, Counter[str]] = {}  # key -> etag -> open handles
        self._through_page_cache: Counter[str] = Counter()  # key -> open handles not direct_io
        self._direct: set[int] = set()  # handles opened direct_io
        self._page_cache_version: dict[str, str] = {}  # key -> etag the kernel may hold pages of
        # key -> etag of a version replaced while the kernel may still hold
        # its size; until we drop the kernel's attributes of the key (an open
        # or a release says when). Our getattr replies prove nothing: the
        # kernel discards one that raced another update of the attributes,
        # and kept the old size (reads cut at it).
        self._replaced: dict[str, str] = {}
        # (key, etag) -> a version gone upstream while a handle still reads
        # it: its blocks are released when its last handle is.
        self._gone_while_open: dict[tuple[str, str], ObjectInfo] = {}
        self._next_handle = itertools.count(1)

    def getattr(self, path: str) -> Attributes:
        info = self._namespace.lookup(path).info
        ino = inode_number(path)
        if info is None:
            return Attributes(DIR_MODE, 0, self._mounted_at, self._uid, self._gid, nlink=2, ino=ino)
        return Attributes(FILE_MODE, info.size, info.mtime, self._uid, self._gid, nlink=1, ino=ino)

    def readdir(self, path: str) -> list[tuple[str, int, int]]:
        """``(name, mode, inode number)`` of every entry, ``.`` and ``..`` included."""
        entries = self._namespace.listdir(path)
        self._access.listed(entries, path.strip("/"))
        here = path.rstrip("/")
        listing = [
            (".", DIR_MODE, inode_number(path)),
            ("..", DIR_MODE, inode_number(here.rpartition("/")[0] or "/")),
        ]
        listing.extend(
            (name, DIR_MODE if info is None else FILE_MODE, inode_number(f"{here}/{name}"))
            for name, info in entries.items()
        )
        return listing

    def open(self, path: str, flags: int) -> OpenFile:
        if flags & _WRITE_FLAGS:
            raise ReadOnly(path)
        info = self._namespace.lookup(path).info
        if info is None:
            raise IsADirectory(path)
        self._access.opened(info)
        self._reader.opened(info)
        if 0 < info.size <= self._reader.block_size:
            # A sample file: unless the kernel still holds its pages, its
            # READ follows this reply. Loading its block from the cache disk
            # now overlaps that disk read with the round trip (and with the
            # other readers' requests); when the pages are held, it costs a
            # few system calls on a block file already in RAM. A larger
            # file's first read may not be at offset 0 (a footer).
            self._reader.warm(info, 0, hold=True)
        with self._lock:
            handle = next(self._next_handle)
            self._handles[handle] = info
            # Listed again (re-uploaded with the same content): current, not gone.
            self._gone_while_open.pop((info.key, info.etag), None)
            open_versions = self._open_versions.setdefault(info.key, Counter())
            other_version_open = any(etag != info.etag for etag in open_versions)
            open_versions[info.etag] += 1
            # The kernel keeps a size for the metadata TTL, counted from its
            # own lookup, while our listing may have expired (or been dropped
            # by ObjectChanged) sooner: then it still has the old version's
            # size, would cut this one's reads there or pad them with zeros
            # up to it. This handle reads around the page cache, which clamps
            # reads to that size, and the kernel drops its attributes, so the
            # next stat learns the new size. Dropping them waits for the
            # file's pages being read in, so only once no handle reads
            # through the page cache (here, or when the last one is
            # released): a read-ahead waiting on a GET could hold that for a
            # whole fetch deadline, and this libfuse worker with it.
            stale_size = self._replaced.get(info.key, info.etag) != info.etag
            if other_version_open or stale_size:
                self._direct.add(handle)
                invalidate = None
                if stale_size and not self._through_page_cache[info.key]:
                    invalidate = StaleSize(info.key, self._replaced[info.key])
                return OpenFile(handle, keep_cache=False, direct_io=True, invalidate_attributes=invalidate)
            self._through_page_cache[info.key] += 1
            keep_cache = self._page_cache_version.get(info.key) == info.etag
            self._page_cache_version[info.key] = info.etag
        return OpenFile(handle, keep_cache=keep_cache, direct_io=False)

    def read(self, handle: int, size: int, offset: int) -> list[Piece]:
        with self._lock:
            info = self._handles.get(handle)
        if info is None:
            raise BadFileHandle(str(handle))
        self._access.read(info, offset, size)
        try:
            return self._reader.read(info, offset, size)
        except ObjectChanged:
            # Overwritten or deleted since the open (the fetcher reports a
            # deleted version as changed): the listing that showed it is
            # dropped, so the next open sees what is there now.
            self._namespace.invalidate(info)
            self.version_replaced(info)
            raise

    def version_replaced(self, info: ObjectInfo) -> None:
        """A refreshed listing, not yet visible, shows ``info`` overwritten
        or deleted (or a read found it so): the kernel may still hold its size."""
        with self._lock:
            self._replaced[info.key] = info.etag

    def version_gone(self, info: ObjectInfo) -> None:
        """The refreshed listing is visible: ``info``'s blocks are released,
        once no handle reads it any more (a handle is pinned to its version,
        and its cached blocks are all it can still read)."""
        with self._lock:
            still_open = info.etag in self._open_versions.get(info.key, ())  # counts are dropped at 0
            if still_open:
                self._gone_while_open[(info.key, info.etag)] = info
        if not still_open:
            self._reader.release_version(info)

    def release(self, handle: int) -> StaleSize | None:
        """What the kernel's attributes of the path are to be dropped for,
        now: they may be stale, and this was the last handle reading through
        the page cache, which an open of the new version had to wait for."""
        with self._lock:
            info = self._handles.pop(handle, None)
            if info is None:
                return None
            open_versions = self._open_versions[info.key]
            open_versions[info.etag] -= 1
            gone = None
            if open_versions[info.etag] == 0:
                del open_versions[info.etag]
                gone = self._gone_while_open.pop((info.key, info.etag), None)
            if not open_versions:
                del self._open_versions[info.key]
            replaced = self._leaves_page_cache(handle, info.key)
        if replaced is not None:
            return StaleSize(info.key, replaced, gone)
        if gone is not None:
            self._reader.release_version(gone)
        return None

    def _leaves_page_cache(self, handle: int, key: str) -> str | None:
        """For ``release``, under the lock: the etag of the replaced version
        whose size the kernel may hold, if this was the path's last handle
        reading through the page cache."""
        if handle in self._direct:
            self._direct.discard(handle)
            return None
        self._through_page_cache[key] -= 1
        if self._through_page_cache[key]:
            return None
        del self._through_page_cache[key]
        return self._replaced.get(key)

    def attributes_dropped(self, stale: StaleSize) -> None:
        """The kernel no longer holds the attributes ``stale`` was about:
        its next stat asks us. Unless the path was marked again meanwhile."""
        with self._lock:
            if self._replaced.get(stale.key) == stale.etag:
                del self._replaced[stale.key]
        if stale.gone is not None:
            self._reader.release_version(stale.gone)

    def statfs(self) -> dict[str, int]:
        """Sizes for ``df``: a bucket has none, so the cache's (its
        capacity, and its room as free space), in blocks. With no size,
        ``df`` left the mount out of its list, as it does pseudo filesystems."""
        capacity, used = self._reader.cache_usage()
        unit = self._reader.block_size
        room = max(0, capacity - used) // unit
        return {
            "f_bsize": unit,
            "f_frsize": unit,
            "f_blocks": capacity // unit,
            "f_bfree": room,
            "f_bavail": room,
            "f_namemax": 255,
        }

    def refuse_write(self, path: str) -> NoReturn:
        """Every write path ends here: the mount is read-only."""
        raise ReadOnly(path)
