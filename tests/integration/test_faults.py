"""Faults through a real mount: the bucket goes away or hangs, block files rot
on disk, the daemon is killed mid-read, the cache disk fills up, and a second
daemon reaches for a cache directory in use.

The promises under test (SEMANTICS.md, "Errors" and "Crashes"): a read
returns the object's exact bytes or fails with EIO after a bounded time; the
cache is advisory, so any trouble in it becomes a miss and a re-fetch; and a
``kill -9`` at any moment never leaves a wrong byte to be served.

Cached reads are checked after dropping the kernel page cache, so the bytes
really come from the daemon. Every wait is a bounded poll, never a sleep.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import functools
import mmap
import os
import random
import select
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cachefsd.cache.codec import Codec, CorruptBlock, decode_file
from cachefsd.cache.lock import LOCK_WAIT_SECONDS
from cachefsd.cache.tiered import disk_bytes
from cachefsd.fuse.session import SERVING_WORKERS
from cachefsd.testing.s3_server import S3TestServer
from tests.integration.conftest import Mount, MountFactory, drop_page_cache, force_unmount, run_cli
from tests.integration.torture import KILL_ROUNDS, assert_reads_right, kill_round, metric, write_manifest
from tests.polling import wait_until

KiB = 1 << 10
MiB = 1 << 20

# The fetch deadline the outage tests mount with, and the slack allowed on top
# of it for the retries' last backoff, the FUSE bridge margin and a loaded CI box.
FETCH_DEADLINE_SECONDS = 3.0
EIO_MARGIN_SECONDS = 7.0
# A read served from the daemon's cache never touches the network; on a dead
# or hanging bucket it must still be quick (far below the deadline).
CACHED_READ_SECONDS = 2.0


def _new_bucket(s3_client: Any, objects: dict[str, bytes]) -> str:
    bucket = f"faults-{uuid.uuid4().hex[:16]}"
    s3_client.create_bucket(Bucket=bucket)
    for key, body in objects.items():
        s3_client.put_object(Bucket=bucket, Key=key, Body=body)
    return bucket


def _block_files(cache_dir: Path) -> list[Path]:
    return sorted(path for path in (cache_dir / "blocks").glob("*/*") if path.is_file())


def _read_expecting_eio(path: Path) -> float:
    """Seconds until reading ``path`` failed with EIO (fails the test otherwise)."""
    started = time.monotonic()
    # open succeeds from the cached listing; the read needs the bucket.
    with pytest.raises(OSError, match=r"Input/output error") as raised, open(path, "rb") as handle:
        handle.read()
    assert raised.value.errno == errno.EIO
    return time.monotonic() - started


def _timed_read(path: Path) -> tuple[bytes, float]:
    started = time.monotonic()
    data = path.read_bytes()
    return data, time.monotonic() - started


def _mount_for_outage(mounter: MountFactory, server: S3TestServer, bucket: str) -> Mount:
    """A mount whose fetches give up after ``FETCH_DEADLINE_SECONDS``, and
    that never prefetches (so a file the test does not read stays uncached)."""
    return mounter(
        f"s3://{bucket}",
        "--endpoint-url",
        server.endpoint_url,
        "--fetch-deadline",
        f"{FETCH_DEADLINE_SECONDS:g}s",
        "--no-prefetch",
    )


@pytest.fixture(name="outage_server")
def fixture_outage_server(s3_server: S3TestServer) -> Iterator[S3TestServer]:
    """The shared S3 server, which the test may stop or slow down: it is
    running again, with no latency, whatever the test did."""
    try:
        yield s3_server
    finally:
        s3_server.latency_seconds = 0.0
        s3_server.start()


# -- the bucket goes away --------------------------------------------------------------------


def test_stopped_server_serves_cached_files_fails_others_with_eio_then_recovers(
    outage_server: S3TestServer, s3_client: Any, mounter: MountFactory
) -> None:
    objects = {f"data/{name}.bin": os.urandom(300 * KiB) for name in ("a", "b", "c")}
    bucket = _new_bucket(s3_client, objects)
    mount = _mount_for_outage(mounter, outage_server, bucket)
    assert sorted(p.name for p in mount.path("data").iterdir()) == ["a.bin", "b.bin", "c.bin"]
    for key in ("data/a.bin", "data/b.bin"):
        assert mount.path(key).read_bytes() == objects[key]

    outage_server.stop()
    drop_page_cache()
    for key in ("data/a.bin", "data/b.bin"):
        data, elapsed = _timed_read(mount.path(key))
        assert data == objects[key], f"{key}: cached bytes differ with the bucket down"
        assert elapsed < CACHED_READ_SECONDS, f"{key}: a cached read took {elapsed:.1f}s with the bucket down"

    elapsed = _read_expecting_eio(mount.path("data/c.bin"))
    assert elapsed < FETCH_DEADLINE_SECONDS + EIO_MARGIN_SECONDS, f"EIO only after {elapsed:.1f}s"
    assert mount.alive
    assert os.path.ismount(mount.mountpoint)
    assert metric(mount, "cachefsd_fetch_errors_total") >= 1

    outage_server.start()
    outage_server.reset_counts()
    assert mount.path("data/c.bin").read_bytes() == objects["data/c.bin"]
    assert outage_server.get_object_count >= 1


def test_hanging_server_fails_uncached_reads_within_deadline_and_serves_cached(
    outage_server: S3TestServer, s3_client: Any, mounter: MountFactory
) -> None:
    objects = {"cached.bin": os.urandom(200 * KiB), "uncached.bin": os.urandom(200 * KiB)}
    bucket = _new_bucket(s3_client, objects)
    mount = _mount_for_outage(mounter, outage_server, bucket)
    assert sorted(p.name for p in mount.mountpoint.iterdir()) == ["cached.bin", "uncached.bin"]
    assert mount.path("cached.bin").read_bytes() == objects["cached.bin"]

    # Every request now takes longer than a read may wait in all.
    outage_server.latency_seconds = FETCH_DEADLINE_SECONDS + EIO_MARGIN_SECONDS + 5
    elapsed = _read_expecting_eio(mount.path("uncached.bin"))
    assert elapsed < FETCH_DEADLINE_SECONDS + EIO_MARGIN_SECONDS, f"EIO only after {elapsed:.1f}s"
    assert mount.alive
    # One read, one wait: the kernel's retry of its failed read-ahead is
    # refused at once, not given a deadline of its own. And the log says why.
    assert metric(mount, "cachefsd_fetch_errors_total") == 1
    log = (mount.cache_dir / "cachefsd.log").read_text()
    assert "read of uncached.bin block 0 failed: uncached.bin: gave up after" in log, log

    drop_page_cache()
    data, elapsed = _timed_read(mount.path("cached.bin"))
    assert data == objects["cached.bin"]
    assert elapsed < CACHED_READ_SECONDS, f"a cached read took {elapsed:.1f}s while the bucket hangs"

    outage_server.latency_seconds = 0.0
    assert mount.path("uncached.bin").read_bytes() == objects["uncached.bin"]


def test_reads_waiting_on_a_hanging_server_leave_the_cached_ones_served(
    outage_server: S3TestServer, s3_client: Any, mounter: MountFactory
) -> None:
    """More reads wait on the bucket than the workers that serve at a time
    (``SERVING_WORKERS``): each hands its turn on, so none of them holds up
    a cached read."""
    waiting = SERVING_WORKERS + 2
    objects = {f"uncached-{n}.bin": os.urandom(100 * KiB) for n in range(waiting)}
    objects["cached.bin"] = os.urandom(200 * KiB)
    bucket = _new_bucket(s3_client, objects)
    mount = _mount_for_outage(mounter, outage_server, bucket)
    assert mount.path("cached.bin").read_bytes() == objects["cached.bin"]
    drop_page_cache()

    outage_server.latency_seconds = FETCH_DEADLINE_SECONDS + EIO_MARGIN_SECONDS + 5
    with concurrent.futures.ThreadPoolExecutor(waiting) as pool:
        failed = [pool.submit(_read_expecting_eio, mount.path(f"uncached-{n}.bin")) for n in range(waiting)]
        wait_until(
            lambda: outage_server.counter.in_flight("get_object") >= waiting,
            f"{waiting} GETs waiting on the server at once",
            FETCH_DEADLINE_SECONDS,
        )
        data, elapsed = _timed_read(mount.path("cached.bin"))
        assert data == objects["cached.bin"]
        assert elapsed < CACHED_READ_SECONDS, f"a cached read took {elapsed:.1f}s behind {waiting} hung reads"
        for read in failed:
            assert read.result() < FETCH_DEADLINE_SECONDS + EIO_MARGIN_SECONDS
    assert mount.alive


# -- block files rot on disk -----------------------------------------------------------------


def _flip_payload_byte(block_file: Path) -> None:
    content = bytearray(block_file.read_bytes())
    content[len(content) // 2] ^= 0xFF
    with open(block_file, "r+b") as handle:  # in place: same size, so start-up keeps the row
        handle.write(content)


def _truncate_tail(block_file: Path) -> None:
    """A torn write's last bytes: the file still fills the same allocation
    units, so only its exact length (which start-up checks against its row)
    and its hash can tell."""
    size = block_file.stat().st_size
    assert disk_bytes(size - 8) == disk_bytes(size)
    os.truncate(block_file, size - 8)


def _truncate_half(block_file: Path) -> None:
    os.truncate(block_file, block_file.stat().st_size // 2)


CORRUPTIONS: dict[str, Callable[[Path], None]] = {
    "flip": _flip_payload_byte,
    "truncate_tail": _truncate_tail,
    "truncate_half": _truncate_half,
}


# The corruption tests corrupt block files, without passthrough: then a
# file read to its end gets no whole file (``cache.whole``), made in the
# background beside its blocks and served instead of them.
NO_WHOLE_FILES = ("-o", "nopassthrough")


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_corrupt_block_on_disk_is_refetched_after_remount(
    corruption: str, s3_server: S3TestServer, s3_client: Any, mounter: MountFactory
) -> None:
    # Random bytes: four distinct blocks, so no block file is shared (dedup).
    original = os.urandom(1 * MiB)
    bucket = _new_bucket(s3_client, {"file.bin": original})
    flags = (*NO_WHOLE_FILES, "--endpoint-url", s3_server.endpoint_url, "--block-size", "256K")
    mount = mounter(f"s3://{bucket}", *flags)
    assert mount.path("file.bin").read_bytes() == original
    mount.unmount()

    block_files = _block_files(mount.cache_dir)
    assert len(block_files) == 4
    victim = random.choice(block_files)
    CORRUPTIONS[corruption](victim)

    s3_server.reset_counts()
    mount = mounter(f"s3://{bucket}", *flags, cache_dir=mount.cache_dir)
    assert mount.path("file.bin").read_bytes() == original
    # Exactly the bad block went back to the bucket; the three good ones came from disk.
    assert s3_server.get_object_count == 1
    if corruption == "flip":
        # A file that still has its recorded length is caught by its hash on
        # read (a shorter one is already dropped by start-up's reconcile).
        assert metric(mount, "cachefsd_cache_corrupt_blocks_total") >= 1
    drop_page_cache()
    assert mount.path("file.bin").read_bytes() == original


def test_corrupt_block_while_mounted_is_never_served(tmp_path: Path, mounter: MountFactory) -> None:
    """Corrupt block files under a live daemon, push them out of its memory
    buffer by reading more than it holds, and read again."""
    source = tmp_path / "src"
    source.mkdir()
    original = os.urandom(1 * MiB)
    (source / "target.bin").write_bytes(original)
    # More than the daemon's 64 MiB buffer of decoded blocks.
    filler = {f"filler-{i}.bin": os.urandom(8 * MiB) for i in range(10)}
    for name, body in filler.items():
        (source / name).write_bytes(body)
    mount = mounter(str(source), *NO_WHOLE_FILES, "--block-size", "256K")
    assert mount.path("target.bin").read_bytes() == original
    target_blocks = set(_block_files(mount.cache_dir))
    assert len(target_blocks) == 4

    flipped, truncated, *_ = sorted(target_blocks)
    _flip_payload_byte(flipped)
    _truncate_tail(truncated)
    for name, body in filler.items():
        assert mount.path(name).read_bytes() == body
    drop_page_cache()
    assert mount.path("target.bin").read_bytes() == original
    assert metric(mount, "cachefsd_cache_corrupt_blocks_total") >= 2
    assert mount.alive


# -- kill -9 mid-read --------------------------------------------------------------------------

# Kill once the readers got this far: files have been read whole, admissions
# and evictions are under way, and most of the dataset is still to be fetched.
KILL_AFTER_READ_BYTES = 8 * MiB
KILL_AFTER_EVICTIONS = 8


def _churning(mount: Mount) -> bool:
    """True once the readers have read a few files and the cache has evicted
    a few blocks under them."""
    return (
        metric(mount, "cachefsd_read_bytes_total") >= KILL_AFTER_READ_BYTES
        and metric(mount, "cachefsd_cache_evictions_total") >= KILL_AFTER_EVICTIONS
    )


def _check_cache_dir(cache_dir: Path, capacity: int) -> None:
    """The on-disk invariants after a clean unmount: no temp files, every
    block file (bare content: the single tier is raw) holds the content its
    name claims, capacity kept."""
    assert list((cache_dir / "tmp").iterdir()) == []
    block_files = _block_files(cache_dir)
    assert block_files, "the cache holds no blocks at all"
    for block_file in block_files:
        try:
            decode_file(block_file.read_bytes(), Codec.RAW, block_file.name)
        except CorruptBlock as exc:
            pytest.fail(f"{block_file} does not decode: {exc}")
    on_disk = sum(disk_bytes(path.stat().st_size) for path in block_files)
    assert on_disk <= capacity, f"{on_disk} bytes of blocks in a {capacity}-byte cache"


def test_sigkill_during_heavy_reads_never_serves_wrong_bytes(
    tmp_path: Path, s3_server: S3TestServer, s3_client: Any, mounter: MountFactory
) -> None:
    objects = {f"shard-{i:02d}.bin": os.urandom(1 * MiB) for i in range(40)}
    bucket = _new_bucket(s3_client, objects)
    manifest = tmp_path / "manifest.txt"
    write_manifest(manifest, objects)
    capacity = 12 * MiB  # under a third of the dataset: admissions keep evicting
    flags = ("--endpoint-url", s3_server.endpoint_url, "--block-size", "256K", "--cache-size", "12M")
    cache_dir = tmp_path / "cache"
    new_mount = functools.partial(mounter, f"s3://{bucket}", *flags, cache_dir=cache_dir)

    for round_number in range(KILL_ROUNDS):
        kill_round(new_mount, manifest, round_number, _churning, "evictions under the readers")
        mount = new_mount()
        assert_reads_right(mount, objects, f"after kill -9 number {round_number + 1}")
        mount.unmount()

    _check_cache_dir(cache_dir, capacity)


# -- the cache disk fills up -----------------------------------------------------------------


# One O_DIRECT read request: a few blocks, like a loader's read.
DIRECT_READ_BYTES = 1 * MiB


def _read_direct(path: Path) -> bytes:
    """The whole file through O_DIRECT: every read reaches the daemon, and a
    failed read is not retried behind our back (the kernel retries a failed
    readahead with a plain read, which can hide an EIO)."""
    buffer = mmap.mmap(-1, DIRECT_READ_BYTES)  # page-aligned, as O_DIRECT may require
    pieces = []
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        offset = 0
        while count := os.preadv(fd, [buffer], offset):
            pieces.append(buffer[:count])
            offset += count
    finally:
        os.close(fd)
        buffer.close()
    return b"".join(pieces)


@contextlib.contextmanager
def _tiny_disk(path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs at ``path``, owner-only as a cache directory must be;
    unmounted afterwards."""
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M,mode=0700", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_new_cache_on_a_full_disk_fails_the_mount_saying_so(tmp_path: Path) -> None:
    """The lock file's pid could not be written: "unexpected error: [Errno
    28]". The pid is only for messages; the index names the cause."""
    source, mountpoint = tmp_path / "src", tmp_path / "mnt"
    source.mkdir()
    mountpoint.mkdir()
    with _tiny_disk(tmp_path / "tiny") as disk:
        with contextlib.suppress(OSError), open(disk / "filler", "wb") as filler:
            while True:
                filler.write(b"\0" * 65536)
        cache_dir = disk / "cache"
        cache_dir.mkdir(mode=0o700)
        result = run_cli("mount", str(source), str(mountpoint), "--cache-dir", str(cache_dir), "--no-metrics")
    assert result.returncode != 0
    assert not os.path.ismount(mountpoint)
    assert "Traceback" not in result.stderr, result.stderr
    assert "unexpected error" not in result.stderr, result.stderr
    assert "its disk is full" in result.stderr, result.stderr


def test_full_cache_disk_falls_back_to_the_network(
    tmp_path: Path, s3_server: S3TestServer, s3_client: Any, mounter: MountFactory
) -> None:
    """The blocks and the index share a 1 MiB disk: block writes and index
    commits fail with "disk full", and every read still succeeds."""
    # Multi-block objects, then one-page ones, fill the disk with blocks and
    # index commits; then copies of those objects under other keys need no
    # new block file, only an index commit, which finds the disk full.
    unique = {f"large/{i}.bin": os.urandom(256 * KiB) for i in range(6)}
    unique.update({f"small/{i:02d}.bin": os.urandom(KiB + i) for i in range(96)})
    objects = {**unique, **{f"copy/{key}": body for key, body in unique.items()}}
    bucket = _new_bucket(s3_client, objects)
    flags = ("--endpoint-url", s3_server.endpoint_url, "--block-size", "64K", "--cache-size", "64M")
    mount: Mount | None = None
    with _tiny_disk(tmp_path / "tiny") as cache_dir:
        try:
            mount = mounter(f"s3://{bucket}", *flags, cache_dir=cache_dir)
            for _ in range(2):
                for name, body in objects.items():
                    assert _read_direct(mount.path(name)) == body, f"{name} wrong on a full cache disk"
            for name, body in objects.items():
                assert mount.path(name).read_bytes() == body
            # The disk did fill: index commits failed (block writes mostly do
            # not, as a tier stays within its filesystem's free space).
            assert "database or disk is full" in (cache_dir / "cachefsd.log").read_text()
            assert mount.alive
            mount.unmount()
            # The cache left room on the disk it filled: the maintenance
            # commands and the next mount run on it, without a hand clean-up.
            # Index rows the full disk kept from being dropped are reported;
            # a repair that cannot drop them (the index's disk is still full)
            # says so and fails, and never claims it did.
            result = run_cli("verify", "--cache-dir", str(cache_dir))
            assert result.stdout.startswith("checked "), result.stdout + result.stderr
            found_bad = any(line.startswith(("corrupt ", "missing ")) for line in result.stdout.splitlines())
            assert result.returncode == (1 if found_bad else 0), result.stdout + result.stderr
            result = run_cli("verify", "--repair", "--cache-dir", str(cache_dir))
            assert "Traceback" not in result.stderr, result.stderr
            not_repaired = "not repaired: " in result.stdout
            assert result.returncode == (1 if not_repaired else 0), result.stdout + result.stderr
            result = run_cli("gc", "--cache-dir", str(cache_dir))
            assert result.returncode == 0, result.stdout + result.stderr
            mount = mounter(f"s3://{bucket}", *flags, cache_dir=cache_dir)
            for name, body in objects.items():
                assert mount.path(name).read_bytes() == body
            mount.unmount()
        finally:
            if mount is not None:
                force_unmount(mount.mountpoint)


def test_an_index_disk_filled_while_no_daemon_runs_is_named(
    tmp_path: Path, s3_server: S3TestServer, s3_client: Any, mounter: MountFactory
) -> None:
    """sqlite cannot create its write-ahead log on a disk something else
    filled after a clean unmount, and says only "disk I/O error"."""
    bucket = _new_bucket(s3_client, {"a.bin": b"a" * KiB})
    flags = ("--endpoint-url", s3_server.endpoint_url, "--hot", str(tmp_path / "hot"), "--hot-size", "8M")
    with _tiny_disk(tmp_path / "index-disk") as cache_dir:
        try:
            mount = mounter(f"s3://{bucket}", *flags, cache_dir=cache_dir)
            assert mount.path("a.bin").read_bytes() == b"a" * KiB
            mount.unmount()
            with open(cache_dir / "filler", "wb", buffering=0) as filler:
                for chunk in (65536, 4096, 512):
                    with contextlib.suppress(OSError):  # ENOSPC: on to a smaller chunk, to the last byte
                        while filler.write(b"\0" * chunk):
                            pass
            again = ("mount", f"s3://{bucket}", str(mount.mountpoint), "--cache-dir", str(cache_dir), *flags)
            result = run_cli(*again, "--no-metrics")
            assert result.returncode != 0
            assert "cache.dir: cannot open the index" in result.stderr
            assert "its disk is full: free space on it, or give another --cache-dir" in result.stderr
        finally:
            force_unmount(tmp_path / "mnt")


# -- a cache directory held by another process ---------------------------------------------

# Holds a cache directory's lock as an offline stage, `verify` or another
# user's daemon does: no state file this user's mount could join.
_HOLD_LOCK = (
    "import pathlib, sys\n"
    "from cachefsd.cache.lock import CacheDirLock\n"
    "CacheDirLock(pathlib.Path(sys.argv[1]))\n"
    "print('locked', flush=True)\n"
    "sys.stdin.read()\n"
)


def test_a_mount_on_a_cache_dir_another_process_holds_fails_in_one_line(tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    (source / "x.bin").write_bytes(b"x" * 1000)
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_LOCK, str(cache_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        readable, _, _ = select.select([holder.stdout], [], [], 30)
        assert readable, "the lock holder did not start"
        assert holder.stdout.readline() == "locked\n"
        started = time.monotonic()
        try:
            result = run_cli(
                "mount", str(source), str(mountpoint), "--cache-dir", str(cache_dir), "--no-metrics",
                timeout=LOCK_WAIT_SECONDS + 30,
            )  # fmt: skip
        finally:
            force_unmount(mountpoint)
        elapsed = time.monotonic() - started
    finally:
        holder.kill()
        holder.wait(timeout=30)

    assert result.returncode != 0
    assert not os.path.ismount(mountpoint)
    message = result.stderr.strip()
    assert "\n" not in message, message
    assert message.startswith(f"cachefsd: error: cache.dir: {cache_dir} is in use by pid {holder.pid}"), (
        message
    )
    assert "give another --cache-dir" in message
    assert elapsed < LOCK_WAIT_SECONDS + 15, f"refused only after {elapsed:.1f}s"
