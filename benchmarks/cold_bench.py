"""The cold path's CPU: obstore alone against the daemon, on one file-backed S3
server (``cachefsd.testing.file_s3``, whose ranged GETs cost only their
bytes) in the same run.

Two datasets: many small files (96-160 KiB) and a few 32 MiB shards. For
each, repeated, alternating:

- obstore alone, in a process of its own (its CPU is ``time.process_time``
  there: the caller's Python and obstore's runtime threads): small objects
  as whole GETs, ``IN_FLIGHT`` at once; shards whole, and as parallel
  4 MiB ranged GETs (``get_ranges_async``), one shard at a time;
- the daemon: a fresh mount with an empty cache, every file read once by
  ``--workers`` reader processes, the daemon's user and system CPU from
  ``/proc/PID/stat`` around the pass;
- the machine: CPU a MiB of writing a new file beside the cache
  (``write_cpu``), what caching a cold byte costs the kernel here.

The server runs in this process's threads, so neither side pays for it.
With ``--py-spy DIR`` the first cold pass of each dataset is profiled
(py-spy's raw format: collapsed stacks, one line a stack, with native
frames and only samples holding the GIL). Prints CPU per object and per MiB
(medians and spread) and writes ``benchmarks/results/cold_bench.json``.

    .venv/bin/python -m benchmarks.cold_bench [--repeats 3] [--workers 4] [--py-spy DIR] [--dataset D]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import boto3
import uvloop
from obstore import get_async, get_ranges_async
from obstore.store import S3Store

from benchmarks.client_bench import obstore_client
from benchmarks.epoch_bench import RESULTS
from benchmarks.read_bench import Readers, free_port, process_cpu
from cachefsd.cli.supervise import unmount
from cachefsd.control.mounts import read_state
from cachefsd.testing.file_s3 import FileS3Server

BUCKET = "bench"
MIB = 1 << 20
# Small files span the sizes of a dataset of images; shards are what a
# training job streams. Block and part size: the daemon's default block.
SMALL_FILES = 1000
SMALL_BYTES = (96 << 10, 160 << 10)
SHARDS = 8
SHARD_BYTES = 32 << 20
PART_BYTES = 4 << 20
# obstore's GETs at once: about what the daemon's readers and prefetch keep
# in flight.
IN_FLIGHT = 16
PY_SPY_ATTACH_SECONDS = 1.0
# Enough to average over many page allocations, small beside a dataset.
WRITE_PROBE_BYTES = 64 << 20


@dataclass(frozen=True)
class Dataset:
    name: str
    keys: list[str]  # relative to the dataset's prefix
    nbytes: int


def upload(endpoint: str) -> dict[str, Dataset]:
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    client.create_bucket(Bucket=BUCKET)
    rng = random.Random(SHARD_BYTES)
    sizes = {
        "small": [
            (f"class_{i % 10}/sample_{i:05d}.bin", rng.randint(*SMALL_BYTES)) for i in range(SMALL_FILES)
        ],
        "shards": [(f"shard_{i:03d}.bin", SHARD_BYTES) for i in range(SHARDS)],
    }
    datasets = {}
    for name, objects in sizes.items():
        for key, size in objects:
            client.put_object(Bucket=BUCKET, Key=f"{name}/{key}", Body=rng.randbytes(size))
        datasets[name] = Dataset(name, [key for key, _ in objects], sum(size for _, size in objects))
    return datasets


async def _whole(store: S3Store, keys: list[str]) -> int:
    slots = asyncio.Semaphore(IN_FLIGHT)

    async def one(key: str) -> int:
        async with slots:
            return len(await (await get_async(store, key)).bytes_async())

    return sum(await asyncio.gather(*(one(key) for key in keys)))


async def _parts(store: S3Store, keys: list[str]) -> int:
    """Each object as parallel ranged GETs of ``PART_BYTES``, one object at a time."""
    total = 0
    for key in keys:
        starts = list(range(0, SHARD_BYTES, PART_BYTES))
        parts = await get_ranges_async(store, key, starts=starts, lengths=[PART_BYTES] * len(starts))
        total += sum(len(part) for part in parts)
    return total


MODES: dict[str, Callable[[S3Store, list[str]], Coroutine[None, None, int]]] = {
    "whole": _whole,
    "parts": _parts,
}


def obstore_cpu(endpoint: str, mode: str, keys: list[str]) -> tuple[float, int]:
    """CPU seconds and bytes of GETs of ``keys`` in ``mode``, in this (a
    fresh) process, after one warm-up GET."""
    store = obstore_client(endpoint, BUCKET)
    uvloop.run(MODES[mode](store, keys[:1]))
    before = time.process_time()
    nbytes = uvloop.run(MODES[mode](store, keys))
    return time.process_time() - before, nbytes


def write_cpu(directory: Path) -> float:
    """CPU seconds a MiB of writing ``WRITE_PROBE_BYTES`` to a new file in
    ``directory``, as a cache tier writes a cold block: on a VM that backs
    guest memory lazily, a page the guest takes afresh faults in the host,
    which made this 2 ms a MiB here against 0.25 after the same memory
    had been touched, a cost the daemon pays for every cold byte it caches
    (and obstore alone for each new buffer)."""
    probe = directory / "write-probe"
    block = os.urandom(PART_BYTES)
    before = time.process_time()
    with probe.open("wb", buffering=0) as file:
        for _ in range(WRITE_PROBE_BYTES // PART_BYTES):
            file.write(block)
    used = time.process_time() - before
    probe.unlink()
    return used / (WRITE_PROBE_BYTES / MIB)


def daemon_cpu(
    endpoint: str, dataset: Dataset, work: Path, readers: Readers, seed: int, profile: Path | None
) -> tuple[float, float, int]:
    """Daemon CPU seconds, wall seconds and bytes of one cold pass over a
    fresh mount of ``dataset``."""
    mountpoint, cache = work / "mnt", work / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    mountpoint.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "cachefsd", "mount", f"s3://{BUCKET}/{dataset.name}", str(mountpoint)]
    options = [
        "--endpoint-url",
        endpoint,
        "--cache-dir",
        str(cache),
        "--metrics-addr",
        f"127.0.0.1:{free_port()}",
    ]
    subprocess.run([*command, *options], check=True)
    spy = None
    try:
        state = read_state(mountpoint)
        assert state is not None, f"no daemon serves {mountpoint}"
        if profile is not None:
            spy = subprocess.Popen(
                [
                    "py-spy",
                    "record",
                    "--native",
                    "--gil",
                    "--format",
                    "raw",
                    "-p",
                    str(state.pid),
                    "-o",
                    str(profile),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            time.sleep(PY_SPY_ATTACH_SECONDS)  # py-spy has no "attached" signal
        before = process_cpu(state.pid)
        seconds, nbytes = readers.epoch(mountpoint, dataset.keys, str(seed))
        used = (process_cpu(state.pid) - before).total
    finally:
        if spy is not None:
            spy.send_signal(2)
            spy.wait(60)
        unmount(mountpoint)
    return used, seconds, nbytes


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):7.3f} ({min(values):.3f}-{max(values):.3f})"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--dataset", choices=("small", "shards"), help="only this dataset")
    parser.add_argument(
        "--py-spy", type=Path, help="directory for py-spy profiles of the first daemon passes"
    )
    args = parser.parse_args()
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")

    work = Path(tempfile.mkdtemp(prefix="cachefsd-cold-"))
    readers = Readers(args.workers)  # forked before the server's threads start
    server = FileS3Server(work / "file-s3")
    # ms of CPU, by (dataset, who) -> one value a repeat
    runs: dict[tuple[str, str], list[float]] = {}
    try:
        server.start()
        datasets = upload(server.endpoint_url)
        # A fresh process for each obstore run: its CPU time is obstore's alone.
        spawn = multiprocessing.get_context("spawn")
        for repeat in range(args.repeats):
            for dataset in datasets.values():
                if args.dataset not in (None, dataset.name):
                    continue
                keys = [f"{dataset.name}/{key}" for key in dataset.keys]
                per = len(keys) if dataset.name == "small" else dataset.nbytes / MIB
                unit = "ms/object" if dataset.name == "small" else "ms/MiB"
                modes = ["whole"] if dataset.name == "small" else ["whole", "parts"]
                for mode in modes:
                    with ProcessPoolExecutor(1, mp_context=spawn) as pool:
                        cpu, nbytes = pool.submit(obstore_cpu, server.endpoint_url, mode, keys).result()
                    assert nbytes == dataset.nbytes
                    runs.setdefault((dataset.name, f"obstore {mode}"), []).append(cpu / per * 1e3)
                    print(
                        f"run {repeat + 1} {dataset.name:<7} obstore {mode:<6} {cpu / per * 1e3:7.3f} {unit}"
                    )
                profile = None
                if args.py_spy is not None and repeat == 0:
                    args.py_spy.mkdir(parents=True, exist_ok=True)
                    profile = args.py_spy / f"{dataset.name}.txt"
                cpu, seconds, nbytes = daemon_cpu(
                    server.endpoint_url, dataset, work / dataset.name, readers, repeat, profile
                )
                assert nbytes == dataset.nbytes
                runs.setdefault((dataset.name, "daemon"), []).append(cpu / per * 1e3)
                runs.setdefault((dataset.name, "daemon MB/s"), []).append(nbytes / seconds / 1e6)
                runs.setdefault(("machine", "write ms/MiB"), []).append(write_cpu(work) * 1e3)
                print(
                    f"run {repeat + 1} {dataset.name:<7} daemon         {cpu / per * 1e3:7.3f} {unit}"
                    f"  ({nbytes / seconds / 1e6:.0f} MB/s, {len(keys) / seconds:.0f} files/s)",
                    flush=True,
                )
    finally:
        server.stop()
        readers.close()
        shutil.rmtree(work, ignore_errors=True)

    print(f"\nmedians (min-max) of {args.repeats} runs; CPU: small ms a file, shards and machine ms a MiB")
    for (name, who), values in runs.items():
        print(f"{name:<7} {who:<15} {_spread(values)}")
    RESULTS.mkdir(exist_ok=True)
    results = {f"{name} {who}": statistics.median(values) for (name, who), values in runs.items()}
    (RESULTS / "cold_bench.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
