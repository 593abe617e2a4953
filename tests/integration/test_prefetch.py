"""Reading ahead of the loader on a real mount: from a hint, and from the
directory scan a loader makes before its first epoch."""

from __future__ import annotations

import os
import random
from typing import Any

from cachefsd.testing.s3_server import S3TestServer
from tests.integration.conftest import Mount, MountFactory, run_cli
from tests.integration.datasets import new_bucket, put_objects
from tests.polling import wait_until

KiB = 1 << 10
PREFETCH_WAIT_SECONDS = 30.0


def _dataset(rng: random.Random, files: int = 40) -> dict[str, bytes]:
    return {f"train/class_{i % 4}/{i:03d}.jpg": rng.randbytes(96 * KiB) for i in range(files)}


def _metric(mount: Mount, name: str, labels: str = "") -> float:
    return mount.metrics().get(f"{name}{{{labels}}}" if labels else name, 0.0)


def _mount(mounter: MountFactory, s3_server: S3TestServer, bucket: str, *flags: str) -> Mount:
    return mounter(f"s3://{bucket}", "--endpoint-url", s3_server.endpoint_url, "--block-size", "64K", *flags)


def test_an_epoch_read_in_the_hinted_order_is_served_from_the_cache(
    s3_client: Any, s3_server: S3TestServer, mounter: MountFactory, tmp_path: Any
) -> None:
    objects = _dataset(random.Random(1))
    bucket = new_bucket(s3_client)
    put_objects(s3_client, bucket, objects)
    mount = _mount(mounter, s3_server, bucket)
    order = sorted(objects)
    random.Random(2).shuffle(order)
    order_file = tmp_path / "order.txt"
    order_file.write_text("".join(f"{mount.path(key)}\n" for key in order))

    result = run_cli("hint", str(mount.mountpoint), "--order", str(order_file))
    assert result.returncode == 0, result.stderr
    assert f"{len(order)} accepted" in result.stdout
    total = sum(len(data) for data in objects.values())
    # A training step takes longer than a prefetch; here the reader simply
    # starts once the prefetcher has had the head start it keeps in a run.
    wait_until(
        lambda: _metric(mount, "cachefsd_prefetch_issued_bytes_total") >= total,
        "the hinted files",
        PREFETCH_WAIT_SECONDS,
    )

    for key in order:
        assert mount.path(key).read_bytes() == objects[key]
    cached = _metric(mount, "cachefsd_read_bytes_total", "source=cache")
    cold = _metric(mount, "cachefsd_read_bytes_total", "source=cold")
    assert cached / (cached + cold) >= 0.98
    assert _metric(mount, "cachefsd_fetch_bytes_total", "kind=demand") == 0
    assert _metric(mount, "cachefsd_prefetch_used_bytes_total") == total


def test_a_wrong_hint_costs_bandwidth_never_correctness(
    s3_client: Any, s3_server: S3TestServer, mounter: MountFactory, tmp_path: Any
) -> None:
    objects = _dataset(random.Random(3), files=12)
    bucket = new_bucket(s3_client)
    put_objects(s3_client, bucket, objects)
    mount = _mount(mounter, s3_server, bucket)
    order_file = tmp_path / "order.txt"
    order_file.write_text(
        "train/no/such.jpg\nvalid/../elsewhere/x\n" + "".join(f"{key}\n" for key in sorted(objects)[::2])
    )
    result = run_cli("hint", str(mount.mountpoint), "--order", str(order_file))
    assert result.returncode == 0, result.stderr
    assert "6 accepted, 2 unknown" in result.stdout
    reading = sorted(objects, reverse=True)
    for key in reading:
        assert mount.path(key).read_bytes() == objects[key]


def test_a_scanned_dataset_is_prefetched_in_the_first_epoch(
    s3_client: Any, s3_server: S3TestServer, mounter: MountFactory
) -> None:
    objects = _dataset(random.Random(4))
    bucket = new_bucket(s3_client)
    put_objects(s3_client, bucket, objects)
    mount = _mount(mounter, s3_server, bucket)
    # What torchvision's ImageFolder does before the first sample.
    files = [os.path.join(root, name) for root, _, names in os.walk(mount.path("train")) for name in names]
    assert len(files) == len(objects)
    first = sorted(objects)[0]
    assert mount.path(first).read_bytes() == objects[first]
    rest = sum(len(data) for key, data in objects.items() if key != first)
    wait_until(
        lambda: _metric(mount, "cachefsd_prefetch_issued_bytes_total") >= rest,
        "the rest of the scanned dataset",
        PREFETCH_WAIT_SECONDS,
    )
    demand_before = _metric(mount, "cachefsd_fetch_bytes_total", "kind=demand")
    for key in sorted(objects)[1:]:
        assert mount.path(key).read_bytes() == objects[key]
    assert _metric(mount, "cachefsd_fetch_bytes_total", "kind=demand") == demand_before


def test_without_prefetch_nothing_is_fetched_ahead(
    s3_client: Any, s3_server: S3TestServer, mounter: MountFactory
) -> None:
    objects = _dataset(random.Random(5), files=8)
    bucket = new_bucket(s3_client)
    put_objects(s3_client, bucket, objects)
    mount = _mount(mounter, s3_server, bucket, "--no-prefetch")
    list(os.walk(mount.mountpoint))
    first = sorted(objects)[0]
    s3_server.reset_counts()
    assert mount.path(first).read_bytes() == objects[first]
    assert s3_server.get_object_count == 2  # 96 KiB in 64 KiB blocks: this file only
    assert _metric(mount, "cachefsd_prefetch_issued_bytes_total") == 0
