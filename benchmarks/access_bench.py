"""Access patterns beside training epochs: large objects and random reads, cachefsd vs its peers.

``epoch_bench.py`` reads many small files; this reads what else a training
node reads, through each contender in turn against the same remote-like S3
server (moto in a network namespace, ``--latency-ms`` per request, an HTB
``--rate-mbit`` cap; the same network and contenders as ``epoch_bench``):

- **sequential**: a cold read of a 256 MB object, 1 MiB ``read()`` calls
  (a shard, a checkpoint, ``cp``);
- **tar stream**: a cold pass over a 100 MB tar of 2,000 members with
  ``tarfile.open(mode="r|")`` (a WebDataset shard);
- **random, fresh opens**: 1,000 reads of 64 KiB at random 4 KiB-aligned
  offsets of a cached 256 MB object, each through its own ``open`` (a
  dataset that opens its shard per sample);
- **random, one descriptor**: the same through one ``open`` (an indexed
  format read with ``pread``, or ``np.memmap``).

The random reads are of a cached object (read once in full first), with the
page cache dropped before each pattern: they measure the cache, not the
network. Every byte read is compared with the local copy. ``local`` reads
the same files from local disk, the limit. Per contender the serving
process's peak RSS (``VmHWM``) over the whole run is reported too.

Each contender starts from an empty cache; ``--repeats`` runs the whole
sequence again and the table shows medians. Moto reads a whole object for
every ranged GET (about 200 ms for 256 MB), which punishes many small GETs
and not one long one: the server's limit, not the client's, on the cold
patterns. Writes ``benchmarks/results/access_bench.json``. Needs root.

    .venv/bin/python benchmarks/access_bench.py [--repeats 3] [--only cachefsd,rclone,s3fs,local]
"""

from __future__ import annotations

import argparse
import io
import multiprocessing as mp
import os
import queue
import random
import shutil
import statistics
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.epoch_bench import (
    BUCKET,
    PREFIX,
    RESULTS,
    STARTERS,
    VARIANTS,
    Context,
    Dataset,
    drop_page_cache,
    environment,
    finish,
    log,
    s3_client,
    unmount_all_under,
)

MIB = 1 << 20
SEQUENTIAL_BYTES = 256 * MIB
TAR_MEMBERS = 2000
TAR_MEMBER_BYTES = 50_000
RANDOM_READS = 1000
RANDOM_READ_BYTES = 64 << 10
PATTERN_SECONDS = 600.0
CONTENDERS = ("local", "cachefsd", "rclone", "s3fs")
PATTERNS = ("sequential", "tar stream", "random, fresh opens", "random, one descriptor")
FILES = {"sequential": "seq.bin", "tar stream": "shard.tar", "random": "rand.bin"}


def make_files(local: Path, client: Any) -> Dataset:
    """The three objects, written locally and uploaded under the prefix the starters mount."""
    rng = random.Random("access-bench")
    local.mkdir(parents=True)
    for name in (FILES["sequential"], FILES["random"]):
        with open(local / name, "wb") as out:
            for _ in range(SEQUENTIAL_BYTES // MIB):
                out.write(rng.randbytes(MIB))
    with tarfile.open(local / FILES["tar stream"], "w") as shard:
        for member in range(TAR_MEMBERS):
            data = rng.randbytes(TAR_MEMBER_BYTES)
            info = tarfile.TarInfo(f"{member:05d}.jpg")
            info.size = len(data)
            shard.addfile(info, io.BytesIO(data))
    names = sorted(path.name for path in local.iterdir())
    client.create_bucket(Bucket=BUCKET)
    for name in names:
        client.upload_file(str(local / name), BUCKET, f"{PREFIX}/{name}")
    return Dataset(names, local, [(local / name).stat().st_size for name in names])


# -- patterns, each in a child process with a deadline (a wedged mount must not hang the run) --


def _sequential(root: Path, local: Path) -> dict[str, Any]:
    started = time.monotonic()
    with (
        open(root / FILES["sequential"], "rb", buffering=0) as mounted,
        open(local / FILES["sequential"], "rb") as ref,
    ):
        nbytes, same = 0, True
        while chunk := mounted.read(MIB):
            nbytes += len(chunk)
            same = same and chunk == ref.read(len(chunk))
    return {"MBps": nbytes / (time.monotonic() - started) / 1e6, "ok": same and nbytes == SEQUENTIAL_BYTES}


def _tar_stream(root: Path, local: Path) -> dict[str, Any]:
    started = time.monotonic()
    members: list[bytes] = []
    with open(root / FILES["tar stream"], "rb") as raw, tarfile.open(fileobj=raw, mode="r|") as shard:
        for member in shard:
            extracted = shard.extractfile(member)
            if extracted is not None:
                members.append(extracted.read())
    seconds = time.monotonic() - started
    with tarfile.open(local / FILES["tar stream"]) as ref:
        expected = [ref.extractfile(member).read() for member in ref.getmembers()]  # type: ignore[union-attr]
    nbytes = (root / FILES["tar stream"]).stat().st_size
    return {"MBps": nbytes / seconds / 1e6, "ok": members == expected}


def _offsets(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [
        rng.randrange(0, (SEQUENTIAL_BYTES - RANDOM_READ_BYTES) // 4096) * 4096 for _ in range(RANDOM_READS)
    ]


def _random_reads(root: Path, local: Path, seed: int, fresh_opens: bool) -> dict[str, Any]:
    path = root / FILES["random"]
    offsets = _offsets(seed)
    got: list[bytes] = []
    started = time.monotonic()
    if fresh_opens:
        for offset in offsets:
            fd = os.open(path, os.O_RDONLY)
            got.append(os.pread(fd, RANDOM_READ_BYTES, offset))
            os.close(fd)
    else:
        fd = os.open(path, os.O_RDONLY)
        got = [os.pread(fd, RANDOM_READ_BYTES, offset) for offset in offsets]
        os.close(fd)
    seconds = time.monotonic() - started
    with open(local / FILES["random"], "rb") as ref:
        same = all(
            os.pread(ref.fileno(), RANDOM_READ_BYTES, offset) == data
            for offset, data in zip(offsets, got, strict=True)
        )
    return {"reads_per_s": RANDOM_READS / seconds, "ok": same}


def _read_whole(root: Path, local: Path) -> dict[str, Any]:
    with open(root / FILES["random"], "rb", buffering=0) as mounted:
        while mounted.read(MIB):
            pass
    return {}


def _child(target: Callable[..., dict[str, Any]], args: tuple[Any, ...], results: mp.Queue[Any]) -> None:
    try:
        results.put(target(*args))
    except Exception as exc:
        results.put({"error": f"{type(exc).__name__}: {exc}"})


def in_child(target: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    ctx = mp.get_context("fork")
    results: mp.Queue[Any] = ctx.Queue()
    child = ctx.Process(target=_child, args=(target, args, results), daemon=True)
    child.start()
    try:
        result: dict[str, Any] = results.get(timeout=PATTERN_SECONDS)
        return result
    except queue.Empty:
        return {"error": f"no result within {PATTERN_SECONDS:g}s"}
    finally:
        child.join(5)
        if child.is_alive():
            child.kill()
            child.join(5)


def peak_rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    kib = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")), None)
    return None if kib is None else kib / 1024


def bench_contender(key: str, ctx: Context, repeat: int) -> dict[str, Any]:
    variant = next(v for v in VARIANTS if v.key == key)
    run_dir = Path(tempfile.mkdtemp(prefix=f"{key}-", dir=ctx.work))
    row: dict[str, Any] = {}
    mounted = None
    try:
        mounted = STARTERS[variant.kind](variant, ctx, 4 << 30, run_dir)
        root, local = mounted.root, ctx.dataset.local_root
        for pattern, target, args in (
            ("sequential", _sequential, ()),
            ("tar stream", _tar_stream, ()),
            (None, _read_whole, ()),  # caches the object the random reads are of
            ("random, fresh opens", _random_reads, (repeat, True)),
            ("random, one descriptor", _random_reads, (repeat + 1000, False)),
        ):
            drop_page_cache()
            result = in_child(target, root, local, *args)
            if pattern is None and "error" in result:
                raise RuntimeError(f"caching the object the random reads are of: {result['error']}")
            if pattern is not None:
                row[pattern] = result
                log(f"    {pattern}: {result}")
        row["peak_rss_mb"] = peak_rss_mb(mounted.pid)
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"
        log(f"    failed: {row['error']}")
    finally:
        if mounted is not None:
            mounted.stop()
        unmount_all_under(run_dir)
        shutil.rmtree(run_dir, ignore_errors=True)
    return row


def _value(result: dict[str, Any]) -> float | None:
    if "error" in result or not result.get("ok", False):
        return None
    return result.get("MBps", result.get("reads_per_s"))


def render(report: dict[str, Any]) -> None:
    runs: dict[str, list[dict[str, Any]]] = report["runs"]
    header = [
        "contender",
        *[f"{p} ({'MB/s' if p in ('sequential', 'tar stream') else 'reads/s'})" for p in PATTERNS],
    ]
    log("\nmedians of " + str(report["config"]["repeats"]) + " runs (- : failed or wrong bytes)")
    log(" | ".join([*header, "peak RSS MB"]))
    for key, rows in runs.items():
        cells = [key]
        for pattern in PATTERNS:
            values = [v for row in rows if (v := _value(row.get(pattern, {"error": "-"}))) is not None]
            cells.append(f"{statistics.median(values):.0f}" if len(values) == len(rows) else "-")
        peaks = [row["peak_rss_mb"] for row in rows if row.get("peak_rss_mb") is not None]
        cells.append(f"{max(peaks):.0f}" if peaks else "")
        log(" | ".join(cells))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--latency-ms", type=float, default=20.0, help="added to every S3 request")
    parser.add_argument("--rate-mbit", type=int, default=4000, help="bandwidth cap each way (HTB)")
    parser.add_argument(
        "--only", default=",".join(CONTENDERS), help=f"comma-separated: {', '.join(CONTENDERS)}"
    )
    parser.add_argument("--output", type=Path, default=RESULTS / "access_bench.json")
    args = parser.parse_args(argv)
    args.keys = [key.strip() for key in args.only.split(",") if key.strip()]
    unknown = set(args.keys) - set(CONTENDERS)
    if unknown:
        parser.error(f"--only: unknown contender(s) {', '.join(sorted(unknown))}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("access_bench needs root (network namespace, tc, drop_caches)", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="cachefsd-access-bench-"))
    report: dict[str, Any] = {
        "config": {"repeats": args.repeats, "latency_ms": args.latency_ms, "rate_mbit": args.rate_mbit},
        "runs": {key: [] for key in args.keys},
    }
    try:
        with environment(args, work):
            dataset = make_files(work / "local", s3_client())
            ctx = Context(work, dataset, {})
            for repeat in range(args.repeats):
                for key in args.keys:  # contenders alternate: the machine's noise hits them alike
                    log(f"  {key} (repeat {repeat + 1}/{args.repeats})")
                    report["runs"][key].append(bench_contender(key, ctx, repeat))
        render(report)
    finally:
        finish(work, args.output, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
