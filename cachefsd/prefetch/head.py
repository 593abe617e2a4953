"""A large file's first run, begun by a read at its start before anything
shows whether the reader streams or only peeked at a header.

The run's GET reads its free blocks (``PrefetchTuning.head_free_bytes``),
then goes on only once the verdict is in: the next read of the file past its
first block, by any reader. Inside the free blocks or just past them
(``workload.streams.STREAM_FORWARD_SLACK``), a stream; further on, a jump. A read in
the first block says nothing: a header read again, or the kernel's
read-ahead of the first read, took a run of 128 MiB for a stream. Without a
verdict within ``head_verdict_seconds``, the run stops after its free blocks.

Concurrency: ``HeadRuns._lock`` guards the registry; the prefetcher takes
its own lock under it, so that no two reads of a file begin its first run
(lock order in ``engine.py``). A run's GET waits for its verdict
(``HeadRun.goes_on``) on the fetching thread, holding no lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from cachefsd.cache.index import BlockRef
from cachefsd.workload.streams import STREAM_FORWARD_SLACK

T = TypeVar("T")


def free_blocks(head_free_bytes: int, block_size: int) -> int:
    """Blocks a first run reads before it waits for its verdict: at least one."""
    return max(1, head_free_bytes // block_size)


def verdict(offset: int, block_size: int, free: int) -> bool | None:
    """What a read at ``offset`` says of a first run with ``free`` free
    blocks: True a stream, False a jump, None nothing (the first block)."""
    if offset < block_size:
        return None
    return offset < free * block_size + STREAM_FORWARD_SLACK


class HeadRun:
    """One file's first run: its GET reads ``free_blocks`` blocks, then goes
    on only if the verdict, awaited at most ``verdict_seconds``, is a stream."""

    def __init__(self, free_blocks: int, verdict_seconds: float) -> None:
        self.free_blocks = free_blocks
        self._verdict_seconds = verdict_seconds
        self.claimed = threading.Event()  # its blocks are claimed (or it fetches nothing)
        self.verdict = threading.Event()
        self.streaming = False

    def decide(self, streaming: bool) -> None:
        self.streaming = streaming
        self.verdict.set()

    def goes_on(self, index: int) -> bool:
        """Whether the GET may read block ``index`` (asked before each block)."""
        if index < self.free_blocks:
            return True
        self.verdict.wait(self._verdict_seconds)
        return self.streaming


class HeadRuns:
    """The first runs awaiting a verdict, by their file's block 0."""

    def __init__(self, free_blocks: int, verdict_seconds: float) -> None:
        self._free_blocks = free_blocks
        self._verdict_seconds = verdict_seconds
        self._lock = threading.Lock()
        self._runs: dict[BlockRef, HeadRun] = {}

    def awaiting(self) -> bool:
        """Whether any run awaits a verdict. Read without the lock, on every
        read: a run begun meanwhile misses this read's verdict, as it would
        had the read come a moment sooner."""
        return bool(self._runs)

    def begin(self, ref: BlockRef, take: Callable[[], T | None]) -> tuple[HeadRun, T | None] | None:
        """The first run of the file whose block 0 is ``ref``: with what
        ``take`` claimed for it when this call begins it, with None when
        another read already did; None when there is none and ``take``
        claims nothing. ``take`` runs under this registry's lock."""
        with self._lock:
            run = self._runs.get(ref)
            if run is not None:
                return run, None
            taken = take()
            if not taken:
                return None
            run = self._runs[ref] = HeadRun(self._free_blocks, self._verdict_seconds)
            return run, taken

    def judge(self, ref: BlockRef, offset: int, block_size: int) -> None:
        """A read at ``offset`` of the file whose block 0 is ``ref``."""
        if offset < block_size:
            return  # says nothing (``verdict``): no need for the lock
        with self._lock:
            run = self._runs.get(ref)
        if run is None or run.verdict.is_set():
            return
        streaming = verdict(offset, block_size, run.free_blocks)
        if streaming is not None:
            run.decide(streaming)

    def over(self, ref: BlockRef, run: HeadRun) -> None:
        """``run``'s GET is over (or never started)."""
        with self._lock:
            if self._runs.get(ref) is run:
                del self._runs[ref]

    def stop(self) -> None:
        """Stop every run at its free blocks (the prefetcher is stopping)."""
        with self._lock:
            runs = list(self._runs.values())
        for run in runs:
            run.decide(False)
