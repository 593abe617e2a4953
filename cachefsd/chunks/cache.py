"""The block directory: content-addressed block files with a byte capacity.

Layout under the cache directory::

    blocks/ab/abcdef...   one frame (chunks/codec.py) per content hash
    tmp/                  frames being written; anything here after a crash is garbage
    index.sqlite          the index (index.py)

A block is written to ``tmp/``, renamed into ``blocks/``, and only then
recorded in the index; eviction deletes the row before the file. Start-up
(``reconcile``) deletes temp files, files the index does not name, rows
whose file is missing or has the wrong size, and unreferenced blocks. So a
``kill -9`` at any point leaves nothing that could be served wrongly, and a
frame that rotted on disk is caught by its hash on read-back.

The cache is advisory: every failure in here (disk full, unwritable
directory, a corrupt frame) is logged, counted, and turned into a miss. No
fsync: the frames' hashes catch what a power loss could tear, and a miss
only costs a re-fetch.

Capacity counts each file rounded up to the filesystem allocation unit, so
``used_bytes`` never exceeds ``capacity`` in bytes on disk. Space is
reserved (evicting least-recently-used blocks) before a frame is written, so
concurrent admissions cannot overshoot either.

Concurrency: ``_lock`` guards ``_lru`` and ``_used``; ``_admit_lock``
serialises admissions. Lock order: ``_admit_lock``, ``_lock``, then the
index's lock. File I/O for reads happens outside every lock.
"""

from __future__ import annotations

import logging
import os
import secrets
import sqlite3
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Protocol

from cachefsd.chunks.codec import Codec, CorruptBlock, decode, encode
from cachefsd.index import BlockRef, Index

log = logging.getLogger(__name__)

# Files occupy whole filesystem blocks; 4 KiB is the allocation unit of
# ext4 and xfs as formatted by default.
ALLOCATION_UNIT = 4096

# What a failing cache disk raises: the filesystem's errors, and sqlite's when
# the index, which lives on the same disk, cannot be written (SQLITE_FULL,
# SQLITE_IOERR). Both are turned into a miss, never into a failed read.
_DISK_ERRORS = (OSError, sqlite3.Error)


def disk_bytes(length: int) -> int:
    return -(-length // ALLOCATION_UNIT) * ALLOCATION_UNIT


class CacheEvents(Protocol):
    """What the cache reports (metrics.py implements it)."""

    def cache_usage(self, used_bytes: int, capacity_bytes: int) -> None: ...
    def block_evicted(self) -> None: ...
    def block_corrupt(self) -> None: ...
    def cache_error(self) -> None: ...


class BlockCache:
    def __init__(self, root: Path, capacity: int, index: Index, events: CacheEvents) -> None:
        self._blocks_dir = root / "blocks"
        self._tmp_dir = root / "tmp"
        self._capacity = capacity
        self._index = index
        self._events = events
        self._lock = threading.Lock()
        self._admit_lock = threading.Lock()
        self._lru: OrderedDict[str, int] = OrderedDict()  # hash -> disk bytes, oldest first
        self._used = 0
        for directory in (self._blocks_dir, self._tmp_dir):
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    def path_of(self, digest: str) -> Path:
        return self._blocks_dir / digest[:2] / digest

    # -- start-up -------------------------------------------------------

    def reconcile(self) -> None:
        """Make files and index agree after whatever happened last time."""
        for leftover in self._tmp_dir.iterdir():
            leftover.unlink(missing_ok=True)
        on_disk: dict[str, int] = {}
        for shard in self._blocks_dir.iterdir():
            for block_file in shard.iterdir():
                on_disk[block_file.name] = block_file.stat().st_size
        garbage = set(self._index.unreferenced())
        kept: dict[str, int] = {}
        for stored in self._index.blocks():
            file_size = on_disk.pop(stored.hash, None)
            if file_size is None or disk_bytes(file_size) != stored.disk_bytes or stored.hash in garbage:
                self._index.remove_block(stored.hash)
                self.path_of(stored.hash).unlink(missing_ok=True)
                continue
            kept[stored.hash] = stored.disk_bytes
        for orphan in on_disk:
            self.path_of(orphan).unlink(missing_ok=True)
        with self._lock:
            self._lru = OrderedDict(kept)
            self._used = sum(kept.values())
            evicted = self._make_room_locked(0)
        self._delete_files(evicted)
        log.info(
            "cache reconciled: %d blocks, %d bytes, %d orphans removed", len(kept), self._used, len(on_disk)
        )
        self._report_usage()

    def save_recency(self) -> None:
        with self._lock:
            now = time.time()
            order = {
                digest: now - (len(self._lru) - position) * 1e-6 for position, digest in enumerate(self._lru)
            }
        self._index.save_last_used(order)

    # -- read path ------------------------------------------------------

    def read(self, ref: BlockRef) -> bytes | None:
        """The verified content of ``ref``, or None on any miss or failure."""
        digest = self._index.lookup(ref)
        if digest is None:
            return None
        try:
            with open(self.path_of(digest), "rb") as block_file:
                frame = block_file.read()
            data = decode(frame, digest)
        except FileNotFoundError:
            self._forget(digest)
            return None
        except CorruptBlock as exc:
            log.warning("dropping corrupt block %s: %s", digest, exc)
            self._events.block_corrupt()
            self._forget(digest)
            return None
        except OSError as exc:
            log.warning("cannot read block %s: %s", digest, exc)
            self._events.cache_error()
            return None
        with self._lock:
            if digest in self._lru:
                self._lru.move_to_end(digest)
        return data

    # -- admission ------------------------------------------------------

    def admit(self, ref: BlockRef, digest: str, data: bytes) -> None:
        """Store ``data`` (whose hash the caller computed from the fetched
        bytes) as the content of ``ref``. Best effort: failures only log.

        Admissions are serialised by ``_admit_lock`` so a hash is reserved,
        written and recorded by one thread at a time; reads never take it."""
        with self._admit_lock:
            with self._lock:
                stored_size = self._lru.get(digest)
                if stored_size is not None:
                    self._lru.move_to_end(digest)
            if stored_size is not None:
                # Same content under another name: one more row, no new file.
                try:
                    self._index.record(ref, digest, stored_size, len(data))
                except sqlite3.Error as exc:
                    log.warning("cannot record block %s: %s", digest, exc)
                    self._events.cache_error()
                return
            frame = encode(data, Codec.RAW)
            size = disk_bytes(len(frame))
            if size > self._capacity:
                return
            with self._lock:
                evicted = self._make_room_locked(size)
                self._lru[digest] = size
                self._used += size
            self._delete_files(evicted)
            try:
                self._write(digest, frame)
                self._index.record(ref, digest, size, len(data))
            except _DISK_ERRORS as exc:
                log.warning("cannot cache block %s: %s", digest, exc)
                self._events.cache_error()
                self._forget(digest)
        self._report_usage()

    def _write(self, digest: str, frame: bytes) -> None:
        temp = self._tmp_dir / f"{digest}.{secrets.token_hex(4)}"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            view = memoryview(frame)
            while view:
                written = os.write(fd, view)
                view = view[written:]
        except OSError:
            os.close(fd)
            temp.unlink(missing_ok=True)
            raise
        os.close(fd)
        final = self.path_of(digest)
        final.parent.mkdir(mode=0o700, exist_ok=True)
        os.replace(temp, final)

    def _make_room_locked(self, size: int) -> list[str]:
        """Reserve ``size`` bytes by evicting least recently used blocks; the
        caller deletes the returned blocks' rows and files outside the lock."""
        evicted = []
        while self._lru and self._used + size > self._capacity:
            digest, victim_size = self._lru.popitem(last=False)
            self._used -= victim_size
            evicted.append(digest)
        return evicted

    def _delete_files(self, digests: list[str]) -> None:
        for digest in digests:
            self._remove_block(digest)
            self._events.block_evicted()

    def _remove_block(self, digest: str) -> None:
        """Delete a block's row, then its file; best effort. If the row cannot
        be deleted the file goes anyway: a row naming a missing file is a miss
        on read, and start-up's reconcile drops it."""
        try:
            self._index.remove_block(digest)
        except sqlite3.Error as exc:
            log.warning("cannot drop block %s from the index: %s", digest, exc)
            self._events.cache_error()
        try:
            self.path_of(digest).unlink(missing_ok=True)
        except OSError as exc:
            log.warning("cannot delete block file %s: %s", digest, exc)
            self._events.cache_error()

    def _forget(self, digest: str) -> None:
        with self._lock:
            size = self._lru.pop(digest, None)
            if size is not None:
                self._used -= size
        self._remove_block(digest)
        self._report_usage()

    def release_version(self, source: str, key: str, etag: str, block_count: int) -> None:
        """Drop one version of an object (it changed or was deleted upstream),
        deleting the blocks nothing else references."""
        try:
            unreferenced = self._index.release_version(source, key, etag, block_count)
        except sqlite3.Error as exc:
            log.warning("cannot release %s version %s in the index: %s", key, etag, exc)
            self._events.cache_error()
            return
        for digest in unreferenced:
            self._forget(digest)

    def _report_usage(self) -> None:
        self._events.cache_usage(self.used_bytes, self._capacity)
