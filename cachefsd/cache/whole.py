"""Whole files: when an object larger than a block has been read to its
end, one background thread makes it a whole file (``index.WHOLE``), one
raw file of all its bytes, of its cached blocks
(``tiered.TieredCache.assemble_whole``). Its next open is then served by
the kernel from that file (FUSE passthrough, ``view.CacheView.whole_file``),
which a read through the daemon, block by block, cannot match for speed.

Best effort and never in a reader's way: a read only queues the version
(a bounded queue, each version once; full, it is dropped, and the next
read to the end queues it again), and the thread reads the blocks from the
cache disk, after the reader did.

Concurrency: ``_changed`` guards ``_pending``, ``_queued`` and
``_stopping``; the thread assembles without it.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

from cachefsd.cache.blocks import Version

log = logging.getLogger(__name__)

# Versions waiting for their whole file, at most: an epoch of shards read
# at once by a loader's workers, and a few more. Past it a version is
# dropped; its next read to the end queues it again.
QUEUED_VERSIONS = 64
# How long stopping waits for the version being made: reading and writing
# a shard of a few hundred MiB on a cache disk. The thread gives up between
# blocks once told to stop, so it is far shorter in practice.
STOP_WAIT_SECONDS = 10.0


def ends_file(offset: int, size: int, file_size: int) -> bool:
    """Whether a read of ``size`` bytes at ``offset`` reaches the end of a
    file of ``file_size`` bytes: a reader that got this far has had every
    block of a file read front to back."""
    return offset + size >= file_size


def worth_whole_file(file_size: int, block_size: int) -> bool:
    """Whether an object of ``file_size`` bytes needs a whole file to be
    served by the kernel: one of one block (or none) is its own."""
    return file_size > block_size


class WholeFiles:
    """Makes the whole files of the versions ``want`` is told of, one at
    a time, on a thread of its own, by ``assemble(version, abandoned)``
    (which returns whether the version has one, and gives up once
    ``abandoned()``). ``start`` before ``want``; ``stop`` once done."""

    def __init__(
        self,
        assemble: Callable[[Version, Callable[[], bool]], bool],
        queued_versions: int = QUEUED_VERSIONS,
    ) -> None:
        self._assemble = assemble
        self._queued_versions = queued_versions
        self._changed = threading.Condition()
        self._pending: deque[Version] = deque()
        # Versions pending or being made: none is made twice at once.
        self._queued: set[Version] = set()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="whole-files", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def want(self, version: Version) -> bool:
        """Queue ``version`` for its whole file; False if it is queued
        already, the queue is full, or the thread is stopping."""
        with self._changed:
            if self._stopping or version in self._queued or len(self._pending) >= self._queued_versions:
                return False
            self._pending.append(version)
            self._queued.add(version)
            self._changed.notify()
            return True

    def stop(self, timeout: float = STOP_WAIT_SECONDS) -> None:
        """Drop what is queued, abandon the version being made, and wait
        for the thread (at most ``timeout``: then it is left, a daemon
        thread, with a warning)."""
        with self._changed:
            self._stopping = True
            self._pending.clear()
            self._changed.notify_all()
        if not self._thread.is_alive():
            return
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("whole files: still making one after %.0f s; left to finish", timeout)

    def _is_stopping(self) -> bool:
        with self._changed:
            return self._stopping

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._pending and not self._stopping:
                    self._changed.wait()
                if self._stopping:
                    return
                version = self._pending.popleft()
            try:
                self._assemble(version, self._is_stopping)
            except Exception:  # a bug must not end the thread: the cache is advisory
                log.exception("whole files: cannot make that of %s", version.key)
            finally:
                with self._changed:
                    self._queued.discard(version)
