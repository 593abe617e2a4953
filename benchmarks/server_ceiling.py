"""The benchmark servers' own ceilings, side by side: moto
(``cachefsd.testing.s3_server``) and the file-backed endpoint
(``cachefsd.testing.file_s3``), for whole GETs and for 4 MiB ranged GETs of
32 MiB objects.

moto reads and copies the whole object for every GET, so a range costs what
the object costs; file_s3 sends a range's bytes with ``sendfile``. Clients
are ``server_ceiling``'s: 4 processes of 8 threads (boto3), so client CPU
is not one GIL (``read_bench`` measures its server with the same clients).
Both servers run in this process, so its CPU time around a measurement is
the server's (the clients' is their own): reported as cores busy and
milliseconds a GET, it says whether the server or the machine was the
limit. Servers and modes take turns, repeated; the medians are reported.
Prints a table and writes ``benchmarks/results/server_ceiling.json``.

    .venv/bin/python -m benchmarks.server_ceiling [--repeats 3] [--seconds 6]
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import boto3

from cachefsd.testing.file_s3 import FileS3Server
from cachefsd.testing.s3_server import S3TestServer

RESULTS = Path(__file__).parent / "results"
# The clients: this many processes of this many threads, so that client
# CPU (boto3 reading every body into Python) is not one GIL's worth.
CEILING_PROCESSES = 4
CEILING_THREADS = 8
# Shards as a training job reads them, fetched as parts the size real S3
# clients use (Mountpoint starts at 8 MiB; cachefsd's blocks are 4 MiB).
OBJECTS = 8
OBJECT_BYTES = 32 << 20
PART_BYTES = 4 << 20


def aligned_ranges(object_bytes: int, part_bytes: int = PART_BYTES) -> tuple[str, ...]:
    """``Range`` headers of every whole part of an object of ``object_bytes``."""
    return tuple(
        f"bytes={start}-{start + part_bytes - 1}"
        for start in range(0, object_bytes - part_bytes + 1, part_bytes)
    )


RANGES = aligned_ranges(OBJECT_BYTES)
# Long enough that the clients' start (a process and boto3 each) is a small
# part of a run; 2 servers x 2 modes x 3 repeats stay under two minutes.
DEFAULT_SECONDS = 6.0
MODES = {"whole": (), "ranged 4 MiB": RANGES}
MEASURES = ("MBps", "gets_per_s", "server_cores", "server_cpu_ms_per_get")


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
    endpoint: str, keys: list[str], ranges: tuple[str, ...], seconds: float
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


def _cpu_seconds() -> float:
    """User and system CPU time of this process (its server threads) so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def in_process_ceiling(
    endpoint: str, keys: list[str], ranges: tuple[str, ...], seconds: float
) -> dict[str, float]:
    """``server_ceiling`` of a server that runs in this process (and nothing
    else does meanwhile), with its CPU: cores busy and milliseconds a GET,
    which say whether the server or the machine was the limit."""
    before, started = _cpu_seconds(), time.perf_counter()
    got = server_ceiling(endpoint, keys, ranges, seconds)
    cpu, elapsed = _cpu_seconds() - before, time.perf_counter() - started
    got["server_cores"] = cpu / elapsed
    got["server_cpu_ms_per_get"] = cpu / (got["gets_per_s"] * elapsed) * 1e3
    return got


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=DEFAULT_SECONDS)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="cachefsd-ceiling-"))
    servers: dict[str, S3TestServer | FileS3Server] = {
        "moto": S3TestServer(),
        "file_s3": FileS3Server(work / "file-s3"),
    }
    rng = random.Random(OBJECT_BYTES)
    objects = {f"shards/{index:02d}.bin": rng.randbytes(OBJECT_BYTES) for index in range(OBJECTS)}
    runs: dict[tuple[str, str], list[dict[str, float]]] = {}
    try:
        for server in servers.values():
            server.start()
            client = boto3.client("s3", endpoint_url=server.endpoint_url, region_name="us-east-1")
            client.create_bucket(Bucket="bench")
            for key, data in objects.items():
                client.put_object(Bucket="bench", Key=key, Body=data)
        for repeat in range(args.repeats):
            for name, server in servers.items():
                for mode, ranges in MODES.items():
                    got = in_process_ceiling(server.endpoint_url, list(objects), ranges, args.seconds)
                    runs.setdefault((name, mode), []).append(got)
                    print(
                        f"run {repeat + 1}  {name:<8} {mode:<13} "
                        f"{got['MBps']:8.1f} MB/s {got['gets_per_s']:8.1f} GETs/s "
                        f"server {got['server_cores']:.2f} cores, "
                        f"{got['server_cpu_ms_per_get']:.2f} ms a GET",
                        flush=True,
                    )
    finally:
        for server in servers.values():
            server.stop()
        shutil.rmtree(work, ignore_errors=True)

    results = {
        f"{name} {mode}": {
            measure: statistics.median(run[measure] for run in measured) for measure in MEASURES
        }
        for (name, mode), measured in runs.items()
    }
    print(
        f"\nmedians of {args.repeats} runs of {args.seconds:.0f} s, {CEILING_PROCESSES} x {CEILING_THREADS} "
        f"clients, {OBJECTS} objects of {OBJECT_BYTES >> 20} MiB"
    )
    print(f"{'server, GETs':<24}" + "".join(f"{measure:>24}" for measure in MEASURES))
    for label, row in results.items():
        print(f"{label:<24}" + "".join(f"{row[measure]:>24.2f}" for measure in MEASURES))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "server_ceiling.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
