"""Which opens the kernel serves itself from a cache file (FUSE passthrough),
by the kernel's rules for an inode:

- all its open files are passthrough ones, on one backing file, or none is:
  an open in cached mode while it has a passthrough one, or a passthrough
  open while it has a cached one, fails (EIO in the opener), as does a
  second backing file;
- a backing id, once registered, stays valid until it is closed, whatever
  happens to the cache file (the kernel holds the file open), so the
  inode's last release closes it.

An inode whose opens are all cached (a cold read in progress) stays cached
until they are all released; an inode with a passthrough open gets
passthrough for every further open, on the same backing id. What counts as
released is our RELEASE answer, which comes after the kernel dropped its
own count: ours are never below the kernel's, so a choice made from ours
never breaks its rules.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from cachefsd.cache.blocks import WholeFile

log = logging.getLogger(__name__)

# The opens a mount's files are judged by (``OpenSizes``).
JUDGED_OPENS = 64


class OpenSizes:
    """Whether a mount's files are worth an OPEN request each, judged by the
    sizes of the first ``JUDGED_OPENS`` files opened.

    Passthrough needs an OPEN (and a RELEASE) for every open. A file larger
    than one read saves the daemon at least two READs by it; a file of one
    read or less saves one READ, or none when the kernel still holds its
    pages, so for a mount of such files no-open (the kernel opening files
    without asking, keeping their pages) costs fewer requests: measured,
    images of 96-160 KiB read at 0.05 x the local disk's speed through
    passthrough with their pages kept, 1.0 x without OPEN requests, and
    equally fast through both with the pages dropped. The verdict is for
    good: a kernel told once that OPEN is not implemented never sends it
    again."""

    def __init__(self, read_size: int) -> None:
        self._read_size = read_size
        self._lock = threading.Lock()
        self._large = 0
        self._judged = 0

    @property
    def judging(self) -> bool:
        """Whether opens still count towards the verdict."""
        with self._lock:
            return self._judged < JUDGED_OPENS

    def opened(self, size: int) -> bool | None:
        """Count an open of a file of ``size`` bytes: None until the mount
        is judged, then whether its files are worth an OPEN (once)."""
        with self._lock:
            if self._judged >= JUDGED_OPENS:
                return None
            self._judged += 1
            self._large += size > self._read_size
            if self._judged < JUDGED_OPENS:
                return None
            return 2 * self._large >= self._judged


class BackingIds(Protocol):
    """Registering backing files with the connection (``device.py``)."""

    def register(self, fd: int) -> int: ...
    def unregister(self, backing_id: int) -> None: ...


@dataclass(frozen=True, slots=True)
class Through:
    """A passthrough open: the backing id to answer with, and the tier its file lies in."""

    backing_id: int
    tier: str


@dataclass(slots=True)
class _Opens:
    lock: threading.Lock = field(default_factory=threading.Lock)
    cached: int = 0
    through: int = 0
    backing: Through | None = None


class Opens:
    """The open files of one mount's inodes, and their backing ids."""

    def __init__(self, backing: BackingIds) -> None:
        self._backing = backing
        self._lock = threading.Lock()  # guards _inodes; each entry's lock its counts
        self._inodes: dict[int, _Opens] = {}

    def open(self, inode: int, whole_file: Callable[[], WholeFile | None]) -> Through | None:
        """Open ``inode``: how to serve it through, or None for a cached
        open. ``whole_file`` is asked for the cache file unless the rules
        already decided (a cached open is still there); the descriptor it
        gives is closed here."""
        while True:
            with self._lock:
                opens = self._inodes.setdefault(inode, _Opens())
            with opens.lock:
                with self._lock:
                    if self._inodes.get(inode) is not opens:  # removed by a last release meanwhile
                        continue
                return self._open(opens, whole_file)

    def _open(self, opens: _Opens, whole_file: Callable[[], WholeFile | None]) -> Through | None:
        if opens.cached:
            opens.cached += 1
            return None
        found = whole_file()
        if found is not None:
            try:
                if opens.backing is None:
                    opens.backing = Through(self._backing.register(found.fd), found.tier)
            except OSError as exc:
                log.warning("cannot hand a cache file to the kernel: %s; the daemon serves it", exc)
            finally:
                os.close(found.fd)
        if opens.backing is None:
            opens.cached += 1
            return None
        opens.through += 1
        return opens.backing

    def backed(self, inode: int) -> bool:
        """Whether ``inode`` has passthrough opens (on its backing file)."""
        with self._lock:
            opens = self._inodes.get(inode)
        return opens is not None and opens.backing is not None

    def passing_through(self) -> bool:
        """Whether any inode has a passthrough open: until none has, a mount
        that gave passthrough up must still answer OPEN (``session``), as
        a new open of such an inode must be a passthrough one too."""
        with self._lock:
            return any(opens.backing is not None for opens in self._inodes.values())

    def release(self, inode: int, through: bool) -> None:
        """An open of ``inode`` was released (``through``: a passthrough one)."""
        with self._lock:
            opens = self._inodes.get(inode)
        if opens is None:
            return
        with opens.lock:
            if through:
                opens.through -= 1
                if not opens.through and opens.backing is not None:
                    backing_id, opens.backing = opens.backing.backing_id, None
                    try:
                        self._backing.unregister(backing_id)
                    except OSError as exc:
                        log.warning("cannot close backing id %d: %s", backing_id, exc)
            else:
                opens.cached -= 1
            if not opens.cached and not opens.through:
                with self._lock:
                    if self._inodes.get(inode) is opens:
                        del self._inodes[inode]
