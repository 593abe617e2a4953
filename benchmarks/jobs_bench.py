"""Two jobs on one dataset through one mount (a sweep), against one job alone.

A moto S3 server in its own process on 127.0.0.1, a dataset of ``--files``
objects of ``--kib`` KiB, and a mount whose cache holds ``--cache-fraction``
of it. Each job is a process in a session of its own (so the daemon tells
them apart) that reads every file once an epoch in its own shuffle, and
drops each file's pages once read (a dataset larger than RAM: every epoch's
reads reach the daemon). After each epoch a job reads its own per-job
metrics: the share of its bytes that did not wait on the store, which is
what a cache policy can win. Run as root (FUSE).

    .venv/bin/python benchmarks/jobs_bench.py [--files 3000] [--kib 128] [--epochs 4] [--cache-fraction 0.5]
        [--policy epoch-aware|minio|lru|...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import boto3

os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")

from profile_daemon import s3_server
from read_bench import Dataset, free_port, make_dataset

from cachefsd.cache.codec import HEADER_SIZE
from cachefsd.cache.tier import disk_bytes
from cachefsd.cli.supervise import unmount


def run_jobs(metrics_url: str, paths: list[str], jobs: int, epochs: int) -> list[list[float]]:
    """Hit ratio of each epoch of each of ``jobs`` jobs run side by side."""
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cachefsd.testing.epochs",
                str(seed),
                str(epochs),
                "--metrics",
                metrics_url,
                *paths,
            ],
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        for seed in range(jobs)
    ]
    ratios = []
    for process in processes:
        out, _ = process.communicate(timeout=1800)
        assert process.returncode == 0
        rows = [json.loads(line) for line in out.decode().splitlines()]
        ratios.append([row["cache"] / (row["cache"] + row["cold"]) for row in rows])
    return ratios


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    # Far more than the daemon's 64 MiB memory buffer of recent blocks.
    parser.add_argument("--files", type=int, default=3000)
    parser.add_argument("--kib", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--cache-fraction", type=float, default=0.5)
    parser.add_argument("--policy", default="epoch-aware", help="the cache's eviction policy")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="cachefsd-jobs-") as temporary, s3_server() as endpoint:
        work = Path(temporary)
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        client.create_bucket(Bucket="bench")
        relatives = make_dataset(Dataset("data", args.files, args.kib << 10), work / "local", client, "bench")
        capacity = int(args.cache_fraction * args.files * disk_bytes(HEADER_SIZE + (args.kib << 10)))
        config = work / "cachefsd.toml"
        config.write_text(f'[cache]\npolicy = "{args.policy}"\n')
        cache = f"{args.cache_fraction:.0%} of them, {args.policy}"
        print(f"{args.files} files of {args.kib} KiB, a cache of {cache}, {args.epochs} epochs")
        for jobs in (1, 2):
            mountpoint, port = work / f"mnt-{jobs}", free_port()
            mountpoint.mkdir()
            subprocess.run(
                [
                    *(sys.executable, "-m", "cachefsd", "mount", "s3://bench", str(mountpoint)),
                    *("--endpoint-url", endpoint, "--cache-dir", str(work / f"cache-{jobs}")),
                    *("--cache-size", str(capacity), "--metrics-addr", f"127.0.0.1:{port}"),
                    *("--config", str(config)),
                ],
                check=True,
            )
            try:
                paths = [str(mountpoint / relative) for relative in relatives]
                ratios = run_jobs(f"http://127.0.0.1:{port}/metrics", paths, jobs, args.epochs)
            finally:
                unmount(mountpoint)
            for job, per_epoch in enumerate(ratios):
                shown = " ".join(f"{ratio:.2f}" for ratio in per_epoch)
                steady = statistics.median(per_epoch[1:])
                print(f"  {jobs} job(s), job {job + 1}: hit ratio by epoch {shown}; 2+ median {steady:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
