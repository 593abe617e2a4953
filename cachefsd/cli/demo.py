"""``cachefsd demo``: the whole loop on one machine, with no cloud account.

Generates an ImageFolder-style dataset in a temporary directory, mounts it
through cachefsd with a fresh cache, scans it as ImageFolder does, reads
every file once per epoch in a new shuffled order with several worker
processes (as a DataLoader does),
checks every byte against the source, and prints each epoch's hit ratio as
the daemon's metrics report it.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.table import Table

from cachefsd.cli.supervise import unmount

CLASSES = 8
FILES_PER_CLASS = 64
FILE_BYTES = 128 << 10  # a typical JPEG sample
EPOCHS = 2


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _make_dataset(root: Path) -> dict[str, str]:
    """Files of random bytes in ImageFolder's layout (``train/<class>/``, so
    the daemon sees one job, not one a class folder at the mount's root);
    returns relative path -> sha256."""
    digests = {}
    rng = random.Random(0)
    for class_index in range(CLASSES):
        class_dir = root / "train" / f"class_{class_index:02d}"
        class_dir.mkdir(parents=True)
        for file_index in range(FILES_PER_CLASS):
            data = rng.randbytes(FILE_BYTES)
            relative = f"train/class_{class_index:02d}/sample_{file_index:04d}.jpg"
            (root / relative).write_bytes(data)
            digests[relative] = hashlib.sha256(data).hexdigest()
    return digests


def _read_files(paths: list[str]) -> list[tuple[str, str, int]]:
    """Read and hash each file, then drop its pages from the kernel's page
    cache: a real dataset outgrows RAM, and without this the second epoch
    would be served by the page cache, never reaching the daemon's tiers
    (nor its hit counters)."""
    results = []
    for path in paths:
        with open(path, "rb") as sample:
            data = sample.read()
            os.posix_fadvise(sample.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        results.append((path, hashlib.sha256(data).hexdigest(), len(data)))
    return results


def _cold_bytes(metrics_url: str) -> float:
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == "cachefsd_read_bytes":
            for sample in family.samples:
                if sample.name.endswith("_total") and sample.labels.get("source") == "cold":
                    return sample.value
    raise RuntimeError("cachefsd_read_bytes_total{source='cold'} not found in the metrics")


def run(workers: int, keep: bool) -> int:
    console = Console()
    workdir = Path(tempfile.mkdtemp(prefix="cachefsd-demo-"))
    dataset, mountpoint, cache = workdir / "dataset", workdir / "mnt", workdir / "cache"
    mountpoint.mkdir()
    console.print(f"[bold]cachefsd demo[/] in {workdir}")
    digests = _make_dataset(dataset)
    total_mib = len(digests) * FILE_BYTES / 2**20
    console.print(f"dataset: {len(digests)} files in {CLASSES} classes, {total_mib:.0f} MiB")
    port = _free_port()
    metrics_url = f"http://127.0.0.1:{port}/metrics"
    mount = subprocess.run(
        [
            sys.executable,
            "-m",
            "cachefsd",
            "mount",
            str(dataset),
            str(mountpoint),
            "--cache-dir",
            str(cache),
            "--metrics-addr",
            f"127.0.0.1:{port}",
        ],
        check=False,
    )
    if mount.returncode != 0:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
        return mount.returncode
    console.print(f"metrics at {metrics_url} while the demo runs")
    table = Table(title="shuffled epochs through the mount")
    for column in ("epoch", "files", "MiB/s", "hit ratio", "bytes verified"):
        table.add_column(column, justify="right")
    try:
        # The loader's index, as ImageFolder builds it: a scan of every class
        # folder, which is also the daemon's first guess of the epoch's files.
        files = sorted(str(Path(root) / name) for root, _, names in os.walk(mountpoint) for name in names)
        for epoch in range(1, EPOCHS + 1):
            order = list(files)
            random.Random(epoch).shuffle(order)
            shards = [order[worker::workers] for worker in range(workers)]
            cold_before = _cold_bytes(metrics_url)
            started = time.perf_counter()
            with ProcessPoolExecutor(workers) as pool:
                results = [item for shard in pool.map(_read_files, shards) for item in shard]
            elapsed = time.perf_counter() - started
            read_bytes = sum(size for _, _, size in results)
            bad = [
                path
                for path, digest, _ in results
                if digest != digests[str(Path(path).relative_to(mountpoint))]
            ]
            hit_ratio = 1 - (_cold_bytes(metrics_url) - cold_before) / read_bytes
            table.add_row(
                str(epoch),
                str(len(results)),
                f"{read_bytes / 2**20 / elapsed:.0f}",
                f"{hit_ratio:.1%}",
                "all match" if not bad else f"{len(bad)} MISMATCHED",
            )
            if bad:
                console.print(table)
                console.print(f"[red]mismatched files: {bad[:5]}")
                return 1
        console.print(table)
        console.print(f"\n[bold]cachefsd stats {mountpoint}[/]")
        subprocess.run([sys.executable, "-m", "cachefsd", "stats", str(mountpoint)], check=False)
    finally:
        unmount(mountpoint)
        console.print(f"unmounted {mountpoint}")
        if keep:
            console.print(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0
