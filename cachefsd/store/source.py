"""The local file an upload sends (``ObjectStore.put_file``), read through
one descriptor and pinned to what it was when opened.

An upload must publish one state of the file, not a mix of two: a writer
still appending, or truncating and rewriting, would otherwise leave an
object made of old and new parts. ``check_unchanged`` compares the file's
size, mtime and ctime (every write(2), truncate or utime changes one) with
those at open; the stores call it after the last byte is read and before
the upload is made visible, and refuse with ``SourceChanged``. A file
renamed over ``path`` meanwhile does not count: the descriptor still reads
the file that was opened, whole.

``SourceFile``'s methods block (file I/O, hashing): run them in a thread.
hashlib releases the GIL for buffers this size, so the hashing costs the
event loop nothing. ``FileParts`` does so for a block upload (S3, Azure).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections import deque
from pathlib import Path

from cachefsd.errors import SourceChanged, SourceUnreadable

# Parts of a file read and hashed at once, ahead of obstore asking for
# them: one MD5 runs at about 560 MiB/s on one core, so four keep ahead of
# a 10 Gb/s link (and hold four parts more in memory).
READ_AHEAD_PARTS = 4


def part_ranges(size: int, part_size: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each part of an object of ``size`` bytes."""
    return [(start, min(start + part_size, size)) for start in range(0, size, part_size)]


def multipart_etag(part_md5s: list[bytes]) -> str:
    """The etag S3 gives an object completed from parts with these MD5s:
    the MD5 of their concatenation, ``-`` and the number of parts."""
    return f"{hashlib.md5(b''.join(part_md5s)).hexdigest()}-{len(part_md5s)}"


class SourceFile:
    """An open file to upload. Not shared between threads at once: one
    upload reads it, a part at a time or concurrently with ``pread``, which
    has no shared offset."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise SourceUnreadable(f"cannot open {path}: {exc.strerror}") from exc
        try:
            st = os.fstat(self._fd)
        except OSError as exc:
            os.close(self._fd)
            raise SourceUnreadable(f"cannot stat {path}: {exc.strerror}") from exc
        self.size = st.st_size
        self._identity = (st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    @property
    def fd(self) -> int:
        return self._fd

    def read(self, offset: int, size: int) -> bytes:
        """Exactly ``size`` bytes at ``offset``; ``SourceChanged`` if the
        file is shorter now than when it was opened."""
        try:
            data = os.pread(self._fd, size, offset)
        except OSError as exc:
            raise SourceUnreadable(f"cannot read {self.path}: {exc.strerror}") from exc
        if len(data) != size:
            raise SourceChanged(f"{self.path} shrank while it was uploaded")
        return data

    def read_with_md5(self, offset: int, size: int) -> tuple[bytes, bytes]:
        """``read``, and the MD5 digest of what was read."""
        data = self.read(offset, size)
        return data, hashlib.md5(data).digest()

    def check_unchanged(self) -> None:
        """``SourceChanged`` if the file's size, mtime or ctime differ from
        those it had when opened."""
        try:
            st = os.fstat(self._fd)
        except OSError as exc:
            raise SourceUnreadable(f"cannot stat {self.path}: {exc.strerror}") from exc
        if (st.st_size, st.st_mtime_ns, st.st_ctime_ns) != self._identity:
            raise SourceChanged(f"{self.path} changed while it was uploaded")

    def close(self) -> None:
        os.close(self._fd)


class FileParts:
    """A file's parts for obstore's multipart upload, ``part_size`` bytes
    but the last, so obstore's parts are these and the etag they make is
    known. Each is read and its MD5 taken in a worker thread, up to
    ``READ_AHEAD_PARTS`` at once (obstore asks for one part at a time);
    after the last, the file is checked unchanged, before obstore completes
    the upload. ``drain`` before the file is closed."""

    def __init__(self, source: SourceFile, part_size: int) -> None:
        self._source = source
        self._ranges = iter(part_ranges(source.size, part_size))
        self._reading: deque[asyncio.Future[tuple[bytes, bytes]]] = deque()
        self.md5s: list[bytes] = []

    def __aiter__(self) -> FileParts:
        return self

    async def __anext__(self) -> bytes:
        while len(self._reading) < READ_AHEAD_PARTS:
            part = next(self._ranges, None)
            if part is None:
                break
            start, end = part
            self._reading.append(
                asyncio.ensure_future(asyncio.to_thread(self._source.read_with_md5, start, end - start))
            )
        if not self._reading:
            await asyncio.to_thread(self._source.check_unchanged)
            raise StopAsyncIteration
        data, md5 = await self._reading.popleft()
        self.md5s.append(md5)
        return data

    async def drain(self) -> None:
        """Wait for the reads still running (a thread cannot be stopped)."""
        await asyncio.gather(*self._reading, return_exceptions=True)
        self._reading.clear()
