"""Real mounts of a moto S3 bucket over HTTP: what a training job sees.

Each test seeds its own bucket, mounts it through the ``cachefsd`` CLI and
checks the mount against the bucket: names, bytes, errors, consistency after
upstream changes, the cache across remounts, metrics and the capacity bound.
Waits on the daemon are bounded polls, never fixed sleeps.
"""

from __future__ import annotations

import errno
import multiprocessing
import os
import random
import select
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from io import BytesIO
from pathlib import Path
from typing import Any

import boto3
import pytest

from cachefsd.cache.tier import disk_bytes
from cachefsd.testing.counting import GET_OBJECT, HEAD_OBJECT, LIST, OTHER, PUT_OBJECT
from cachefsd.testing.s3_server import S3TestServer
from tests.conftest import TEST_REGION
from tests.integration.conftest import Mount, MountFactory
from tests.integration.datasets import (
    KiB,
    MiB,
    RawFileDataset,
    bucket_state,
    collate_list,
    file_sha256,
    hash_files,
    mmap_slices,
    new_bucket,
    put_objects,
    put_objects_in_process,
    sha256,
    walk_files,
)
from tests.polling import wait_until

# The smallest block size the daemon accepts: multi-block files stay small.
BLOCK = 64 * KiB
BLOCK_FLAG = ("--block-size", "64K")
# Upper bound on how long an upstream change may take to show through a
# mount with a 1 s metadata TTL (TTL, the kernel's attribute timeout, slack
# for a loaded 2-core machine).
CONSISTENCY_DEADLINE_SECONDS = 10.0
SERVER_START_SECONDS = 30.0

MountBucket = Callable[..., Mount]


@pytest.fixture(name="mount_bucket")
def fixture_mount_bucket(mounter: MountFactory, s3_server: S3TestServer) -> MountBucket:
    """``mount_bucket(bucket, *flags, prefix="", name=..., cache_dir=...)``."""

    def mount(bucket: str, *flags: str, prefix: str = "", **kwargs: Any) -> Mount:
        source = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        return mounter(source, "--endpoint-url", s3_server.endpoint_url, *flags, **kwargs)

    return mount


def read_or_errno(path: Path) -> bytes | int:
    """The file's bytes through a fresh open, or the errno it failed with."""
    try:
        return path.read_bytes()
    except OSError as exc:
        return exc.errno or -1


def seeded(seed: int, sizes: dict[str, int]) -> dict[str, bytes]:
    rng = random.Random(seed)
    return {key: rng.randbytes(size) for key, size in sizes.items()}


# -- names and bytes -------------------------------------------------------------


@pytest.mark.parametrize("prefix", ["", "data"])
def test_listing_and_bytes_equal_the_bucket(s3_client: Any, mount_bucket: MountBucket, prefix: str) -> None:
    bucket = new_bucket(s3_client)
    relative = {
        "top.bin": 10 * KiB,
        "a/one.bin": 1,
        "a/b/two.bin": 70 * KiB,
        "a/b/c/d/deep.bin": 3 * KiB,
        "e/f/three.bin": 5 * KiB,
        "e/four.bin": 200 * KiB,
    }
    objects = seeded(1, relative)
    root = f"{prefix}/" if prefix else ""
    put_objects(s3_client, bucket, {root + key: data for key, data in objects.items()})
    if prefix:
        put_objects(s3_client, bucket, {"outside/skip.bin": b"not under the prefix", "datafile": b"no"})

    mount = mount_bucket(bucket, *BLOCK_FLAG, prefix=prefix)

    assert walk_files(mount.mountpoint) == set(objects)
    for key, data in objects.items():
        path = mount.path(key)
        assert path.stat().st_size == len(data), key
        assert file_sha256(path) == sha256(data), key
    assert sorted(os.listdir(mount.mountpoint)) == sorted({key.split("/")[0] for key in objects})
    # Inode numbers are the same in readdir and stat, and after the kernel
    # forgot the nodes (tools key on device and inode).
    inodes = {entry.name: entry.inode() for entry in os.scandir(mount.path("e"))}
    Path("/proc/sys/vm/drop_caches").write_text("2\n")
    assert inodes == {name: mount.path(f"e/{name}").stat().st_ino for name in inodes}
    assert len(set(inodes.values())) == len(inodes) == 2
    # df lists it (a filesystem of no size is left out, as pseudo filesystems are).
    # Its exit status is not ours: any dead FUSE mount elsewhere on the machine fails it.
    df = subprocess.run(["df", "--output=target"], capture_output=True, text=True, timeout=30, check=False)
    assert str(mount.mountpoint) in df.stdout.split(), df.stderr


def test_random_preads_match_the_object(s3_client: Any, mount_bucket: MountBucket) -> None:
    bucket = new_bucket(s3_client)
    sizes = {
        "empty": 0,
        "one": 1,
        "page": 4095,
        "block-minus-one": BLOCK - 1,
        "block": BLOCK,
        "block-plus-one": BLOCK + 1,
        "three-blocks": 3 * BLOCK + 123,
        "sixteen-blocks": 16 * BLOCK + 17,
    }
    objects = seeded(2, sizes)
    put_objects(s3_client, bucket, objects)
    mount = mount_bucket(bucket, *BLOCK_FLAG)

    rng = random.Random(3)
    fds = {key: os.open(mount.path(key), os.O_RDONLY) for key in objects}
    try:
        for _ in range(1000):
            key = rng.choice(list(objects))
            data = objects[key]
            if rng.random() < 0.3:
                # Straddle a block boundary (or the end of the object).
                boundary = rng.randrange(0, len(data) // BLOCK + 2) * BLOCK
                offset = max(0, boundary - rng.randrange(1, 4 * KiB))
            else:
                offset = rng.randrange(0, len(data) + 2 * BLOCK)
            length = rng.choice([1, rng.randrange(1, 8 * KiB), rng.randrange(1, 3 * BLOCK)])
            got = os.pread(fds[key], length, offset)
            assert got == data[offset : offset + length], (key, offset, length)
    finally:
        for fd in fds.values():
            os.close(fd)


def test_threads_and_processes_read_at_once(s3_client: Any, mount_bucket: MountBucket) -> None:
    bucket = new_bucket(s3_client)
    objects = seeded(4, {f"shard/{index}.bin": 6 * BLOCK + index * 1000 for index in range(6)})
    put_objects(s3_client, bucket, objects)
    expected = {key: sha256(data) for key, data in objects.items()}
    mount = mount_bucket(bucket, *BLOCK_FLAG)
    keys = sorted(objects)
    # Every reader starts on file 0 (same file, cold, at once), then walks
    # all files from its own starting point (different files).
    orders = [[keys[0], *keys[i % len(keys) :], *keys[: i % len(keys)]] for i in range(12)]

    def paths(order: list[str]) -> list[str]:
        return [str(mount.path(key)) for key in order]

    with (
        ProcessPoolExecutor(4, mp_context=multiprocessing.get_context("spawn")) as processes,
        ThreadPoolExecutor(8) as threads,
    ):
        in_processes = [processes.submit(hash_files, paths(order)) for order in orders[:4]]
        in_threads = [threads.submit(hash_files, paths(order)) for order in orders[4:]]
        results = [future.result(timeout=120) for future in in_threads + in_processes]

    for result in results:
        assert {str(Path(path).relative_to(mount.mountpoint)): digest for path, digest in result.items()} == (
            expected
        )


def test_a_cold_read_for_every_loader_worker_is_in_flight_at_once(
    s3_client: Any, s3_server: S3TestServer, mount_bucket: MountBucket
) -> None:
    """A loader with 16 workers on a cold epoch: each read waits on a GET
    and holds a libfuse worker meanwhile, so there must be a worker for
    each (libfuse's default of 10 made the other six wait a round trip)."""
    readers = 16
    bucket = new_bucket(s3_client)
    objects = seeded(12, {f"cold/{index}.bin": 10 * KiB for index in range(readers)})
    put_objects(s3_client, bucket, objects)
    mount = mount_bucket(bucket, "--no-prefetch")
    assert len(os.listdir(mount.path("cold"))) == readers  # listed before any GET
    s3_server.reset_counts()
    s3_server.latency_seconds = 1.0  # every GET stays in flight while the others arrive
    try:
        with ThreadPoolExecutor(readers) as pool:
            got = list(pool.map(lambda key: mount.path(key).read_bytes(), objects))
    finally:
        s3_server.latency_seconds = 0.0
    assert got == list(objects.values())
    assert s3_server.peak_in_flight(GET_OBJECT) == readers


def test_mmap_returns_exact_bytes(s3_client: Any, mount_bucket: MountBucket) -> None:
    bucket = new_bucket(s3_client)
    data = seeded(5, {"weights.bin": 5 * BLOCK + 1234})["weights.bin"]
    put_objects(s3_client, bucket, {"weights.bin": data})
    mount = mount_bucket(bucket, *BLOCK_FLAG)

    # A slice across a block boundary first (faulting in a page past the
    # first block, cold), then the tail page, then all of it.
    slices = [(3 * BLOCK - 10, 3 * BLOCK + 10), (len(data) - 100, len(data)), (0, len(data))]
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as process:
        length, got = process.submit(mmap_slices, str(mount.path("weights.bin")), slices).result(timeout=120)
    assert length == len(data)
    for (start, end), piece in zip(slices, got, strict=True):
        assert piece == data[start:end], (start, end)


# -- loaders ---------------------------------------------------------------------


# Four workers on a two-core runner is the point (loaders oversubscribe I/O-bound workers).
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_dataloader_two_epochs_second_makes_no_get(
    s3_client: Any, s3_server: S3TestServer, mount_bucket: MountBucket
) -> None:
    from torch.utils.data import DataLoader  # noqa: PLC0415 - torch is slow to import

    bucket = new_bucket(s3_client)
    rng = random.Random(6)
    objects = {
        f"train/class_{label}/sample_{index:03d}.raw": rng.randbytes(rng.randrange(1, 80 * KiB))
        for label in range(4)
        for index in range(24)
    }
    put_objects(s3_client, bucket, objects)
    mount = mount_bucket(bucket)
    dataset = RawFileDataset(mount.path("train"))
    assert len(dataset) == len(objects)
    loader = DataLoader(dataset, batch_size=8, shuffle=True, num_workers=4, collate_fn=collate_list)

    def one_epoch() -> list[int]:
        seen = []
        for batch in loader:
            for index, label, data in batch:
                path, expected_label = dataset.samples[index]
                key = str(Path(path).relative_to(mount.mountpoint))
                assert label == expected_label
                assert data == objects[key], key
                seen.append(index)
        return seen

    s3_server.reset_counts()
    first = one_epoch()
    assert sorted(first) == list(range(len(objects)))
    assert s3_server.get_object_count > 0, "the first epoch must have read from the bucket"

    s3_server.reset_counts()
    second = one_epoch()
    assert sorted(second) == list(range(len(objects)))
    assert second != first, "shuffle=True should give the second epoch another order"
    assert s3_server.get_object_count == 0, s3_server.counts()


def test_webdataset_shards_yield_every_sample(s3_client: Any, mount_bucket: MountBucket) -> None:
    import webdataset as wds  # noqa: PLC0415 - pulls in torch

    bucket = new_bucket(s3_client)
    rng = random.Random(7)
    samples: dict[str, dict[str, bytes]] = {}
    shards: dict[str, bytes] = {}
    for shard in range(3):
        buffer = BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            for index in range(20):
                key = f"s{shard}_{index:04d}"
                sample = {
                    "cls": str(rng.randrange(10)).encode(),
                    "bin": rng.randbytes(rng.randrange(1, 40 * KiB)),
                }
                samples[key] = sample
                for extension, payload in sample.items():
                    member = tarfile.TarInfo(f"{key}.{extension}")
                    member.size = len(payload)
                    tar.addfile(member, BytesIO(payload))
        shards[f"shards/train-{shard:05d}.tar"] = buffer.getvalue()
    put_objects(s3_client, bucket, shards)
    mount = mount_bucket(bucket, *BLOCK_FLAG)

    urls = sorted(str(mount.path(key)) for key in shards)
    got: dict[str, dict[str, bytes]] = {}
    for sample in wds.WebDataset(urls, shardshuffle=False):
        key = sample["__key__"]
        assert key not in got, f"sample {key} yielded twice"
        got[key] = {"cls": sample["cls"], "bin": sample["bin"]}
    assert got == samples


# -- read-only, errors -----------------------------------------------------------


def test_every_write_path_is_erofs_and_the_bucket_is_unchanged(
    s3_client: Any, s3_server: S3TestServer, mount_bucket: MountBucket, tmp_path: Path
) -> None:
    bucket = new_bucket(s3_client)
    put_objects(
        s3_client,
        bucket,
        {"dir/file.txt": b"contents", "dir/sub/other.txt": b"more", "emptydir/": b"", "top.txt": b"top"},
    )
    before = bucket_state(s3_client, bucket)
    mount = mount_bucket(bucket)
    file, other, directory = mount.path("dir/file.txt"), mount.path("top.txt"), mount.path("emptydir")
    assert file.read_bytes() == b"contents"
    s3_server.reset_counts()

    def open_with(path: Path, flags: int) -> Callable[[], object]:
        def attempt() -> None:
            fd = os.open(path, flags, 0o644)
            os.close(fd)

        return attempt

    attempts: dict[str, Callable[[], object]] = {
        "create": open_with(mount.path("dir/new.txt"), os.O_WRONLY | os.O_CREAT | os.O_EXCL),
        "open O_WRONLY": open_with(file, os.O_WRONLY),
        "open O_RDWR": open_with(file, os.O_RDWR),
        "open O_APPEND": open_with(file, os.O_WRONLY | os.O_APPEND),
        "open O_TRUNC": open_with(file, os.O_WRONLY | os.O_TRUNC),
        "open O_RDONLY|O_TRUNC": open_with(file, os.O_RDONLY | os.O_TRUNC),
        "mkdir": lambda: os.mkdir(mount.path("dir/newdir")),
        "rmdir": lambda: os.rmdir(directory),
        "rmdir non-empty": lambda: os.rmdir(mount.path("dir/sub")),
        "unlink": lambda: os.unlink(file),
        "rename": lambda: os.rename(file, mount.path("dir/renamed.txt")),
        "rename over": lambda: os.rename(file, other),
        "rename dir": lambda: os.rename(mount.path("dir/sub"), mount.path("dir/sub2")),
        "symlink": lambda: os.symlink("file.txt", mount.path("dir/link")),
        "link": lambda: os.link(file, mount.path("dir/hardlink")),
        "mkfifo": lambda: os.mkfifo(mount.path("dir/fifo")),
        "chmod": lambda: os.chmod(file, 0o666),
        "chmod dir": lambda: os.chmod(directory, 0o777),
        "chown": lambda: os.chown(file, os.getuid(), os.getgid()),
        "utime": lambda: os.utime(file, (0, 0)),
        "utime now": lambda: os.utime(file),
        "setxattr": lambda: os.setxattr(file, "user.test", b"1"),
        "removexattr": lambda: os.removexattr(file, "user.test"),
        "truncate(path)": lambda: os.truncate(file, 0),
        "truncate(path) extend": lambda: os.truncate(file, 100),
    }
    wrong = {}
    for name, attempt in attempts.items():
        try:
            attempt()
        except OSError as exc:
            if exc.errno != errno.EROFS:
                wrong[name] = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        else:
            wrong[name] = "succeeded"
    assert wrong == {}

    # No writable descriptor can exist, so a write can only be tried on a
    # read-only one: the kernel refuses it before the daemon sees it.
    fd = os.open(file, os.O_RDONLY)
    try:
        with pytest.raises(OSError, match="Bad file descriptor"):
            os.write(fd, b"x")
        with pytest.raises(OSError, match=r"Read-only file system|Bad file descriptor|Invalid argument"):
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)

    assert file.read_bytes() == b"contents"
    assert walk_files(mount.mountpoint) == {"dir/file.txt", "dir/sub/other.txt", "top.txt"}
    counts = s3_server.counts()
    assert counts.get(PUT_OBJECT, 0) == 0, counts
    assert counts.get(OTHER, 0) == 0, counts
    assert bucket_state(s3_client, bucket) == before
    assert mount.alive


def test_missing_paths_are_enoent_and_files_are_not_directories(
    s3_client: Any, mount_bucket: MountBucket
) -> None:
    bucket = new_bucket(s3_client)
    put_objects(s3_client, bucket, {"dir/file.txt": b"contents"})
    mount = mount_bucket(bucket)

    enoent: list[Callable[[], object]] = [
        lambda: os.stat(mount.path("missing")),
        lambda: os.stat(mount.path("dir/missing.txt")),
        lambda: os.stat(mount.path("missing/deeper/file")),
        lambda: open(mount.path("dir/missing.txt"), "rb"),  # noqa: SIM115 - it must fail to open
        lambda: os.listdir(mount.path("missing")),
        lambda: os.listdir(mount.path("dir/missing")),
    ]
    for attempt in enoent:
        with pytest.raises(FileNotFoundError):
            attempt()

    enotdir: list[Callable[[], object]] = [
        lambda: os.stat(mount.path("dir/file.txt/x")),
        lambda: os.listdir(mount.path("dir/file.txt")),
        lambda: open(mount.path("dir/file.txt/x"), "rb"),  # noqa: SIM115 - it must fail to open
        lambda: os.scandir(mount.path("dir/file.txt")),
    ]
    for attempt in enotdir:
        with pytest.raises(NotADirectoryError):
            attempt()

    with pytest.raises(IsADirectoryError):
        mount.path("dir").read_bytes()
    assert mount.path("dir/file.txt").read_bytes() == b"contents"


# -- namespace edge cases --------------------------------------------------------


def test_namespace_edge_cases(s3_client: Any, mount_bucket: MountBucket) -> None:
    bucket = new_bucket(s3_client)
    name_255 = "n" * 251 + ".bin"
    unicode_255 = "é" * 127 + "a"  # 2 bytes a character in UTF-8
    visible = {
        "markers/full/a.txt": b"in a marked directory",
        "empty.bin": b"",
        "with space/file name.txt": b"spaces",
        "ünïcödé/日本語 файл.txt": b"unicode",
        f"long/{name_255}": b"255 bytes is NAME_MAX",
        f"long/{unicode_255}": b"255 bytes of UTF-8",
        "x/y": b"the directory wins",
    }
    hidden = {
        "markers/empty/": b"",
        "markers/full/": b"",
        "x": b"shadowed by the directory x/",
        f"long/n{name_255}": b"256 bytes",
        f"long/{unicode_255}b": b"256 bytes of UTF-8",
    }
    assert len(name_255.encode()) == 255
    assert len(unicode_255.encode()) == 255
    put_objects(s3_client, bucket, {**visible, **hidden})
    mount = mount_bucket(bucket)

    assert walk_files(mount.mountpoint) == set(visible)
    for key, data in visible.items():
        assert mount.path(key).stat().st_size == len(data), key
        assert mount.path(key).read_bytes() == data, key
    assert mount.path("markers/empty").is_dir()
    assert os.listdir(mount.path("markers/empty")) == []
    assert os.listdir(mount.path("markers/full")) == ["a.txt"]
    assert mount.path("x").is_dir()
    assert os.listdir(mount.path("x")) == ["y"]
    assert sorted(os.listdir(mount.path("long"))) == sorted([name_255, unicode_255])
    with open(mount.path("empty.bin"), "rb") as empty:
        assert empty.read() == b""
        assert os.pread(empty.fileno(), 10, 0) == b""
        assert os.pread(empty.fileno(), 10, 1000) == b""


def test_escaping_keys_never_become_paths(s3_client: Any, mount_bucket: MountBucket) -> None:
    bucket = new_bucket(s3_client)
    escaping = ["../evil", "/abs", "a//b", "a/./b", "a/../b", "./dot", "c/..", "c/."]
    put_objects(s3_client, bucket, dict.fromkeys(escaping, b"must not be reachable"))
    put_objects(s3_client, bucket, {"ok.txt": b"fine", "a/ok.txt": b"also fine"})
    mount = mount_bucket(bucket)

    # Listing every directory (twice, to be sure nothing broke in between) sees only valid names.
    for _ in range(2):
        assert walk_files(mount.mountpoint) == {"ok.txt", "a/ok.txt"}
    for directory, subdirs, files in os.walk(mount.mountpoint):
        for name in subdirs + files:
            assert name not in ("", ".", ".."), directory
            assert "/" not in name, (directory, name)
    assert sorted(os.listdir(mount.mountpoint)) == ["a", "c", "ok.txt"]
    assert os.listdir(mount.path("c")) == []
    assert not os.path.exists(os.path.join(mount.mountpoint, "a", "..", "b"))  # the kernel resolves ..
    assert not mount.path("dot").exists()

    assert mount.alive
    assert mount.path("ok.txt").read_bytes() == b"fine"
    assert mount.path("a/ok.txt").read_bytes() == b"also fine"


def test_listing_a_directory_of_10000_entries(s3_client: Any, mount_bucket: MountBucket) -> None:
    bucket = new_bucket(s3_client)
    names = {f"sample_{index:05d}.bin" for index in range(10_000)}
    put_objects_in_process(bucket, (f"many/{name}" for name in names), b"x")
    put_objects(s3_client, bucket, {"many/sample_00042.bin": b"read through the big directory"})
    mount = mount_bucket(bucket)

    started = time.monotonic()
    listed = os.listdir(mount.path("many"))
    assert len(listed) == len(names)
    assert set(listed) == names
    assert time.monotonic() - started < 60
    assert mount.path("many/sample_09999.bin").stat().st_size == 1
    assert mount.path("many/sample_00042.bin").read_bytes() == b"read through the big directory"


# -- consistency -----------------------------------------------------------------


def test_upstream_changes_show_after_the_metadata_ttl(s3_client: Any, mount_bucket: MountBucket) -> None:
    bucket = new_bucket(s3_client)
    old = seeded(8, {"changing.bin": 100 * KiB, "doomed.bin": 10 * KiB})
    put_objects(s3_client, bucket, old)
    mount = mount_bucket(bucket, *BLOCK_FLAG, "--metadata-ttl", "1s")
    changing, doomed, fresh = mount.path("changing.bin"), mount.path("doomed.bin"), mount.path("fresh.bin")
    assert changing.read_bytes() == old["changing.bin"]
    assert doomed.read_bytes() == old["doomed.bin"]
    assert not fresh.exists()

    new = seeded(9, {"changing.bin": 150 * KiB + 3})["changing.bin"]
    s3_client.put_object(Bucket=bucket, Key="changing.bin", Body=new)
    s3_client.delete_object(Bucket=bucket, Key="doomed.bin")
    s3_client.put_object(Bucket=bucket, Key="fresh.bin", Body=b"new object")

    wait_until(
        lambda: changing.stat().st_size == len(new) and read_or_errno(changing) == new,
        "the overwritten object shows its new size and bytes",
        CONSISTENCY_DEADLINE_SECONDS,
    )
    wait_until(lambda: not doomed.exists(), "the deleted object disappears", CONSISTENCY_DEADLINE_SECONDS)
    wait_until(fresh.exists, "the new object appears", CONSISTENCY_DEADLINE_SECONDS)
    assert fresh.read_bytes() == b"new object"
    assert "doomed.bin" not in os.listdir(mount.mountpoint)
    assert mount.alive


def test_a_new_object_opens_as_soon_as_it_is_listed(s3_client: Any, mount_bucket: MountBucket) -> None:
    """A "no such file" the kernel cached for a TTL of its own (counted from
    its lookup, after our listing was taken) hid a new object from open
    while ``ls`` already showed it."""
    bucket = new_bucket(s3_client)
    put_objects(s3_client, bucket, {"d/a.txt": b"a"})
    ttl = 4.0
    mount = mount_bucket(bucket, *BLOCK_FLAG, "--metadata-ttl", f"{ttl:g}s")
    directory, fresh = mount.path("d"), mount.path("d/new.txt")
    assert os.listdir(directory) == ["a.txt"]  # the listing is taken now
    listed_at = time.monotonic()
    s3_client.put_object(Bucket=bucket, Key="d/new.txt", Body=b"new")
    # Half a TTL later, a lookup of the name: a kernel that caches the
    # answer holds it half a TTL past the listing's refresh. (Time passing
    # is the subject here, not a wait for an event.)
    time.sleep(max(0.0, listed_at + ttl / 2 - time.monotonic()))
    assert time.monotonic() < listed_at + ttl, "the machine stalled past the TTL: the setup no longer holds"
    assert not fresh.exists()  # from the listing taken before the upload
    wait_until(lambda: "new.txt" in os.listdir(directory), "it listed", CONSISTENCY_DEADLINE_SECONDS)
    assert read_or_errno(fresh) == b"new"


def test_one_bucket_name_on_two_endpoints_is_two_sources(
    tmp_path: Path, s3_client: Any, s3_server: S3TestServer, mounter: MountFactory
) -> None:
    """A cache directory mounted for ``data`` on one endpoint, then for
    ``data`` on another (a MinIO, an emulator), showed the first one's
    listing: the cache keys sources by endpoint too."""
    bucket = new_bucket(s3_client)
    put_objects(s3_client, bucket, {"only-on-a.txt": b"a"})
    cache = tmp_path / "shared-cache"
    first = mounter(f"s3://{bucket}", "--endpoint-url", s3_server.endpoint_url, cache_dir=cache)
    assert os.listdir(first.mountpoint) == ["only-on-a.txt"]
    first.unmount()
    # Another process: moto's buckets are shared by every server in one.
    other = subprocess.Popen(
        [sys.executable, "-m", "cachefsd.testing.s3_server"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert other.stdout is not None
        readable, _, _ = select.select([other.stdout], [], [], SERVER_START_SECONDS)
        assert readable, "the second S3 server did not start"
        endpoint = other.stdout.readline().strip()
        other_client = boto3.client("s3", endpoint_url=endpoint, region_name=TEST_REGION)
        other_client.create_bucket(Bucket=bucket)
        other_client.put_object(Bucket=bucket, Key="only-on-b.txt", Body=b"b")
        second = mounter(f"s3://{bucket}", "--endpoint-url", endpoint, name="other", cache_dir=cache)
        assert os.listdir(second.mountpoint) == ["only-on-b.txt"]
        assert second.path("only-on-b.txt").read_bytes() == b"b"
        second.unmount()
    finally:
        other.terminate()
        other.wait(timeout=SERVER_START_SECONDS)


def test_an_open_handle_never_returns_bytes_of_a_newer_version(
    s3_client: Any, mount_bucket: MountBucket
) -> None:
    bucket = new_bucket(s3_client)
    size = 32 * BLOCK
    old = seeded(10, {"f.bin": size})["f.bin"]
    new = seeded(11, {"f.bin": size})["f.bin"]
    put_objects(s3_client, bucket, {"f.bin": old})
    mount = mount_bucket(bucket, *BLOCK_FLAG, "--metadata-ttl", "1s")
    path = mount.path("f.bin")

    outcomes = []
    fd = os.open(path, os.O_RDONLY)
    try:
        assert os.pread(fd, BLOCK, 0) == old[:BLOCK]
        s3_client.put_object(Bucket=bucket, Key="f.bin", Body=new)
        for offset in range(BLOCK, size, BLOCK):
            try:
                got = os.pread(fd, BLOCK, offset)
            except OSError as exc:
                outcomes.append(errno.errorcode.get(exc.errno or 0, str(exc)))
                continue
            assert got != new[offset : offset + BLOCK], f"bytes of the new version at {offset}"
            assert got == old[offset : offset + BLOCK], f"bytes of neither version at {offset}"
            outcomes.append("old")
    finally:
        os.close(fd)
    assert set(outcomes) <= {"old", "EIO"}, outcomes

    # A fresh open is all old or all new (never a mix), and soon all new.
    seen: list[str] = []

    def describe(got: bytes | int) -> str:
        if isinstance(got, int):
            return errno.errorcode.get(got, str(got))
        if got in (old, new):
            return "new" if got == new else "old"
        # One letter a block: o(ld), n(ew), x (neither: a block of mixed pages).
        return "MIXED " + "".join(
            "o"
            if got[i : i + BLOCK] == old[i : i + BLOCK]
            else "n"
            if got[i : i + BLOCK] == new[i : i + BLOCK]
            else "x"
            for i in range(0, size, BLOCK)
        )

    def fresh_read_is_new() -> bool:
        got = read_or_errno(path)
        seen.append(describe(got))
        return got == new

    try:
        wait_until(fresh_read_is_new, "a fresh open reads the new version", CONSISTENCY_DEADLINE_SECONDS)
    finally:
        mixed = [outcome for outcome in seen if outcome.startswith("MIXED")]
        assert not mixed, f"{len(mixed)} of {len(seen)} fresh reads mixed versions, first: {mixed[0]}"
    assert mount.alive


@pytest.mark.parametrize("new_blocks", [40, 3], ids=["grows", "shrinks"])
def test_a_new_version_is_read_whole_at_its_own_size(
    new_blocks: int, s3_client: Any, mount_bucket: MountBucket
) -> None:
    """The kernel keeps a file's size for the metadata TTL. When the daemon
    learns of a new version sooner (here a read of the old one finds it
    changed; or its listing expires before the kernel's copy), a fresh open
    must still read exactly the new bytes and report the new size, neither
    cut at the old size nor padded with zeros up to it."""
    bucket = new_bucket(s3_client)
    old = seeded(13, {"f.bin": 16 * BLOCK})["f.bin"]
    new = seeded(14, {"f.bin": new_blocks * BLOCK + 5})["f.bin"]
    put_objects(s3_client, bucket, {"f.bin": old})
    mount = mount_bucket(bucket, *BLOCK_FLAG, "--no-prefetch")  # the default, long metadata TTL
    path = mount.path("f.bin")
    assert path.stat().st_size == len(old)

    def read_whole() -> tuple[bytes, int]:
        fd = os.open(path, os.O_RDONLY)
        try:
            chunks = []
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
            return b"".join(chunks), os.fstat(fd).st_size
        finally:
            os.close(fd)

    old_fd = os.open(path, os.O_RDONLY)
    try:
        assert os.pread(old_fd, BLOCK, 0) == old[:BLOCK]
        s3_client.put_object(Bucket=bucket, Key="f.bin", Body=new)
        with pytest.raises(OSError, match="Input/output error") as raised:
            os.pread(old_fd, BLOCK, 8 * BLOCK)  # not cached: its GET finds the new version
        assert raised.value.errno == errno.EIO
        # While the old version is open, the new one reads whole (the size
        # shown is the old one's until then: one inode per path).
        got, _ = read_whole()
        assert (len(got), got == new) == (len(new), True)
    finally:
        os.close(old_fd)
    got, size = read_whole()  # alone now: the kernel is told to drop the old size
    assert (len(got), got == new, size) == (len(new), True, len(new))
    assert path.stat().st_size == len(new)
    got, size = read_whole()  # an ordinary open again, through the page cache
    assert (len(got), got == new, size) == (len(new), True, len(new))


# -- cache -----------------------------------------------------------------------


def test_cache_survives_a_remount_which_sees_what_changed_while_unmounted(
    s3_client: Any, s3_server: S3TestServer, mount_bucket: MountBucket, tmp_path: Path
) -> None:
    bucket = new_bucket(s3_client)
    objects = seeded(12, {f"d{index % 3}/sub/f{index}.bin": 50 * KiB + index * 7000 for index in range(12)})
    put_objects(s3_client, bucket, objects)
    cache_dir = tmp_path / "shared-cache"

    first = mount_bucket(bucket, *BLOCK_FLAG, cache_dir=cache_dir)
    assert walk_files(first.mountpoint) == set(objects)
    for key, data in objects.items():
        assert first.path(key).read_bytes() == data
    first.unmount()
    assert not first.alive

    # While nothing is mounted: one object overwritten (one block, another
    # size), one deleted, one added.
    changed, deleted, added = "d0/sub/f0.bin", "d1/sub/f1.bin", "d2/sub/new.bin"
    objects[changed] = seeded(13, {changed: 20 * KiB})[changed]
    objects[added] = seeded(14, {added: 10 * KiB})[added]
    del objects[deleted]
    put_objects(s3_client, bucket, {key: objects[key] for key in (changed, added)})
    s3_client.delete_object(Bucket=bucket, Key=deleted)

    second = mount_bucket(bucket, *BLOCK_FLAG, cache_dir=cache_dir)
    s3_server.reset_counts()
    assert walk_files(second.mountpoint) == set(objects)
    for key, data in objects.items():
        assert second.path(key).read_bytes() == data
    counts = s3_server.counts()
    assert counts.get(GET_OBJECT, 0) == 2, counts  # the changed object and the new one, all else cached
    assert counts.get(LIST, 0) > 0, counts
    second.unmount()

    # Trusting saved listings: nothing is asked of the bucket at all.
    config = tmp_path / "trusting.toml"
    config.write_text("[namespace]\ntrust_saved_listings = true\n")
    third = mount_bucket(bucket, *BLOCK_FLAG, "--config", str(config), cache_dir=cache_dir)
    s3_server.reset_counts()
    assert walk_files(third.mountpoint) == set(objects)
    for key, data in objects.items():
        assert third.path(key).read_bytes() == data
    counts = s3_server.counts()
    assert counts.get(GET_OBJECT, 0) == 0, counts
    assert counts.get(LIST, 0) == 0, counts
    assert counts.get(HEAD_OBJECT, 0) == 0, counts


def _metric(samples: dict[str, float], name: str) -> float:
    return samples.get(name, 0.0)


def _gets(metrics: dict[str, float]) -> float:
    """GETs of object bytes: for a read (demand), or ahead of one (prefetch;
    a large file's first read is its first run's)."""
    kinds = ("demand", "prefetch")
    return sum(_metric(metrics, f"cachefsd_fetch_seconds_count{{kind={kind}}}") for kind in kinds)


def test_metrics_count_cold_reads_and_cache_usage(s3_client: Any, mount_bucket: MountBucket) -> None:
    bucket = new_bucket(s3_client)
    objects = seeded(13, {f"m/{index}.bin": 3 * BLOCK + index for index in range(5)})
    put_objects(s3_client, bucket, objects)
    total = sum(len(data) for data in objects.values())
    mount = mount_bucket(bucket, *BLOCK_FLAG)
    cold, cache = "cachefsd_read_bytes_total{source=cold}", "cachefsd_read_bytes_total{source=cache}"

    before = mount.metrics()
    for key, data in objects.items():
        assert mount.path(key).read_bytes() == data
    after = mount.metrics()

    cold_read = _metric(after, cold) - _metric(before, cold)
    cache_read = _metric(after, cache) - _metric(before, cache)
    assert cold_read > 0
    # The page cache was empty, so every byte went through the daemon.
    assert cold_read + cache_read >= total
    assert _gets(after) > 0
    used, capacity = after["cachefsd_cache_used_bytes"], after["cachefsd_cache_capacity_bytes"]
    assert 0 < used <= capacity

    for key, data in objects.items():
        assert mount.path(key).read_bytes() == data
    again = mount.metrics()
    # The second pass is served by the kernel's page cache or the block
    # cache; either way not one byte waits on the bucket, and no read asks
    # it for any (a prefetch the first pass started may still land meanwhile).
    assert _metric(again, cold) == _metric(after, cold)
    demand = "cachefsd_fetch_seconds_count{kind=demand}"
    assert _metric(again, demand) == _metric(after, demand)


def _blocks_on_disk(mount: Mount) -> int:
    """Bytes of the cache's files now, in whole allocation units: what the
    cache may hold. Not ``st_blocks``, which also counts the blocks a
    filesystem takes to map a file in many pieces (its metadata, not the
    cache's bytes). The daemon is stopped while they are counted: a walk
    that met a block before its eviction and its replacement after would
    count both, which the cache never held at once."""
    total = 0
    os.kill(mount.pid, signal.SIGSTOP)
    try:
        for directory, _, files in os.walk(mount.cache_dir / "blocks"):
            for name in files:
                total += disk_bytes((Path(directory) / name).stat().st_size)
    finally:
        os.kill(mount.pid, signal.SIGCONT)
    return total


def test_cache_never_exceeds_its_capacity(s3_client: Any, mount_bucket: MountBucket) -> None:
    bucket = new_bucket(s3_client)
    capacity = 2 * MiB
    objects = seeded(14, {f"big/{index:02d}.bin": MiB // 2 + index for index in range(12)})
    assert sum(len(data) for data in objects.values()) >= 6 * MiB
    put_objects(s3_client, bucket, objects)
    mount = mount_bucket(bucket, *BLOCK_FLAG, "--cache-size", "2M")

    peak = 0
    for _ in range(2):
        for key, data in objects.items():
            assert file_sha256(mount.path(key)) == sha256(data), key
            peak = max(peak, _blocks_on_disk(mount))
            assert peak <= capacity, f"{peak} bytes of blocks on disk after reading {key}"
    assert peak > capacity // 2, "the cache should have filled up"
    samples = mount.metrics()
    assert 0 < samples["cachefsd_cache_used_bytes"] <= samples["cachefsd_cache_capacity_bytes"] == capacity
    assert sum(v for k, v in samples.items() if k.startswith("cachefsd_cache_evictions_total")) > 0
