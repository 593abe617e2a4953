"""The native data plane answers what the cache already holds without
Python: with the page cache, dentries and inodes dropped, and more reads
of uncached files waiting on a hung store than the mount has Python
workers (so a request handed to Python now waits behind them, for as long
as the store hangs), a cached file still looks up, stats and reads, its
bytes exact.

Twice: a mount that serves every read itself (``-o nopassthrough``: the
kernel then opens files without asking), and one in passthrough, whose
files (larger than a read, of one block) are judged worth an OPEN each
by the first ``JUDGED_OPENS`` opens: the native workers then open a
cached file on its cache file themselves, and the kernel reads it.

The kernel's own count of the requests a connection has in flight
(fusectl's ``waiting``) says when the waiting reads have all reached the
daemon.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachefsd.fuse import session
from cachefsd.fuse.passthrough import JUDGED_OPENS
from cachefsd.fuse.protocol import BACKGROUND_REQUESTS, MAX_READ
from tests.integration.conftest import MountFactory, ServerProcess, drop_page_cache
from tests.polling import wait_until

KiB = 1 << 10
BUCKET = "native"
FUSECTL = Path("/sys/fs/fuse/connections")
# More than the mount's Python workers (the fetch concurrency, here 32,
# above BACKGROUND_REQUESTS, plus the spares): at least one handed request
# is always queued behind them.
WAITERS = BACKGROUND_REQUESTS + session.SPARE_WORKERS + 12
# A cached read answered natively takes milliseconds; one handed to Python
# would wait for the hung store, which the test resumes only after.
CACHED_SECONDS = 30.0


@contextlib.contextmanager
def _fusectl() -> Iterator[None]:
    """The fuse control filesystem, mounted for the test if it is not."""
    mounted = FUSECTL.is_dir() and any(FUSECTL.iterdir())
    if not mounted:
        subprocess.run(["mount", "-t", "fusectl", "fusectl", str(FUSECTL)], check=True)
    try:
        yield
    finally:
        if not mounted:
            subprocess.run(["umount", str(FUSECTL)], check=False)


def _waiting(mountpoint: Path) -> int:
    """Requests the kernel sent the mount and has no answer to yet."""
    return int((FUSECTL / str(os.minor(os.stat(mountpoint).st_dev)) / "waiting").read_text())


# Per mode: its flags, and the cached files' sizes (images; or larger than
# a read, enough to be judged worth passthrough's OPEN requests).
MODES = {
    "daemon reads": (("-o", "nopassthrough"), [(96 + i) * KiB for i in range(8)]),
    "passthrough": ((), [MAX_READ + (i + 1) * KiB for i in range(JUDGED_OPENS)]),
}


@pytest.mark.fuse
@pytest.mark.parametrize("mode", list(MODES))
def test_cached_files_are_served_while_every_python_worker_waits_on_a_hung_store(
    server: ServerProcess, mounter: MountFactory, mode: str
) -> None:
    flags, sizes = MODES[mode]
    cached = {f"cached/{i}.bin": os.urandom(size) for i, size in enumerate(sizes)}
    cold = {f"cold/{i}.bin": os.urandom(64 * KiB) for i in range(WAITERS)}
    client = server.client()
    client.create_bucket(Bucket=BUCKET)
    for key, body in {**cached, **cold}.items():
        client.put_object(Bucket=BUCKET, Key=key, Body=body)
    # No prefetch: the cold files must stay uncached; a long deadline: their
    # reads wait as long as the store hangs.
    mount = mounter(
        f"s3://{BUCKET}",
        "--endpoint-url",
        server.endpoint_url,
        "--fetch-deadline",
        "600s",
        "--no-prefetch",
        *flags,
    )
    for _ in range(2):  # the second epoch opens each file on its cache file, judged
        for key, body in cached.items():
            assert mount.path(key).read_bytes() == body
            # The kernel asks once whether STATX and FLUSH are answered (they
            # are not: it uses GETATTR, and a read-only file needs no flush).
            assert mount.path(key).stat().st_size == len(body)
    assert mount.metrics()[f"cachefsd_passthrough{{mount={mount.mountpoint}}}"] == (mode == "passthrough")
    assert sorted(os.listdir(mount.path("cold"))) == sorted(Path(key).name for key in cold)
    drop_page_cache()

    results: dict[str, bytes | OSError] = {}

    def read_cold(key: str) -> None:
        try:
            results[key] = mount.path(key).read_bytes()
        except OSError as exc:
            results[key] = exc

    waiters = [threading.Thread(target=read_cold, args=(key,), daemon=True) for key in cold]
    with _fusectl():
        before = _waiting(mount.mountpoint)
        server.signal(signal.SIGSTOP)
        try:
            for waiter in waiters:
                waiter.start()
            wait_until(
                lambda: _waiting(mount.mountpoint) >= before + WAITERS,
                "every cold read to wait on the hung store",
                CACHED_SECONDS,
            )
            served: dict[str, bytes] = {}

            def read_cached() -> None:
                for key, body in cached.items():
                    assert mount.path(key).stat().st_size == len(body)
                    served[key] = mount.path(key).read_bytes()

            reader = threading.Thread(target=read_cached, daemon=True)
            reader.start()
            reader.join(CACHED_SECONDS)
            assert not reader.is_alive(), "a cached file waited behind the reads of the hung store"
            assert served == cached
            assert not results, "a cold read finished while the store was hung"
        finally:
            server.signal(signal.SIGCONT)
    for waiter in waiters:
        waiter.join(CACHED_SECONDS)
    assert results == cold
