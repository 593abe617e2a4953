"""An az:// source mounted for real, against Azurite over HTTP: cold and
warm reads, an overwrite seen after the metadata TTL, an outage (Azurite
hung or gone), the shared tier on Azure, and a writable mount.

The daemon signs with the emulator's account key, which the ``azurite``
fixture puts in ``AZURE_STORAGE_ACCOUNT_KEY`` (the mounted subprocess
inherits it), and finds the emulator through ``--endpoint-url``, whose
path names the account. Azurite counts no requests, so requests to the
origin are the daemon's own counters here (``cachefsd_fetch_*`` by kind),
except in the shared tier's test, whose origin is the moto server that
counts its GETs.
"""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from azure.storage.blob import BlobServiceClient, ContainerClient

from cachefsd.testing.azurite import ACCOUNT, ACCOUNT_KEY, Azurite
from cachefsd.testing.s3_server import S3TestServer
from tests.conftest import KEY_ENV
from tests.integration.conftest import Mount, MountFactory, drop_page_cache, run_cli
from tests.integration.datasets import KiB, MiB, new_bucket, put_objects
from tests.polling import timed, wait_until

BLOCK = 64 * KiB
BLOCK_FLAG = ("--block-size", "64K")
# How long an upstream change may take to show through a mount with a 1 s
# metadata TTL (the TTL, the kernel's attribute timeout, a loaded machine).
CONSISTENCY_DEADLINE_SECONDS = 10.0
# The outage's fetch deadline: short, so the test is; what it proves (EIO
# within one deadline) holds for any.
DEADLINE_SECONDS = 5.0
TTL_SECONDS = 1.0
# A cached read never touches the store: far below a deadline even on a loaded machine.
CACHED_SECONDS = 2.0
# Slack on top of one deadline for an uncached read's EIO: the last
# backoff, the FUSE bridge's margin, a loaded machine.
EIO_MARGIN_SECONDS = 7.0
EXIT_SECONDS = 5.0
SYNC_SECONDS = 60.0
SHARED_WRITE_SECONDS = 30.0
# More than AzureTuning's 8 MiB block: the upload goes as blocks and a
# block list, not one Put Blob.
LARGE_FILE_BYTES = 9 * MiB + 123

MountContainer = Callable[..., Mount]


def _container(client: BlobServiceClient, stem: str = "a") -> ContainerClient:
    """A fresh, empty container with a unique name."""
    return client.create_container(f"{stem}-{uuid.uuid4().hex[:16]}")


def _put(container: ContainerClient, blobs: dict[str, bytes]) -> None:
    for name, data in blobs.items():
        container.upload_blob(name, data, overwrite=True)


def _origin_fetches(mount: Mount) -> float:
    """Ranged GETs the daemon sent to its source (demand and prefetch)."""
    samples = mount.metrics()
    return sum(
        samples.get(f"cachefsd_fetch_seconds_count{{kind={kind}}}", 0.0) for kind in ("demand", "prefetch")
    )


def _names(root: Path) -> set[str]:
    """Every file's path under ``root``, none of them read."""
    return {str(path.relative_to(root)) for path in root.rglob("*") if path.is_file()}


def _files(root: Path) -> dict[str, bytes]:
    return {name: (root / name).read_bytes() for name in _names(root)}


def _read_or_errno(path: Path) -> bytes | int:
    try:
        return path.read_bytes()
    except OSError as exc:
        return exc.errno or -1


@pytest.fixture(name="mount_container")
def fixture_mount_container(mounter: MountFactory, azurite: Azurite) -> MountContainer:
    """``mount_container(container, *flags, prefix="", name=..., cache_dir=...)``."""

    def mount(container: str, *flags: str, prefix: str = "", **kwargs: Any) -> Mount:
        source = f"az://{container}/{prefix}" if prefix else f"az://{container}"
        return mounter(source, "--endpoint-url", azurite.endpoint_url, *flags, **kwargs)

    return mount


def test_a_container_reads_back_exact_bytes_cold_then_from_the_cache(
    tmp_path: Path, azure_client: BlobServiceClient, mount_container: MountContainer
) -> None:
    container = _container(azure_client)
    rng = random.Random(21)
    blobs = {
        "train/a.bin": rng.randbytes(300 * KiB),
        "train/sub/b.bin": rng.randbytes(70 * KiB),
        "train/sub/deeper/c.bin": rng.randbytes(5 * BLOCK + 1),
        "train/empty": b"",
        "other/d.bin": b"not under the prefix",
    }
    _put(container, blobs)
    expected = {
        name.removeprefix("train/"): data for name, data in blobs.items() if name.startswith("train/")
    }
    cache = tmp_path / "az-cache"
    cold = mount_container(container.container_name, *BLOCK_FLAG, prefix="train", cache_dir=cache)

    assert _files(cold.mountpoint) == expected
    with open(cold.path("a.bin"), "rb") as handle:
        assert os.pread(handle.fileno(), 1000, 65_000) == blobs["train/a.bin"][65_000:66_000]
    with pytest.raises(FileNotFoundError):
        os.stat(cold.path("d.bin"))
    samples = cold.metrics()
    fetched = sum(
        samples.get(f"cachefsd_fetch_bytes_total{{kind={kind}}}", 0) for kind in ("demand", "prefetch")
    )
    assert fetched >= sum(len(data) for data in expected.values())  # every byte came from Azurite
    assert _origin_fetches(cold) > 0
    cold.unmount()

    # A daemon of its own, on the same cache: its counters start at zero.
    warm = mount_container(
        container.container_name, *BLOCK_FLAG, prefix="train", name="warm", cache_dir=cache
    )
    assert _files(warm.mountpoint) == expected
    assert _origin_fetches(warm) == 0  # not one GET: every block from the cache
    assert warm.metrics().get("cachefsd_fetch_seconds_count{kind=metadata}", 0) > 0  # the listings were asked


def test_an_overwritten_blob_shows_after_the_ttl_and_never_mixes_versions(
    azure_client: BlobServiceClient, mount_container: MountContainer
) -> None:
    container = _container(azure_client)
    size = 32 * BLOCK
    rng = random.Random(22)
    old, new = rng.randbytes(size), rng.randbytes(size)
    _put(container, {"f.bin": old, "doomed.bin": b"doomed"})
    mount = mount_container(container.container_name, *BLOCK_FLAG, "--metadata-ttl", f"{TTL_SECONDS:g}s")
    path = mount.path("f.bin")
    assert mount.path("doomed.bin").read_bytes() == b"doomed"

    outcomes = []
    fd = os.open(path, os.O_RDONLY)
    try:
        assert os.pread(fd, BLOCK, 0) == old[:BLOCK]
        _put(container, {"f.bin": new, "fresh.bin": b"fresh"})
        container.delete_blob("doomed.bin")
        # An open handle is pinned to the version it opened (its ETag, If-Match).
        for offset in range(BLOCK, size, BLOCK):
            try:
                got = os.pread(fd, BLOCK, offset)
            except OSError as exc:
                outcomes.append(errno.errorcode.get(exc.errno or 0, str(exc)))
                continue
            assert got == old[offset : offset + BLOCK], f"bytes not of the open version at {offset}"
            outcomes.append("old")
    finally:
        os.close(fd)
    assert set(outcomes) <= {"old", "EIO"}, outcomes

    # A fresh open reads one version whole (or fails: the open version
    # was replaced), and soon the new one.
    seen: list[str] = []

    def fresh_read_is_new() -> bool:
        got = _read_or_errno(path)
        if isinstance(got, int):
            seen.append(errno.errorcode.get(got, str(got)))
        else:
            seen.append("new" if got == new else "old" if got == old else "neither")
        return got == new

    wait_until(fresh_read_is_new, "a fresh open reads the new version", CONSISTENCY_DEADLINE_SECONDS)
    assert set(seen) <= {"old", "new", "EIO"}, seen
    wait_until(
        lambda: not mount.path("doomed.bin").exists(),
        "the deleted blob disappears",
        CONSISTENCY_DEADLINE_SECONDS,
    )
    wait_until(mount.path("fresh.bin").exists, "the new blob appears", CONSISTENCY_DEADLINE_SECONDS)
    assert mount.path("fresh.bin").read_bytes() == b"fresh"
    assert mount.alive


@pytest.fixture(name="own_azurite")
def fixture_own_azurite(monkeypatch: pytest.MonkeyPatch) -> Iterator[Azurite]:
    """An Azurite of the test's own, to hang (SIGSTOP) and resume."""
    monkeypatch.setenv(KEY_ENV, ACCOUNT_KEY)
    server = Azurite()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(name="own_container")
def fixture_own_container(own_azurite: Azurite) -> Iterator[ContainerClient]:
    """Container ``outage`` on ``own_azurite``."""
    credential = {"account_name": ACCOUNT, "account_key": ACCOUNT_KEY}
    with BlobServiceClient(own_azurite.endpoint_url, credential=credential) as client:
        yield client.create_container("outage")


@pytest.mark.parametrize("fault", ["hung", "refused"])
def test_an_outage_serves_cached_files_fails_the_rest_in_one_deadline_and_recovers(
    fault: str, own_azurite: Azurite, own_container: ContainerClient, mounter: MountFactory
) -> None:
    """Azurite hung (SIGSTOP: connections accepted, never answered) or gone
    (stopped: connections refused). A stopped one comes back empty on its
    port, and the test uploads the same bytes again, as new versions (an
    Azure ETag is not a hash of the bytes)."""
    container = own_container
    blobs = {f"train/c{d}/{i}.bin": os.urandom((40 + 13 * i) * KiB) for d in range(3) for i in range(4)}
    blobs["top.bin"] = os.urandom(10 * KiB)
    _put(container, blobs)
    mount = mounter(
        "az://outage",
        "--endpoint-url",
        own_azurite.endpoint_url,
        "--metadata-ttl",
        f"{TTL_SECONDS:g}s",
        "--fetch-deadline",
        f"{DEADLINE_SECONDS:g}s",
        "--no-prefetch",  # a file the test does not read stays uncached
    )
    names = sorted(blobs)
    cached, uncached = names[::2], names[1::2]
    assert _names(mount.mountpoint) == set(names)
    for name in cached:
        assert mount.path(name).read_bytes() == blobs[name]

    if fault == "hung":
        own_azurite.signal(signal.SIGSTOP)  # the fixture's stop resumes it if the test fails
    else:
        own_azurite.stop()
    # The outage outlasts the metadata TTL: time passing is the subject here.
    time.sleep(TTL_SECONDS + 0.5)
    drop_page_cache()
    for name in cached:
        data, seconds = timed(mount.path(name).read_bytes)
        assert data == blobs[name], f"{name}: wrong bytes through the outage"
        assert seconds < CACHED_SECONDS, f"{name}: a cached read took {seconds:.1f}s through the outage"
    started = time.monotonic()
    with pytest.raises(OSError, match=r"Input/output error") as raised:
        mount.path(uncached[-1]).read_bytes()
    seconds = time.monotonic() - started
    assert raised.value.errno == errno.EIO
    assert seconds < DEADLINE_SECONDS + EIO_MARGIN_SECONDS, f"EIO only after {seconds:.1f}s"
    assert mount.alive

    if fault == "hung":
        own_azurite.signal(signal.SIGCONT)
    else:
        own_azurite.start()
        container.create_container()
        _put(container, blobs)
    container.upload_blob("train/c0/new.bin", b"new")
    container.delete_blob(cached[0])
    # No remount: the daemon finds the store back by itself.
    wait_until(
        lambda: mount.path("train/c0/new.bin").exists() and not mount.path(cached[0]).exists(),
        "the listings to show the store's changes",
        CONSISTENCY_DEADLINE_SECONDS + DEADLINE_SECONDS,
    )
    assert mount.path("train/c0/new.bin").read_bytes() == b"new"
    for name in names[1:]:
        assert mount.path(name).read_bytes() == blobs[name], f"{name}: wrong bytes after the outage"
    _, seconds = timed(mount.unmount)  # it returns once the daemon has exited
    assert seconds < EXIT_SECONDS, f"unmount took {seconds:.1f}s"


def _shared_node(
    mounter: MountFactory, name: str, origin: S3TestServer, bucket: str, azurite: Azurite, shared: str
) -> Mount:
    return mounter(
        f"s3://{bucket}",
        "--endpoint-url",
        origin.endpoint_url,
        *BLOCK_FLAG,
        "--no-prefetch",
        "--shared-tier",
        f"az://{shared}/blocks",
        "--shared-endpoint-url",
        azurite.endpoint_url,
        name=name,
    )


def test_a_second_node_fills_from_an_azure_shared_tier_without_the_origin(
    s3_server: S3TestServer,
    s3_client: Any,
    azurite: Azurite,
    azure_client: BlobServiceClient,
    mounter: MountFactory,
) -> None:
    """The origin is moto, which counts its GETs; the shared tier a container on Azurite."""
    files, file_bytes = 6, 2 * BLOCK + 1000  # each file three blocks
    bucket = new_bucket(s3_client)
    dataset = {f"d/{index:03d}.bin": os.urandom(file_bytes) for index in range(files)}
    put_objects(s3_client, bucket, dataset)
    shared = _container(azure_client, "fleet")

    first = _shared_node(mounter, "node1", s3_server, bucket, azurite, shared.container_name)
    for key, data in dataset.items():
        assert first.path(key).read_bytes() == data, key

    def written() -> bool:
        """Every version mapped to all three of its blocks (the mappings go last)."""
        maps = list(shared.list_blob_names(name_starts_with="blocks/maps/"))
        return len(maps) == files and all(
            len(json.loads(shared.download_blob(name).readall())["blocks"]) == 3 for name in maps
        )

    wait_until(written, "node 1's blocks and mappings in the Azure shared tier", SHARED_WRITE_SECONDS)
    assert len(list(shared.list_blob_names(name_starts_with="blocks/blocks/"))) == 3 * files

    second = _shared_node(mounter, "node2", s3_server, bucket, azurite, shared.container_name)
    os.listdir(second.path("d"))
    gets = s3_server.get_object_count
    for key, data in dataset.items():
        assert second.path(key).read_bytes() == data, key
    assert s3_server.get_object_count == gets  # not one byte from the origin
    assert second.metrics()["cachefsd_served_bytes_total{tier=shared}"] == files * file_bytes


def test_a_writable_mount_uploads_what_is_written(
    azure_client: BlobServiceClient, mount_container: MountContainer
) -> None:
    container = _container(azure_client)
    _put(container, {"runs/old.pt": b"old"})
    mount = mount_container(container.container_name, *BLOCK_FLAG, "--writable", prefix="runs")
    files = {
        "step-1/model.pt": os.urandom(LARGE_FILE_BYTES),  # blocks and a block list
        "step-1/meta.json": b'{"step": 1}',  # one Put Blob
    }
    os.makedirs(mount.path("step-1"))
    for name, data in files.items():
        mount.path(name).write_bytes(data)
    os.rename(mount.path("old.pt"), mount.path("older.pt"))

    result = run_cli("sync", str(mount.mountpoint), timeout=SYNC_SECONDS)
    assert result.returncode == 0, result.stderr
    for name, data in files.items():
        assert container.download_blob(f"runs/{name}").readall() == data, name
    assert sorted(container.list_blob_names()) == [
        "runs/older.pt",
        "runs/step-1/meta.json",
        "runs/step-1/model.pt",
    ]
    assert container.download_blob("runs/older.pt").readall() == b"old"
    for name, data in files.items():
        assert mount.path(name).read_bytes() == data, name


def test_a_missing_container_fails_the_mount_in_one_line(azurite: Azurite, tmp_path: Path) -> None:
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    result = run_cli(
        "mount",
        "az://no-such-container",
        str(mountpoint),
        "--endpoint-url",
        azurite.endpoint_url,
        "--cache-dir",
        str(tmp_path / "cache"),
        "--no-metrics",
    )
    assert result.returncode != 0
    assert "no-such-container" in result.stderr
    assert ACCOUNT_KEY not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not os.path.ismount(mountpoint)
