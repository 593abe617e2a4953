"""Two jobs on one dataset through one mount (a sweep), against one job alone,
on a remote-like S3 bucket.

The S3 server is epoch_bench's: moto behind a middleware that adds
``--latency-ms`` to every request, in a network namespace whose veth pair is
capped at ``--rate-mbit`` each way. A dataset of ``--files`` objects of
``--kib`` KiB, and a mount whose cache holds ``--cache-fraction`` of it.
Each job is a process in a session of its own (so the daemon tells them
apart) that reads every file once an epoch in its own shuffle, "trains"
``--compute-ms`` after each file (a GPU-bound job), and drops each file's
pages once read (a dataset larger than RAM: every epoch's reads reach the
daemon). After each epoch a job reads its own per-job metrics: the share of
its bytes that did not wait on the store. Three cases, each on a fresh
mount and cache: one job, two jobs, two jobs that hint each epoch's order.
Needs root (network namespace, tc, FUSE).

    .venv/bin/python -m benchmarks.jobs_bench [--files 3000] [--kib 128] [--epochs 4] [--cache-fraction 0.5]
        [--latency-ms 20] [--rate-mbit 400] [--compute-ms 10] [--policy epoch-aware|minio|lru|...]
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

from benchmarks.epoch_bench import ENDPOINT, environment
from benchmarks.read_bench import Dataset, free_port, make_dataset
from cachefsd.cache.tier import disk_bytes
from cachefsd.cli.supervise import unmount

# (label, jobs, whether they hint)
CASES = (("one job", 1, False), ("two jobs", 2, False), ("two jobs, hinting", 2, True))


def run_jobs(
    metrics_url: str, paths: list[str], jobs: int, epochs: int, compute_ms: float, hinting: bool
) -> list[list[float]]:
    """Hit ratio of each epoch of each of ``jobs`` jobs run side by side."""
    processes = [
        subprocess.Popen(
            [
                *(sys.executable, "-m", "cachefsd.testing.epochs", str(seed), str(epochs)),
                *("--metrics", metrics_url, "--compute-ms", str(compute_ms)),
                *(("--hint",) if hinting else ()),
                *paths,
            ],
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        for seed in range(jobs)
    ]
    ratios = []
    for process in processes:
        out, _ = process.communicate(timeout=3600)
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
    parser.add_argument("--latency-ms", type=float, default=20.0, help="added to every S3 request")
    parser.add_argument("--rate-mbit", type=int, default=400, help="bandwidth cap each way (HTB)")
    # 10 ms a 128 KiB file is 12.5 MiB/s a job: two jobs' misses at a 50 %
    # cache fit the capped link, so what a job waits for is the policy's
    # and the prefetcher's doing, not the network's.
    parser.add_argument("--compute-ms", type=float, default=10.0, help="training step after each file")
    parser.add_argument("--policy", default="epoch-aware", help="the cache's eviction policy")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="cachefsd-jobs-") as temporary:
        work = Path(temporary)
        with environment(args, work):
            client = boto3.client("s3", endpoint_url=ENDPOINT, region_name="us-east-1")
            client.create_bucket(Bucket="bench")
            dataset = Dataset("data", args.files, args.kib << 10)
            relatives = make_dataset(dataset, work / "local", client, "bench")
            capacity = int(args.cache_fraction * args.files * disk_bytes(args.kib << 10))
            config = work / "cachefsd.toml"
            config.write_text(f'[cache]\npolicy = "{args.policy}"\n')
            print(
                f"{args.files} files of {args.kib} KiB, a cache of {args.cache_fraction:.0%} of them "
                f"({args.policy}), {args.epochs} epochs, {args.compute_ms:g} ms a file; "
                f"S3 at +{args.latency_ms:g} ms a request, {args.rate_mbit} Mbit/s"
            )
            for number, (label, jobs, hinting) in enumerate(CASES):
                mountpoint, port = work / f"mnt-{number}", free_port()
                mountpoint.mkdir()
                subprocess.run(
                    [
                        *(sys.executable, "-m", "cachefsd", "mount", "s3://bench", str(mountpoint)),
                        *("--endpoint-url", ENDPOINT, "--cache-dir", str(work / f"cache-{number}")),
                        *("--cache-size", str(capacity), "--metrics-addr", f"127.0.0.1:{port}"),
                        *("--config", str(config)),
                    ],
                    check=True,
                )
                try:
                    paths = [str(mountpoint / relative) for relative in relatives]
                    metrics = f"http://127.0.0.1:{port}/metrics"
                    ratios = run_jobs(metrics, paths, jobs, args.epochs, args.compute_ms, hinting)
                finally:
                    unmount(mountpoint)
                for job, per_epoch in enumerate(ratios):
                    shown = " ".join(f"{ratio:.2f}" for ratio in per_epoch)
                    steady = statistics.median(per_epoch[1:])
                    print(f"  {label}, job {job + 1}: did not wait, by epoch {shown}; 2+ median {steady:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
