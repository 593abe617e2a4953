"""Issue 31's write benchmark: a checkpoint written through the local disk,
cachefsd, rclone mount and s3fs-fuse, beside obstore uploading the same
files, in one run against one remote-like S3 server; timed until every file
is closed and until every object is durable in the bucket.

The server is epoch_bench's: moto (``cachefsd.testing.s3_server``, each
request delayed ``--latency-ms``, 20) in a network namespace behind a veth
pair whose two directions an HTB qdisc caps at ``--rate-mbit`` (4000: a
fast link a node has to its bucket, which leaves the server's own write
path to be the limit it usually is here). Needs root (namespace, tc, FUSE,
``drop_caches``).

Two layouts (``--small``: every size a sixteenth, the same files):

- ``large``: 4 files of 1 GiB, one rank each, as ``torch.save(obj, path)``
  writes them: open, the tensors one ``write`` each, close; no fsync;
- ``dcp``: what torch 2.13's ``FileSystemWriter`` writes for 2 ranks with
  ``single_file_per_rank=False`` (a file per tensor): each rank's
  ``__R_0.distcp`` of 512 MiB (an embedding) and ``__R_1..32.distcp`` of
  8 MiB, each fsynced before its close (``sync_files``, on by default), in
  turn (``thread_count=1``); then, once every rank is done, rank 0 writes the
  pickled metadata to ``.metadata.tmp``, fsyncs and closes it, removes any
  ``.metadata`` and renames the tmp file onto it.

A file holds tensors of ``TENSOR_BYTES`` (8 MiB), each one ``write``: that
is how ``torch.save`` writes a tensor's storage (one call of its whole
size). Every rank is a process of its own that reads its files' bytes
(random, made once a run, the same for every contender) into memory before
the clock starts, as a checkpoint's state is in memory; the page cache is
dropped (``sync`` first) just before, so that one contender's dirty pages
do not slow the next.

Contenders, each repeat (``--repeats``, 3) in turn, the local disk first and
the others rotated a place a repeat (read_bench's ``in_turn``):

- ``local``: the files on the disk the caches are on; closed is all;
- ``obstore``: the same files uploaded from local disk by obstore in a
  process of its own, ``OBSTORE_FILES`` files at a time, each in parts of
  5 MiB, 12 in flight (its defaults): the server's write ceiling, and the
  durable time the others are compared with;
- ``ordered``: obstore again, the files in the writers' order: a rank's
  files one after another, the ranks at once, the metadata last. With fsync
  each file, a client whose fsync means "in the bucket" (cachefsd) cannot
  close the last file sooner than this: the floor its close time is
  measured against;
- ``cachefsd``: ``python -m cachefsd mount --writable``; durable when
  ``python -m cachefsd sync MNT --timeout S`` returns 0. Until cachefsd has
  ``--writable`` its mount fails and the contender is skipped, reason
  printed;
- ``rclone``: ``rclone mount --vfs-cache-mode writes`` (the mode for
  writing: it stages a file on local disk and uploads it once closed),
  ``--vfs-write-back 1ms``: its default, 5s, waits that long after the last
  close before uploading, a fixed delay on every durable time; 0 is no
  shorter delay but another mode, in which close itself uploads (rclone's
  ``syncWriteBack := WriteBack <= 0``), so 1ms is its least; and
  ``--no-modtime`` (no server-side copy to set a modification time after
  an upload); its upload defaults kept: ``--transfers 4`` files at a time,
  multipart above ``--s3-upload-cutoff 200Mi`` in ``--s3-chunk-size 5Mi``
  parts, ``--s3-upload-concurrency 4``;
- ``s3fs``: ``s3fs -o use_cache=DIR`` (staging under the run directory);
  it uploads on fsync and close, so a file is in the bucket once closed.

A mounted contender is durable when ``cachefsd sync`` returns or, for the
others, when a listing of its prefix shows every object at its size
(ListObjectsV2, polled, bounded: one request a poll, where a HEAD a file
would take 66 x 20 ms a sweep). Then every object is checked against the
file written (its size; its md5, from the ETag of a single-part upload or by
reading it back): a contender whose bucket holds other bytes, or objects
that were not written (a ``.metadata.tmp`` left behind), has failed. A
contender whose program is missing, or whose mount fails, is skipped with
the reason printed. Everything is under the run's temporary directory
(``TMPDIR``), unmounted in ``finally``; every wait is bounded.

Reported, medians over the repeats, by layout: seconds and MB/s until every
file was closed and its ratio to the local disk's (goal for cachefsd:
>= 0.8 x), seconds and MB/s until durable and its ratio to obstore's (goal:
<= 1.2 x), each repeat paired with its own; and the CPU time of the serving
process (daemon, rclone, s3fs; obstore's own) a MiB.

    # from the repository root, as root
    python -m benchmarks.write_bench [--repeats 3] [--small] [--rate-mbit 4000] [--json FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from threading import BrokenBarrierError
from typing import Any

from obstore import put
from obstore.store import S3Store

from benchmarks.epoch_bench import (
    BUCKET,
    ENDPOINT,
    Mounted,
    bench_env,
    environment,
    s3_client,
    tail,
    unmount_all_under,
)
from benchmarks.read_bench import (
    ACCESS_KEY,
    Check,
    Cpu,
    Setup,
    drop_page_cache,
    in_turn,
    own_cpu,
    process_cpu,
    start_cachefsd,
    start_local,
    start_rclone,
    start_s3fs,
)

MIB = 1 << 20
GIB = 1 << 30
# torch.save writes a tensor's storage in one write(2) of its whole size; a
# checkpoint's tensors are taken to be 8 MiB (a 2048 x 1024 fp32 weight).
TENSOR_BYTES = 8 * MIB
# A pickled DCP Metadata of 66 tensors: a few hundred bytes of chunk and
# storage records each.
METADATA_BYTES = 32 << 10
SMALL_DIVISOR = 16
REPEATS = 3
RATE_MBIT = 4000
LATENCY_MS = 20.0
# obstore's files in flight; each file's parts in flight are its own default (12).
OBSTORE_FILES = 4
# moto joins a 1 GiB object's parts in one CompleteMultipartUpload, longer
# than obstore's 30 s default on this loaded 2-core VM: obstore then sends it
# again, to an upload that is no more, and fails.
OBSTORE_REQUEST_TIMEOUT = "300s"
METADATA = ".metadata"
METADATA_TMP = ".metadata.tmp"

LOCAL, OBSTORE, ORDERED, CACHEFSD, RCLONE, S3FS = "local", "obstore", "ordered", "cachefsd", "rclone", "s3fs"
# The module's docstring says why each.
RCLONE_WRITE_OPTIONS = ("--vfs-cache-mode", "writes", "--vfs-write-back", "1ms", "--no-modtime")
# What every cachefsd mount of the run is given besides read_bench's flags.
CACHEFSD_FLAGS = ("--writable",)

# Issue 31's goals for cachefsd.
CLOSE_RATIO = 0.8  # close at least this x the local disk's throughput
DURABLE_RATIO = 1.2  # durable within this x obstore's time

# Bounds: a rank reading its bytes (1 GiB); writing a checkpoint (4 GiB
# through s3fs, which uploads as it closes); everything closed to durable;
# a rank process's exit; a poll of the bucket.
LOAD_SECONDS = 300.0
WRITE_SECONDS = 900.0
DURABLE_SECONDS = 900.0
EXIT_SECONDS = 15.0
POLL_SECONDS = 0.1
# `cachefsd sync` is given DURABLE_SECONDS and this long to say why it failed.
SYNC_MARGIN_SECONDS = 30.0
OBSTORE_SECONDS = DURABLE_SECONDS


# -- layouts -----------------------------------------------------------------------


@dataclass(frozen=True)
class File:
    name: str
    size: int


@dataclass(frozen=True)
class Layout:
    """A checkpoint: each rank's files in the order it writes them."""

    name: str
    ranks: tuple[tuple[File, ...], ...]
    fsync: bool  # each file fsynced before its close
    metadata: File | None = None  # written by rank 0 once every rank is done, via METADATA_TMP

    @property
    def files(self) -> tuple[File, ...]:
        """Every file as the checkpoint ends up, the metadata included."""
        data = tuple(file for rank in self.ranks for file in rank)
        return data + ((self.metadata,) if self.metadata else ())

    @property
    def total_bytes(self) -> int:
        return sum(file.size for file in self.files)


def large_layout(divisor: int = 1) -> Layout:
    """4 files of 1 GiB / ``divisor``, one rank each, as torch.save writes them."""
    return Layout(
        "large", tuple((File(f"shard_{rank}.pt", GIB // divisor),) for rank in range(4)), fsync=False
    )


def dcp_layout(divisor: int = 1) -> Layout:
    """2 ranks of torch.distributed.checkpoint's FileSystemWriter with a file
    a tensor: a 512 MiB tensor and 32 of 8 MiB each (sizes / ``divisor``),
    fsynced, and the metadata."""
    ranks = tuple(
        (
            File(f"__{rank}_0.distcp", 512 * MIB // divisor),
            *(File(f"__{rank}_{index}.distcp", 8 * MIB // divisor) for index in range(1, 33)),
        )
        for rank in range(2)
    )
    return Layout("dcp", ranks, fsync=True, metadata=File(METADATA, METADATA_BYTES))


def layouts(small: bool) -> tuple[Layout, Layout]:
    divisor = SMALL_DIVISOR if small else 1
    return large_layout(divisor), dcp_layout(divisor)


def make_source(layout: Layout, directory: Path) -> dict[str, str]:
    """The layout's files under ``directory``, random bytes; their md5s by name."""
    directory.mkdir(parents=True)
    md5s = {}
    for file in layout.files:
        digest = hashlib.md5()
        with open(directory / file.name, "wb") as out:
            for offset in range(0, file.size, TENSOR_BYTES):
                chunk = os.urandom(min(TENSOR_BYTES, file.size - offset))
                digest.update(chunk)
                out.write(chunk)
        md5s[file.name] = digest.hexdigest()
    return md5s


# -- the writers ----------------------------------------------------------------------


def write_file(path: Path, data: bytes, fsync: bool) -> None:
    """``data`` as a checkpoint writer writes it: a buffered file, a tensor a write."""
    view = memoryview(data)
    with open(path, "wb") as out:
        for offset in range(0, len(view), TENSOR_BYTES):
            out.write(view[offset : offset + TENSOR_BYTES])
        if fsync:
            out.flush()
            os.fsync(out.fileno())


def write_metadata(directory: Path, data: bytes, fsync: bool) -> None:
    """FileSystemWriter.finish: the tmp file, then renamed over any old one."""
    write_file(directory / METADATA_TMP, data, fsync)
    (directory / METADATA).unlink(missing_ok=True)
    os.replace(directory / METADATA_TMP, directory / METADATA)


def _rank(
    layout: Layout, rank: int, source: Path, target: Path, barrier: Any, results: mp.Queue[tuple[Any, ...]]
) -> None:
    """One rank: its bytes into memory; then, when the barrier lets it, its
    files; rank 0 then the metadata once every rank is done. Puts (rank,
    started, ended, error) on ``results``."""
    try:
        data = [(file, (source / file.name).read_bytes()) for file in layout.ranks[rank]]
        metadata = (source / layout.metadata.name).read_bytes() if rank == 0 and layout.metadata else None
        barrier.wait(LOAD_SECONDS)  # loaded
        barrier.wait(LOAD_SECONDS)  # the clock starts
        started = time.monotonic()
        for file, contents in data:
            write_file(target / file.name, contents, layout.fsync)
        barrier.wait(WRITE_SECONDS)  # every rank's files closed
        if metadata is not None:
            write_metadata(target, metadata, layout.fsync)
        results.put((rank, started, time.monotonic(), None))
    except BaseException as exc:
        barrier.abort()
        results.put((rank, 0.0, 0.0, f"rank {rank}: {exc!r}"))


def write_checkpoint(
    layout: Layout, source: Path, target: Path, before_start: Callable[[], object]
) -> tuple[float, float]:
    """Write ``layout`` from ``source`` into ``target``, a process a rank;
    ``before_start`` runs once every rank holds its bytes. When the first
    rank started and the last file was closed (``time.monotonic``, one clock
    for every process)."""
    context = mp.get_context("fork")
    barrier = context.Barrier(len(layout.ranks) + 1)
    results: mp.Queue[tuple[Any, ...]] = context.Queue()
    processes = [
        context.Process(target=_rank, args=(layout, rank, source, target, barrier, results), daemon=True)
        for rank in range(len(layout.ranks))
    ]
    for process in processes:
        process.start()
    outcomes = []
    try:
        barrier.wait(LOAD_SECONDS)
        before_start()
        barrier.wait(LOAD_SECONDS)
        barrier.wait(WRITE_SECONDS)
        outcomes = [results.get(timeout=WRITE_SECONDS) for _ in processes]
    except (BrokenBarrierError, queue.Empty) as exc:
        barrier.abort()
        errors = []
        while True:
            try:
                errors.append(results.get(timeout=POLL_SECONDS)[3])
            except queue.Empty:
                break
        raise RuntimeError(
            "; ".join(error for error in errors if error) or f"the ranks did not finish: {exc!r}"
        ) from exc
    finally:
        for process in processes:
            process.join(EXIT_SECONDS)
            if process.is_alive():
                process.kill()
                process.join(EXIT_SECONDS)
    errors = [error for _, _, _, error in outcomes if error]
    if errors:
        raise RuntimeError("; ".join(errors))
    return min(started for _, started, _, _ in outcomes), max(ended for _, _, ended, _ in outcomes)


# -- the bucket ----------------------------------------------------------------------------


Listing = dict[str, tuple[int, str]]  # name under the prefix -> (size, ETag without quotes)


def missing(sizes: dict[str, int], listing: Listing) -> list[str]:
    """The names not in ``listing`` at their size."""
    return [name for name, size in sizes.items() if name not in listing or listing[name][0] != size]


def check_objects(
    sizes: dict[str, int], md5s: dict[str, str], listing: Listing, read_md5: Callable[[str], str]
) -> list[str]:
    """What is wrong with the bucket's copy of a checkpoint: an object
    missing, of another size, other bytes, or one that was not written.
    An ETag is the md5 of a single-part upload (one without a "-"); an
    object uploaded in parts is read back (``read_md5``)."""
    problems = []
    for name, size in sizes.items():
        if name not in listing:
            problems.append(f"{name} missing")
            continue
        got_size, etag = listing[name]
        if got_size != size:
            problems.append(f"{name} is {got_size:,} bytes, not {size:,}")
        elif (etag if "-" not in etag else read_md5(name)) != md5s[name]:
            problems.append(f"{name} holds other bytes")
    problems += [f"{name} was not written" for name in sorted(set(listing) - set(sizes))]
    return problems


@dataclass(frozen=True)
class Prefix:
    """A contender's place in the bucket."""

    client: Any
    prefix: str

    def listing(self) -> Listing:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=f"{self.prefix}/")
        return {
            item["Key"].removeprefix(f"{self.prefix}/"): (item["Size"], item["ETag"].strip('"'))
            for page in pages
            for item in page.get("Contents", [])
        }

    def read_md5(self, name: str) -> str:
        digest = hashlib.md5()
        body = self.client.get_object(Bucket=BUCKET, Key=f"{self.prefix}/{name}")["Body"]
        for chunk in iter(lambda: body.read(TENSOR_BYTES), b""):
            digest.update(chunk)
        return digest.hexdigest()

    def delete_all(self) -> None:
        names = list(self.listing())
        for start in range(0, len(names), 1000):  # DeleteObjects takes up to 1,000 keys
            keys = [{"Key": f"{self.prefix}/{name}"} for name in names[start : start + 1000]]
            self.client.delete_objects(Bucket=BUCKET, Delete={"Objects": keys})


def in_bucket(mounted: Mounted, prefix: Prefix, sizes: dict[str, int]) -> float:
    """When a listing first showed every object at its size."""
    deadline = time.monotonic() + DURABLE_SECONDS
    while True:
        left = missing(sizes, prefix.listing())
        if not left:
            return time.monotonic()
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{len(left)} objects not in the bucket {DURABLE_SECONDS:g}s after the last close"
            )
        time.sleep(POLL_SECONDS)


def cachefsd_sync(mounted: Mounted, prefix: Prefix, sizes: dict[str, int]) -> float:
    """When ``cachefsd sync`` returned 0."""
    command = [
        sys.executable,
        "-m",
        "cachefsd",
        "sync",
        str(mounted.root),
        "--timeout",
        f"{DURABLE_SECONDS:g}",
    ]
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=DURABLE_SECONDS + SYNC_MARGIN_SECONDS,
        check=False,
        env=bench_env(),
    )
    if result.returncode != 0:
        said = (result.stderr or result.stdout).strip()[-300:]
        raise RuntimeError(f"cachefsd sync exited {result.returncode}: {said}")
    return time.monotonic()


# -- the contenders -------------------------------------------------------------------------


@dataclass(frozen=True)
class Contender:
    name: str
    start: Callable[[Setup], Mounted] | None  # None: obstore, which uploads from local disk
    durable: Callable[[Mounted, Prefix, dict[str, int]], float] | None = None  # when; None: never uploads
    program: str | None = None  # the executable it needs on PATH
    install: str = ""


CONTENDERS = (
    Contender(LOCAL, start_local),
    Contender(OBSTORE, None),
    Contender(ORDERED, None),
    Contender(CACHEFSD, start_cachefsd, cachefsd_sync),
    Contender(
        RCLONE,
        lambda setup: start_rclone(setup, *RCLONE_WRITE_OPTIONS),
        in_bucket,
        "rclone",
        "apt-get install -y rclone",
    ),
    Contender(S3FS, start_s3fs, in_bucket, "s3fs", "apt-get install -y s3fs"),
)


def available_contenders() -> tuple[list[Contender], dict[str, str]]:
    """The contenders this machine can run, and why each other one cannot."""
    ready, skipped = [], {}
    fuse = Path("/dev/fuse").exists()
    for contender in CONTENDERS:
        if contender.program and shutil.which(contender.program) is None:
            skipped[contender.name] = f"{contender.program} is not installed: {contender.install}"
        elif contender.start not in (None, start_local) and not fuse:
            skipped[contender.name] = "no /dev/fuse"
        else:
            ready.append(contender)
    return ready, skipped


@dataclass(frozen=True)
class Run:
    """One contender's checkpoint, seconds from the first rank's start."""

    closed: float | None  # the last file closed; None for obstore and ordered
    durable: float | None  # every object in the bucket; None for the local disk
    nbytes: int
    cpu: Cpu | None  # the serving process's; obstore's own; None for the local disk


def _obstore_upload(
    prefix: str, source: Path, stages: list[list[list[str]]], threads: int
) -> tuple[float, Cpu]:
    """Each stage after the one before; a stage's queues ``threads`` at a
    time, each queue's files one after another."""
    store = S3Store(
        BUCKET,
        endpoint=ENDPOINT,
        region="us-east-1",
        access_key_id=ACCESS_KEY,
        secret_access_key=ACCESS_KEY,
        virtual_hosted_style_request=False,
        client_options={"allow_http": True, "timeout": OBSTORE_REQUEST_TIMEOUT},
    )
    cpu, started = own_cpu(), time.monotonic()

    def upload(names: list[str]) -> None:
        for name in names:
            put(store, f"{prefix}/{name}", source / name)

    for stage in stages:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(upload, stage))
    return time.monotonic() - started, own_cpu() - cpu


def run_obstore(layout: Layout, source: Path, prefix: Prefix, in_order: bool) -> Run:
    """obstore uploading the checkpoint's files from ``source``, any
    ``OBSTORE_FILES`` at a time or ``in_order`` (the module's docstring), in
    a process of its own (its CPU time is then its own)."""
    drop_page_cache()
    if in_order:
        stages = [[[file.name for file in rank] for rank in layout.ranks]]
        stages += [[[layout.metadata.name]]] if layout.metadata else []
        threads = len(layout.ranks)
    else:
        stages, threads = [[[file.name] for file in layout.files]], OBSTORE_FILES
    with ProcessPoolExecutor(1, mp_context=mp.get_context("fork")) as pool:
        upload = pool.submit(_obstore_upload, prefix.prefix, source, stages, threads)
        seconds, cpu = upload.result(OBSTORE_SECONDS)
    return Run(closed=None, durable=seconds, nbytes=layout.total_bytes, cpu=cpu)


def run_mounted(contender: Contender, setup: Setup, layout: Layout, source: Path, prefix: Prefix) -> Run:
    """The checkpoint written through the contender's fresh mount, until
    every file is closed and, if it uploads, until every object is durable."""
    assert contender.start is not None
    setup.local_root.mkdir()
    mounted = contender.start(setup)
    try:
        before = process_cpu(mounted.pid) if mounted.pid else None
        started, closed = write_checkpoint(layout, source, mounted.root, drop_page_cache)
        sizes = {file.name: file.size for file in layout.files}
        durable = None if contender.durable is None else contender.durable(mounted, prefix, sizes)
        cpu = None if mounted.pid is None or before is None else process_cpu(mounted.pid) - before
    finally:
        mounted.stop()
    return Run(closed - started, None if durable is None else durable - started, layout.total_bytes, cpu)


# -- the summary --------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One line of the table: medians over the repeats."""

    layout: str
    contender: str
    runs: int
    close_s: float | None
    close_MBps: float | None
    close_ratio: float | None  # throughput to the local disk's, paired by repeat
    durable_s: float | None
    durable_MBps: float | None
    durable_ratio: float | None  # time to obstore's, paired by repeat
    cpu_ms_per_MiB: float | None


def _median(values: Iterable[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return statistics.median(present) if present else None


def _ratio(part: float | None, whole: float | None) -> float | None:
    return None if part is None or not whole else part / whole


def summarize(runs: dict[tuple[str, str, int], Run]) -> list[Row]:
    """Rows from runs keyed by (layout, contender, repeat), in the runs'
    order. A ratio pairs each repeat with the local disk's (close) or
    obstore's (durable) run of that repeat: the machine drifts."""
    rows = []
    for layout, contender in dict.fromkeys(key[:2] for key in runs):
        mine = {key[2]: run for key, run in runs.items() if key[:2] == (layout, contender)}
        close_ratios, durable_ratios = [], []
        for repeat, run in mine.items():
            local, obstore = runs.get((layout, LOCAL, repeat)), runs.get((layout, OBSTORE, repeat))
            if contender != LOCAL and local is not None:
                close_ratios.append(_ratio(local.closed, run.closed))
            if contender != OBSTORE and obstore is not None:
                durable_ratios.append(_ratio(run.durable, obstore.durable))
        close_s = _median(run.closed for run in mine.values())
        durable_s = _median(run.durable for run in mine.values())
        nbytes = next(iter(mine.values())).nbytes
        rows.append(
            Row(
                layout=layout,
                contender=contender,
                runs=len(mine),
                close_s=close_s,
                close_MBps=_median(_ratio(run.nbytes / 1e6, run.closed) for run in mine.values()),
                close_ratio=_median(close_ratios),
                durable_s=durable_s,
                durable_MBps=_median(_ratio(run.nbytes / 1e6, run.durable) for run in mine.values()),
                durable_ratio=_median(durable_ratios),
                cpu_ms_per_MiB=_median(
                    None if run.cpu is None else run.cpu.total / (nbytes / MIB) * 1e3 for run in mine.values()
                ),
            )
        )
    return rows


def check_targets(rows: list[Row], layout_names: Iterable[str]) -> list[Check]:
    """cachefsd's rows against issue 31's goals."""
    cells = {(row.layout, row.contender): row for row in rows}
    checks = []
    for name in layout_names:
        row = cells.get((name, CACHEFSD))
        close = None if row is None else row.close_ratio
        durable = None if row is None else row.durable_ratio
        for target, value, bound, at_least in (
            (f"{name}: close >= {CLOSE_RATIO} x local", close, CLOSE_RATIO, True),
            (f"{name}: durable <= {DURABLE_RATIO} x obstore", durable, DURABLE_RATIO, False),
        ):
            if value is None:
                checks.append(Check(target, "not measured", None))
            else:
                checks.append(Check(target, f"{value:.2f} x", value >= bound if at_least else value <= bound))
    return checks


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: list[Row]) -> None:
    print(
        f"{'layout':<6} {'contender':<9} {'closed s':>8} {'MB/s':>7} {'x local':>7} "
        f"{'durable s':>9} {'MB/s':>7} {'x obstore':>9} {'CPU a MiB':>9}"
    )
    for row in rows:
        cpu = "-" if row.cpu_ms_per_MiB is None else f"{row.cpu_ms_per_MiB:.2f} ms"
        print(
            f"{row.layout:<6} {row.contender:<9} {_cell(row.close_s, '.2f'):>8} "
            f"{_cell(row.close_MBps, ',.0f'):>7} {_cell(row.close_ratio, '.2f'):>7} "
            f"{_cell(row.durable_s, '.2f'):>9} "
            f"{_cell(row.durable_MBps, ',.0f'):>7} {_cell(row.durable_ratio, '.2f'):>9} {cpu:>9}"
        )


# -- the run ---------------------------------------------------------------------------------


@dataclass
class Results:
    runs: dict[tuple[str, str, int], Run] = field(default_factory=dict)  # (layout, contender, repeat)
    failed: dict[str, str] = field(default_factory=dict)  # contender -> why; not run again


def bench_layout(
    layout: Layout,
    repeat: int,
    contenders: list[Contender],
    source: Path,
    md5s: dict[str, str],
    client: Any,
    work: Path,
    results: Results,
) -> None:
    """One repeat of one layout: each contender in turn, its bucket checked."""
    label = f"repeat {repeat + 1} {layout.name:<5}"
    sizes = {file.name: file.size for file in layout.files}
    for contender in in_turn(contenders, repeat):
        if contender.name in results.failed:
            continue
        run_dir = work / f"{contender.name}-{layout.name}-{repeat}"
        run_dir.mkdir()
        prefix = Prefix(client, f"{layout.name}-{contender.name}-{repeat}")
        setup = Setup(ENDPOINT, prefix.prefix, run_dir / "checkpoint", run_dir, CACHEFSD_FLAGS)
        try:
            if contender.start is None:
                run = run_obstore(layout, source, prefix, in_order=contender.name == ORDERED)
            else:
                run = run_mounted(contender, setup, layout, source, prefix)
            problems = (
                []
                if contender.name == LOCAL
                else check_objects(sizes, md5s, prefix.listing(), prefix.read_md5)
            )
            if problems:
                raise RuntimeError(f"the bucket is wrong: {'; '.join(problems[:5])}")
        except Exception as exc:  # a contender's failure is a result; the others still run
            logs = " | ".join(tail(log) for log in run_dir.glob("*.log"))
            said = " ".join(str(exc).split())  # a usage message on one line
            results.failed[contender.name] = f"failed: {said}" + (f" (log: {logs})" if logs else "")
            print(f"{label} {contender.name}: {results.failed[contender.name]}", flush=True)
            continue
        finally:
            unmount_all_under(run_dir)
            shutil.rmtree(run_dir, ignore_errors=True)
            prefix.delete_all()
        results.runs[(layout.name, contender.name, repeat)] = run
        closed = (
            ""
            if run.closed is None
            else f"closed {run.closed:7.2f} s {run.nbytes / 1e6 / run.closed:7,.0f} MB/s"
        )
        durable = (
            ""
            if run.durable is None
            else f"durable {run.durable:7.2f} s {run.nbytes / 1e6 / run.durable:7,.0f} MB/s"
        )
        print(f"{label} {contender.name:<9} {closed:<34} {durable}", flush=True)


def report(
    args: argparse.Namespace, plan: tuple[Layout, ...], repeats: int, results: Results
) -> dict[str, Any]:
    """Print the table and the goals; the same as a JSON-able dict."""
    rows = summarize(results.runs)
    checks = check_targets(rows, [layout.name for layout in plan])
    print()
    for layout in plan:
        sizes = ", ".join(
            f"{size / MIB:g} MiB" for size in sorted({f.size for f in layout.files}, reverse=True)
        )
        fsync = "on" if layout.fsync else "off"
        print(
            f"{layout.name}: {len(layout.files)} files ({sizes}), {layout.total_bytes / MIB:,.0f} MiB, "
            f"{len(layout.ranks)} ranks, fsync {fsync}"
        )
    print(
        f"server: moto, {args.latency_ms:g} ms a request, {args.rate_mbit} Mbit/s each way; "
        f"its write ceiling is obstore's row; medians of {repeats} repeats"
    )
    print(f"rclone: {' '.join(RCLONE_WRITE_OPTIONS)} (--vfs-write-back's default: 5s; 0 uploads in close)\n")
    print_table(rows)
    print("\nissue 31's goals for cachefsd:")
    for check in checks:
        verdict = {True: "met", False: "NOT met", None: "-"}[check.met]
        print(f"  {verdict:<8} {check.target:<36} {check.measured}")
    cells = {(row.layout, row.contender): row for row in rows}
    for layout in plan:
        mine, floor = cells.get((layout.name, CACHEFSD)), cells.get((layout.name, ORDERED))
        if layout.fsync and mine and floor and mine.close_s and floor.durable_s:
            print(
                f"  {layout.name}: closed in {mine.close_s / floor.durable_s:.2f} x the time obstore takes"
                " to upload the files in the writers' order (fsync = in the bucket)"
            )
    for name, reason in results.failed.items():
        print(f"{name}: {reason}")
    return {
        "command": sys.argv,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "layouts": [asdict(layout) for layout in plan],
        "repeats": repeats,
        "rate_mbit": args.rate_mbit,
        "latency_ms": args.latency_ms,
        "rclone_options": list(RCLONE_WRITE_OPTIONS),
        "rows": [asdict(row) for row in rows],
        "targets": [asdict(check) for check in checks],
        "skipped": results.failed,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument("--small", action="store_true", help="every size a sixteenth, the same files")
    parser.add_argument("--rate-mbit", type=int, default=RATE_MBIT, help="the link's cap, each way")
    parser.add_argument("--latency-ms", type=float, default=LATENCY_MS, help="the server's delay a request")
    parser.add_argument("--json", type=Path, help="also write the results here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("write_bench needs root (network namespace, tc, FUSE, drop_caches)", file=sys.stderr)
        return 2
    contenders, skipped = available_contenders()
    for name, reason in skipped.items():
        print(f"{name}: skipped ({reason})")
    plan = layouts(args.small)
    results = Results(failed=skipped)
    work = Path(tempfile.mkdtemp(prefix="write-bench-"))
    try:
        with environment(args, work):
            client = s3_client()
            client.create_bucket(Bucket=BUCKET)
            md5s = {layout.name: make_source(layout, work / "source" / layout.name) for layout in plan}
            for repeat in range(args.repeats):
                for layout in plan:
                    source = work / "source" / layout.name
                    bench_layout(layout, repeat, contenders, source, md5s[layout.name], client, work, results)
    finally:
        unmount_all_under(work)
        shutil.rmtree(work, ignore_errors=True)
    summary = report(args, plan, args.repeats, results)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
