"""``cachefsd bench SOURCE|MOUNTPOINT``: the storage path, read the way
training reads it.

``--workers`` processes (a DataLoader's workers) read every file of the
dataset once an epoch, in a seeded shuffle per epoch, for ``--epochs``
epochs; with ``--shards`` each file is a shard read front to back in 1 MiB
reads (a tar or WebDataset reader) rather than in one read. Each file's
pages are dropped once read, as for a dataset larger than RAM: every
epoch's reads reach the daemon (or, for ``--local``, the disk). Per epoch:
MB/s, files/s, the latency of a file's open-to-last-byte (p50, p99), and
from the daemon's counters of this command's own job (``jobs.py``: its
process group, which its workers share) the hit ratio of its bytes and the
share of its read requests that waited on the store.

Given a mount (or a directory in one), it reads there. Given a source (a
bucket URL or a directory not under a mount), it mounts it on a temporary
mountpoint, with a fresh cache unless ``--cache-dir`` names one, and
unmounts it at the end. ``--local DIR`` also reads the same files of a
local copy in the same orders, for the ratio against the local disk.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from cachefsd.cli.supervise import unmount
from cachefsd.control.client import ControlClient, client_for
from cachefsd.control.mounts import find_mount, foreign_mount, not_a_mount
from cachefsd.errors import CachefsdError
from cachefsd.jobs import CallerJobs
from cachefsd.metrics import UNKNOWN_JOB_LABEL

READ_CHUNK_BYTES = 1 << 20
# Files a worker reads per task: few enough for a smooth progress bar,
# enough that handing tasks out costs nothing beside the reads.
FILES_PER_TASK = 16


@dataclass(frozen=True, slots=True)
class EpochResult:
    epoch: int
    files: int
    nbytes: int
    seconds: float
    p50_seconds: float
    p99_seconds: float
    hit_ratio: float | None = None
    waited_share: float | None = None  # of read requests

    @property
    def mb_per_second(self) -> float:
        return self.nbytes / 1e6 / self.seconds if self.seconds > 0 else 0.0

    @property
    def files_per_second(self) -> float:
        return self.files / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True, slots=True)
class JobCounters:
    """This command's job as the daemon counts it."""

    cache_bytes: float = 0.0
    cold_bytes: float = 0.0
    cache_reads: float = 0.0
    cold_reads: float = 0.0

    def since(self, start: JobCounters) -> tuple[float | None, float | None]:
        """Hit ratio of bytes, and share of requests that waited, between ``start`` and this."""
        cache, cold = self.cache_bytes - start.cache_bytes, self.cold_bytes - start.cold_bytes
        hits, waits = self.cache_reads - start.cache_reads, self.cold_reads - start.cold_reads
        return (
            cache / (cache + cold) if cache + cold > 0 else None,
            waits / (hits + waits) if hits + waits > 0 else None,
        )


def epoch_orders(files: list[str], epochs: int, seed: int) -> list[list[str]]:
    """Each epoch's order: a fresh seeded shuffle, the same for any copy of the files."""
    rng = random.Random(seed)
    orders = []
    for _ in range(epochs):
        order = list(files)
        rng.shuffle(order)
        orders.append(order)
    return orders


def percentile(values: list[float], fraction: float) -> float:
    """The nearest-rank percentile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


def read_files(paths: list[str], chunk: int | None) -> list[tuple[int, float]]:
    """Read each file whole (in ``chunk``-byte reads, or one), then drop its
    pages; its bytes and seconds from open to last byte."""
    results = []
    for path in paths:
        started = time.perf_counter()
        nbytes = 0
        with open(path, "rb", buffering=0) as handle:
            if chunk is None:
                nbytes = len(handle.read())
            else:
                while data := handle.read(chunk):
                    nbytes += len(data)
            seconds = time.perf_counter() - started
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        results.append((nbytes, seconds))
    return results


def dataset_files(root: Path) -> list[str]:
    """Every file under ``root``, relative, as a loader's scan finds them."""
    files = []
    for directory, _, names in os.walk(root):
        for name in names:
            files.append(os.path.relpath(os.path.join(directory, name), root))
    return sorted(files)


def run_epochs(
    root: Path,
    orders: list[list[str]],
    workers: int,
    chunk: int | None,
    counters: Callable[[], JobCounters | None],
    label: str,
    console: Console,
) -> list[EpochResult]:
    """Read ``orders`` under ``root`` with ``workers`` processes, an epoch each."""
    results = []
    with ProcessPoolExecutor(workers) as pool:
        for epoch, order in enumerate(orders, start=1):
            paths = [str(root / relative) for relative in order]
            tasks = [paths[start : start + FILES_PER_TASK] for start in range(0, len(paths), FILES_PER_TASK)]
            before = counters()
            latencies: list[float] = []
            nbytes = 0
            columns = (TextColumn(f"{label} epoch {epoch}"), BarColumn(), MofNCompleteColumn())
            with Progress(*columns, TimeRemainingColumn(), console=console, transient=True) as progress:
                bar = progress.add_task("read", total=len(paths))
                started = time.perf_counter()
                for done in as_completed([pool.submit(read_files, task, chunk) for task in tasks]):
                    read = done.result()
                    for size, seconds in read:
                        nbytes += size
                        latencies.append(seconds)
                    progress.advance(bar, len(read))
                elapsed = time.perf_counter() - started
            after = counters()
            # A job with no series yet has read nothing; one without any after the epoch is counted as other.
            hit_ratio, waited = (None, None) if after is None else after.since(before or JobCounters())
            results.append(
                EpochResult(
                    epoch,
                    len(paths),
                    nbytes,
                    elapsed,
                    percentile(latencies, 0.5),
                    percentile(latencies, 0.99),
                    hit_ratio,
                    waited,
                )
            )
    return results


def job_counters(client: ControlClient, job: str) -> JobCounters | None:
    """This command's job in the daemon's ``/stats``; None while the daemon names no such job."""
    found = client.stats().jobs.get(job)
    if found is None:
        return None
    return JobCounters(found.bytes.cache, found.bytes.cold, found.reads.cache, found.reads.cold)


def _table(title: str, results: list[EpochResult]) -> Table:
    table = Table(title=title)
    for column in ("epoch", "files", "MB/s", "files/s", "p50 ms", "p99 ms", "hit ratio", "waited on store"):
        table.add_column(column, justify="right")
    for row in results:
        table.add_row(
            str(row.epoch),
            f"{row.files:,}",
            f"{row.mb_per_second:,.1f}",
            f"{row.files_per_second:,.0f}",
            f"{row.p50_seconds * 1000:.2f}",
            f"{row.p99_seconds * 1000:.2f}",
            "-" if row.hit_ratio is None else f"{row.hit_ratio:.1%}",
            "-" if row.waited_share is None else f"{row.waited_share:.1%}",
        )
    return table


@contextmanager
def mounted(target: str, cache_dir: Path | None, cache_size: str | None) -> Iterator[Path]:
    """``target`` itself when it is under a cachefsd mount; else ``target``
    mounted as a source on a temporary mountpoint, unmounted on exit."""
    if "://" not in target:
        mount = find_mount(target)
        if mount is not None:
            client_for(mount)  # a daemon that is gone is an error, not a source to mount
            yield Path(os.path.abspath(target))
            return
        foreign = foreign_mount(target)
        if foreign is not None:
            raise not_a_mount(target, foreign)
    work = Path(tempfile.mkdtemp(prefix="cachefsd-bench-"))
    mountpoint = work / "mnt"
    mountpoint.mkdir()
    command = [sys.executable, "-m", "cachefsd", "mount", target, str(mountpoint), "--no-metrics"]
    command += ["--cache-dir", str(cache_dir or work / "cache")]
    if cache_size is not None:
        command += ["--cache-size", cache_size]
    # What the mount says goes to stderr: stdout is the measurements' (--json).
    if subprocess.run(command, stdout=sys.stderr, check=False).returncode != 0:
        shutil.rmtree(work, ignore_errors=True)
        raise CachefsdError(f"could not mount {target} to measure it")
    try:
        yield mountpoint
    finally:
        try:
            unmount(mountpoint)
        except CachefsdError as exc:  # left as it is: never delete under a live mount
            print(f"cachefsd: warning: {exc}; {work} is left in place", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


def run(
    target: str,
    workers: int,
    epochs: int,
    seed: int,
    shards: bool,
    local: Path | None,
    cache_dir: Path | None,
    cache_size: str | None,
    as_json: bool = False,
) -> int:
    console = Console(stderr=True)
    chunk = READ_CHUNK_BYTES if shards else None
    with mounted(target, cache_dir, cache_size) as root:
        files = dataset_files(root)
        if not files:
            raise CachefsdError(f"{target} holds no files to read")
        if local is not None:
            missing = [relative for relative in files if not (local / relative).is_file()]
            if missing:
                raise CachefsdError(f"--local {local} lacks {len(missing)} of the files, e.g. {missing[0]}")
        mount = find_mount(root)
        assert mount is not None
        client = client_for(mount)
        job = CallerJobs().of(os.getpid()) or UNKNOWN_JOB_LABEL
        orders = epoch_orders(files, epochs, seed)
        how = f"{workers} workers, {'shards read in 1 MiB reads' if shards else 'whole files'}"
        console.print(f"{len(files):,} files under {root}, {epochs} shuffled epochs (seed {seed}), {how}")
        through = run_epochs(
            root, orders, workers, chunk, lambda: job_counters(client, job), "mount", console
        )
    direct = (
        None if local is None else run_epochs(local, orders, workers, chunk, lambda: None, "local", console)
    )
    ratio = None if direct is None else local_ratio(through, direct)
    if as_json:
        print(
            json.dumps(
                {
                    "mount": [_row(result) for result in through],
                    "local": None if direct is None else [_row(result) for result in direct],
                    "ratio_to_local": ratio,
                },
                indent=2,
            )
        )
        return 0
    out = Console()
    out.print(_table(f"through cachefsd ({target})", through))
    if direct is not None:
        out.print(_table(f"local copy ({local})", direct))
    if ratio is not None:
        out.print(f"epochs 2+: cachefsd reads at {ratio:.2f}x the local copy's MB/s (median)")
    return 0


def local_ratio(through: list[EpochResult], direct: list[EpochResult]) -> float | None:
    """The median over epochs 2+ (1 if only one) of the mount's MB/s over the local copy's."""
    pairs = list(zip(through, direct, strict=True))
    pairs = pairs[1:] or pairs
    ratios = [mine.mb_per_second / theirs.mb_per_second for mine, theirs in pairs if theirs.mb_per_second > 0]
    return statistics.median(ratios) if ratios else None


def _row(result: EpochResult) -> dict[str, Any]:
    return {
        **asdict(result),
        "mb_per_second": result.mb_per_second,
        "files_per_second": result.files_per_second,
    }
