"""Two nodes and a shared tier: node 2's first epoch against node 1's, on a
remote-like origin.

The origin is epoch_bench's: moto behind a middleware that adds
``--latency-ms`` to every request, in a network namespace whose veth pair is
capped at ``--rate-mbit`` each way. The shared tier is a second moto
server on 127.0.0.1 with ``--shared-latency-ms`` a request and no cap: a
MinIO or S3 Express bucket near the GPUs. Node 1 and node 2 are two
daemons on this machine with caches and mountpoints of their own, both
with ``--shared-tier``. Each node reads every file once, in a shuffled
order, with ``--workers`` threads (its first epoch: its cache is empty);
node 2 starts once node 1's writes to the shared tier are done. Reported,
``--repeats`` times with medians: each first epoch's MB/s, and the GETs
each node sent to the origin and to the shared tier (from its metrics).
Needs root (network namespace, tc, FUSE).

    .venv/bin/python -m benchmarks.shared_bench [--files 2000] [--kib 128] [--workers 8]
        [--latency-ms 20] [--rate-mbit 400] [--shared-latency-ms 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import boto3

os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")

from benchmarks.epoch_bench import ENDPOINT, environment, metric_delta, scrape
from benchmarks.read_bench import Dataset, free_port, make_dataset
from cachefsd.cli.supervise import unmount
from cachefsd.testing.epochs import read_epoch
from cachefsd.testing.s3_server import S3TestServer

WRITES_SECONDS = 600.0
ORIGIN = ("demand", "prefetch")  # the fetch kinds that go to the origin


def read_once(paths: list[str], workers: int) -> float:
    """Seconds to read every file once, ``workers`` readers each a share of them."""
    started = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(read_epoch, [paths[worker::workers] for worker in range(workers)]))
    return time.perf_counter() - started


def node(
    work: Path, name: str, shared: S3TestServer, bucket: str, paths: list[str], workers: int, nbytes: int
) -> dict[str, float]:
    """Mount a fresh node, read every file once, and what it took."""
    mountpoint, port = work / f"mnt-{name}", free_port()
    mountpoint.mkdir()
    subprocess.run(
        [
            *(sys.executable, "-m", "cachefsd", "mount", "s3://bench", str(mountpoint)),
            *("--endpoint-url", ENDPOINT, "--cache-dir", str(work / f"cache-{name}")),
            *("--metrics-addr", f"127.0.0.1:{port}"),
            *("--shared-tier", f"s3://{bucket}/blocks", "--shared-endpoint-url", shared.endpoint_url),
        ],
        check=True,
    )
    try:
        seconds = read_once([str(mountpoint / path) for path in paths], workers)
        after = scrape(port)
        origin_gets = sum(
            metric_delta({}, after, "cachefsd_fetch_seconds_count", kind=kind) for kind in ORIGIN
        )
        # Node 2 must find what node 1 fetched: every origin GET here is one
        # block (files under a block), and each is written to the shared tier.
        deadline = time.monotonic() + WRITES_SECONDS
        while metric_delta({}, scrape(port), "cachefsd_shared_writes_total") < origin_gets:
            if time.monotonic() > deadline:
                raise RuntimeError(f"node {name}'s writes to the shared tier did not end")
            time.sleep(0.5)
    finally:
        unmount(mountpoint)
    return {
        "mb_per_second": nbytes / 1e6 / seconds,
        "origin_gets": origin_gets,
        "shared_gets": metric_delta({}, after, "cachefsd_fetch_seconds_count", kind="shared"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--kib", type=int, default=128)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--latency-ms", type=float, default=20.0, help="added to every origin request")
    parser.add_argument(
        "--rate-mbit", type=int, default=400, help="the origin's bandwidth cap each way (HTB)"
    )
    parser.add_argument("--shared-latency-ms", type=float, default=1.0, help="added to every shared request")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    runs: list[tuple[dict[str, float], dict[str, float]]] = []
    with tempfile.TemporaryDirectory(prefix="cachefsd-shared-") as temporary:
        work = Path(temporary)
        with environment(args, work):
            client = boto3.client("s3", endpoint_url=ENDPOINT, region_name="us-east-1")
            client.create_bucket(Bucket="bench")
            relatives = make_dataset(
                Dataset("data", args.files, args.kib << 10), work / "local", client, "bench"
            )
            total = args.files * (args.kib << 10)
            print(
                f"{args.files} files of {args.kib} KiB, {args.workers} readers; origin "
                f"+{args.latency_ms:g} ms a request at {args.rate_mbit} Mbit/s, "
                f"shared tier +{args.shared_latency_ms:g} ms, no cap"
            )
            for repeat in range(args.repeats):
                # moto keeps one store per process: each run its own shared bucket.
                with S3TestServer(latency_seconds=args.shared_latency_ms / 1000) as shared:
                    bucket = f"fleet-{repeat}"
                    shared_client = boto3.client(
                        "s3", endpoint_url=shared.endpoint_url, region_name="us-east-1"
                    )
                    shared_client.create_bucket(Bucket=bucket)
                    order = list(relatives)
                    random.Random(repeat).shuffle(order)
                    first = node(work, f"{repeat}-1", shared, bucket, order, args.workers, total)
                    random.Random(repeat + 1000).shuffle(order)
                    second = node(work, f"{repeat}-2", shared, bucket, order, args.workers, total)
                runs.append((first, second))
                print(
                    f"  run {repeat + 1}: node 1 {first['mb_per_second']:.1f} MB/s "
                    f"({first['origin_gets']:.0f} origin GETs), node 2 {second['mb_per_second']:.1f} MB/s "
                    f"({second['origin_gets']:.0f} origin GETs, {second['shared_gets']:.0f} shared)"
                )
    one = statistics.median(first["mb_per_second"] for first, _ in runs)
    two = statistics.median(second["mb_per_second"] for _, second in runs)
    print(f"medians: node 1's first epoch {one:.1f} MB/s, node 2's {two:.1f} MB/s ({two / one:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
