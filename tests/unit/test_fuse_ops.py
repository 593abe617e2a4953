"""The FUSE edge without a mount: when the descriptors handed to libfuse close."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from cachefsd import fuse_ops
from cachefsd.reader import FileSpan


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_a_replys_descriptors_close_only_when_its_worker_comes_back(tmp_path: Path) -> None:
    """libfuse reads a span's descriptor after read_buf returns, while its
    worker sends the reply, however long a busy disk makes that: no other
    worker may close it meanwhile (its number could then be reused by
    another block file, and the reply read from that)."""
    block = tmp_path / "block"
    block.write_bytes(b"x" * 100)
    fd = os.open(block, os.O_RDONLY)
    replied, back = threading.Event(), threading.Event()

    def worker() -> None:  # alive throughout, as libfuse's workers are
        fuse_ops._bufvec([FileSpan(fd, 0, 100)])
        replied.set()
        back.wait(10)
        fuse_ops._close_previous_spans()  # its next operation

    sender = threading.Thread(target=worker)
    sender.start()
    assert replied.wait(10)
    other = threading.Thread(target=fuse_ops._close_previous_spans)  # another worker's next operation
    other.start()
    other.join(10)
    assert _is_open(fd)
    back.set()
    sender.join(10)
    assert not _is_open(fd)
