"""A gs:// source mounted for real, against fake-gcs-server over HTTP.

The daemon finds the emulator the standard way, through
``STORAGE_EMULATOR_HOST``, which the ``gcs_emulator`` fixture sets for the
session (the mounted subprocess inherits it). gcp-storage-emulator, the
other emulator on PyPI, cannot serve the daemon's reads: it answers HEAD on
the XML API 501 and sends no Last-Modified with a GET, which obstore
requires (as GCS always sends it).
"""

from __future__ import annotations

import errno
import hashlib
import os
import random
import uuid

import pytest
from google.cloud import storage

from cachefsd.testing.gcs_emulator import GcsEmulator
from tests.integration.conftest import MountFactory, run_cli


def test_gcs_bucket_reads_back_exact_bytes_and_caches(
    gcs_client: storage.Client, mounter: MountFactory
) -> None:
    bucket = gcs_client.create_bucket(f"g-{uuid.uuid4().hex[:12]}")
    rng = random.Random(3)
    objects = {
        "train/a.bin": rng.randbytes(300_000),
        "train/sub/b.bin": rng.randbytes(70_000),
        "train/empty": b"",
        "other/c.bin": b"not under the prefix",
    }
    for key, data in objects.items():
        bucket.blob(key).upload_from_string(data)
    mount = mounter(f"gs://{bucket.name}/train", "--block-size", "64K")

    found = {
        str(path.relative_to(mount.mountpoint)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in mount.mountpoint.rglob("*")
        if path.is_file()
    }
    expected = {
        key.removeprefix("train/"): hashlib.sha256(data).hexdigest()
        for key, data in objects.items()
        if key.startswith("train/")
    }
    assert found == expected
    with open(mount.path("a.bin"), "rb") as handle:
        assert os.pread(handle.fileno(), 1000, 65_000) == objects["train/a.bin"][65_000:66_000]
    with pytest.raises(FileNotFoundError):
        os.stat(mount.path("c.bin"))
    metrics = mount.metrics()
    # Every byte came from the bucket: a.bin's first read brought the rest of it (its first run).
    fetched = sum(
        metrics.get(f"cachefsd_fetch_bytes_total{{kind={kind}}}", 0) for kind in ("demand", "prefetch")
    )
    assert fetched >= 370_000
    assert 0 < metrics["cachefsd_cache_used_bytes"] <= metrics["cachefsd_cache_capacity_bytes"]


def test_a_gcs_object_overwritten_while_open_fails_the_read(
    gcs_client: storage.Client, mounter: MountFactory
) -> None:
    bucket = gcs_client.create_bucket(f"g-{uuid.uuid4().hex[:12]}")
    rng = random.Random(4)
    old, new = rng.randbytes(16 << 20), rng.randbytes(16 << 20)
    bucket.blob("f.bin").upload_from_string(old)
    mount = mounter(f"gs://{bucket.name}", "--block-size", "64K", "--no-prefetch")
    with open(mount.path("f.bin"), "rb") as handle:
        assert os.pread(handle.fileno(), 10, 0) == old[:10]
        bucket.blob("f.bin").upload_from_string(new)
        # Past the kernel's read-ahead: a block that must be fetched, for a version that is gone.
        with pytest.raises(OSError, match=r"Input/output error") as failed:
            os.pread(handle.fileno(), 10, len(old) - 10)
        assert failed.value.errno == errno.EIO
    assert mount.path("f.bin").read_bytes() == new  # the failure dropped the listing: the next open sees it


def test_missing_gcs_bucket_fails_the_mount_in_one_line(gcs_emulator: GcsEmulator, tmp_path: object) -> None:
    mountpoint = os.path.join(str(tmp_path), "mnt")
    os.mkdir(mountpoint)
    result = run_cli(
        "mount", "gs://no-such-bucket-here", mountpoint, "--cache-dir", f"{tmp_path}/cache", "--no-metrics"
    )
    assert result.returncode != 0
    assert "no-such-bucket-here" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not os.path.ismount(mountpoint)


def test_a_writable_gcs_mount_uploads_what_is_written(
    gcs_client: storage.Client, mounter: MountFactory
) -> None:
    bucket = gcs_client.create_bucket(f"g-{uuid.uuid4().hex[:12]}")
    bucket.blob("runs/old.pt").upload_from_string(b"old")
    mount = mounter(f"gs://{bucket.name}/runs", "--block-size", "64K", "--writable")
    data = random.Random(5).randbytes(200_000)
    os.makedirs(mount.path("step-1"))
    mount.path("step-1/model.pt").write_bytes(data)
    os.rename(mount.path("old.pt"), mount.path("older.pt"))
    result = run_cli("sync", str(mount.mountpoint))
    assert result.returncode == 0, result.stderr
    assert bucket.blob("runs/step-1/model.pt").download_as_bytes() == data
    assert sorted(blob.name for blob in gcs_client.list_blobs(bucket.name)) == [
        "runs/older.pt",
        "runs/step-1/model.pt",
    ]
    assert mount.path("step-1/model.pt").read_bytes() == data
