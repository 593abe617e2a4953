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
kernel holds until it FORGETs it. A directory's listing is taken whole at
its OPENDIR, every entry's inode made then, and handed to the native
plane, which answers its READDIRPLUS requests (each entry sent held there)
and its RELEASEDIR; the listing's inodes stay while it is open. The references are counted by the
native plane (``cachefsd._native.Tables``), which answers the kernel's FORGETs, and
the lookups of names it was handed, itself: every inode handed to the
kernel is held there with the name that found it. A file's inode is
dropped when the native plane says it is gone (no reference, and no fresh
name keeps it: ``forgotten``), and the blocks of a version gone upstream
are released then, as nothing can read them any more. A name found stale,
removed or renamed is dropped there first, so it is asked of this table
again.

Reads the native plane serves from verified cache files (``set_blocks``,
named after each lookup and read here) are told to ``served_natively``,
which counts them as ``read`` counts its own.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import stat
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol, TypeVar

from cachefsd._native import Tables
from cachefsd.cache.blocks import WholeFile
from cachefsd.cache.whole import ends_file
from cachefsd.errors import (
    AlreadyExists,
    BadFileHandle,
    BadName,
    CrossDevice,
    IsADirectory,
    NameTooLong,
    NotADirectory,
    NotEmpty,
    NotPermitted,
    ObjectChanged,
    ObjectNotFound,
    StoreError,
    UnknownInode,
)
from cachefsd.jobs import CallerJobs
from cachefsd.namespace.names import NAME_MAX, inode_number, is_valid_name
from cachefsd.namespace.tree import Namespace
from cachefsd.reader import BlockReader, Piece, block_range
from cachefsd.store.base import ObjectInfo
from cachefsd.writes.staged import StagedFile, Staging
from cachefsd.writes.uploads import Uploads

_T = TypeVar("_T")

DIR_MODE = stat.S_IFDIR | 0o555
FILE_MODE = stat.S_IFREG | 0o444
# A writable mount's: only its owner may write through it (the kernel
# checks, ``default_permissions``), and so read, unless configured.
WRITABLE_DIR_MODE = stat.S_IFDIR | 0o700
WRITABLE_FILE_MODE = stat.S_IFREG | 0o600
# The longest key S3, GCS and Azure hold, in UTF-8 bytes.
KEY_MAX = 1024
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

    # Whether cache files' pages are warmed for every read (the kernel reads
    # them through the page cache), or only for reads not served natively.
    page_warming: bool

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

    def raw_files(self, info: ObjectInfo, indices: range) -> list[tuple[int, str, int, int, int, int, str]]:
        """The blocks of ``indices`` of ``info`` that lie in raw files this
        process verified, for the native plane to read: (index, path,
        offset of the block in the file, its device, inode and ctime in ns, tier)."""
        ...

    def count_read(self, info: ObjectInfo, index: int) -> None:
        """A read of block ``index`` of ``info`` served from its raw file
        without the cache: its tier's policy counts it."""
        ...

    def whole_place(self, info: ObjectInfo) -> tuple[str, int, int, int, str] | None:
        """Where the file ``whole_file`` would hand over lies, as verified,
        for the native plane: (path, device, inode, ctime in ns, tier)."""
        ...

    def count_whole_read(self, info: ObjectInfo) -> None:
        """``info``'s whole file was handed over without the cache: its
        tier's policy counts the read."""
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


class Bucket(Protocol):
    """What a writable mount asks of the bucket while a process waits
    (``writes.bucket.Bucket``): bounded, retried, or a ``StoreError``."""

    def delete(self, key: str) -> None: ...
    def copy(self, source: str, target: str, size: int) -> ObjectInfo: ...


@dataclass(frozen=True, slots=True)
class Writes:
    """What makes a mount writable: its staged files, their uploader, and the bucket."""

    staging: Staging
    uploads: Uploads
    bucket: Bucket


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
    # False for a staged file, whose size and times change under the
    # kernel: it must ask again rather than cache them.
    cacheable: bool = True

    @property
    def kernel_fields(self) -> tuple[int, int, float, int, int, int, int]:
        """What the kernel is told (``protocol.Attr``, ``Tables.hold``)."""
        return (self.st_ino, self.size, self.mtime, self.mode, self.nlink, self.uid, self.gid)


@dataclass(frozen=True, slots=True)
class DirEntry:
    name: str
    info: ObjectInfo | None  # None: a directory (or a staged file)
    staged: StagedFile | None = None


@dataclass(frozen=True, slots=True)
class Listing:
    """A directory's listing as its OPENDIR took it: the handle the native
    plane serves it by, and its entries, ``.`` and ``..`` first."""

    handle: int
    entries: list[tuple[str, Attributes]]


@dataclass(slots=True)
class _File:
    info: ObjectInfo
    parent: int  # the inode of its directory
    name: str
    gone: bool = False  # replaced or deleted upstream
    # What this mount wrote for it, until uploaded (then its ``info``
    # names the version in the bucket).
    staged: StagedFile | None = None


@dataclass(slots=True)
class _Handle:
    """An open of a staged file."""

    file: StagedFile
    writing: bool
    flushed: bool = False  # a descriptor of it was closed


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
        kernel: Tables,
        writes: Writes | None = None,
    ) -> None:
        self._namespace = namespace
        self.kernel = kernel
        self.writes = writes
        self._file_mode = FILE_MODE if writes is None else WRITABLE_FILE_MODE
        self._dir_mode = DIR_MODE if writes is None else WRITABLE_DIR_MODE
        self._access = access
        self._read_marks = read_marks
        self.jobs = jobs  # who a request's pid reads for
        self._reader = reader
        self._cache = cache
        # Whether opens may be handed a cache file (FUSE passthrough is
        # on), set by the FUSE edge (``passthrough``): only then is a whole
        # file made for a file read to its end, as only such an open reads
        # it, and cache files' pages warmed ahead of the kernel's reads.
        self._passthrough = False
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
        self._next_handle = itertools.count(1)
        self._staged_inodes: dict[StagedFile, int] = {}
        # Opens of staged files, by handle; 0 and 1 are the kernel's other
        # opens (of a cached version, and handed to the kernel).
        self._handles: dict[int, _Handle] = {}
        self._next_file_handle = itertools.count(2)

    @property
    def passthrough(self) -> bool:
        return self._passthrough

    @passthrough.setter
    def passthrough(self, on: bool) -> None:
        self._passthrough = on
        self._cache.page_warming = on

    def lookup(self, parent: int, name: str) -> Attributes:
        """The entry ``name`` in directory ``parent``: one more reference."""
        path = _child(self._dir(parent).path, name)
        if self.writes is not None:
            staged = self.writes.staging.find(path[1:])
            if staged is not None:
                return self._remember_staged(parent, name, staged)
            if self.writes.staging.is_dir(path[1:] + "/"):
                return self._remember(parent, name, None)
        info = self._namespace.lookup(path).info
        if info is not None:
            self._reader.listed(info)
            # A lookup is how the kernel opens a file, and unless it still
            # holds its pages, its READ (or its own read of the file handed
            # over) follows. Loading that file from the cache disk now
            # overlaps the disk read with the round trip; when the pages
            # are held, it costs a few system calls on a file already in RAM.
            self._cache.warm_file(info)
        attributes = self._remember(parent, name, info)
        if info is not None:
            self._name_blocks(
                attributes.inode, info, block_range(0, info.size, info.size, self._reader.block_size)
            )
        return attributes

    def forget(self, inode: int, count: int) -> None:
        """The kernel dropped ``count`` references to ``inode`` (an answer
        it never got, or a test playing the kernel)."""
        if self.kernel.forget(inode, count):
            self.forgotten(inode)

    def _forgotten(self, inodes: list[int]) -> None:
        for inode in inodes:
            self.forgotten(inode)

    def forgotten(self, inode: int) -> None:
        """The native plane dropped ``inode`` (``cachefsd._native.Tables``): unless it
        holds it again (a lookup here handed it out meanwhile), so is this table."""
        with self._lock:
            file = self._files.get(inode)
            if file is None or self.kernel.holds(inode):  # a directory's inode is its path's for good
                return
            del self._files[inode]
            version = (file.info.key, file.info.etag)
            if self._file_inodes.get(version) == inode:
                del self._file_inodes[version]
            if file.staged is not None and self._staged_inodes.get(file.staged) == inode:
                del self._staged_inodes[file.staged]
        if file.gone:
            self._reader.release_version(file.info)

    def getattr(self, inode: int) -> Attributes:
        with self._lock:
            file = self._files.get(inode)
            if file is None and inode not in self._dirs:
                raise UnknownInode(str(inode))
        if file is not None and file.staged is not None:
            assert self.writes is not None
            self.writes.staging.refresh(file.staged)  # written through the kernel, unseen
            return self._staged_attributes(inode, file.staged)
        return self._attributes(inode, None if file is None else file.info)

    def read(self, inode: int, size: int, offset: int, pid: int) -> list[Piece]:
        """Bytes of the version ``inode`` stands for, for process ``pid``
        (whose job is counted). Unless the kernel asks before it opens a
        file (``open_through``), a read at offset 0 is what tells the
        workload model a file was opened."""
        file = self._file(inode)
        info = file.info
        if file.staged is not None:
            assert self.writes is not None
            data = self.writes.staging.read(file.staged, offset, size)
            if data is not None:
                return [data]
            assert file.staged.info is not None  # it left for the bucket: read that version
            info = file.staged.info
        job = self.jobs.of(pid)
        try:
            pieces = self._counted(
                info, offset, size, job, lambda: self._reader.read(info, offset, size, job)
            )
        except ObjectChanged:
            # Overwritten or deleted since it was listed: the listing that
            # showed it is dropped, and the kernel forgets the name, so the
            # next open looks it up again and finds what is there now.
            self._namespace.invalidate(info)
            self._stale(file.parent, file.name)
            raise
        if file.staged is None:  # what this read fetched, the next reads natively
            self._name_blocks(inode, info, block_range(offset, size, info.size, self._reader.block_size))
        return pieces

    def served_natively(
        self, inode: int, offset: int, size: int, pid: int, served: dict[str, int], seconds: float
    ) -> None:
        """The native plane answered process ``pid``'s read of ``size``
        bytes at ``offset`` of ``inode`` from cache files (bytes ``served``
        by tier, in ``seconds``): counted as ``read`` counts its own."""
        reported = self._reported(inode, pid)
        if reported is None:
            return
        info, job = reported

        def count() -> None:
            for index in block_range(offset, size, info.size, self._reader.block_size):
                self._cache.count_read(info, index)
            self._reader.served_elsewhere(served, job, seconds)

        self._counted(info, offset, size, job, count)

    def _counted(self, info: ObjectInfo, offset: int, size: int, job: str, serve: Callable[[], _T]) -> _T:
        """``serve()``, a read of ``job``'s, told to the workload model and
        the cache's policy. Unless the kernel asks before it opens a file
        (``open_through``), a read at offset 0 is what tells the model a
        file was opened."""
        if offset == 0:
            self._access.opened(info, job)
        self._access.read(info, offset, size, job)
        again = self._access.wanted_elsewhere(info, job)
        with self._marked(info, offset, size, again):
            served = serve()
        if again:
            self._access.read_by_one_of_many(info, offset, size, job)
        if self.passthrough and ends_file(offset, size, info.size):
            self._cache.read_to_end(info)
        return served

    def _name_blocks(self, inode: int, info: ObjectInfo, indices: range) -> None:
        """Name to the native plane the verified raw files of blocks
        ``indices`` of ``info``, which it then reads itself (and those
        without one, which it leaves to ``read``), and the file of all its
        bytes, which it hands over at an open in passthrough."""
        if indices:
            files = self._cache.raw_files(info, indices)
            whole = self._cache.whole_place(info)
            self.kernel.set_blocks(
                inode, info.size, self._reader.block_size, indices.start, indices.stop - 1, files, whole
            )

    def _stale(self, parent: int, name: str) -> None:
        """``name`` in ``parent`` no longer names what it named: the native
        plane and then the kernel (``stale_entries``) forget it."""
        self._forgotten(self.kernel.drop_name(parent, os.fsencode(name)))
        self.stale_entries.put((parent, name))

    def open_through(self, inode: int, pid: int) -> WholeFile | None:
        """The cache file that holds exactly the bytes of the version
        ``inode`` stands for, for the kernel to read itself (FUSE
        passthrough); None if there is none. The kernel then asks nothing
        more, so this counts as process ``pid``'s read of the whole file,
        for everyone ``read`` tells; the native plane is named the file,
        for the next opens."""
        info = self._file(inode).info
        job = self.jobs.of(pid)
        again = self._access.wanted_elsewhere(info, job)
        with self._marked(info, 0, info.size, again):
            found = self._cache.whole_file(info)
        if found is None:
            return None
        self._read_through(info, job, found.tier, again)
        self._name_blocks(inode, info, block_range(0, info.size, info.size, self._reader.block_size))
        return found

    def opened_natively(self, inode: int, pid: int, tier: str) -> None:
        """The native plane opened ``inode`` in passthrough for process
        ``pid``, on its whole file in ``tier``: counted as ``open_through``
        counts its own."""
        reported = self._reported(inode, pid)
        if reported is None:
            return
        info, job = reported
        again = self._access.wanted_elsewhere(info, job)
        with self._marked(info, 0, info.size, again):
            self._cache.count_whole_read(info)
        self._read_through(info, job, tier, again)

    def _reported(self, inode: int, pid: int) -> tuple[ObjectInfo, str] | None:
        """The version and job a native report of ``inode`` for process
        ``pid`` counts for; None if the inode went meanwhile."""
        with self._lock:
            file = self._files.get(inode)
        return None if file is None else (file.info, self.jobs.of(pid))

    def _read_through(self, info: ObjectInfo, job: str, tier: str, again: bool) -> None:
        """An open of ``info``'s whole file in ``tier`` for the kernel to
        read, told as ``job``'s read of all of it to the workload model and
        the reader's counts (``again``: another job still reads it)."""
        self._access.opened(info, job)
        self._access.read(info, 0, info.size, job)
        if again:
            self._access.read_by_one_of_many(info, 0, info.size, job)
        self._reader.read_through(info, tier, job)

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

    def opendir(self, inode: int, pid: int) -> Listing:
        """The listing of directory ``inode`` as it is now, for process
        ``pid``: the kernel reads it in pieces, by offset, and each piece
        must come from the same listing. Every entry's inode is made now,
        and the listing handed to the native plane, which serves it until
        it is released."""
        directory = self._dir(inode)
        listing = self._listing(directory.path)
        self._access.listed(listing, directory.path.strip("/"), self.jobs.of(pid))
        entries = [DirEntry(name, info) for name, info in listing.items()]
        if self.writes is not None:
            staged = self.writes.staging.entries(directory.path[1:] + "/" if directory.path != "/" else "")
            entries = [entry for entry in entries if entry.name not in staged]
            entries.extend(DirEntry(name, None, file) for name, file in staged.items())
        with self._lock:
            handle = next(self._next_handle)
            listed = [
                (".", self._attributes_locked(inode, None)),
                ("..", self._attributes_locked(directory.parent, None)),
            ]
            listed.extend((entry.name, self._entry_attributes_locked(inode, entry)) for entry in entries)
            self.kernel.set_listing(
                handle,
                inode,
                [
                    (os.fsencode(name), attributes.inode, attributes.kernel_fields, attributes.cacheable)
                    for name, attributes in listed
                ],
            )
        return Listing(handle, listed)

    def _entry_attributes_locked(self, parent: int, entry: DirEntry) -> Attributes:
        """The attributes of ``entry`` of directory ``parent``, its inode made if new."""
        if entry.staged is not None:
            return self._staged_attributes(
                self._staged_inode_locked(parent, entry.name, entry.staged), entry.staged
            )
        return self._attributes_locked(self._inode_locked(parent, entry.name, entry.info), entry.info)

    def releasedir(self, handle: int) -> None:
        """Listing ``handle`` is released without the kernel (its OPENDIR was interrupted)."""
        self._forgotten(self.kernel.release_listing(handle))

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
            self._stale(file.parent, file.name)

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
        None), made if new, and one more reference to it. Held in the native
        plane under this table's lock, so that ``forgotten`` sees it held."""
        with self._lock:
            inode = self._inode_locked(parent, name, info)
            attributes = self._attributes_locked(inode, info)
            gone = self.kernel.hold(inode, parent, os.fsencode(name), attributes.kernel_fields, True)
        self._forgotten(gone)
        return attributes

    def _inode_locked(self, parent: int, name: str, info: ObjectInfo | None) -> int:
        """The inode of ``name`` in ``parent`` (a directory if ``info`` is None), made if new."""
        if info is None:
            path = _child(self._dirs[parent].path, name)
            inode = self._dir_inodes.get(path)
            if inode is None:
                inode = self._dir_inodes[path] = next(self._next_inode)
                self._dirs[inode] = _Dir(path, parent)
            return inode
        version = (info.key, info.etag)
        inode = self._file_inodes.get(version)
        if inode is None:
            inode = self._file_inodes[version] = next(self._next_inode)
            self._files[inode] = _File(info, parent, name)
        self._files[inode].gone = False  # listed again: re-uploaded with the same content
        return inode

    def _attributes(self, inode: int, info: ObjectInfo | None) -> Attributes:
        with self._lock:
            return self._attributes_locked(inode, info)

    def _attributes_locked(self, inode: int, info: ObjectInfo | None) -> Attributes:
        if info is None:
            number = inode_number(self._dirs[inode].path)
            return Attributes(self._dir_mode, 0, self._mounted_at, self._uid, self._gid, 2, inode, number)
        number = inode_number(f"/{info.key}\0{info.etag}")
        return Attributes(self._file_mode, info.size, info.mtime, self._uid, self._gid, 1, inode, number)

    # -- a writable mount -------------------------------------------------
    #
    # What it writes is staged (``writes.staged``) and uploaded behind;
    # what it removes or renames in the bucket is done while the process
    # waits (a DELETE, a copy), as a local filesystem's would be.

    def _listing(self, path: str) -> dict[str, ObjectInfo | None]:
        """The bucket's entries of directory ``path``; none for a local one."""
        try:
            return self._namespace.listdir(path)
        except ObjectNotFound:
            if self.writes is not None and self.writes.staging.is_dir(path[1:] + "/"):
                return {}
            raise

    def _writes(self) -> Writes:
        if self.writes is None:
            raise NotPermitted("the mount is read-only")
        return self.writes

    def _remember_staged(self, parent: int, name: str, staged: StagedFile) -> Attributes:
        with self._lock:
            inode = self._staged_inode_locked(parent, name, staged)
            attributes = self._staged_attributes(inode, staged)
            gone = self.kernel.hold(inode, parent, os.fsencode(name), attributes.kernel_fields, False)
        self._forgotten(gone)
        return attributes

    def _staged_inode_locked(self, parent: int, name: str, staged: StagedFile) -> int:
        inode = self._staged_inodes.get(staged)
        if inode is None:
            inode = self._staged_inodes[staged] = next(self._next_inode)
            info = ObjectInfo(staged.key, 0, "", staged.mtime)
            self._files[inode] = _File(info, parent, name, staged=staged)
        return inode

    def _staged_attributes(self, inode: int, staged: StagedFile) -> Attributes:
        if staged.info is not None and staged.gone:
            size, mtime = staged.info.size, staged.info.mtime
        else:
            size, mtime = staged.size, staged.mtime
        number = inode_number(f"/{staged.key}\0staged")
        return Attributes(
            self._file_mode, size, mtime, self._uid, self._gid, 1, inode, number, cacheable=False
        )

    def _key(self, parent: int, name: str) -> str:
        """The key of ``name`` in directory ``parent``, if the bucket can hold it."""
        if len(name.encode("utf-8", "surrogateescape")) > NAME_MAX:
            raise NameTooLong(name)
        if not is_valid_name(name):
            raise BadName(name)
        key = _child(self._dir(parent).path, name)[1:]
        if len(key.encode("utf-8")) > KEY_MAX:
            raise NameTooLong(key)
        return key

    def _kind(self, key: str) -> str | None:
        """What ``key`` is through this mount: "file", "dir", or None."""
        staging = self._writes().staging
        if staging.find(key) is not None:
            return "file"
        if staging.is_dir(key + "/"):
            return "dir"
        remote = self._remote(key)
        if remote is None:
            return None
        return "dir" if remote is True else "file"

    def create(self, parent: int, name: str, flags: int) -> tuple[Attributes, int]:
        """A new file ``name`` in ``parent``, open for writing (``O_EXCL``:
        only if there is none): its attributes and handle."""
        key = self._key(parent, name)
        writes = self._writes()
        staged = writes.staging.find(key)
        if staged is not None:
            if flags & os.O_EXCL:
                raise AlreadyExists(key)
            attributes = self._remember_staged(parent, name, staged)
            return attributes, self._open_staged(attributes.inode, staged, flags)
        existing = self._kind(key)
        if existing == "dir":
            raise IsADirectory(key)
        if existing == "file" and flags & os.O_EXCL:
            raise AlreadyExists(key)
        staged = writes.staging.create(key)
        attributes = self._remember_staged(parent, name, staged)
        return attributes, self._new_handle(staged, writing=True)

    def open(self, inode: int, flags: int) -> int | None:
        """A handle on ``inode`` where the open needs one: a staged file, or
        an object opened to be written (replaced whole: ``O_TRUNC``). None
        for a read of a cached version (the caller opens it as ever)."""
        file = self._file(inode)
        writing = flags & os.O_ACCMODE != os.O_RDONLY
        with self._lock:
            staged = file.staged
        if staged is not None and not staged.gone:
            return self._open_staged(inode, staged, flags)
        if not writing and not flags & os.O_TRUNC:
            return None
        if not flags & os.O_TRUNC:
            raise NotPermitted(
                f"{file.info.key} is in the bucket: it can be replaced whole (opened with O_TRUNC), "
                "not changed in part"
            )
        staged = self._writes().staging.create(file.info.key)
        with self._lock:
            file.staged = staged
            self._staged_inodes[staged] = inode
            self.kernel.uncache(inode)  # its attributes now change under the kernel
        return self._new_handle(staged, writing)

    def _open_staged(self, inode: int, staged: StagedFile, flags: int) -> int:
        writing = flags & os.O_ACCMODE != os.O_RDONLY
        if writing:
            self._writes().staging.open_write(staged, truncate=bool(flags & os.O_TRUNC))
        return self._new_handle(staged, writing)

    def _new_handle(self, staged: StagedFile, writing: bool) -> int:
        with self._lock:
            handle = next(self._next_file_handle)
            self._handles[handle] = _Handle(staged, writing)
        return handle

    def _handle(self, handle: int) -> _Handle:
        with self._lock:
            found = self._handles.get(handle)
        if found is None:
            raise BadFileHandle(str(handle))
        return found

    def staged_backing(self, handle: int) -> WholeFile | None:
        """The staged file of open ``handle``, for the kernel to read and
        write itself (FUSE passthrough), while staging allows it; None
        otherwise (the daemon serves the open)."""
        found = self._handle(handle)
        staging = self._writes().staging
        if found.writing and not staging.through_allowed():
            return None
        with found.file.lock:
            if found.file.gone:
                return None
            return WholeFile(os.dup(found.file.fd), "hot", found.file.size)

    def is_staged(self, inode: int) -> bool:
        with self._lock:
            file = self._files.get(inode)
        return file is not None and file.staged is not None and not file.staged.gone

    def write(self, handle: int, offset: int, data: memoryview) -> int:
        return self._writes().staging.write(self._handle(handle).file, offset, data)

    def flush(self, handle: int) -> None:
        """A process closed a descriptor of open ``handle``: unless another
        descriptor shares the open, its release is on its way."""
        with self._lock:
            found = self._handles.get(handle)
            if found is None or not found.writing or found.flushed:
                return
            found.flushed = True
        self._writes().staging.closing()

    def release(self, handle: int) -> None:
        """The kernel closed open ``handle`` (its last descriptor)."""
        with self._lock:
            found = self._handles.pop(handle, None)
        if found is not None and found.writing:
            self._writes().staging.release_write(found.file, found.flushed)

    def fsync(self, inode: int) -> None:
        """Return once ``inode``'s bytes are in the bucket."""
        with self._lock:
            file = self._files.get(inode)
        staged = None if file is None else file.staged
        if staged is None or staged.gone:
            return
        writes = self._writes()
        writes.staging.refresh(staged)
        writes.staging.make_due(staged)
        _, failed = writes.uploads.wait([staged.op], None)
        if failed:
            raise StoreError(f"{staged.key} is not in the bucket: {failed[staged.key]}")

    def setattr(self, inode: int, size: int | None, mtime: float | None, mode_change: bool) -> Attributes:
        """Truncate (a staged file), set times (a staged file's; an
        object's stay the bucket's), or refuse a change of mode or owner."""
        if mode_change:
            raise NotPermitted("a bucket keeps no modes or owners")
        file = self._file(inode)
        staged = file.staged
        if staged is None or staged.gone:
            if size is not None:
                raise NotPermitted(f"{file.info.key} is in the bucket: open it with O_TRUNC to replace it")
            return self.getattr(inode)
        staging = self._writes().staging
        if size is not None:
            staging.truncate(staged, size)
        if mtime is not None:
            staging.touch(staged, mtime)
        return self.getattr(inode)

    def mkdir(self, parent: int, name: str) -> Attributes:
        key = self._key(parent, name)
        if self._kind(key) is not None:
            raise AlreadyExists(key)
        self._writes().staging.mkdir(key + "/")
        return self._remember(parent, name, None)

    def unlink(self, parent: int, name: str) -> None:
        key = self._key(parent, name)
        writes = self._writes()
        staged = writes.staging.find(key)
        if staged is not None:
            writes.staging.unlink(staged)
        remote = self._remote(key)
        if remote is True:
            raise IsADirectory(key)
        if remote is not None:
            writes.bucket.delete(key)
            self._namespace.removed(key)
        elif staged is None:
            raise ObjectNotFound(key)
        self._gone(parent, name)

    def _remote(self, key: str) -> ObjectInfo | bool | None:
        """What the bucket's listing shows at ``key``: an object, True for a directory, None for nothing."""
        try:
            entry = self._namespace.lookup("/" + key)
        except (ObjectNotFound, NotADirectory):
            return None
        return True if entry.info is None else entry.info

    def rmdir(self, parent: int, name: str) -> None:
        key = self._key(parent, name)
        writes = self._writes()
        prefix = key + "/"
        if writes.staging.entries(prefix):
            raise NotEmpty(key)
        remote = self._remote(key)
        if remote is True:
            if self._namespace.listdir("/" + key):
                raise NotEmpty(key)
            writes.bucket.delete(prefix)  # its marker object, if it has one
            self._namespace.removed(prefix)
        elif remote is not None:
            raise NotADirectory(key)
        elif not writes.staging.is_dir(prefix):
            raise ObjectNotFound(key)
        writes.staging.rmdir(prefix)
        self._gone(parent, name)

    def rename(self, parent: int, name: str, new_parent: int, new_name: str, no_replace: bool) -> None:
        """Move ``name``: a staged file or a directory of staged files here,
        an object as a copy and a delete in the bucket (not atomic)."""
        key, new_key = self._key(parent, name), self._key(new_parent, new_name)
        writes = self._writes()
        target = self._kind(new_key)
        if target is not None and no_replace:
            raise AlreadyExists(new_key)
        staged = writes.staging.find(key)
        remote = self._remote(key)
        if staged is None and remote is None and not writes.staging.is_dir(key + "/"):
            raise ObjectNotFound(key)
        if staged is None and (remote is True or writes.staging.is_dir(key + "/")):
            self._rename_dir(key, new_key, target)
        else:
            if target == "dir":
                raise IsADirectory(new_key)
            if staged is not None:
                writes.staging.rename(staged, new_key)
            elif isinstance(remote, ObjectInfo):
                replaced = writes.staging.find(new_key)
                if replaced is not None:
                    writes.staging.unlink(replaced)
                self._namespace.wrote(writes.bucket.copy(key, new_key, remote.size))
                # The kernel moves the inode, which stands for the old
                # key's version: it is to look the new name up again.
                self._stale(new_parent, new_name)
            if remote is not None:
                writes.bucket.delete(key)
                self._namespace.removed(key)
        self._moved(parent, name, new_parent, new_name)

    def _rename_dir(self, key: str, new_key: str, target: str | None) -> None:
        """A directory is renamed in place only while the bucket holds
        nothing under it; else EXDEV, and ``mv`` copies it."""
        writes = self._writes()
        if target == "file":
            raise NotADirectory(new_key)
        if target == "dir" and (writes.staging.entries(new_key + "/") or self._remote(new_key) is True):
            raise NotEmpty(new_key)
        if self._remote(key) is True:
            raise CrossDevice(f"{key} holds objects in the bucket: a directory is renamed by copying it")
        writes.staging.rename_dir(key + "/", new_key + "/")

    def _gone(self, parent: int, name: str) -> None:
        """``name`` in ``parent`` no longer exists: its inode, held by the
        kernel until it forgets it, is of nothing any more."""
        path = _child(self._dir(parent).path, name)
        self._forgotten(self.kernel.drop_name(parent, os.fsencode(name)))
        with self._lock:
            inode = self._dir_inodes.pop(path, None)
            if inode is not None:
                del self._dirs[inode]

    def _moved(self, parent: int, name: str, new_parent: int, new_name: str) -> None:
        """The inodes under ``name`` now stand for ``new_name``: a file's
        entry, a directory's path and every directory's below it."""
        old = _child(self._dir(parent).path, name)
        new = _child(self._dir(new_parent).path, new_name)
        self._forgotten(self.kernel.drop_name(parent, os.fsencode(name)))
        self._forgotten(self.kernel.drop_name(new_parent, os.fsencode(new_name)))
        with self._lock:
            for file in self._files.values():
                if file.parent == parent and file.name == name:
                    file.parent, file.name = new_parent, new_name
            for path in [each for each in self._dir_inodes if each == old or each.startswith(old + "/")]:
                inode = self._dir_inodes.pop(path)
                moved = new + path[len(old) :]
                up = self._dirs[inode].parent if path != old else new_parent
                self._dirs[inode] = _Dir(moved, up)
                self._dir_inodes[moved] = inode
