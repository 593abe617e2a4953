"""Where the daemon's CPU goes in one epoch: user and system time, per thread,
and (with ``--py-spy``, after ``pip install py-spy``) a py-spy profile of
its Python stacks.

A moto S3 server in its own process on 127.0.0.1, a dataset of ``--files``
objects of ``--kib`` KiB, a fresh mount, and one epoch read by 4 processes:
the cold one, or (``--dropped``) one after a cold epoch and a warm one, with
the page cache dropped before it (root only), as for a dataset larger than RAM.

    .venv/bin/python -m benchmarks.profile_daemon [--files 1000] [--kib 128] [--dropped] [--py-spy OUT]

The profile is py-spy's "raw" format (collapsed stacks), one line a stack.
"""

from __future__ import annotations

import argparse
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import boto3

os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")

from benchmarks.read_bench import Dataset, Readers, drop_page_cache, free_port, make_dataset
from cachefsd.cli.supervise import unmount
from cachefsd.control.mounts import read_state

SERVER_START_SECONDS = 30.0


def thread_cpu(pid: int) -> dict[str, tuple[str, float, float]]:
    """Thread id -> (name, user seconds, system seconds) of process ``pid``."""
    tick = os.sysconf("SC_CLK_TCK")
    threads = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rpartition(")")[2].split()
            name = (task / "comm").read_text().strip()
        except OSError:  # the thread ended
            continue
        threads[task.name] = (name, int(fields[11]) / tick, int(fields[12]) / tick)
    return threads


@contextmanager
def s3_server(file_root: Path | None = None) -> Iterator[str]:
    """moto S3 (or the file-backed endpoint keeping its objects under
    ``file_root``) in a process of its own on a free port of 127.0.0.1,
    while the block runs: its endpoint, which it prints once it serves (as
    epoch_bench.py waits for it)."""
    command = [sys.executable, "-m", "cachefsd.testing.s3_server", "--host", "127.0.0.1"]
    if file_root is not None:
        command = [
            sys.executable,
            "-m",
            "cachefsd.testing.file_s3",
            "--host",
            "127.0.0.1",
            "--root",
            str(file_root),
        ]
    server = subprocess.Popen(command, stdout=subprocess.PIPE)
    try:
        assert server.stdout is not None
        ready, _, _ = select.select([server.stdout], [], [], SERVER_START_SECONDS)
        endpoint = server.stdout.readline().decode().strip() if ready else ""
        if not endpoint.startswith("http://"):
            raise RuntimeError(f"the S3 server did not start (said {endpoint!r})")
        yield endpoint
    finally:
        server.terminate()
        server.wait(30)


def report(
    before: dict[str, tuple[str, float, float]],
    after: dict[str, tuple[str, float, float]],
    files: int,
    seconds: float,
    nbytes: int,
    dropped: bool,
) -> None:
    used: dict[str, float] = {}
    user = system = 0.0
    for tid, (name, after_user, after_system) in after.items():
        _, before_user, before_system = before.get(tid, (name, 0.0, 0.0))
        user, system = user + after_user - before_user, system + after_system - before_system
        used[f"{tid} {name}"] = after_user - before_user + after_system - before_system
    mib = nbytes / (1 << 20)
    kind = "warm, page cache dropped" if dropped else "cold"
    print(f"{kind}: {nbytes / seconds / 1e6:.1f} MB/s, {files / seconds:.0f} files/s")
    total = user + system
    print(f"daemon CPU: {total / files * 1e6:.0f} us a file, {total / mib * 1e3:.2f} ms a MiB", end=" ")
    print(f"(user {user / files * 1e6:.0f} us, system {system / files * 1e6:.0f} us a file)")
    print("busiest threads (seconds):")
    for thread, seconds_used in sorted(used.items(), key=lambda item: item[1], reverse=True)[:8]:
        print(f"  {thread:<28} {seconds_used:6.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--files", type=int, default=1000)
    parser.add_argument("--kib", type=int, default=128)
    parser.add_argument("--dropped", action="store_true", help="a warm epoch with the page cache dropped")
    parser.add_argument("--py-spy", type=Path, help="write a py-spy profile of the epoch here")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="cachefsd-profile-"))
    mountpoint = work / "mnt"
    readers = Readers(4)
    with s3_server() as endpoint:
        try:
            client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
            client.create_bucket(Bucket="bench")
            dataset = Dataset("data", args.files, args.kib << 10)
            relatives = [
                r.removeprefix("data/") for r in make_dataset(dataset, work / "local", client, "bench")
            ]
            mountpoint.mkdir()
            mount = [sys.executable, "-m", "cachefsd", "mount", "s3://bench/data", str(mountpoint)]
            options = ["--endpoint-url", endpoint, "--cache-dir", str(work / "cache")]
            subprocess.run([*mount, *options, "--metrics-addr", f"127.0.0.1:{free_port()}"], check=True)
            state = read_state(mountpoint)
            assert state is not None
            if args.dropped:
                readers.epoch(mountpoint, relatives, seed="0")
                readers.epoch(mountpoint, relatives, seed="1")
                drop_page_cache()
            spy = None
            if args.py_spy:
                command = ["py-spy", "record", "-p", str(state.pid), "-o", str(args.py_spy)]
                spy = subprocess.Popen(
                    [*command, "--format", "raw", "--threads"],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                time.sleep(1)  # attached
            before = thread_cpu(state.pid)
            seconds, nbytes = readers.epoch(mountpoint, relatives, seed="2")
            after = thread_cpu(state.pid)
            if spy is not None:
                spy.send_signal(2)
                spy.wait(60)
        finally:
            if mountpoint.exists():
                unmount(mountpoint)
            readers.close()
            shutil.rmtree(work, ignore_errors=True)

    report(before, after, args.files, seconds, nbytes, args.dropped)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
