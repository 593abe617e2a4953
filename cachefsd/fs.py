"""The filesystem in plain Python types: the inode table, and what each
kernel request answers. No FUSE here, so unit tests drive it directly;
``fuse/`` only translates.

One inode per object version: a file's inode stands for one (key, etag),
so its attributes never change and every read through it returns bytes of
that version or fails (EIO, when the version is gone upstream and the
block was not cached). The kernel may keep an inode's pages for as long as
it likes, across opens: they can only be of that version, so a reader never
sees a mix of old and new bytes. A refreshed listing that shows a new
version makes the next lookup answer a new inode, and the kernel is told to
forget the name (``stale_entries``); open files and mmaps keep their inode,
and their version, until they close. A directory's inode stands for its
path for the whole mount.

Inodes have two numbers. The kernel names one in its requests (``inode``,
FUSE's nodeid): counted up, never reused within a mount, so no request can
reach another inode than the kernel meant. ``stat`` shows the other: a hash of the path
and the version's etag (of the path, for a directory), the same after the
kernel forgot the inode and looked it up again, and across remounts, as
tools that key on device and inode (``du``, ``tar``, ``rsync``) expect.

Each answered lookup, and each entry of a READDIRPLUS, is a reference the
kernel holds until it FORGETs it: a file's inode is dropped when its last
reference is, and the blocks of a version gone upstream are released then,
as nothing can read them any more.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import stat
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

from cachefsd.cache.blocks import WholeFile
from cachefsd.cache.whole import ends_file
from cachefsd.errors import BadFileHandle, IsADirectory, NotADirectory, ObjectChanged, UnknownInode
from cachefsd.jobs import CallerJobs
from cachefsd.namespace.names import inode_number
from cachefsd.namespace.tree import Namespace
from cachefsd.reader import BlockReader, Piece, block_range
from cachefsd.store.base import ObjectInfo

DIR_MODE = stat.S_IFDIR | 0o555
FILE_MODE = stat.S_IFREG | 0o444
# The root directory's inode, in every FUSE filesystem.
ROOT_INODE = 1


class AccessEvents(Protocol):
    """What the workload model learns from, and what a read asks and tells it
    of the other jobs (prefetch/prefetcher.py implements it)."""

    def opened(self, info: ObjectInfo, job: str) -> None: ...
    def read(self, info: ObjectInfo, offset: int, size: int, job: str) -> None: ...
    def listed(self, entries: dict[str, ObjectInfo | None], directory: str, job: str) -> None: ...
    def wanted_elsewhere(self, info: ObjectInfo, job: str) -> bool:
        """Whether another job is still to read ``info`` this epoch."""
        ...

    def read_by_one_of_many(self, info: ObjectInfo, offset: int, size: int, job: str) -> None:
        """``job`` read these bytes, which ``wanted_elsewhere`` said another job is still to read."""
        ...


class CacheDisk(Protocol):
    """What the filesystem asks of the block cache (``cache.view.CacheView``)."""

    def digest(self, info: ObjectInfo, index: int) -> str | None:
        """The content hash cached for block ``index`` of ``info``; None if it is not cached."""
        ...

    def warm_file(self, info: ObjectInfo) -> None:
        """Start loading the file ``whole_file`` would hand over for
        ``info``, if it is cached, ahead of the open (and read) that follows."""
        ...

    def read_to_end(self, info: ObjectInfo) -> None:
        """A read reached the end of ``info``: the cache may now make the
        file ``whole_file`` hands over for it (in the background)."""
        ...

    def usage(self) -> tuple[int, int]:
        """The cache's capacity and the bytes it holds."""
        ...

    def whole_file(self, info: ObjectInfo) -> WholeFile | None:
        """A read-only descriptor (the caller closes it) of a verified file
        holding exactly ``info``'s bytes from offset 0, for the kernel to
        serve the object's reads from (FUSE passthrough), counted as a read
        of it by the cache; None unless the object is cached whole in one
        raw file (its one block, or its whole file)."""
        ...


class ReadMarks(Protocol):
    """Where a read says that another job is still to read its blocks this
    epoch, which the cache's policy asks as it counts them
    (``cache.policy.ReadMarks``)."""

    def reading(self, blocks: Callable[[str], bool]) -> AbstractContextManager[None]:
        """Within the block, on this thread, the blocks for which
        ``blocks(hash)`` is true are due for another job."""
        ...


@dataclass(frozen=True, slots=True)
class Attributes:
    mode: int
    size: int
    mtime: float
    uid: int
    gid: int
    nlink: int
    inode: int  # what the kernel names the inode by in its requests (FUSE's nodeid)
    st_ino: int  # what ``stat`` shows: a hash of the version (or the directory's path)


@dataclass(frozen=True, slots=True)
class DirEntry:
    name: str
    info: ObjectInfo | None  # None: a directory


@dataclass(slots=True)
class _File:
    info: ObjectInfo
    parent: int  # the inode of its directory
    name: str
    lookups: int = 0  # the kernel's references
    gone: bool = False  # replaced or deleted upstream


@dataclass(frozen=True, slots=True)
class _Dir:
    path: str  # "/" or "/a/b"
    parent: int


def _child(path: str, name: str) -> str:
    return f"{path.rstrip('/')}/{name}"


class FileSystem:
    """The mount's inode table: inodes for object versions and directories,
    the kernel's references to them, and reads through the reader."""

    def __init__(
        self,
        namespace: Namespace,
        reader: BlockReader,
        cache: CacheDisk,
        uid: int,
        gid: int,
        access: AccessEvents,
        jobs: CallerJobs,
        read_marks: ReadMarks,
    ) -> None:
        self._namespace = namespace
        self._access = access
        self._read_marks = read_marks
        self.jobs = jobs  # who a request's pid reads for
        self._reader = reader
        self._cache = cache
        # Whether opens may be handed a cache file (FUSE passthrough is
        # on), set by the FUSE edge: only then is a whole file made for a
        # file read to its end, as only such an open reads it.
        self.passthrough = False
        self._uid = uid
        self._gid = gid
        self._mounted_at = time.time()
        # (parent inode, name) of entries the kernel is to forget: the FUSE
        # edge tells the kernel from a thread of its own, as a notification
        # sent while serving a request in that directory would deadlock.
        self.stale_entries: queue.SimpleQueue[tuple[int, str]] = queue.SimpleQueue()
        # _lock guards the tables below.
        self._lock = threading.Lock()
        self._next_inode = itertools.count(ROOT_INODE + 1)
        self._dirs: dict[int, _Dir] = {ROOT_INODE: _Dir("/", ROOT_INODE)}
        self._dir_inodes: dict[str, int] = {"/": ROOT_INODE}
        self._files: dict[int, _File] = {}
        self._file_inodes: dict[tuple[str, str], int] = {}  # (key, etag) -> inode
        self._listings: dict[int, tuple[int, Sequence[DirEntry]]] = {}  # handle -> (inode, entries)
        self._next_handle = itertools.count(1)

    def lookup(self, parent: int, name: str) -> Attributes:
        """The entry ``name`` in directory ``parent``: one more reference."""
        path = _child(self._dir(parent).path, name)
        info = self._namespace.lookup(path).info
        if info is not None:
            self._reader.listed(info)
            # A lookup is how the kernel opens a file, and unless it still
            # holds its pages, its READ (or its own read of the file handed
            # over) follows. Loading that file from the cache disk now
            # overlaps the disk read with the round trip; when the pages
            # are held, it costs a few system calls on a file already in RAM.
            self._cache.warm_file(info)
        return self._remember(parent, name, info)

    def forget(self, inode: int, count: int) -> None:
        """The kernel dropped ``count`` references to ``inode``."""
        with self._lock:
            file = self._files.get(inode)
            if file is None:  # a directory: its inode is its path's for good
                return
            file.lookups -= count
            if file.lookups > 0:
                return
            del self._files[inode]
            version = (file.info.key, file.info.etag)
            if self._file_inodes.get(version) == inode:
                del self._file_inodes[version]
        if file.gone:
            self._reader.release_version(file.info)

    def getattr(self, inode: int) -> Attributes:
        with self._lock:
            file = self._files.get(inode)
            if file is None and inode not in self._dirs:
                raise UnknownInode(str(inode))
        return self._attributes(inode, None if file is None else file.info)

    def read(self, inode: int, size: int, offset: int, pid: int) -> list[Piece]:
        """Bytes of the version ``inode`` stands for, for process ``pid``
        (whose job is counted). Unless the kernel asks before it opens a
        file (``open_through``), a read at offset 0 is what tells the
        workload model a file was opened."""
        file = self._file(inode)
        info = file.info
        job = self.jobs.of(pid)
        if offset == 0:
            self._access.opened(info, job)
        self._access.read(info, offset, size, job)
        again = self._access.wanted_elsewhere(info, job)
        try:
            with self._marked(info, offset, size, again):
                pieces = self._reader.read(info, offset, size, job)
        except ObjectChanged:
            # Overwritten or deleted since it was listed: the listing that
            # showed it is dropped, and the kernel forgets the name, so the
            # next open looks it up again and finds what is there now.
            self._namespace.invalidate(info)
            self.stale_entries.put((file.parent, file.name))
            raise
        if again:
            self._access.read_by_one_of_many(info, offset, size, job)
        if self.passthrough and ends_file(offset, size, info.size):
            self._cache.read_to_end(info)
        return pieces

    def open_through(self, inode: int, pid: int) -> WholeFile | None:
        """The cache file that holds exactly the bytes of the version
        ``inode`` stands for, for the kernel to read itself (FUSE
        passthrough); None if there is none. The kernel then asks nothing
        more, so this counts as process ``pid``'s read of the whole file,
        for everyone ``read`` tells."""
        info = self._file(inode).info
        job = self.jobs.of(pid)
        again = self._access.wanted_elsewhere(info, job)
        with self._marked(info, 0, info.size, again):
            found = self._cache.whole_file(info)
        if found is None:
            return None
        self._access.opened(info, job)
        self._access.read(info, 0, info.size, job)
        if again:
            self._access.read_by_one_of_many(info, 0, info.size, job)
        self._reader.read_through(info, found.tier, job)
        return found

    def _file(self, inode: int) -> _File:
        with self._lock:
            file = self._files.get(inode)
        if file is None:
            if inode in self._dirs:
                raise IsADirectory(str(inode))
            raise UnknownInode(str(inode))
        return file

    def _marked(self, info: ObjectInfo, offset: int, size: int, again: bool) -> AbstractContextManager[None]:
        """Where ``again`` (another job is still to read ``info``), the
        cache's policy learns so of the blocks it counts as read within."""
        if not again:
            return contextlib.nullcontext()
        return self._read_marks.reading(self._blocks_of(info, offset, size))

    def _blocks_of(self, info: ObjectInfo, offset: int, size: int) -> Callable[[str], bool]:
        """Whether a block (by hash) holds bytes ``[offset, offset + size)``
        of ``info``: asked as the cache counts each, so a block fetched for
        the read is found once it is cached."""
        indices = block_range(offset, size, info.size, self._reader.block_size)
        return lambda digest: any(self._cache.digest(info, index) == digest for index in indices)

    def entry_of(self, inode: int) -> tuple[int, str] | None:
        """(parent inode, name) of file inode ``inode``, None if unknown."""
        with self._lock:
            file = self._files.get(inode)
        return None if file is None else (file.parent, file.name)

    def opendir(self, inode: int, pid: int) -> int:
        """A handle on the listing of directory ``inode`` as it is now, for
        process ``pid``: the kernel reads it in pieces, by offset, and each
        piece must come from the same listing."""
        directory = self._dir(inode)
        listing = self._namespace.listdir(directory.path)
        self._access.listed(listing, directory.path.strip("/"), self.jobs.of(pid))
        entries = [DirEntry(".", None), DirEntry("..", None)]
        entries.extend(DirEntry(name, info) for name, info in listing.items())
        with self._lock:
            handle = next(self._next_handle)
            self._listings[handle] = (inode, entries)
        return handle

    def readdir(self, handle: int) -> Sequence[DirEntry]:
        """The entries of ``handle``, ``.`` and ``..`` first; the kernel's
        offset is an index into them."""
        with self._lock:
            listing = self._listings.get(handle)
        if listing is None:
            raise BadFileHandle(str(handle))
        return listing[1]

    def remember(self, handle: int, entry: DirEntry) -> Attributes:
        """The attributes of ``entry`` of listing ``handle``, which the
        kernel now holds as if it had looked it up (READDIRPLUS): one more
        reference, except for ``.`` and ``..``, which it never counts."""
        with self._lock:
            listing = self._listings.get(handle)
        if listing is None:
            raise BadFileHandle(str(handle))
        inode = listing[0]
        if entry.name == ".":
            return self._attributes(inode, None)
        if entry.name == "..":
            return self._attributes(self._dirs[inode].parent, None)
        return self._remember(inode, entry.name, entry.info)

    def releasedir(self, handle: int) -> None:
        with self._lock:
            self._listings.pop(handle, None)

    def version_gone(self, info: ObjectInfo) -> None:
        """A refreshed listing, now visible, shows ``info`` replaced or
        deleted: the kernel forgets its name, and its blocks are released
        once the kernel holds no reference to its inode (open files and
        mmaps read what is cached of it until they close)."""
        with self._lock:
            inode = self._file_inodes.get((info.key, info.etag))
            file = None if inode is None else self._files[inode]
            if file is not None:
                file.gone = True
        if file is None:
            self._reader.release_version(info)
        else:
            self.stale_entries.put((file.parent, file.name))

    def statfs(self) -> dict[str, int]:
        """Sizes for ``df``: a bucket has none, so the cache's (its
        capacity, and its room as free space), in blocks. With no size,
        ``df`` left the mount out of its list, as it does pseudo filesystems."""
        capacity, used = self._cache.usage()
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

    def _dir(self, inode: int) -> _Dir:
        with self._lock:
            directory = self._dirs.get(inode)
            is_file = inode in self._files
        if directory is None:
            raise NotADirectory(str(inode)) if is_file else UnknownInode(str(inode))
        return directory

    def _remember(self, parent: int, name: str, info: ObjectInfo | None) -> Attributes:
        """The inode of ``name`` in ``parent`` (a directory if ``info`` is
        None), made if new, and one more reference to it."""
        with self._lock:
            if info is None:
                path = _child(self._dirs[parent].path, name)
                inode = self._dir_inodes.get(path)
                if inode is None:
                    inode = self._dir_inodes[path] = next(self._next_inode)
                    self._dirs[inode] = _Dir(path, parent)
            else:
                version = (info.key, info.etag)
                inode = self._file_inodes.get(version)
                if inode is None:
                    inode = self._file_inodes[version] = next(self._next_inode)
                    self._files[inode] = _File(info, parent, name)
                file = self._files[inode]
                file.lookups += 1
                file.gone = False  # listed again: re-uploaded with the same content
        return self._attributes(inode, info)

    def _attributes(self, inode: int, info: ObjectInfo | None) -> Attributes:
        if info is None:
            with self._lock:
                path = self._dirs[inode].path
            number = inode_number(path)
            return Attributes(DIR_MODE, 0, self._mounted_at, self._uid, self._gid, 2, inode, number)
        number = inode_number(f"/{info.key}\0{info.etag}")
        return Attributes(FILE_MODE, info.size, info.mtime, self._uid, self._gid, 1, inode, number)
