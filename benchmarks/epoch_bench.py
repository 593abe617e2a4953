"""Training emulation: shuffled epochs over a remote-like S3 bucket, cachefsd vs its peers.

W reader processes read every file of an ImageFolder-like dataset once per
epoch, in a new seeded random order split across the workers, for E epochs,
through each contender in turn, against one moto S3 server made to behave
like a remote store:

- **latency**: moto runs behind ``cachefsd.testing.s3_server``, whose WSGI
  middleware sleeps ``--latency-ms`` (20 ms) before every request (this
  kernel has no netem);
- **bandwidth**: the server lives in a network namespace (``cfsbench``)
  reached over a veth pair (10.200.0.1/30 host side, 10.200.0.2/30 inside),
  with an HTB qdisc capping each direction to ``--rate-mbit``; the
  namespace's egress is what clients download.

Nothing leaves the machine: every address is loopback or the private /30 of
the namespace this script creates and deletes.

Contenders (each a table entry in ``VARIANTS``; ``--only KEY`` picks some):

- ``local``: the same files in a local directory, the limit;
- ``cachefsd``: the daemon with its defaults (what ships today);
- ``cachefsd-noprefetch`` / ``cachefsd-model``: ``[prefetch] enabled =
  false / true`` in a ``--config`` TOML;
- ``cachefsd-hint``: ``cachefsd hint MNT --order FILE`` before every epoch
  with that epoch's exact order (one path per line, relative to the mount);
- ``cachefsd-stage``: ``cachefsd stage MNT`` after mounting, before epoch 1
  (its time and bytes are reported on a ``stage`` line, not in epoch 1);
- ``rclone``: ``rclone mount --vfs-cache-mode full --vfs-cache-max-size``;
- ``s3fs``: ``s3fs -o use_cache``; s3fs 1.90 has no cache size limit. At
  100 % it runs uncapped; below, the cap is emulated with
  ``ensure_diskfree`` = free disk space at mount time minus the cap (s3fs
  then purges unused cache files, and fails a read with ENOSPC when that is
  not enough); approximate, as anything else writing to the disk moves it.

Variants whose cachefsd feature (the ``[prefetch]`` settings section, the
``hint`` or ``stage`` command) is not in this checkout print ``n/a (feature
missing: ...)`` and are skipped, so the same command can be rerun when they
land. A contender that fails to mount prints its error; the run goes on.

Each contender starts from an empty cache, and every cache is sized at each
``--cache-fractions`` share (default 100 % and 50 %) of the dataset's
footprint: its bytes plus ``CACHE_SLACK_PER_MIB`` for every started MiB of
every file, for a tool's overhead per file or per block (cachefsd frames
each block with a header and a file rounds up to 4 KiB; rclone keeps
metadata per file), so that "100 %" really holds the dataset.

Before every epoch the kernel page cache is dropped (``drop_caches``, root),
as when the dataset is far larger than RAM; otherwise a 24 GiB machine keeps
the whole dataset in RAM and the 50 % cache would never be exercised
(``--keep-page-cache`` turns this off).

Before epoch 1 the dataset's tree is listed once, as a loader does when it
builds its index (ImageFolder scans every class folder); its time is
printed, not counted in epoch 1.

Two regimes, by ``--compute-ms`` (the emulated training step per sample):

- the default, 1 ms, is a loader as fast as it can go: the data path is the
  limit, and it shows throughput (epoch 1, and a cache holding everything);
- about 10 ms is a GPU-bound job whose misses the emulated network can keep
  up with (4 workers then consume about 50 MB/s, of which a 50 % cache
  misses half, within moto's ceiling): the regime in which a prefetcher can
  reach the hit ratios theory allows (f(1 + ln 1/f) without a hint, all of
  them with one). At 1 ms no prefetcher can: the readers outrun the network.

Per epoch (for every contender the same seeded orders):

- **MB/s**: dataset bytes / wall time (first worker start to last worker end);
- **stall %**: time the readers spent inside ``open`` + ``read`` / (W x
  wall). Each worker "trains" ``--compute-ms`` per sample (a sleep, like a
  GPU step, using no CPU), so stall % is the share of the readers' time
  spent waiting for data, i.e. the GPU-starvation fraction. It counts every
  wait, not only waits on the store: a hit served slowly stalls too;
- **MB fetched**: bytes received on the host end of the veth during the
  epoch (every contender measured the same way; includes HTTP headers and
  listings, so a cold epoch shows a little over the dataset size);
- **hit %**: for cachefsd, the daemon's share of bytes read that did not wait
  on the store (``cachefsd_read_bytes_total{source="cache"}`` over cache +
  cold, deltas over the epoch), so prefetched bytes count as hits; for rclone
  and s3fs, which fetch only on demand, 1 - MB fetched / dataset size
  (floored at 0). Both are in the JSON as ``hit_ratio_daemon`` and
  ``hit_ratio_wire``.

Before the contenders, moto's own ceiling through the namespace is measured
(32 client threads doing GETs of dataset objects) and printed, so the
results can say when moto, not the client, was the limit.

Prints one table per cache size and writes ``benchmarks/results/epoch_bench.json``.
Needs root (network namespace, tc, FUSE mounts, drop_caches).

    .venv/bin/python benchmarks/epoch_bench.py [--epochs 3] [--repeats 1] [--only cachefsd,rclone]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import queue
import random
import re
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
VENV_BIN = Path(sys.executable).parent
CACHEFSD = str(VENV_BIN / "cachefsd") if (VENV_BIN / "cachefsd").exists() else "cachefsd"

# -- the network --------------------------------------------------------------

NETNS = "cfsbench"
VETH_HOST = "cfsbench0"
VETH_NS = "cfsbench1"
HOST_ADDR = "10.200.0.1"
NS_ADDR = "10.200.0.2"
PREFIX_LEN = 30
S3_PORT = 9000
ENDPOINT = f"http://{NS_ADDR}:{S3_PORT}"
BUCKET = "bench"
PREFIX = "train"
# HTB warns (and shapes badly) when rate / r2q exceeds its 200,000-byte
# quantum limit; one jumbo-ish quantum per round is fine at these rates.
HTB_QUANTUM = 60000

# -- the dataset --------------------------------------------------------------

CLASSES = 20
# Sample sizes are spread around the mean like JPEGs in ImageNet (64..192 KiB
# for the 128 KiB default): a fixed size would hide per-size effects.
SIZE_SPREAD = 0.5
UPLOAD_THREADS = 16
MIB = 1 << 20
READ_CHUNK = MIB
# Allowance in the cache size for a tool's own overhead, per started MiB of
# a file: cachefsd frames each block (1 MiB or more) with a header and a
# file rounds up to 4 KiB, so a 128 KiB sample takes 132 KiB on disk.
CACHE_SLACK_PER_MIB = 4096

# -- bounds on every wait -------------------------------------------------------

SERVER_START_SECONDS = 60.0
MOUNT_SECONDS = 90.0
UNMOUNT_SECONDS = 30.0
EXIT_SECONDS = 15.0
COMMAND_SECONDS = 60.0
STAGE_SECONDS = 900.0
METRICS_SECONDS = 5.0
POLL_SECONDS = 0.1
CALIBRATE_SECONDS = 4.0
CALIBRATE_THREADS = 32

# s3fs 1.90 refuses to start unless this much disk is free beyond ensure_diskfree.
S3FS_STARTUP_ROOM_MB = 64

FUSE_TYPES = ("fuse", "fuse.", "fuseblk")


def log(message: str) -> None:
    print(message, flush=True)


def run(cmd: Sequence[str], timeout: float = COMMAND_SECONDS, check: bool = True, **kw: Any) -> str:
    """Run a command, bounded; return its stdout, raise with its stderr on failure."""
    result = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, check=False, **kw)
    if check and result.returncode != 0:
        detail = (result.stderr or result.stdout).strip().splitlines()
        raise RuntimeError(f"{' '.join(cmd[:4])}...: exit {result.returncode}: {' | '.join(detail[-3:])}")
    stdout: str = result.stdout
    return stdout


def bench_env() -> dict[str, str]:
    """Dummy credentials only; never a real profile or the instance metadata service."""
    env = dict(os.environ)
    env.update(
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
        AWS_CONFIG_FILE="/dev/null",
        AWS_SHARED_CREDENTIALS_FILE="/dev/null",
    )
    # The endpoint is plain HTTP; a CA bundle from the host makes rclone's
    # AWS SDK refuse to build its HTTP transport (LoadCustomCABundleError).
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CA_BUNDLE"):
        env.pop(name, None)
    return env


# -- network namespace, veth, HTB ------------------------------------------------


class Network:
    """A namespace for the S3 server behind a rate-capped veth pair."""

    def __init__(self, rate_mbit: int) -> None:
        self.rate_mbit = rate_mbit
        self.created = False

    def setup(self) -> None:
        if NETNS in run(["ip", "netns", "list"]).split():
            log(f"removing a leftover namespace {NETNS} from an earlier run")
            run(["ip", "netns", "del", NETNS])
        with contextlib.suppress(RuntimeError):
            run(["ip", "link", "del", VETH_HOST])
        if f"{HOST_ADDR}/" in run(["ip", "-4", "-o", "addr"]):
            raise RuntimeError(
                f"{HOST_ADDR} is already in use on this machine; cannot build the test network"
            )
        self.created = True
        ns = ["ip", "netns", "exec", NETNS]
        run(["ip", "netns", "add", NETNS])
        run(["ip", "link", "add", VETH_HOST, "type", "veth", "peer", "name", VETH_NS])
        run(["ip", "link", "set", VETH_NS, "netns", NETNS])
        run(["ip", "addr", "add", f"{HOST_ADDR}/{PREFIX_LEN}", "dev", VETH_HOST])
        run(["ip", "link", "set", VETH_HOST, "up"])
        run([*ns, "ip", "addr", "add", f"{NS_ADDR}/{PREFIX_LEN}", "dev", VETH_NS])
        run([*ns, "ip", "link", "set", VETH_NS, "up"])
        run([*ns, "ip", "link", "set", "lo", "up"])
        for prefix, dev in (([], VETH_HOST), (ns, VETH_NS)):
            rate = f"{self.rate_mbit}mbit"
            run([*prefix, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10"])
            htb_class = ["htb", "rate", rate, "ceil", rate, "quantum", str(HTB_QUANTUM)]
            run([*prefix, "tc", "class", "add", "dev", dev, "parent", "1:", "classid", "1:10", *htb_class])

    def rx_bytes(self) -> int:
        """Bytes the host received from the namespace: everything clients downloaded."""
        return int(Path(f"/sys/class/net/{VETH_HOST}/statistics/rx_bytes").read_text())

    def teardown(self) -> None:
        if not self.created:
            return
        self.created = False
        for cmd in (["ip", "netns", "del", NETNS], ["ip", "link", "del", VETH_HOST]):
            with contextlib.suppress(Exception):
                run(cmd, check=False)


# -- the S3 server -----------------------------------------------------------------


class Server:
    """``cachefsd.testing.s3_server`` (moto + latency middleware) inside the namespace."""

    def __init__(self, latency_ms: float) -> None:
        self.latency_ms = latency_ms
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, log_path: Path) -> None:
        cmd = ["ip", "netns", "exec", NETNS, sys.executable, "-m", "cachefsd.testing.s3_server"]
        cmd += ["--host", NS_ADDR, "--port", str(S3_PORT), "--latency-ms", str(self.latency_ms)]
        with open(log_path, "ab") as errors:
            self.proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=errors, cwd=ROOT, env=bench_env(), start_new_session=True
            )
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], SERVER_START_SECONDS)
        line = self.proc.stdout.readline().decode().strip() if ready else ""
        if line != ENDPOINT:
            raise RuntimeError(f"S3 server did not start (said {line!r}); see {log_path}")

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None


def stop_process(proc: subprocess.Popen[Any]) -> None:
    """SIGTERM, bounded wait, then SIGKILL: only this process, by its pid."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(EXIT_SECONDS)
    except subprocess.TimeoutExpired:
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(EXIT_SECONDS)


def kill_pid(pid: int) -> None:
    """Like ``stop_process`` for a daemon we started but do not hold a handle to."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + EXIT_SECONDS
        while time.monotonic() < deadline:
            if not Path(f"/proc/{pid}").exists() or "State:\tZ" in _proc_status(pid):
                return
            time.sleep(POLL_SECONDS)


def _proc_status(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return ""


def s3_client(max_connections: int = UPLOAD_THREADS) -> Any:
    import boto3  # noqa: PLC0415 - keep --help fast
    from botocore.config import Config  # noqa: PLC0415

    os.environ.update({k: v for k, v in bench_env().items() if k.startswith("AWS_")})
    config = Config(max_pool_connections=max_connections, retries={"max_attempts": 3})
    return boto3.client("s3", endpoint_url=ENDPOINT, region_name="us-east-1", config=config)


# -- the dataset ------------------------------------------------------------------


@dataclass(frozen=True)
class Dataset:
    relatives: list[str]  # paths under the dataset root, e.g. class_03/img_00042.bin
    local_root: Path
    sizes: list[int]  # bytes of each file, in the order of ``relatives``

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes)


def make_dataset(files: int, mean_bytes: int, local: Path, client: Any) -> Dataset:
    """Write the dataset locally and upload it to ``s3://bench/train/``."""
    rng = random.Random(f"epoch-bench-{files}-{mean_bytes}")
    low, high = int(mean_bytes * (1 - SIZE_SPREAD)), int(mean_bytes * (1 + SIZE_SPREAD))
    samples: list[tuple[str, int, int]] = []
    for index in range(files):
        samples.append((f"class_{index % CLASSES:02d}/img_{index:06d}.bin", rng.randint(low, high), index))
    client.create_bucket(Bucket=BUCKET)

    def put(sample: tuple[str, int, int]) -> None:
        relative, size, index = sample
        data = random.Random(index).randbytes(size)
        path = local / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        client.put_object(Bucket=BUCKET, Key=f"{PREFIX}/{relative}", Body=data)

    with ThreadPoolExecutor(UPLOAD_THREADS) as pool:
        list(pool.map(put, samples))
    return Dataset([s[0] for s in samples], local, [s[1] for s in samples])


def dataset_footprint(dataset: Dataset) -> int:
    """What "100 %" of a cache means: the bytes plus an allowance per started MiB."""
    started_mib = sum(max(1, -(-size // MIB)) for size in dataset.sizes)
    return dataset.total_bytes + CACHE_SLACK_PER_MIB * started_mib


def calibrate_moto(client: Any, dataset: Dataset, network: Network) -> dict[str, float]:
    """GETs/s and MB/s that the server (moto + latency + cap) gives many parallel clients."""
    stop = threading.Event()
    counts = [0] * CALIBRATE_THREADS

    def loop(slot: int) -> None:
        rng = random.Random(slot)
        while not stop.is_set():
            key = f"{PREFIX}/{rng.choice(dataset.relatives)}"
            client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
            counts[slot] += 1

    rx = network.rx_bytes()
    started = time.monotonic()
    with ThreadPoolExecutor(CALIBRATE_THREADS) as pool:
        futures = [pool.submit(loop, slot) for slot in range(CALIBRATE_THREADS)]
        time.sleep(CALIBRATE_SECONDS)
        stop.set()
        for future in futures:
            future.result(timeout=COMMAND_SECONDS)
    elapsed = time.monotonic() - started
    return {
        "gets_per_s": sum(counts) / elapsed,
        "MBps": (network.rx_bytes() - rx) / elapsed / 1e6,
        "threads": CALIBRATE_THREADS,
    }


# -- readers ------------------------------------------------------------------------


def _reader(paths: list[str], compute_s: float, results: mp.Queue[dict[str, Any]], slot: int) -> None:
    """One worker: open+read every path (timed), then 'train' ``compute_s`` on it."""
    wait = 0.0
    nbytes = errors = 0
    first_error = ""
    started = time.monotonic()
    for path in paths:
        t0 = time.monotonic()
        try:
            with open(path, "rb", buffering=0) as sample:
                while chunk := sample.read(READ_CHUNK):
                    nbytes += len(chunk)
        except OSError as exc:
            errors += 1
            first_error = first_error or f"{path}: {exc}"
        wait += time.monotonic() - t0
        if compute_s:
            time.sleep(compute_s)
    results.put(
        {
            "slot": slot,
            "bytes": nbytes,
            "wait": wait,
            "start": started,
            "end": time.monotonic(),
            "errors": errors,
            "first_error": first_error,
        }
    )


def run_epoch(root: Path, order: list[str], workers: int, compute_s: float, timeout: float) -> dict[str, Any]:
    """Read ``order`` (split round-robin across ``workers`` processes) under ``root``."""
    ctx = mp.get_context("fork")
    results: mp.Queue[dict[str, Any]] = ctx.Queue()
    paths = [str(root / relative) for relative in order]
    procs = [
        ctx.Process(target=_reader, args=(paths[slot::workers], compute_s, results, slot), daemon=True)
        for slot in range(workers)
    ]
    for proc in procs:
        proc.start()
    reports: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    try:
        while len(reports) < workers:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"epoch did not finish within {timeout:g}s")
            try:
                reports.append(results.get(timeout=min(remaining, 1.0)))
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    raise RuntimeError("a reader process died without a report") from None
    finally:
        for proc in procs:
            proc.join(EXIT_SECONDS if len(reports) == workers else 0)
            if proc.is_alive():
                proc.kill()
                proc.join(EXIT_SECONDS)
    wall = max(r["end"] for r in reports) - min(r["start"] for r in reports)
    return {
        "wall_s": wall,
        "bytes": sum(r["bytes"] for r in reports),
        "wait_s": sum(r["wait"] for r in reports),
        "errors": sum(r["errors"] for r in reports),
        "first_error": next((r["first_error"] for r in reports if r["first_error"]), ""),
    }


def index_dataset(root: Path) -> int:
    """What a loader does before its first epoch (ImageFolder scans every
    class folder, WebDataset globs its shards): list the dataset's tree.
    Returns the number of files found."""
    files = 0
    pending = [root]
    while pending:
        with os.scandir(pending.pop()) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    pending.append(Path(entry.path))
                else:
                    files += 1
    return files


def drop_page_cache() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


# -- cachefsd metrics -----------------------------------------------------------------

_SAMPLE = re.compile(r"^(cachefsd_[a-z_]+)(\{[^}]*\})?\s+(\S+)$")


def scrape(port: int) -> dict[str, float]:
    """``name{labels}`` -> value of the daemon's Prometheus text output."""
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=METRICS_SECONDS) as response:
        text = response.read().decode()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            samples[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return samples


def metric_delta(before: dict[str, float], after: dict[str, float], name: str, **labels: str) -> float:
    """The change of every sample of ``name`` whose labels include ``labels``."""
    total = 0.0
    for key, value in after.items():
        metric, _, label_text = key.partition("{")
        if metric != name or any(f'{k}="{v}"' not in label_text for k, v in labels.items()):
            continue
        total += value - before.get(key, 0.0)
    return total


# -- contenders -------------------------------------------------------------------------

Kind = Literal["local", "cachefsd", "rclone", "s3fs"]


@dataclass(frozen=True)
class Variant:
    key: str
    label: str
    kind: Kind
    prefetch: bool | None = None  # None: no [prefetch] section in the config
    hint: bool = False
    stage: bool = False
    needs: tuple[str, ...] = ()  # cachefsd features this variant needs


VARIANTS: tuple[Variant, ...] = (
    Variant("local", "local copy", "local"),
    Variant("cachefsd", "cachefsd (defaults)", "cachefsd"),
    Variant("cachefsd-noprefetch", "cachefsd, no prefetch", "cachefsd", False, needs=("prefetch",)),
    Variant("cachefsd-model", "cachefsd, workload model", "cachefsd", True, needs=("prefetch",)),
    Variant("cachefsd-hint", "cachefsd, hint", "cachefsd", hint=True, needs=("hint",)),
    Variant("cachefsd-stage", "cachefsd, stage first", "cachefsd", stage=True, needs=("stage",)),
    Variant("rclone", "rclone mount (full)", "rclone"),
    Variant("s3fs", "s3fs (use_cache)", "s3fs"),
)


def detect_features() -> dict[str, bool]:
    """Which in-progress cachefsd features this checkout has."""
    features: dict[str, bool] = {}
    from cachefsd.config import load_settings  # noqa: PLC0415
    from cachefsd.errors import ConfigError  # noqa: PLC0415

    with tempfile.NamedTemporaryFile("w", suffix=".toml") as config:
        config.write("[prefetch]\nenabled = true\n")
        config.flush()
        try:
            load_settings(Path(config.name), {"source": ".", "mountpoint": "."})
            features["prefetch"] = True
        except ConfigError:
            features["prefetch"] = False
    for command, flag in (("hint", "--order"), ("stage", "")):
        result = subprocess.run(
            [CACHEFSD, command, "--help"],
            capture_output=True,
            text=True,
            timeout=COMMAND_SECONDS,
            check=False,
        )
        features[command] = result.returncode == 0 and flag in result.stdout
    return features


class Unavailable(Exception):
    """The contender cannot run in this checkout (a feature is missing)."""


@dataclass
class Mounted:
    """A running contender: where to read, and how to measure and stop it."""

    root: Path
    stop: Callable[[], None]
    pid: int | None = None  # the serving process (its peak RSS is in /proc/PID/status), if any
    before_epoch: Callable[[list[str], int], None] = lambda order, epoch: None
    metrics: Callable[[], dict[str, float]] | None = None
    stage: Callable[[], None] | None = None


def is_mounted(path: Path) -> bool:
    target = str(path)
    with open("/proc/self/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            if len(fields) > 2 and fields[1] == target and fields[2].startswith(FUSE_TYPES):
                return True
    return False


def fuse_unmount(path: Path) -> None:
    """fusermount3 -u, and -uz if that fails; bounded."""
    for flags in ("-u", "-uz"):
        if not is_mounted(path):
            return
        with contextlib.suppress(Exception):
            run(["fusermount3", flags, str(path)], timeout=UNMOUNT_SECONDS, check=False)
    if is_mounted(path):
        run(["umount", "-l", str(path)], timeout=UNMOUNT_SECONDS, check=False)


def unmount_all_under(directory: Path) -> None:
    """Last resort before deleting ``directory``: no FUSE mount may be left inside it."""
    prefix = f"{directory}/"
    with open("/proc/self/mounts") as mounts:
        targets = [line.split()[1] for line in mounts if line.split()[1].startswith(prefix)]
    for target in sorted(targets, reverse=True):
        log(f"unmounting leftover {target}")
        fuse_unmount(Path(target))


def wait_mounted(path: Path, proc: subprocess.Popen[Any] | None, log_path: Path) -> None:
    deadline = time.monotonic() + MOUNT_SECONDS
    while not is_mounted(path):
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"exited with status {proc.returncode}: {tail(log_path)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"not mounted within {MOUNT_SECONDS:g}s: {tail(log_path)}")
        time.sleep(POLL_SECONDS)


_ERROR_LINE = re.compile(r"error|fail|crt\]|err\]|no enough|denied|refused", re.IGNORECASE)


def tail(path: Path, lines: int = 3) -> str:
    """The log's error lines if it has any (s3fs prints its reason first), else its last lines."""
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    errors = [line for line in text if _ERROR_LINE.search(line) and "LowSetLogLevel" not in line]
    return " | ".join((errors or text)[-lines:])


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class Context:
    work: Path
    dataset: Dataset
    features: dict[str, bool]


def start_local(variant: Variant, ctx: Context, cache_bytes: int, run_dir: Path) -> Mounted:
    return Mounted(root=ctx.dataset.local_root, stop=lambda: None)


def start_cachefsd(variant: Variant, ctx: Context, cache_bytes: int, run_dir: Path) -> Mounted:
    missing = [need for need in variant.needs if not ctx.features.get(need)]
    if missing:
        raise Unavailable(f"feature missing: {', '.join(missing)}")
    mountpoint, cache_dir = run_dir / "mnt", run_dir / "cache"
    mountpoint.mkdir(parents=True)
    port = free_port()
    cmd = [CACHEFSD, "mount", f"s3://{BUCKET}/{PREFIX}", str(mountpoint), "--endpoint-url", ENDPOINT]
    cmd += ["--cache-dir", str(cache_dir), "--cache-size", str(cache_bytes)]
    cmd += ["--metrics-addr", f"127.0.0.1:{port}"]
    prefetch = variant.prefetch
    if prefetch is None and (variant.hint or variant.stage) and ctx.features.get("prefetch"):
        prefetch = True
    if prefetch is not None:
        config = run_dir / "cachefsd.toml"
        config.write_text(f"[prefetch]\nenabled = {str(prefetch).lower()}\n")
        cmd += ["--config", str(config)]
    result = subprocess.run(
        cmd, capture_output=True, text=True, timeout=MOUNT_SECONDS, check=False, env=bench_env()
    )
    pid_match = re.search(r"\(pid (\d+)\)", result.stdout)
    if result.returncode != 0 or not is_mounted(mountpoint):
        if pid_match:
            kill_pid(int(pid_match.group(1)))
        fuse_unmount(mountpoint)
        raise RuntimeError((result.stderr or result.stdout).strip() or "mount failed")
    pid = int(pid_match.group(1)) if pid_match else None

    def stop() -> None:
        subprocess.run(
            [CACHEFSD, "unmount", str(mountpoint)],
            capture_output=True,
            timeout=UNMOUNT_SECONDS + EXIT_SECONDS,
            check=False,
        )
        fuse_unmount(mountpoint)
        if pid is not None:
            kill_pid(pid)

    def before_epoch(order: list[str], epoch: int) -> None:
        if not variant.hint:
            return
        order_file = run_dir / f"order-{epoch}.txt"
        order_file.write_text("".join(f"{relative}\n" for relative in order))
        answer = run([CACHEFSD, "hint", str(mountpoint), "--order", str(order_file)], env=bench_env())
        log(f"    hint before epoch {epoch}: {answer.strip()}")

    def stage() -> None:
        run([CACHEFSD, "stage", str(mountpoint)], timeout=STAGE_SECONDS, env=bench_env())

    return Mounted(
        root=mountpoint,
        stop=stop,
        pid=pid,
        before_epoch=before_epoch,
        metrics=lambda: scrape(port),
        stage=stage if variant.stage else None,
    )


def start_rclone(variant: Variant, ctx: Context, cache_bytes: int, run_dir: Path) -> Mounted:
    mountpoint, cache_dir = run_dir / "mnt", run_dir / "cache"
    mountpoint.mkdir(parents=True)
    conf = run_dir / "rclone.conf"
    conf.write_text(
        "[bench]\ntype = s3\nprovider = Other\n"
        f"endpoint = {ENDPOINT}\naccess_key_id = bench\nsecret_access_key = bench\n"
        "region = us-east-1\nforce_path_style = true\n"
    )
    conf.chmod(0o600)
    log_path = run_dir / "rclone.log"
    cmd = ["rclone", "mount", f"bench:{BUCKET}/{PREFIX}", str(mountpoint), "--config", str(conf)]
    cmd += ["--read-only", "--vfs-cache-mode", "full", "--cache-dir", str(cache_dir)]
    # rclone reads a size without a suffix as KiB; "B" means bytes. The cap is
    # enforced by a sweep every --vfs-cache-poll-interval (1 min by default,
    # longer than an epoch here), so poll every 5 s to let it bite.
    cmd += ["--vfs-cache-max-size", f"{cache_bytes}B", "--vfs-cache-poll-interval", "5s"]
    # S3 keeps rclone's modtime in object metadata, one HEAD per file per stat
    # unless told not to: the documented speed-up for S3.
    cmd += ["--no-modtime", "--dir-cache-time", "1h", "--log-file", str(log_path), "--log-level", "NOTICE"]
    proc = subprocess.Popen(
        cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env=bench_env(), start_new_session=True,
    )  # fmt: skip
    return foreground_mount(proc, mountpoint, log_path)


def start_s3fs(variant: Variant, ctx: Context, cache_bytes: int, run_dir: Path) -> Mounted:
    mountpoint, cache_dir = run_dir / "mnt", run_dir / "cache"
    mountpoint.mkdir(parents=True)
    cache_dir.mkdir()
    passwd = run_dir / "s3fs.passwd"
    passwd.write_text("bench:bench\n")
    passwd.chmod(0o600)
    log_path = run_dir / "s3fs.log"
    cap: list[str] = []
    if cache_bytes < dataset_footprint(ctx.dataset):
        # s3fs has no size limit: emulate one with ensure_diskfree, the free
        # space it must leave on the disk. Only below 100 %: the emulation
        # moves with every other writer of the disk, and a cache that can hold
        # the whole dataset needs no cap (an earlier run at 100 % through it
        # got ENOSPC reads when the disk's free space shrank meanwhile).
        stats = os.statvfs(cache_dir)
        free_mb = stats.f_bavail * stats.f_frsize // MIB
        cap_mb = -(-cache_bytes // MIB)
        cap.append(f"ensure_diskfree={max(1, free_mb - cap_mb)}")
        # At start s3fs insists on room for one parallel multipart transfer
        # (multipart_size x parallel_count, 10 MB x 5) beyond ensure_diskfree;
        # those settings only matter for objects over 20 MB, so shrink them
        # when the cap is smaller than that.
        if cap_mb < S3FS_STARTUP_ROOM_MB:
            cap += ["multipart_size=5", "parallel_count=1"]
    options = [
        f"url={ENDPOINT}",
        "use_path_request_style",
        f"passwd_file={passwd}",
        f"use_cache={cache_dir}",
        "ro",
        "endpoint=us-east-1",
        "dbglevel=warn",
        *cap,
    ]
    cmd = ["s3fs", f"{BUCKET}:/{PREFIX}", str(mountpoint), "-f", "-o", ",".join(options)]
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=bench_env(), start_new_session=True
        )
    mounted = foreground_mount(proc, mountpoint, log_path)
    # s3fs mounts before it has checked the bucket; fail here, not in epoch 1.
    try:
        os.listdir(mountpoint)
    except OSError as exc:
        mounted.stop()
        raise RuntimeError(f"mounted but unreadable: {exc}: {tail(log_path)}") from exc
    return mounted


def foreground_mount(proc: subprocess.Popen[Any], mountpoint: Path, log_path: Path) -> Mounted:
    def stop() -> None:
        fuse_unmount(mountpoint)
        try:
            proc.wait(EXIT_SECONDS)
        except subprocess.TimeoutExpired:
            stop_process(proc)
        fuse_unmount(mountpoint)

    try:
        wait_mounted(mountpoint, proc, log_path)
    except BaseException:
        stop()
        raise
    return Mounted(root=mountpoint, stop=stop, pid=proc.pid)


STARTERS: dict[Kind, Callable[[Variant, Context, int, Path], Mounted]] = {
    "local": start_local,
    "cachefsd": start_cachefsd,
    "rclone": start_rclone,
    "s3fs": start_s3fs,
}


# -- one contender at one cache size ------------------------------------------------------


@dataclass
class Outcome:
    status: str = "ok"  # ok | n/a (feature missing) | failed (no result) | errors (some reads failed)
    detail: str = ""
    epochs: list[dict[str, Any]] = field(default_factory=list)
    stage: dict[str, Any] | None = None
    index_s: float | None = None


def epoch_order(dataset: Dataset, seed: int, repeat: int, epoch: int) -> list[str]:
    order = list(dataset.relatives)
    random.Random(f"{seed}/{repeat}/{epoch}").shuffle(order)
    return order


def bench_contender(
    variant: Variant, ctx: Context, network: Network, cache_bytes: int, args: argparse.Namespace, repeat: int
) -> Outcome:
    run_dir = Path(tempfile.mkdtemp(prefix=f"{variant.key}-", dir=ctx.work))
    outcome = Outcome()
    mounted: Mounted | None = None
    try:
        try:
            mounted = STARTERS[variant.kind](variant, ctx, cache_bytes, run_dir)
        except Unavailable as exc:
            return Outcome("n/a", str(exc))
        except Exception as exc:
            return Outcome("failed", f"mount: {exc}")
        if mounted.stage is not None:
            rx, started = network.rx_bytes(), time.monotonic()
            mounted.stage()
            outcome.stage = {"seconds": time.monotonic() - started, "fetched_bytes": network.rx_bytes() - rx}
            log(f"    stage: {outcome.stage['seconds']:.1f} s, {outcome.stage['fetched_bytes'] / 1e6:.1f} MB")
        started = time.monotonic()
        found = index_dataset(mounted.root)
        outcome.index_s = time.monotonic() - started
        if found != len(ctx.dataset.relatives):
            raise RuntimeError(f"the loader's scan found {found} files, not {len(ctx.dataset.relatives)}")
        log(f"    loader's scan: {found} files in {outcome.index_s:.2f} s")
        for epoch in range(1, args.epochs + 1):
            order = epoch_order(ctx.dataset, args.seed, repeat, epoch)
            if not args.keep_page_cache:
                drop_page_cache()
            mounted.before_epoch(order, epoch)
            metrics_before = mounted.metrics() if mounted.metrics else None
            rx = network.rx_bytes()
            result = run_epoch(mounted.root, order, args.workers, args.compute_ms / 1000, args.epoch_timeout)
            fetched = network.rx_bytes() - rx
            row = summarize(result, fetched, ctx.dataset, args.workers, variant.kind)
            if metrics_before is not None and mounted.metrics is not None:
                add_daemon_metrics(row, metrics_before, mounted.metrics())
            row["epoch"] = epoch
            outcome.epochs.append(row)
            log(f"    epoch {epoch}: {format_row(row)}")
            if result["errors"] and outcome.status == "ok":
                # A failed read is a result (s3fs: ENOSPC); later epochs still tell something.
                outcome.status = "errors"
                outcome.detail = (
                    f"epoch {epoch}: {result['errors']} read errors, first: {result['first_error']}"
                )
    except Exception as exc:
        outcome.status, outcome.detail = "failed", f"{type(exc).__name__}: {exc}"
    finally:
        if mounted is not None:
            try:
                mounted.stop()
            except Exception as exc:
                log(f"    stopping {variant.label} failed: {exc}")
        unmount_all_under(run_dir)
        shutil.rmtree(run_dir, ignore_errors=True)
    return outcome


def summarize(
    result: dict[str, Any], fetched: int, dataset: Dataset, workers: int, kind: Kind
) -> dict[str, Any]:
    wall = result["wall_s"]
    wire_hit = None if kind == "local" else max(0.0, 1 - fetched / dataset.total_bytes)
    return {
        "MBps": dataset.total_bytes / wall / 1e6,
        "wall_s": wall,
        "stall": result["wait_s"] / (workers * wall),
        "fetched_bytes": fetched,
        "bytes_read": result["bytes"],
        "complete": result["bytes"] == dataset.total_bytes,
        "hit_ratio_wire": wire_hit,
        "hit_ratio": wire_hit,
        "errors": result["errors"],
    }


def add_daemon_metrics(row: dict[str, Any], before: dict[str, float], after: dict[str, float]) -> None:
    cache = metric_delta(before, after, "cachefsd_read_bytes_total", source="cache")
    cold = metric_delta(before, after, "cachefsd_read_bytes_total", source="cold")
    row["daemon_read_bytes"] = {"cache": cache, "cold": cold}
    row["daemon_fetch_bytes"] = metric_delta(before, after, "cachefsd_fetch_bytes_total")
    row["daemon_stall_s"] = metric_delta(before, after, "cachefsd_read_stall_seconds_total")
    for what in ("issued", "used", "wasted", "warmed"):
        row[f"daemon_prefetch_{what}_bytes"] = metric_delta(
            before, after, f"cachefsd_prefetch_{what}_bytes_total"
        )
    if cache + cold > 0:
        row["hit_ratio_daemon"] = cache / (cache + cold)
        row["hit_ratio"] = row["hit_ratio_daemon"]


def format_row(row: dict[str, Any]) -> str:
    hit = "-" if row["hit_ratio"] is None else f"{100 * row['hit_ratio']:.1f}"
    flag = "" if row["complete"] else "  (bytes read != dataset size)"
    return (
        f"{row['MBps']:8.1f} MB/s  stall {100 * row['stall']:5.1f} %  hit {hit:>5} %  "
        f"fetched {row['fetched_bytes'] / 1e6:8.1f} MB{flag}"
    )


# -- report ----------------------------------------------------------------------------------


def median_rows(runs: list[Outcome], epochs: int) -> list[dict[str, Any]]:
    """Per epoch, the median of each number over the repeats that completed it."""
    rows = []
    for epoch in range(epochs):
        cells = [o.epochs[epoch] for o in runs if len(o.epochs) > epoch]
        if not cells:
            break
        row: dict[str, Any] = {"epoch": epoch + 1, "repeats": len(cells)}
        for name in ("MBps", "stall", "fetched_bytes", "hit_ratio", "hit_ratio_wire", "errors"):
            values = [c[name] for c in cells if c.get(name) is not None]
            row[name] = statistics.median(values) if values else None
        rows.append(row)
    return rows


def print_table(title: str, labels: dict[str, str], outcomes: dict[str, list[Outcome]], epochs: int) -> None:
    log(f"\n{title}")
    header = (
        f"{'contender':<24}{'epoch':>6}{'MB/s':>10}{'stall %':>9}{'hit %':>8}{'wire hit %':>12}"
        f"{'MB fetched':>12}{'errors':>8}"
    )
    log(header)
    log("-" * len(header))
    for key, runs in outcomes.items():
        label = labels[key]
        ok = [o for o in runs if o.epochs]
        problems = sorted({f"{o.status}: {o.detail}" for o in runs if o.status != "ok"})
        stages = [o.stage for o in runs if o.stage]
        if stages:
            seconds = statistics.median(s["seconds"] for s in stages)
            mb = statistics.median(s["fetched_bytes"] for s in stages) / 1e6
            log(f"{label:<24}{'stage':>6}{'':>10}{'':>9}{'':>8}{'':>12}{mb:>12.1f}   ({seconds:.1f} s)")
        for row in median_rows(ok, epochs):
            hit, wire = (
                "-" if row[name] is None else f"{100 * row[name]:.1f}"
                for name in ("hit_ratio", "hit_ratio_wire")
            )
            log(
                f"{label:<24}{row['epoch']:>6}{row['MBps']:>10.1f}{100 * row['stall']:>9.1f}"
                f"{hit:>8}{wire:>12}{row['fetched_bytes'] / 1e6:>12.1f}{row['errors']:>8.0f}"
            )
        for problem in problems:
            log(f"{label:<24}  {problem}")


def render(report: dict[str, Any]) -> None:
    """The tables of a report (this run's, or an earlier one's with ``--from-json``)."""
    config = report["config"]
    log(
        f"\n{config['workers']} readers, {config['epochs']} epochs, {config['compute_ms']:g} ms compute per "
        f"sample, {config['latency_ms']:g} ms per request, {config['rate_mbit']} Mbit/s cap, page cache "
        f"{'kept' if config['keep_page_cache'] else 'dropped before every epoch'}"
        + (f"; medians of {config['repeats']} repeats" if config["repeats"] > 1 else "")
    )
    dataset, ceiling = report["dataset"], report.get("moto_ceiling")
    if dataset:
        log(f"dataset: {dataset['files']} files, {dataset['bytes'] / 1e6:.1f} MB")
    if ceiling:
        log(f"server ceiling: {ceiling['gets_per_s']:.0f} GETs/s, {ceiling['MBps']:.1f} MB/s")
    for fraction, result in report["results"].items():
        title = f"cache {100 * float(fraction):.0f} % of the dataset ({result['cache_bytes'] / 1e6:.1f} MB)"
        contenders = result["contenders"]
        labels = {key: entry["label"] for key, entry in contenders.items()}
        outcomes = {key: [Outcome(**run) for run in entry["runs"]] for key, entry in contenders.items()}
        print_table(title, labels, outcomes, config["epochs"])


# -- main ----------------------------------------------------------------------------------------


def write_report(output: Path, report: dict[str, Any]) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2, default=str))


def finish(work: Path, output: Path, report: dict[str, Any]) -> None:
    """Whatever happened: no mount left under ``work``, ``work`` gone, and
    what was measured written to ``output``."""
    unmount_all_under(work)
    shutil.rmtree(work, ignore_errors=True)
    write_report(output, report)
    log(f"\nwrote {output}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=1, help="repeat every contender; tables show medians")
    parser.add_argument("--workers", type=int, default=4, help="reader processes (W)")
    parser.add_argument("--files", type=int, default=2000, help="samples in the dataset")
    parser.add_argument("--file-kib", type=int, default=128, help="mean sample size (64..192 KiB for 128)")
    parser.add_argument("--latency-ms", type=float, default=20.0, help="added to every S3 request")
    parser.add_argument("--rate-mbit", type=int, default=400, help="bandwidth cap each way (HTB)")
    parser.add_argument("--compute-ms", type=float, default=1.0, help="emulated training step per sample")
    parser.add_argument(
        "--cache-fractions", default="1.0,0.5", help="cache sizes as shares of the dataset (comma-separated)"
    )
    parser.add_argument(
        "--only", default="", help=f"comma-separated keys: {', '.join(v.key for v in VARIANTS)}"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--epoch-timeout", type=float, default=900.0, help="seconds before an epoch is failed"
    )
    parser.add_argument("--keep-page-cache", action="store_true", help="do not drop the page cache per epoch")
    parser.add_argument("--no-calibrate", action="store_true", help="skip measuring moto's ceiling")
    parser.add_argument("--output", type=Path, default=RESULTS / "epoch_bench.json")
    parser.add_argument("--from-json", type=Path, help="only print the tables of an earlier run's JSON")
    args = parser.parse_args(argv)
    keys = {v.key for v in VARIANTS}
    args.only_keys = [k.strip() for k in args.only.split(",") if k.strip()] or [v.key for v in VARIANTS]
    unknown = set(args.only_keys) - keys
    if unknown:
        parser.error(f"--only: unknown contender(s) {', '.join(sorted(unknown))}")
    args.fractions = [float(f) for f in args.cache_fractions.split(",") if f.strip()]
    return args


@contextlib.contextmanager
def environment(args: argparse.Namespace, work: Path) -> Iterator[tuple[Network, Server]]:
    """The namespace and the server, torn down whatever happens (also on SIGTERM)."""
    network, server = Network(args.rate_mbit), Server(args.latency_ms)
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))
    try:
        network.setup()
        server.start(work / "s3_server.log")
        yield network, server
    finally:
        server.stop()
        network.teardown()
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json is not None:
        render(json.loads(args.from_json.read_text()))
        return 0
    if os.geteuid() != 0:
        print("epoch_bench needs root (network namespace, tc, drop_caches)", file=sys.stderr)
        return 2
    variants = [v for v in VARIANTS if v.key in args.only_keys]
    features = detect_features()
    log(f"cachefsd features: {features}")
    work = Path(tempfile.mkdtemp(prefix="cachefsd-epoch-bench-"))
    report: dict[str, Any] = {
        "config": {
            k: v for k, v in vars(args).items() if k not in ("only", "only_keys", "output", "cache_fractions")
        },
        "features": features,
        "dataset": {},
        "moto_ceiling": None,
        "results": {},
    }
    labels = {v.key: v.label for v in variants}
    try:
        with environment(args, work) as (network, _server):
            client = s3_client()
            started = time.monotonic()
            dataset = make_dataset(args.files, args.file_kib << 10, work / "local", client)
            log(
                f"dataset: {len(dataset.relatives)} files, {dataset.total_bytes / 1e6:.1f} MB, "
                f"uploaded in {time.monotonic() - started:.1f} s"
            )
            report["dataset"] = {"files": len(dataset.relatives), "bytes": dataset.total_bytes}
            if not args.no_calibrate:
                ceiling = calibrate_moto(s3_client(CALIBRATE_THREADS), dataset, network)
                report["moto_ceiling"] = ceiling
                log(
                    f"server ceiling ({CALIBRATE_THREADS} parallel GETs, {args.latency_ms:g} ms, "
                    f"{args.rate_mbit} Mbit/s): {ceiling['gets_per_s']:.0f} GETs/s, "
                    f"{ceiling['MBps']:.1f} MB/s"
                )
            ctx = Context(work, dataset, features)
            footprint = dataset_footprint(dataset)
            for fraction in args.fractions:
                cache_bytes = int(footprint * fraction)
                title = f"cache {100 * fraction:.0f} % of the dataset ({cache_bytes / 1e6:.1f} MB)"
                log(f"\n== {title}")
                outcomes: dict[str, list[Outcome]] = {v.key: [] for v in variants}
                for repeat in range(args.repeats):
                    for variant in variants:
                        log(f"  {variant.label} (repeat {repeat + 1}/{args.repeats})")
                        outcome = bench_contender(variant, ctx, network, cache_bytes, args, repeat)
                        if outcome.status != "ok":
                            log(f"    {outcome.status}: {outcome.detail}")
                        outcomes[variant.key].append(outcome)
                report["results"][f"{fraction:g}"] = {
                    "cache_bytes": cache_bytes,
                    "contenders": {
                        key: {"label": labels[key], "runs": [asdict(o) for o in runs]}
                        for key, runs in outcomes.items()
                    },
                }
                write_report(args.output, report)
            render(report)
    finally:
        finish(work, args.output, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
