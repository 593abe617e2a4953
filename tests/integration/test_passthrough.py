"""FUSE passthrough on real mounts (root, Linux 6.9+): a file cached whole
in the hot tier is opened on its cache file, and the kernel reads it itself.

"The daemon sees no READ" is checked after the page cache is dropped, so a
READ could not be saved by pages the kernel kept for the mounted file:
``cachefsd_fuse_requests_total{operation="read"}`` must not move while the
bytes come back right by ``read``, ``mmap`` and ``sendfile``.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest

from cachefsd.fuse.passthrough import JUDGED_OPENS
from cachefsd.testing.s3_server import S3TestServer
from tests.integration.conftest import Mount, MountFactory, drop_page_cache, force_unmount, run_cli
from tests.integration.datasets import KiB, new_bucket, put_objects
from tests.integration.torture import metric
from tests.polling import wait_until

SAMPLE = 100 * KiB  # one block at the default block size: an image-sized file
SMALL_BLOCK = 64 * KiB  # the smallest block size: a file of several blocks stays small
# Errors a reader may get from a mount whose daemon was killed.
DEAD_MOUNT_ERRNOS = {errno.ENOTCONN, errno.ECONNABORTED, errno.EIO}
POLL_SECONDS = 60.0


def answered(mount: Mount, operation: str = "read") -> float:
    """Requests of ``operation`` the daemon answered."""
    series = f"cachefsd_fuse_requests_total{{mount={mount.mountpoint},operation={operation}}}"
    return mount.metrics().get(series, 0.0)


def counted(mount: Mount) -> None:
    """Wait until every request answered so far is counted: the native plane
    reports in batches, in order, and a directory read now (READDIRPLUS,
    which it answers, and the kernel waits for) is counted after them all."""
    before = answered(mount, "readdirplus")
    os.listdir(mount.mountpoint)
    wait_until(lambda: answered(mount, "readdirplus") > before, "the reports to be counted", POLL_SECONDS)


def passthrough_state(mount: Mount) -> str:
    result = run_cli("stats", str(mount.mountpoint), "--json")
    assert result.returncode == 0, result.stderr
    state: str = json.loads(result.stdout)["mount"]["passthrough"]
    return state


def by_read(path: Path) -> bytes:
    with path.open("rb") as file:
        return file.read()


def by_mmap(path: Path) -> bytes:
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, prot=mmap.PROT_READ) as mapped:
        return bytes(mapped)


def by_sendfile(path: Path, scratch: Path) -> bytes:
    size = path.stat().st_size
    with path.open("rb") as source, scratch.open("w+b") as target:
        sent = 0
        while sent < size:
            done = os.sendfile(target.fileno(), source.fileno(), sent, size - sent)
            assert done > 0
            sent += done
        target.seek(0)
        return target.read()


@pytest.fixture(name="samples")
def fixture_samples(s3_client: Any) -> tuple[str, dict[str, bytes]]:
    bucket = new_bucket(s3_client, "through")
    objects = {f"img-{number}.jpg": os.urandom(SAMPLE + number) for number in range(6)}
    put_objects(s3_client, bucket, objects)
    return bucket, objects


def mount_samples(
    mounter: MountFactory, s3_server: S3TestServer, bucket: str, *flags: str, **kwargs: Any
) -> Mount:
    return mounter(f"s3://{bucket}", "--endpoint-url", s3_server.endpoint_url, *flags, **kwargs)


def test_a_cached_file_is_read_by_the_kernel_by_read_mmap_and_sendfile(
    tmp_path: Path, mounter: MountFactory, s3_server: S3TestServer, samples: tuple[str, dict[str, bytes]]
) -> None:
    bucket, objects = samples
    mount = mount_samples(mounter, s3_server, bucket)
    assert passthrough_state(mount) == "on"
    assert metric(mount, "cachefsd_passthrough") == 1
    for name, data in objects.items():
        assert by_read(mount.path(name)) == data  # cold: the daemon reads it, and caches it whole
    hot_before = mount.metrics()["cachefsd_served_bytes_total{tier=hot}"]
    drop_page_cache()
    counted(mount)
    reads = answered(mount)
    for name, data in objects.items():
        assert by_read(mount.path(name)) == data, name
        assert by_mmap(mount.path(name)) == data, name
        assert by_sendfile(mount.path(name), tmp_path / "sent") == data, name
    counted(mount)
    assert answered(mount) == reads
    # Each open counted as a read of the whole file from the hot tier.
    hot_after = mount.metrics()["cachefsd_served_bytes_total{tier=hot}"]
    assert hot_after - hot_before == 3 * sum(len(data) for data in objects.values())


def test_a_file_open_from_its_cold_read_keeps_new_opens_off_passthrough_until_it_closes(
    mounter: MountFactory, s3_server: S3TestServer, samples: tuple[str, dict[str, bytes]]
) -> None:
    """The kernel refuses a passthrough open of an inode with an open in
    cached mode: a new open while the cold one is open is a cached one."""
    bucket, objects = samples
    mount = mount_samples(mounter, s3_server, bucket)
    name, data = next(iter(objects.items()))
    with mount.path(name).open("rb") as cold:
        assert cold.read() == data
        assert by_read(mount.path(name)) == data  # cached by now, but opened in cached mode
        assert by_mmap(mount.path(name)) == data
    drop_page_cache()
    counted(mount)
    reads = answered(mount)
    with mount.path(name).open("rb") as first, mount.path(name).open("rb") as second:
        assert first.read() == data
        assert second.read() == data  # the second passthrough open shares the first's backing file
    counted(mount)
    assert answered(mount) == reads


def test_a_file_of_several_blocks_read_to_its_end_is_then_read_by_the_kernel_from_its_whole_file(
    mounter: MountFactory, s3_server: S3TestServer, s3_client: Any
) -> None:
    """A shard larger than a block: its cold read goes through the daemon,
    and having reached the end has the blocks made one whole file, which
    the next open hands the kernel."""
    bucket = new_bucket(s3_client, "shards")
    data = os.urandom(3 * SMALL_BLOCK - 1000)  # three blocks, the last one short
    put_objects(s3_client, bucket, {"shard.tar": data})
    mount = mount_samples(mounter, s3_server, bucket, "--block-size", str(SMALL_BLOCK))
    path = mount.path("shard.tar")
    counted(mount)
    reads = answered(mount)
    assert by_read(path) == data
    counted(mount)
    assert answered(mount) > reads  # cold: the daemon served it
    wait_until(
        lambda: metric(mount, "cachefsd_whole_files_total") == 1, "the whole file is made", POLL_SECONDS
    )
    drop_page_cache()
    counted(mount)
    reads = answered(mount)
    assert by_read(path) == data
    assert by_mmap(path) == data
    counted(mount)
    assert answered(mount) == reads


def test_passthrough_turned_off_serves_the_same_bytes_through_the_daemon(
    mounter: MountFactory, s3_server: S3TestServer, samples: tuple[str, dict[str, bytes]]
) -> None:
    bucket, objects = samples
    mount = mount_samples(mounter, s3_server, bucket, "-o", "nopassthrough")
    assert passthrough_state(mount) == "off: turned off (fuse.passthrough = false)"
    assert metric(mount, "cachefsd_passthrough") == 0
    for name, data in objects.items():
        assert by_read(mount.path(name)) == data
    drop_page_cache()
    counted(mount)
    reads = answered(mount)
    for name, data in objects.items():
        assert by_mmap(mount.path(name)) == data
    counted(mount)
    assert answered(mount) > reads  # the daemon served them (a page the drop left needs no READ)


def test_kill_9_during_passthrough_reads_leaves_a_cache_verify_finds_clean(
    tmp_path: Path, mounter: MountFactory, s3_server: S3TestServer, samples: tuple[str, dict[str, bytes]]
) -> None:
    bucket, objects = samples
    cache_dir = tmp_path / "cache"
    mount = mount_samples(mounter, s3_server, bucket, cache_dir=cache_dir)
    for name, data in objects.items():
        assert by_read(mount.path(name)) == data
    wrong: list[str] = []
    rounds = [0]
    stop = threading.Event()

    def read_in_turn() -> None:
        while not stop.is_set():
            for name, data in objects.items():
                try:
                    if by_read(mount.path(name)) != data:
                        wrong.append(name)
                except OSError as exc:
                    if exc.errno not in DEAD_MOUNT_ERRNOS:
                        wrong.append(f"{name}: {exc}")
            rounds[0] += 1

    readers = [threading.Thread(target=read_in_turn) for _ in range(3)]
    for reader in readers:
        reader.start()
    try:
        wait_until(lambda: rounds[0] >= 20, "readers going round", POLL_SECONDS)
        os.kill(mount.pid, signal.SIGKILL)
        wait_until(lambda: not mount.alive, "the daemon gone", POLL_SECONDS)
    finally:
        stop.set()
        for reader in readers:
            reader.join(POLL_SECONDS)
    assert wrong == []
    force_unmount(mount.mountpoint)
    again = mount_samples(mounter, s3_server, bucket, cache_dir=cache_dir)
    for name, data in objects.items():
        assert by_read(again.path(name)) == data
    again.unmount()
    result = run_cli("verify", "--cache-dir", str(cache_dir))
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_mount_of_small_files_gives_up_open_requests_after_judging_its_first_opens(
    s3_client: Any, mounter: MountFactory, s3_server: S3TestServer
) -> None:
    """An OPEN and a RELEASE cost more than the one READ a file of one read
    saves: once the first opens show small files, the kernel opens them
    without asking, and keeps their pages across opens."""
    bucket = new_bucket(s3_client, "small")
    objects = {f"img-{number:03d}.jpg": os.urandom(4 * KiB) for number in range(JUDGED_OPENS + 8)}
    put_objects(s3_client, bucket, objects)
    mount = mount_samples(mounter, s3_server, bucket)
    names = sorted(objects)
    for name in names[:JUDGED_OPENS]:
        assert by_read(mount.path(name)) == objects[name]
    assert passthrough_state(mount).startswith(f"off: most of the first {JUDGED_OPENS} files opened")
    assert metric(mount, "cachefsd_passthrough") == 0
    counted(mount)
    opens = answered(mount, "open")
    for name in names:
        assert by_read(mount.path(name)) == objects[name]
    counted(mount)
    assert answered(mount, "open") == opens


def test_a_file_open_in_passthrough_when_it_is_given_up_opens_again_until_it_closes(
    s3_client: Any, mounter: MountFactory, s3_server: S3TestServer
) -> None:
    """The kernel fails a cached open of an inode open in passthrough: a
    mount that gives passthrough up still answers OPEN, by the rules, until
    its last passthrough file closes, and only then stops being asked."""
    bucket = new_bucket(s3_client, "given-up")
    shard = os.urandom(3 * SMALL_BLOCK - 1000)
    images = {f"img-{number:03d}.jpg": os.urandom(4 * KiB) for number in range(JUDGED_OPENS)}
    put_objects(s3_client, bucket, {"shard.tar": shard, **images})
    mount = mount_samples(mounter, s3_server, bucket, "--block-size", str(SMALL_BLOCK))
    path = mount.path("shard.tar")
    assert by_read(path) == shard
    wait_until(
        lambda: metric(mount, "cachefsd_whole_files_total") == 1, "the whole file is made", POLL_SECONDS
    )
    with path.open("rb") as held:  # in passthrough, and counted among the judged opens
        for name in sorted(images)[: JUDGED_OPENS - 1]:
            assert by_read(mount.path(name)) == images[name]
        assert passthrough_state(mount).startswith("off: most of the first")
        assert by_read(path) == shard  # a second open of the inode held in passthrough
        assert held.read() == shard
    opened = JUDGED_OPENS + 2  # the shard three times, the images but one
    wait_until(lambda: answered(mount, "release") >= opened, "every open to be released", POLL_SECONDS)
    counted(mount)
    assert answered(mount, "open") == opened
    assert by_read(mount.path("img-000.jpg")) == images["img-000.jpg"]  # asked once more: ENOSYS
    assert by_read(mount.path("img-001.jpg")) == images["img-001.jpg"]
    assert by_read(path) == shard
    counted(mount)
    assert answered(mount, "open") == opened + 1
