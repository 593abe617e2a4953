"""Read throughput through a cachefsd mount vs the same files on local disk.

Two datasets (many ~128 KiB files; a few large files), uploaded to a moto S3
server on 127.0.0.1 and written to a local directory. W reader processes read
every file once per epoch in a new shuffled order. For each dataset:

- cold: the first epoch through a fresh mount (moto is the limit here);
- warm, page cache kept: later epochs, as when the dataset fits in RAM;
- warm, page cache dropped before every epoch (``echo 3 >
  /proc/sys/vm/drop_caches``, root only), as when the dataset is far larger
  than RAM and every read goes to the cache disk.

Local and mount epochs alternate in one run, repeated, and the medians are
compared, because the machine is shared and noisy. Prints a table and writes
``benchmarks/results/read_bench.json``.

    .venv/bin/python benchmarks/read_bench.py [--repeats 3] [--workers 4]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import boto3

os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")

from cachefsd.cli.supervise import unmount
from cachefsd.testing.s3_server import S3TestServer

READ_CHUNK = 1 << 20
RESULTS = Path(__file__).parent / "results"


@dataclass(frozen=True)
class Dataset:
    name: str
    files: int
    file_bytes: int


DATASETS = (Dataset("small", 2000, 128 << 10), Dataset("large", 8, 32 << 20))


def _read_all(paths: list[str]) -> int:
    total = 0
    for path in paths:
        with open(path, "rb", buffering=0) as sample:
            while chunk := sample.read(READ_CHUNK):
                total += len(chunk)
    return total


def epoch(root: Path, relatives: list[str], workers: int, seed: int) -> tuple[float, int]:
    """Seconds and bytes to read every file once, shuffled, with ``workers`` processes."""
    order = [str(root / relative) for relative in relatives]
    random.Random(seed).shuffle(order)
    shards = [order[index::workers] for index in range(workers)]
    started = time.perf_counter()
    with ProcessPoolExecutor(workers) as pool:
        total = sum(pool.map(_read_all, shards))
    return time.perf_counter() - started, total


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def make_dataset(dataset: Dataset, local: Path, client: object, bucket: str) -> list[str]:
    rng = random.Random(dataset.name)
    relatives = []
    for index in range(dataset.files):
        relative = f"{dataset.name}/class_{index % 10}/sample_{index:05d}.bin"
        data = rng.randbytes(dataset.file_bytes)
        path = local / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        client.put_object(Bucket=bucket, Key=relative, Body=data)  # type: ignore[attr-defined]
        relatives.append(relative)
    return relatives


def measure(
    label: str, root: Path, relatives: list[str], workers: int, runs: int, drop: bool
) -> tuple[float, int]:
    """Median seconds of ``runs`` epochs over ``root``, and the bytes of one."""
    seconds = []
    nbytes = 0
    for run in range(runs):
        if drop:
            drop_page_cache()
        elapsed, nbytes = epoch(root, relatives, workers, seed=run)
        seconds.append(elapsed)
        print(f"  {label:<34} run {run + 1}: {nbytes / elapsed / 1e6:8.1f} MB/s", flush=True)
    return statistics.median(seconds), nbytes


def bench_dataset(
    local: Path, mountpoint: Path, relatives: list[str], workers: int, runs: int, can_drop: bool
) -> dict[str, float]:
    """One dataset: the cold epoch, then local and mount epochs side by side."""
    cold, nbytes = measure("mount cold (first epoch)", mountpoint, relatives, workers, 1, drop=False)
    row = {"mount_cold_MBps": nbytes / cold / 1e6}
    conditions = [("warm", False)] + ([("dropped", True)] if can_drop else [])
    for condition, drop in conditions:
        page_cache = "dropped" if drop else "kept"
        local_seconds, _ = measure(f"local, page cache {page_cache}", local, relatives, workers, runs, drop)
        mount_seconds, _ = measure(
            f"mount, page cache {page_cache}", mountpoint, relatives, workers, runs, drop
        )
        row[f"local_{condition}_MBps"] = nbytes / local_seconds / 1e6
        row[f"mount_{condition}_MBps"] = nbytes / mount_seconds / 1e6
        row[f"ratio_{condition}"] = local_seconds / mount_seconds
    return row


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="cachefsd-bench-"))
    server = S3TestServer()
    server.start()
    client = boto3.client("s3", endpoint_url=server.endpoint_url, region_name="us-east-1")
    client.create_bucket(Bucket="bench")
    can_drop = drop_page_cache()
    results: dict[str, dict[str, float]] = {}
    try:
        for dataset in DATASETS:
            print(
                f"dataset {dataset.name}: {dataset.files} files x {dataset.file_bytes >> 10} KiB", flush=True
            )
            relatives = make_dataset(dataset, work / "local", client, "bench")
            mountpoint = work / f"mnt-{dataset.name}"
            mountpoint.mkdir()
            port = free_port()
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "cachefsd",
                    "mount",
                    f"s3://bench/{dataset.name}",
                    str(mountpoint),
                    "--endpoint-url",
                    server.endpoint_url,
                    "--cache-dir",
                    str(work / f"cache-{dataset.name}"),
                    "--metrics-addr",
                    f"127.0.0.1:{port}",
                ],
                check=True,
            )
            mounted = [r.removeprefix(f"{dataset.name}/") for r in relatives]
            try:
                results[dataset.name] = bench_dataset(
                    work / "local" / dataset.name, mountpoint, mounted, args.workers, args.repeats, can_drop
                )
            finally:
                unmount(mountpoint)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)

    print(f"\nmedians of {args.repeats} runs, {args.workers} readers (MB/s; ratio = mount / local)")
    columns = [
        "mount_cold_MBps",
        "local_warm_MBps",
        "mount_warm_MBps",
        "ratio_warm",
        "local_dropped_MBps",
        "mount_dropped_MBps",
        "ratio_dropped",
    ]
    print(f"{'dataset':<8}" + "".join(f"{c:>20}" for c in columns))
    for name, row in results.items():
        print(f"{name:<8}" + "".join(f"{row.get(c, float('nan')):>20.2f}" for c in columns))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "read_bench.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
