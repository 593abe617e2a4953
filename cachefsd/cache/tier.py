"""One tier: a directory of block files with a byte capacity and a codec.

    <dir>/blocks/ab/abcdef...   one file per content hash (codec.py): the
                                bare content in a raw tier, a frame in a
                                compressed one
    <dir>/tmp/                  files being written; garbage after a crash

A tier only stores and accounts; what enters, leaves or moves is decided by
``tiered.TieredCache``, which serialises every operation that adds bytes.
Capacity counts each file rounded up to the filesystem allocation unit, so
``used_bytes`` is bytes on disk; a tier makes room (``make_room``) before a
file is written and its victims' files are deleted before the new one is,
so the bound holds at every moment, not just between operations.

Concurrency: ``_lock`` guards ``_sizes``, ``_used`` and the policy. File I/O
happens outside it.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import secrets
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from cachefsd.cache.codec import Codec, Frame
from cachefsd.cache.policy import EvictionPolicy
from cachefsd.errors import CachefsdError

log = logging.getLogger(__name__)

# Descriptors held from a warm for the read that follows it (``open``). One
# whose read never comes (the kernel still had the file's pages) is closed
# once this many later holds have pushed it out.
HELD_DESCRIPTORS = 64

# Free space a tier leaves on its filesystem, whatever its capacity (one
# larger than the disk, or another user of the disk): the index and the log
# beside the blocks must still be written. At most this fraction of the
# filesystem's size, so a small one is not all reserve.
DISK_RESERVE_BYTES = 64 << 20
DISK_RESERVE_FRACTION = 0.05

# Files occupy whole filesystem blocks; 4 KiB is the allocation unit of
# ext4 and xfs as formatted by default.
ALLOCATION_UNIT = 4096


def disk_bytes(length: int) -> int:
    return -(-length // ALLOCATION_UNIT) * ALLOCATION_UNIT


class NoRoom(Exception):
    """The tier's policy refuses to evict for a newcomer, or it is too big.
    ``victims`` were already taken out before the refusal: they were the
    policy's choice, so the caller deletes (or demotes) them all the same."""

    def __init__(self, message: str, victims: list[str]) -> None:
        super().__init__(message)
        self.victims = victims


class UnplaceableBlock(OSError):
    """A block was written, but something is in the way of its name (a
    directory, a file where its shard goes): this block's problem, not the
    disk's, which took the bytes."""


# What placing a written block under its name fails with when something is
# in the way of that name, not the disk (full, read-only, failing). Not a
# permission refused: an immutable or unwritable blocks/ refuses them all.
_BLOCKED_NAME = frozenset({errno.EEXIST, errno.EISDIR, errno.ENOTDIR, errno.ENOTEMPTY})


def victims_for(
    policy: EvictionPolicy, incoming: str | None, needed: int, remove: Callable[[str], int], where: str
) -> list[str]:
    """How a full tier makes room for block ``incoming``: the victims
    ``policy`` gives up, each taken out with ``remove`` (which returns its
    bytes), until ``needed`` bytes are free. ``NoRoom`` as soon as the
    policy refuses, with the victims taken out so far (``where`` names the
    tier in its message). The tiers and the replayed cache
    (``replay.ReplayCache``) admit by this one rule."""
    victims: list[str] = []
    while needed > 0:
        victim = policy.victim(incoming)
        if victim is None:
            raise NoRoom(f"the {where} policy keeps every block", victims)
        victims.append(victim)
        needed -= remove(victim)
    return victims


class Tier:
    """One directory of block files under a byte capacity it never exceeds, with its codec and its
    eviction policy."""

    def __init__(self, name: str, root: Path, capacity: int, codec: Codec, policy: EvictionPolicy) -> None:
        self.name = name
        self.root = root
        self.capacity = capacity
        self.codec = codec
        self._policy = policy
        self._blocks_dir = root / "blocks"
        self._tmp_dir = root / "tmp"
        self._lock = threading.Lock()
        self._sizes: dict[str, int] = {}  # hash -> disk bytes
        self._used = 0
        # Bytes of staged writes (``writes.staged``) on this tier's disk:
        # never evicted, and taken from the capacity blocks may fill.
        self._reserved = 0
        self._held: OrderedDict[str, int] = OrderedDict()  # hash -> descriptor, guarded by _lock
        self._deletions = 0  # written under _lock; a warm holds nothing across one
        for directory in (self._blocks_dir, self._tmp_dir):
            try:
                directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            except (FileExistsError, NotADirectoryError) as exc:  # not ours to remove
                raise CachefsdError(
                    f"the {name} tier cannot use {root}: {directory} is in the way ({exc.strerror}); move it"
                ) from exc

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    @property
    def block_count(self) -> int:
        with self._lock:
            return len(self._sizes)

    def path_of(self, digest: str) -> Path:
        return self._blocks_dir / digest[:2] / digest

    def holds(self, digest: str) -> bool:
        with self._lock:
            return digest in self._sizes

    def size_of(self, digest: str) -> int | None:
        with self._lock:
            return self._sizes.get(digest)

    # -- accounting -------------------------------------------------------

    def room(self, incoming_use: float | None = None, wanted: int | None = None) -> int:
        """Bytes new blocks (to be read next at ``incoming_use``, if known)
        could take now: free space plus what the policy would give up, its
        blocks counted at the tier's mean size (exact sizes would cost a sum
        over the victims on every call). With ``wanted``, the count may stop
        once that many bytes are found: the caller holds this tier's lock
        for as long as the policy counts."""
        with self._lock:
            free = self.limit() - self._used  # below 0 when the disk filled up under us
            mean = self._used // len(self._sizes) if self._sizes else 0
            if wanted is None or not mean:
                return max(0, free + self._policy.spare(incoming_use) * mean)
            enough = max(0, -(-(wanted - free) // mean))
            return max(0, free + self._policy.spare(incoming_use, enough) * mean)

    def make_room(self, size: int, incoming: str) -> list[str]:
        """Victims whose removal leaves room for ``size`` bytes of block
        ``incoming`` (the policy may weigh it against them); they are out
        of the accounting when this returns, and the caller must delete (or
        demote) them before writing. ``NoRoom`` if the policy refuses."""
        if size > self.capacity:
            raise NoRoom(f"{size} bytes exceed the {self.name} tier", [])
        with self._lock:
            needed = self._used + size - self.limit()
            return victims_for(self._policy, incoming, needed, self._remove_locked, f"{self.name} tier's")

    def limit(self) -> int:
        """The bytes this tier's blocks may take now: its capacity less the
        staged bytes, or less when its filesystem has not that much room
        left (``DISK_RESERVE_BYTES``); a statvfs per admission, far cheaper
        than the block write it guards."""
        try:
            stats = os.statvfs(self.root)
        except OSError:
            return self.capacity - self._reserved
        reserve = min(DISK_RESERVE_BYTES, int(stats.f_blocks * stats.f_frsize * DISK_RESERVE_FRACTION))
        return min(self.capacity - self._reserved, self._used + stats.f_bavail * stats.f_frsize - reserve)

    @property
    def reserved_bytes(self) -> int:
        with self._lock:
            return self._reserved

    def reserve(self, nbytes: int, refusable: bool = True) -> list[str]:
        """Take ``nbytes`` of the capacity for staged writes: the blocks to
        evict for them are out of the accounting when this returns (the
        caller deletes or demotes them). ``NoRoom`` when ``refusable`` and
        the tier cannot hold them beside what is staged already: over its
        capacity, or its disk is full (nothing is taken then)."""
        with self._lock:
            if refusable and self._reserved + nbytes > self.capacity:
                raise NoRoom(f"{nbytes} more staged bytes exceed the {self.name} tier", [])
            self._reserved += nbytes
            needed = self._used - self.limit()
            try:
                return victims_for(self._policy, None, needed, self._remove_locked, f"{self.name} tier's")
            except NoRoom:
                if not refusable:
                    return []
                self._reserved -= nbytes
                raise

    def unreserve(self, nbytes: int) -> None:
        with self._lock:
            self._reserved -= nbytes

    def add(self, digest: str, size: int, ahead: bool = False) -> None:
        """Account a block just written; ``ahead`` as in ``EvictionPolicy.admitted``."""
        with self._lock:
            self._sizes[digest] = size
            self._used += size
            self._policy.admitted(digest, ahead)

    def remove(self, digest: str) -> int | None:
        """Forget ``digest``; its disk bytes, or None if it was not here."""
        with self._lock:
            if digest not in self._sizes:
                return None
            return self._remove_locked(digest)

    def _remove_locked(self, digest: str) -> int:
        size = self._sizes.pop(digest)
        self._used -= size
        self._policy.removed(digest)
        return size

    def replanned(self, digest: str) -> None:
        """The plan changed the block's next use: let the policy re-rank it."""
        with self._lock:
            if digest in self._sizes:
                self._policy.next_use_changed(digest)

    def accessed(self, digest: str) -> None:
        """Block ``digest`` was read: let the policy rank it so."""
        with self._lock:
            if digest in self._sizes:
                self._policy.accessed(digest)

    # -- files ------------------------------------------------------------

    def write(self, digest: str, frame: Frame) -> os.stat_result:
        """Write a block's file (``codec.encode_file``) under its name: a
        temp file, then a rename (``place``); the file's status once in
        place. A write that fails leaves neither behind."""
        temp, fd = self.temp_file()
        try:
            parts = [memoryview(part) for part in (frame.header, frame.payload) if part]
            while parts:
                written = os.writev(fd, parts)
                while parts and written >= len(parts[0]):
                    written -= len(parts.pop(0))
                if parts:
                    parts[0] = parts[0][written:]
            return self.place(temp, fd, digest)
        except OSError:
            temp.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)

    def temp_file(self) -> tuple[Path, int]:
        """A new temp file, open for writing: its path and descriptor, for
        ``place``. Named at random (a whole file's hash is known only once
        it is written); start-up deletes one left behind."""
        temp = self._tmp_dir / f"{secrets.token_hex(16)}.{secrets.token_hex(4)}"
        return temp, os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)

    def place(self, temp: Path, fd: int, digest: str) -> os.stat_result:
        """Rename temp file ``temp`` (``temp_file``), written whole through
        ``fd``, to block ``digest``'s name; the file's status once in place.
        The caller closes ``fd``, and deletes ``temp`` if this fails."""
        final = self.path_of(digest)
        try:
            final.parent.mkdir(mode=0o700, exist_ok=True)
            os.replace(temp, final)
            return os.fstat(fd)  # after the rename, which sets the ctime
        except OSError as exc:
            if exc.errno in _BLOCKED_NAME:
                raise UnplaceableBlock(exc.errno, exc.strerror, str(final)) from exc
            raise

    def read(self, digest: str) -> bytes:
        with open(self.path_of(digest), "rb") as block_file:
            return block_file.read()

    def open(self, digest: str) -> int:
        """A read-only descriptor of block ``digest``'s file; the caller closes it."""
        with self._lock:
            fd = self._held.pop(digest, None)
        if fd is not None:
            return fd
        return os.open(self.path_of(digest), os.O_RDONLY | os.O_CLOEXEC)

    @staticmethod
    def read_into(fd: int, buffer: bytearray) -> memoryview:
        """The bytes of an open block file, read into ``buffer`` (at least
        the file's size): no allocation, no page faults on a buffer already
        used, and one system call (a short read of a regular file is its
        end): each call into the kernel gives up the GIL, and getting it back
        is a wait behind every other FUSE thread."""
        view = memoryview(buffer)
        return view[: os.preadv(fd, [view], 0)]

    def warm(self, digest: str, hold: bool = False, offset: int = 0, length: int = 0) -> None:
        """Start reading block ``digest`` into the page cache (no wait): a
        read soon after finds it in RAM; only ``length`` bytes from
        ``offset`` when given (a block's part of a whole file). A block gone meanwhile is skipped.
        With ``hold``, the read is due next: its ``open`` gets this
        descriptor instead of walking the cache's directories again (a
        compressed block is read by path and decoded: nothing to hold)."""
        # Read without the lock (an int, read whole): every cached open
        # warms, and a stale count only means this descriptor is not held.
        deletions = self._deletions
        try:
            fd = self.open(digest)
        except FileNotFoundError:
            return
        try:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
        except OSError:
            os.close(fd)
            raise
        released = [fd]
        if hold and self.codec is Codec.RAW:
            with self._lock:
                # A block deleted since the open may be gone, or written
                # anew as another file: this descriptor must not outlive it.
                if self._deletions == deletions:
                    released = [old] if (old := self._held.pop(digest, None)) is not None else []
                    self._held[digest] = fd
                    if len(self._held) > HELD_DESCRIPTORS:
                        released.append(self._held.popitem(last=False)[1])
        for old_fd in released:
            os.close(old_fd)

    def delete(self, digest: str) -> None:
        """Remove the block's file; a descriptor held for it is closed, so
        its disk space is freed now, within the tier's capacity."""
        with self._lock:
            self._deletions += 1
            fd = self._held.pop(digest, None)
        if fd is not None:
            os.close(fd)
        self.path_of(digest).unlink(missing_ok=True)

    def files(self, tidy: bool = True) -> tuple[dict[str, int], int]:
        """Every block file on disk -> its size, and how many of our files
        are no block where they lie: temp files, blocks in the wrong shard,
        a file where a shard goes. They take room the tier does not count:
        with ``tidy`` they are deleted, and the count is of those deleted.

        Only what is provably ours is touched: a name of ours (a hash, a
        temp name, a shard) as a regular file. A tier may be a directory the
        user gave that holds other files (``--cache-dir /scratch``, whose
        ``tmp`` may be the user's own), or a damaged index's record may name
        the wrong one: anything else is left alone, and said once."""
        found: dict[str, int] = {}
        strays = [entry for entry in _entries(self._tmp_dir) if _TEMP_NAME.fullmatch(entry.name)]
        foreign = 0
        for shard in _entries(self._blocks_dir):
            mode = shard.lstat().st_mode
            if not _SHARD_NAME.fullmatch(shard.name) or not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                foreign += 1
                continue
            if stat.S_ISREG(mode):  # a file where a shard goes: it would refuse every block of it
                strays.append(shard)
                continue
            for block_file in _entries(shard):
                status = block_file.lstat()
                if not _BLOCK_NAME.fullmatch(block_file.name) or not stat.S_ISREG(status.st_mode):
                    foreign += 1
                elif block_file.name.startswith(shard.name):
                    found[block_file.name] = status.st_size
                else:
                    strays.append(block_file)
        if foreign:
            log.warning(
                "%s tier: %d entries in %s are not cachefsd's: left alone, and not counted in its size",
                self.name,
                foreign,
                self._blocks_dir,
            )
        if not tidy:
            return found, len(strays)
        return found, sum(_remove(stray) for stray in strays)


# The names of our files: a block is named by its hash (``codec.content_hash``,
# 32 hex digits) in the shard of its first two; a temp file as a hash with a
# random suffix (``Tier.temp_file``).
_BLOCK_NAME = re.compile(r"[0-9a-f]{32}")
_SHARD_NAME = re.compile(r"[0-9a-f]{2}")
_TEMP_NAME = re.compile(r"[0-9a-f]{32}\.[0-9a-f]{8}")


def _entries(directory: Path) -> list[Path]:
    """A directory's entries; none if it is gone or not a directory."""
    try:
        return list(directory.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []


def _remove(path: Path) -> bool:
    """Delete a file of ours that does not belong where it lies; one that
    cannot be (immutable, a directory) is logged, not a failed start."""
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("cannot remove %s from the cache: %s", path, exc)
        return False
    return True
