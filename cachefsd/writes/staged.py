"""Staged files: what a writable mount's processes wrote, on the hot tier's
disk, until it is in the bucket.

A file created, or an object opened with ``O_TRUNC``, becomes a staged
file: a plain file in ``<hot tier>/staged/`` that writes land in at the
disk's speed, read back from it, listed and statted through the mount at
once. Once its last writer closes it, it is due for upload
(``uploads.py``); once uploaded, it leaves: its bytes enter the cache as
ordinary blocks of the new version (``admit``), and the mount's listing
shows the object the bucket now holds.

Never lost: a staged file's bytes are reserved in the hot tier (``Room``),
so the cache never evicts them nor counts them as free; a write the tier
cannot hold fails with ENOSPC. Its journal row (``journal.py``) is written
before the file and deleted only after the upload: a mount of the same
source on the same cache directory uploads what a killed daemon left
(``start``).

Directories: a bucket has none, only keys with ``/``. ``mkdir`` makes a
local directory, shown until the mount ends; a file written under it makes
it real in the bucket (Mountpoint for S3 does the same).

Concurrency: ``_lock`` guards the tables and the files' states; each
file's I/O holds its own ``lock``, so its descriptor is never closed
under a read.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from cachefsd.errors import NoSpace, NotEmpty
from cachefsd.store.base import ObjectInfo
from cachefsd.writes.journal import Journal, Op

log = logging.getLogger(__name__)

# Under the staged directory: files found unclosed after a crash. Their
# writer was interrupted, so they are no object anyone finished writing:
# kept for the user, never uploaded.
UNFINISHED_DIR = "unfinished"
# Writers write through the kernel unseen (``Staging.through_allowed``)
# while staged bytes take less than this share of the hot tier, and the
# room left for them is at least THROUGH_ROOM_BYTES.
THROUGH_SHARE = 0.5
THROUGH_ROOM_BYTES = 1 << 30


class Room(Protocol):
    """Room in the hot tier for staged bytes (``cache.tiered.TieredCache``)."""

    def reserve(self, nbytes: int) -> None:
        """Hold ``nbytes`` more, evicting cached blocks as needed; ``NoSpace``
        if the tier cannot hold them beside what is staged already."""
        ...

    def hold(self, nbytes: int) -> None:
        """Hold ``nbytes`` already on disk (found at start): never refused."""
        ...

    def unreserve(self, nbytes: int) -> None: ...

    def staged_room(self) -> tuple[int, int]:
        """The hot tier's capacity, and the bytes of it not staged."""
        ...


class UploadQueue(Protocol):
    """What staging tells the uploader (``uploads.Uploads``)."""

    def due(self, op: int, key: str) -> None:
        """``op`` may run once the ones before it for its key are done."""
        ...

    def cancel(self, op: int) -> None:
        """``op`` changed (written again, renamed away, unlinked): stop any run of it."""
        ...


# Admits the bytes of a staged file, just uploaded as ``info``, into the cache.
Admit = Callable[[ObjectInfo, Path], None]


@dataclass(eq=False, slots=True)
class StagedFile:
    """One staged file. ``op`` is its journal row; ``version`` counts its
    changes, so an upload knows whether it sent the current bytes, and
    ``durable`` is the version the bucket holds (-1: none yet)."""

    key: str
    op: int
    path: Path
    fd: int
    size: int
    mtime: float
    writers: int = 0
    version: int = 0
    durable: int = -1
    # The version in the bucket once uploaded; after the file left, reads
    # of a handle still open on it go through the cache.
    info: ObjectInfo | None = None
    gone: bool = False  # uploaded and left, or unlinked
    # (size, mtime in ns) of the file on disk when last looked at: a change
    # is a write the kernel made itself (``Staging.refresh``).
    stamp: tuple[int, int] = (0, 0)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _ancestors(key: str) -> list[str]:
    """The directory prefixes ``key`` lies under: ``a/b/c`` -> ``a/``, ``a/b/``."""
    parts = key.split("/")[:-1]
    return ["".join(part + "/" for part in parts[: depth + 1]) for depth in range(len(parts))]


class Staging:
    """The staged files and local directories of one writable mount."""

    def __init__(
        self,
        source: str,
        directory: Path,
        journal: Journal,
        room: Room,
        admit: Admit,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._source = source
        self._directory = directory
        self._journal = journal
        self._room = room
        self._admit = admit
        self._clock = clock
        self._queue: UploadQueue | None = None
        self._lock = threading.Lock()
        self._files: dict[str, StagedFile] = {}  # key -> staged file
        self._by_op: dict[int, StagedFile] = {}
        self._dirs: set[str] = set()  # "a/b/": made by mkdir
        # Directory prefix -> staged files under it: a lookup asks whether a
        # name is a directory of staged files, and must not scan them all.
        self._under: Counter[str] = Counter()
        # Writers that closed a descriptor, whose release (sent after
        # close(2) returned) has not reached the daemon yet.
        self._closing = 0
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)

    # -- start and upload ---------------------------------------------------

    def start(self, queue: UploadQueue) -> None:
        """Take up what an earlier daemon left for this source: closed
        files are staged again and handed to ``queue`` in their order;
        unclosed ones are set aside."""
        self._queue = queue
        self._remove_strays()
        for op in self._journal.pending(self._source):
            path = self._directory / op.file
            if not op.closed or not path.is_file() or path.stat().st_size != op.size:
                self._set_aside(op, path)
                continue
            self._room.hold(op.size)
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            status = os.fstat(fd)
            stamp = (status.st_size, status.st_mtime_ns)
            self._add(StagedFile(op.key, op.id, path, fd, op.size, op.mtime, stamp=stamp))
            log.info("%s: %s staged by an earlier daemon, uploading it", self._source, op.key)
            queue.due(op.id, op.key)

    def _remove_strays(self) -> None:
        """Delete staged files no journal row names: a file's row is written
        before it and deleted before it, so such a file is one whose upload
        (or unlink) finished when the daemon died. The set-aside files are
        the user's to delete."""
        named = self._journal.files()
        for entry in self._directory.iterdir():
            if entry.name != UNFINISHED_DIR and entry.name not in named and entry.is_file():
                entry.unlink(missing_ok=True)

    def _set_aside(self, op: Op, path: Path) -> None:
        self._journal.done(op.id)
        if not path.is_file():
            log.error("%s: the staged file of %s is gone; it cannot be uploaded", self._source, op.key)
            return
        # One name of at most 255 bytes, unique (a key may be 1,024).
        kept = self._directory / UNFINISHED_DIR / f"{op.id}-{op.key.replace('/', '%2F')}"[:200]
        try:
            kept.parent.mkdir(mode=0o700, exist_ok=True)
            path.rename(kept)
        except OSError as exc:
            log.error(
                "%s: cannot set aside the unfinished %s (%s): it stays as %s", self._source, op.key, exc, path
            )
            return
        log.error(
            "%s: %s was being written when the daemon stopped (%d bytes, %s); "
            "it is not uploaded, and kept as %s",
            self._source,
            op.key,
            kept.stat().st_size,
            "never closed" if not op.closed else f"{op.size} bytes when closed",
            kept,
        )

    def for_op(self, op: int) -> StagedFile | None:
        with self._lock:
            return self._by_op.get(op)

    def uploaded(self, file: StagedFile, version: int, info: ObjectInfo) -> bool:
        """The upload of ``file`` at ``version`` is in the bucket as ``info``.
        False if the file changed since (its upload is stale). Once no
        writer holds it, the file leaves: into the cache, then off the disk."""
        with self._lock:
            if self._by_op.get(file.op) is not file or file.version != version:
                return False
            file.durable, file.info = version, info
            leaves = file.writers == 0
            if leaves:
                self._remove(file)
        if leaves:
            self._leave(file, info)
        return True

    def _leave(self, file: StagedFile, info: ObjectInfo) -> None:
        self._journal.done(file.op)
        self._room.unreserve(file.size)
        try:
            self._admit(info, file.path)
        except Exception:
            log.exception("caching the uploaded %s failed (it is in the bucket)", file.key)
        with file.lock:
            os.close(file.fd)
            file.fd = -1
            file.gone = True
        file.path.unlink(missing_ok=True)

    # -- the namespace ------------------------------------------------------

    def find(self, key: str) -> StagedFile | None:
        with self._lock:
            return self._files.get(key)

    def is_dir(self, prefix: str) -> bool:
        """Whether ``prefix`` (``a/b/``) is a local directory or holds staged files."""
        with self._lock:
            return prefix in self._dirs or self._under[prefix] > 0

    def entries(self, prefix: str) -> dict[str, StagedFile | None]:
        """The staged files (and directories: None) directly under ``prefix``."""
        found: dict[str, StagedFile | None] = {}
        with self._lock:
            for directory in self._dirs:
                if directory.startswith(prefix) and directory != prefix:
                    found[directory[len(prefix) :].split("/", 1)[0]] = None
            for key, file in self._files.items():
                if key.startswith(prefix):
                    name, separator, _ = key[len(prefix) :].partition("/")
                    found[name] = None if separator else file
        return found

    def mkdir(self, prefix: str) -> None:
        with self._lock:
            self._dirs.add(prefix)

    def rmdir(self, prefix: str) -> None:
        """Drop a local directory; ``NotEmpty`` if anything staged is under it."""
        with self._lock:
            if self._under[prefix] or any(each.startswith(prefix) and each != prefix for each in self._dirs):
                raise NotEmpty(prefix)
            self._dirs.discard(prefix)

    def rename_dir(self, old: str, new: str) -> None:
        """Move local directory ``old`` (all of it staged) to ``new``."""
        with self._lock:
            moved = [file for key, file in self._files.items() if key.startswith(old)]
            self._dirs = {new + each[len(old) :] if each.startswith(old) else each for each in self._dirs}
        for file in moved:
            self.rename(file, new + file.key[len(old) :])

    # -- files --------------------------------------------------------------

    def create(self, key: str) -> StagedFile:
        """A new empty staged file for ``key``, open for one writer; one
        staged before under ``key`` is replaced."""
        name = uuid.uuid4().hex
        path = self._directory / name
        now = self._clock()
        with self._lock:
            replaced = self._files.get(key)
            if replaced is not None:
                self._remove(replaced)
        if replaced is not None:
            self._discard(replaced)
        op = self._journal.staged(self._source, key, name, now)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        file = StagedFile(key, op, path, fd, 0, now, writers=1)
        with self._lock:
            self._add(file)
        return file

    def open_write(self, file: StagedFile, truncate: bool) -> None:
        """One more writer of ``file``; its upload, if due, waits for them all."""
        with self._lock:
            file.writers += 1
            reopened = file.writers == 1
        if reopened:
            self._journal.reopened(file.op)
            self._cancel(file.op)
        if truncate:
            self.truncate(file, 0)

    def through_allowed(self) -> bool:
        """Whether a writer may write straight to a staged file through the
        kernel (FUSE passthrough), unseen: while staged bytes take less than
        ``THROUGH_SHARE`` of the hot tier and leave ``THROUGH_ROOM_BYTES``,
        a file written unseen is accounted at its next close, fsync or stat
        (``refresh``), cached blocks evicted for it then; past that, every
        write is checked, and one the tier cannot hold fails (ENOSPC)."""
        capacity, room = self._room.staged_room()
        return room >= THROUGH_ROOM_BYTES and room > capacity * (1 - THROUGH_SHARE)

    def refresh(self, file: StagedFile) -> None:
        """Account what a writer wrote through the kernel: the file's size
        from the disk, its room held (never refused: the bytes are there)."""
        with file.lock:
            if file.gone:
                return
            status = os.fstat(file.fd)
            stamp = (status.st_size, status.st_mtime_ns)
            if stamp == file.stamp:
                return
            change = status.st_size - file.size
            if change > 0:
                self._room.hold(change)
            elif change < 0:
                self._room.unreserve(-change)
            file.stamp = stamp
            file.size, file.mtime = status.st_size, status.st_mtime
            file.version += 1

    def closing(self) -> None:
        """A writer closed a descriptor (``flushed`` at its release)."""
        with self._lock:
            self._closing += 1

    def any_closing(self) -> bool:
        """Whether a writer's close is under way, its release still to come."""
        with self._lock:
            return self._closing > 0

    def release_write(self, file: StagedFile, flushed: bool) -> None:
        """A writer of ``file`` closed it; after the last, it is due for
        upload (or leaves, if an fsync uploaded it as it is)."""
        self.refresh(file)
        with self._lock:
            file.writers -= 1
            self._closing -= flushed
            last = file.writers == 0 and not file.gone
        if last:
            self._journal.closed(file.op, file.size, file.mtime)
            self.make_due(file)

    def make_due(self, file: StagedFile) -> None:
        """Upload ``file`` as it is now, open or not (fsync, close)."""
        assert self._queue is not None
        self._queue.due(file.op, file.key)

    def write(self, file: StagedFile, offset: int, data: memoryview) -> int:
        end = offset + len(data)
        with file.lock:
            grown = max(0, end - file.size)
            self._room.reserve(grown)
            try:
                written = os.pwrite(file.fd, data, offset)
            except OSError as exc:
                self._room.unreserve(grown)
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):  # the disk itself is full
                    raise NoSpace(file.key) from exc
                raise
            if written < len(data):
                self._room.unreserve(end - max(offset + written, file.size))
            file.size = max(file.size, offset + written)
            file.mtime = self._clock()
            file.version += 1
        return written

    def read(self, file: StagedFile, offset: int, size: int) -> bytes | None:
        """Bytes of ``file``; None once it left (read the uploaded version)."""
        with file.lock:
            if file.gone:
                return None
            return os.pread(file.fd, size, offset)

    def truncate(self, file: StagedFile, size: int) -> None:
        with file.lock:
            change = size - file.size
            if change > 0:
                self._room.reserve(change)
            os.ftruncate(file.fd, size)
            if change < 0:
                self._room.unreserve(-change)
            file.size = size
            file.mtime = self._clock()
            file.version += 1

    def touch(self, file: StagedFile, mtime: float) -> None:
        with file.lock:
            file.mtime = mtime

    def rename(self, file: StagedFile, key: str) -> None:
        """``file`` now stands for ``key``, replacing what was staged there;
        its upload starts over under the new key."""
        with self._lock:
            replaced = self._files.get(key)
            if replaced is not None and replaced is not file:
                self._remove(replaced)
            self._remove(file)
            old_op = file.op
            file.op = self._journal.moved(old_op, self._source, key)
            file.key = key
            file.version += 1
            self._add(file)
            due = file.writers == 0
        self._cancel(old_op)
        if replaced is not None and replaced is not file:
            self._discard(replaced)
        if due:
            self.make_due(file)

    def unlink(self, file: StagedFile) -> None:
        with self._lock:
            self._remove(file)
        self._discard(file)

    def _discard(self, file: StagedFile) -> None:
        """Drop a staged file that will never be uploaded."""
        self._cancel(file.op)
        self._journal.done(file.op)
        with file.lock:
            self._room.unreserve(file.size)
            os.close(file.fd)
            file.fd = -1
            file.gone = True
        file.path.unlink(missing_ok=True)

    def _cancel(self, op: int) -> None:
        if self._queue is not None:
            self._queue.cancel(op)

    def _add(self, file: StagedFile) -> None:
        self._files[file.key] = file
        self._by_op[file.op] = file
        self._under.update(_ancestors(file.key))

    def _remove(self, file: StagedFile) -> None:
        if self._files.get(file.key) is file:
            del self._files[file.key]
            self._under.subtract(_ancestors(file.key))
        self._by_op.pop(file.op, None)

    def staged_bytes(self) -> int:
        with self._lock:
            return sum(file.size for file in self._files.values())

    def staged_files(self) -> int:
        with self._lock:
            return len(self._files)

    def close(self) -> None:
        """The mount ends: descriptors close, the files and their rows stay."""
        with self._lock:
            files = list(self._files.values())
            self._files.clear()
            self._under.clear()
            self._by_op.clear()
        for file in files:
            with file.lock:
                os.close(file.fd)
                file.fd = -1
            self._room.unreserve(file.size)
