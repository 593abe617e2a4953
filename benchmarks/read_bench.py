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
compared, because the machine is shared and noisy. The server's own ceiling
(whole-object GETs from many client threads in other processes) is measured
in the same run, before each dataset is mounted, and the cold epoch is
reported against it. The daemon's CPU time (``/proc/PID/stat``) is taken
around every mount epoch: CPU per file and per MiB, which is what one core
(one GIL) caps on a node with many. Prints a table and writes
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
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import boto3

os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")

from cachefsd.cli.supervise import unmount
from cachefsd.control.mounts import read_state
from cachefsd.testing.s3_server import S3TestServer

READ_CHUNK = 1 << 20
# The server's ceiling: GETs from this many processes of this many threads,
# for this long (client CPU must not be what limits it).
CEILING_PROCESSES = 4
CEILING_THREADS = 8
CEILING_SECONDS = 8.0
MIB = 1 << 20
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


def _get_for(
    endpoint: str, keys: list[str], ranges: tuple[str, ...], seconds: float, slot: int
) -> tuple[int, int]:
    """GETs and bytes that ``CEILING_THREADS`` threads of one process get in
    ``seconds``: of a random key, whole or (with ``ranges``) a random one of
    those ``Range`` headers."""
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    deadline = time.monotonic() + seconds

    def loop(thread: int) -> tuple[int, int]:
        rng = random.Random(slot * CEILING_THREADS + thread)
        gets = nbytes = 0
        while time.monotonic() < deadline:
            request = {"Bucket": "bench", "Key": rng.choice(keys)}
            if ranges:
                request["Range"] = rng.choice(ranges)
            nbytes += len(client.get_object(**request)["Body"].read())
            gets += 1
        return gets, nbytes

    with ThreadPoolExecutor(CEILING_THREADS) as pool:
        counts = list(pool.map(loop, range(CEILING_THREADS)))
    return sum(gets for gets, _ in counts), sum(nbytes for _, nbytes in counts)


def server_ceiling(
    endpoint: str, keys: list[str], ranges: tuple[str, ...] = (), seconds: float = CEILING_SECONDS
) -> dict[str, float]:
    """GETs/s and MB/s the server gives many clients at once, of whole
    objects or of ``ranges`` (``Range`` headers) of them, in bucket ``bench``."""
    started = time.perf_counter()
    with ProcessPoolExecutor(CEILING_PROCESSES) as pool:
        futures = [
            pool.submit(_get_for, endpoint, keys, ranges, seconds, slot) for slot in range(CEILING_PROCESSES)
        ]
        counts = [future.result() for future in futures]
    elapsed = time.perf_counter() - started
    gets, nbytes = sum(got for got, _ in counts), sum(size for _, size in counts)
    return {"gets_per_s": gets / elapsed, "MBps": nbytes / elapsed / 1e6}


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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


@dataclass(frozen=True)
class Measured:
    seconds: float  # median of the runs
    nbytes: int  # of one epoch
    cpu_seconds: float  # the daemon's, median of the runs (0 without a daemon)


def measure(
    label: str,
    root: Path,
    relatives: list[str],
    workers: int,
    runs: int,
    drop: bool,
    daemon: int | None = None,
) -> Measured:
    """``runs`` epochs over ``root``: median seconds, the bytes of one, and
    the median CPU time of process ``daemon`` (if any) an epoch."""
    seconds, cpu = [], []
    nbytes = 0
    for run in range(runs):
        if drop:
            drop_page_cache()
        before = cpu_seconds(daemon) if daemon else 0.0
        elapsed, nbytes = epoch(root, relatives, workers, seed=run)
        cpu.append(cpu_seconds(daemon) - before if daemon else 0.0)
        seconds.append(elapsed)
        used = f", daemon CPU {cpu[-1] / len(relatives) * 1e6:6.0f} us/file" if daemon else ""
        print(f"  {label:<34} run {run + 1}: {nbytes / elapsed / 1e6:8.1f} MB/s{used}", flush=True)
    return Measured(statistics.median(seconds), nbytes, statistics.median(cpu))


def bench_dataset(
    local: Path,
    mountpoint: Path,
    relatives: list[str],
    workers: int,
    runs: int,
    can_drop: bool,
    ceiling: dict[str, float],
) -> dict[str, float]:
    """One dataset: the cold epoch, then local and mount epochs side by side."""
    state = read_state(mountpoint)
    assert state is not None, f"no daemon serves {mountpoint}"
    files = len(relatives)
    cold = measure(
        "mount cold (first epoch)", mountpoint, relatives, workers, 1, drop=False, daemon=state.pid
    )
    row = {
        "ceiling_MBps": ceiling["MBps"],
        "ceiling_gets_per_s": ceiling["gets_per_s"],
        "mount_cold_MBps": cold.nbytes / cold.seconds / 1e6,
        "ratio_cold_to_ceiling": cold.nbytes / cold.seconds / 1e6 / ceiling["MBps"],
        "cpu_us_per_file_cold": cold.cpu_seconds / files * 1e6,
        "cpu_ms_per_MiB_cold": cold.cpu_seconds / (cold.nbytes / MIB) * 1e3,
    }
    conditions = [("warm", False)] + ([("dropped", True)] if can_drop else [])
    for condition, drop in conditions:
        page_cache = "dropped" if drop else "kept"
        on_disk = measure(f"local, page cache {page_cache}", local, relatives, workers, runs, drop)
        mounted = measure(
            f"mount, page cache {page_cache}", mountpoint, relatives, workers, runs, drop, daemon=state.pid
        )
        row[f"local_{condition}_MBps"] = on_disk.nbytes / on_disk.seconds / 1e6
        row[f"mount_{condition}_MBps"] = mounted.nbytes / mounted.seconds / 1e6
        row[f"ratio_{condition}"] = on_disk.seconds / mounted.seconds
        row[f"cpu_us_per_file_{condition}"] = mounted.cpu_seconds / files * 1e6
        row[f"cpu_ms_per_MiB_{condition}"] = mounted.cpu_seconds / (mounted.nbytes / MIB) * 1e3
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
            ceiling = server_ceiling(server.endpoint_url, relatives)
            print(
                f"  server ceiling: {ceiling['gets_per_s']:.0f} GETs/s, {ceiling['MBps']:.1f} MB/s "
                f"({CEILING_PROCESSES} x {CEILING_THREADS} clients, whole objects)",
                flush=True,
            )
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
                    work / "local" / dataset.name,
                    mountpoint,
                    mounted,
                    args.workers,
                    args.repeats,
                    can_drop,
                    ceiling,
                )
            finally:
                unmount(mountpoint)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)

    print(f"\nmedians of {args.repeats} runs, {args.workers} readers (MB/s; ratio = mount / local)")
    columns = [
        ("mount_cold_MBps", "cold MB/s"),
        ("ratio_cold_to_ceiling", "cold/ceiling"),
        ("local_warm_MBps", "local kept"),
        ("mount_warm_MBps", "mount kept"),
        ("ratio_warm", "ratio kept"),
        ("local_dropped_MBps", "local dropped"),
        ("mount_dropped_MBps", "mount dropped"),
        ("ratio_dropped", "ratio dropped"),
    ]
    cpu_columns = [
        (f"cpu_{unit}_{condition}", f"{condition} {unit.replace('_per_', '/')}")
        for condition in ("cold", "warm", "dropped")
        for unit in ("us_per_file", "ms_per_MiB")
    ]
    for table in (columns, cpu_columns):
        print(f"{'dataset':<8}" + "".join(f"{title:>16}" for _, title in table))
        for name, row in results.items():
            print(f"{name:<8}" + "".join(f"{row.get(key, float('nan')):>16.2f}" for key, _ in table))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "read_bench.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
