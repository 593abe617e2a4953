"""The shared tier on real mounts: two daemons on one machine as two nodes
(their own cache directories and mountpoints) over one origin (the session's
moto server) and a shared tier on a second moto server. Node 2 reads a
dataset node 1 read with no origin GET; a corrupted shared block is caught
and fetched from the origin; a shared tier that is down costs nothing but
speed."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest

from cachefsd.testing.s3_server import S3TestServer
from tests.integration.conftest import Mount, MountFactory, run_cli
from tests.integration.datasets import new_bucket, put_objects
from tests.polling import wait_until

BLOCK = 64 << 10
# Two blocks and a bit each: every file is more than one block, so the
# mapping of a version to its blocks matters.
FILE_BYTES = 2 * BLOCK + 1000
FILES = 12
WRITE_WAIT_SECONDS = 30.0


@pytest.fixture(name="shared_server")
def fixture_shared_server() -> Iterator[S3TestServer]:
    server = S3TestServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _client(server: S3TestServer) -> Any:
    return boto3.client("s3", endpoint_url=server.endpoint_url, region_name="us-east-1")


def _node(mounter: MountFactory, name: str, origin: S3TestServer, bucket: str, shared: S3TestServer) -> Mount:
    return mounter(
        f"s3://{bucket}",
        "--endpoint-url",
        origin.endpoint_url,
        "--block-size",
        "64K",
        "--no-prefetch",
        "--shared-tier",
        "s3://fleet/blocks",
        "--shared-endpoint-url",
        shared.endpoint_url,
        name=name,
    )


def _seed(s3_client: Any, shared: S3TestServer, files: int, **extra: bytes) -> tuple[str, dict[str, bytes]]:
    """An origin bucket of ``files`` files (and ``extra``), and the shared bucket; the first's name."""
    bucket = new_bucket(s3_client)
    dataset = {f"d/{index:03d}.bin": os.urandom(FILE_BYTES) for index in range(files)}
    put_objects(s3_client, bucket, {**dataset, **extra})
    if shared.running:
        _client(shared).create_bucket(Bucket="fleet")
    return bucket, dataset


def _read_all(mount: Mount, dataset: dict[str, bytes]) -> None:
    for key, data in dataset.items():
        assert mount.path(key).read_bytes() == data, key


def _shared_keys(shared: S3TestServer) -> list[str]:
    listing = _client(shared).list_objects_v2(Bucket="fleet")
    return [entry["Key"] for entry in listing.get("Contents", [])]


def test_a_second_node_reads_what_the_first_read_without_the_origin(
    tmp_path: Path,
    s3_server: S3TestServer,
    s3_client: Any,
    shared_server: S3TestServer,
    mounter: MountFactory,
) -> None:
    bucket, dataset = _seed(s3_client, shared_server, FILES)
    first = _node(mounter, "node1", s3_server, bucket, shared_server)
    _read_all(first, dataset)

    def written() -> bool:
        """Every version mapped to all three of its blocks (the mappings go last)."""
        maps = [key for key in _shared_keys(shared_server) if key.startswith("blocks/maps/")]
        client = _client(shared_server)
        return len(maps) == FILES and all(
            len(json.loads(client.get_object(Bucket="fleet", Key=key)["Body"].read())["blocks"]) == 3
            for key in maps
        )

    wait_until(written, "node 1's blocks and mappings in the shared tier", WRITE_WAIT_SECONDS)
    blocks = [key for key in _shared_keys(shared_server) if key.startswith("blocks/blocks/")]
    assert len(blocks) == 3 * FILES

    second = _node(mounter, "node2", s3_server, bucket, shared_server)
    os.listdir(second.path("d"))
    gets = s3_server.get_object_count
    _read_all(second, dataset)
    assert s3_server.get_object_count == gets  # not one byte from the origin
    served = second.metrics()
    assert served["cachefsd_served_bytes_total{tier=shared}"] == FILES * FILE_BYTES
    # Its requests there: each version's mapping, once (concurrent reads of
    # its blocks share it), then its three blocks.
    assert served["cachefsd_fetch_seconds_count{kind=shared}"] == 4 * FILES

    # A block damaged in the shared bucket is caught; the reader gets the right bytes from the origin.
    victim = sorted(blocks)[0]
    _client(shared_server).put_object(Bucket="fleet", Key=victim, Body=b"CFSS" + os.urandom(200))
    third = _node(mounter, "node3", s3_server, bucket, shared_server)
    os.listdir(third.path("d"))
    gets = s3_server.get_object_count
    _read_all(third, dataset)
    assert s3_server.get_object_count > gets
    assert third.metrics()["cachefsd_cache_corrupt_blocks_total{tier=shared}"] == 1


def test_a_shared_tier_that_is_down_costs_nothing_but_speed(
    tmp_path: Path,
    s3_server: S3TestServer,
    s3_client: Any,
    shared_server: S3TestServer,
    mounter: MountFactory,
) -> None:
    shared_server.stop()
    bucket, dataset = _seed(s3_client, shared_server, 4)
    node = _node(mounter, "alone", s3_server, bucket, shared_server)
    _read_all(node, dataset)
    samples = node.metrics()
    assert samples.get("cachefsd_served_bytes_total{tier=shared}", 0.0) == 0
    wait_until(
        lambda: node.metrics().get("cachefsd_shared_writes_total{result=failed}", 0.0) >= 1,
        "the failed writes counted",
        WRITE_WAIT_SECONDS,
    )


def test_a_fleet_stage_fills_the_shared_tier_for_every_node(
    tmp_path: Path,
    s3_server: S3TestServer,
    s3_client: Any,
    shared_server: S3TestServer,
    mounter: MountFactory,
) -> None:
    bucket, dataset = _seed(s3_client, shared_server, FILES, **{"skip/x.bin": os.urandom(100)})
    where = ("--endpoint-url", s3_server.endpoint_url, "--block-size", "64K")
    shared = ("--shared-tier", "s3://fleet/blocks", "--shared-endpoint-url", shared_server.endpoint_url)
    staged = run_cli("stage", f"s3://{bucket}", *where, *shared, "--include", "d/**", "--json")
    assert staged.returncode == 0, staged.stderr
    summary = json.loads(staged.stdout)
    assert summary["files"] == FILES
    assert summary["fetched_bytes"] == FILES * FILE_BYTES
    assert summary["failed"] == 0
    check = run_cli("stage", f"s3://{bucket}", *where, *shared, "--include", "d/**", "--check", "--json")
    assert check.returncode == 0, check.stderr
    assert json.loads(check.stdout)["resident"] == {"shared": FILES * FILE_BYTES}
    again = run_cli("stage", f"s3://{bucket}", *where, *shared, "--include", "d/**", "--json")
    assert json.loads(again.stdout)["fetched_bytes"] == 0  # a rerun resumes: nothing left to fetch

    node = _node(mounter, "fresh", s3_server, bucket, shared_server)
    os.listdir(node.path("d"))
    gets = s3_server.get_object_count
    _read_all(node, dataset)
    assert s3_server.get_object_count == gets
