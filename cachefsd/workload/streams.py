"""Streams: sequential readers inside large files, and the window to fetch
ahead of each.

Large files (tar shards, arrow or numpy files) are read front to back. Once
``STREAM_CONFIRM_BYTES`` have been read contiguously in a file, the window
after the last byte read is predicted. The window starts at
``STREAM_INITIAL_WINDOW`` and doubles each time the reader consumes a whole
window, up to ``STREAM_MAX_WINDOW`` (Mountpoint for S3 grows its read
window the same way); a non-contiguous read starts a new stream at the
initial window. Contiguous allows some slack either way: the kernel's page
cache serves some reads that never reach the daemon, and FUSE threads may
deliver one reader's reads out of order.

A workload keeps at most ``MAX_STREAMS_PER_WORKLOAD`` streams, least
recently read dropped first; a stream not read for ``STREAM_IDLE_SECONDS``,
or read to its file's end, predicts nothing.

Time comes in with the reads (``now``); nothing here reads a clock.
Concurrency: none here. A workload's ``Streams`` is guarded by the lock of
its owner (``model.WorkloadModel``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

# First window of a sequential stream: 1 MiB, like Mountpoint for S3's
# initial read window. It grows while the stream is confirmed, so a stream
# predicts 8 MiB when it first does (``STREAM_CONFIRM_BYTES``).
STREAM_INITIAL_WINDOW: Final = 1 << 20
# Largest window: 64 MiB is 16 default 4 MiB blocks in flight for one
# stream, enough to fill a fast link from an object store (about 100 MB/s
# per GET), while the prefetcher's global byte budget bounds the total.
STREAM_MAX_WINDOW: Final = 64 << 20
# Bytes read contiguously that make a stream. Not a count of reads: the
# kernel sends one 1 MiB pread as several contiguous READs, and one mmap
# fault as a read-around of up to its read-ahead (a block, 4 MiB); a
# stream is confirmed by more bytes than either, so a random reader of a
# large file (ten 1 MiB preads) is never fetched ahead by whole runs.
STREAM_CONFIRM_BYTES: Final = 8 << 20
# Files up to this size are one default block, fetched whole by their first
# read; only larger files get streams.
STREAM_MIN_FILE_BYTES: Final = 4 << 20
# A read this far past the stream's end still continues it: reads served by
# the kernel page cache (kernel_cache, readahead) never reach us and leave gaps.
STREAM_FORWARD_SLACK: Final = 1 << 20
# ... and this far before it: FUSE threads may deliver a reader's reads out of order.
STREAM_BACKWARD_SLACK: Final = 1 << 20
# Streams tracked per workload, least recently read dropped first: a loader
# keeps one or two files open per worker; 64 covers 32 workers with room to spare.
MAX_STREAMS_PER_WORKLOAD: Final = 64
# A stream not read for this long is finished or abandoned: stop predicting it.
# Long enough for a slow training step between two reads of one shard.
STREAM_IDLE_SECONDS: Final = 30.0


@dataclass
class Stream:
    """A sequential reader inside one file."""

    start: int  # where its first read began
    end: int  # one past the last byte read
    size: int  # file size, -1 if unknown
    last_read: float
    window: int = STREAM_INITIAL_WINDOW
    consumed: int = 0  # bytes read since the window last grew

    def live(self, now: float) -> bool:
        """Confirmed, short of the file's end, and read lately."""
        return (
            self.end - self.start >= STREAM_CONFIRM_BYTES
            and (self.size < 0 or self.end < self.size)
            and now - self.last_read <= STREAM_IDLE_SECONDS
        )


class Streams:
    """One workload's streams, by path, least recently read first."""

    def __init__(self) -> None:
        self._streams: OrderedDict[str, Stream] = OrderedDict()

    def read(self, path: str, offset: int, length: int, size: int, now: float) -> None:
        """``length`` bytes of ``path`` (``size`` bytes, -1 if unknown) at ``offset`` were read at ``now``."""
        if 0 <= size <= STREAM_MIN_FILE_BYTES:
            return
        end = offset + length
        stream = self._streams.get(path)
        if stream is not None and (
            stream.end - STREAM_BACKWARD_SLACK <= offset <= stream.end + STREAM_FORWARD_SLACK
        ):
            grown = max(0, end - stream.end)
            stream.end = max(stream.end, end)
            stream.consumed += grown
            stream.last_read = now
            stream.size = size
            if stream.consumed >= stream.window:
                stream.consumed = 0
                stream.window = min(2 * stream.window, STREAM_MAX_WINDOW)
            self._streams.move_to_end(path)
            return
        # New stream, or a broken one starting over at the initial window.
        self._streams[path] = Stream(start=offset, end=end, size=size, last_read=now, consumed=length)
        self._streams.move_to_end(path)
        while len(self._streams) > MAX_STREAMS_PER_WORKLOAD:
            self._streams.popitem(last=False)

    def windows(self, now: float) -> Iterator[tuple[str, int, int]]:
        """(path, offset, length) of each live stream's next window, most
        recently read first, clipped to the file when its size is known."""
        for path, stream in reversed(self._streams.items()):
            if stream.live(now):
                length = stream.window if stream.size < 0 else min(stream.window, stream.size - stream.end)
                yield path, stream.end, length

    def live(self, now: float) -> int:
        """How many streams are live."""
        return sum(1 for stream in self._streams.values() if stream.live(now))

    def absorb(self, other: Streams) -> None:
        """Take ``other``'s streams (a workload merged into this one's)."""
        self._streams.update(other._streams)
