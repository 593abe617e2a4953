"""A gs:// source mounted for real, against fake-gcs-server over HTTP.

The daemon finds the emulator the standard way, through
``STORAGE_EMULATOR_HOST``, which the ``gcs_emulator`` fixture sets for the
session (the mounted subprocess inherits it).
"""

from __future__ import annotations

import hashlib
import os
import random
import uuid

import pytest
from google.cloud import storage

from cachefsd.testing.gcs_emulator import GcsEmulator
from tests.integration.conftest import MountFactory, run_cli


def test_gcs_bucket_reads_back_exact_bytes_and_caches(
    gcs_emulator: GcsEmulator, gcs_client: storage.Client, mounter: MountFactory
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
    assert metrics["cachefsd_read_bytes_total{source=cold}"] >= 370_000
    assert 0 < metrics["cachefsd_cache_used_bytes"] <= metrics["cachefsd_cache_capacity_bytes"]


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
