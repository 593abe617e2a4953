"""Observing a real mount: the metrics endpoint counts what the reads
imply, ``cachefsd stats --json`` agrees with it (both read the same
counters), residency reaches 100 % of a prefix that was read, and ``top``
draws on a terminal and quits on ``q``.

Prefetching is off in these mounts so that every byte the daemon fetches
is one a test read asked for, and counters hold still between two looks.
Every wait is bounded: a pseudo-terminal is read with ``select`` against a
deadline, never slept on.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import random
import select
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cachefsd.cache.tier import disk_bytes
from cachefsd.cli.top import SPARK_CHARS
from cachefsd.testing.s3_server import S3TestServer
from tests.integration.conftest import Mount, MountFactory, drop_page_cache, run_cli
from tests.integration.datasets import new_bucket, put_objects

KiB = 1 << 10
BLOCK_SIZE = 64 * KiB
# How long ``top`` may take to draw its first frames, and to exit after q.
TOP_DRAW_SECONDS = 20.0
TOP_EXIT_SECONDS = 10.0
# ``top``'s refresh in the test: short, so a sparkline (which needs two
# samples) appears within a fraction of a second.
TOP_INTERVAL = "0.2"
# The pseudo-terminal ``top`` draws on: large enough for every table.
TERMINAL_ROWS, TERMINAL_COLUMNS = 60, 140


def _dataset(seed: int, sizes: dict[str, int]) -> dict[str, bytes]:
    rng = random.Random(seed)
    return {key: rng.randbytes(size) for key, size in sizes.items()}


def _mount(mounter: MountFactory, s3_server: S3TestServer, bucket: str, *flags: str) -> Mount:
    return mounter(
        f"s3://{bucket}",
        "--endpoint-url",
        s3_server.endpoint_url,
        "--block-size",
        "64K",
        "--no-prefetch",
        *flags,
    )


def _blocks(data: bytes) -> list[bytes]:
    return [data[start : start + BLOCK_SIZE] for start in range(0, len(data), BLOCK_SIZE)]


def _delta(after: dict[str, float], before: dict[str, float], sample: str) -> float:
    return after.get(sample, 0.0) - before.get(sample, 0.0)


def _read_all(mount: Mount, objects: dict[str, bytes]) -> None:
    for key, data in objects.items():
        assert mount.path(key).read_bytes() == data, f"{key}: wrong bytes through the mount"


def test_metrics_count_what_the_reads_imply(
    s3_client: Any, s3_server: S3TestServer, mounter: MountFactory
) -> None:
    # Sizes off the block grid, so the last block of each file is short.
    objects = _dataset(1, {"train/a.bin": 3 * BLOCK_SIZE + 123, "train/b.bin": 5000, "val/c.bin": 200 * KiB})
    bucket = new_bucket(s3_client)
    put_objects(s3_client, bucket, objects)
    # Without passthrough: the files read to their end get no whole files
    # (``cache.whole``), made in the background, which would take room of
    # the hot tier beside the blocks counted here.
    mount = _mount(mounter, s3_server, bucket, "-o", "nopassthrough")
    total = sum(len(data) for data in objects.values())
    blocks = [block for data in objects.values() for block in _blocks(data)]

    before = mount.metrics()
    _read_all(mount, objects)
    first = mount.metrics()
    # Every byte of a first read waited on the bucket, once.
    assert _delta(first, before, "cachefsd_read_bytes_total{source=cold}") == total
    assert _delta(first, before, "cachefsd_read_bytes_total{source=cache}") == 0
    assert _delta(first, before, "cachefsd_served_bytes_total{tier=cold}") == total
    assert _delta(first, before, "cachefsd_fetch_seconds_count{kind=demand}") == len(blocks)
    assert _delta(first, before, "cachefsd_fetch_bytes_total{kind=demand}") == total
    assert _delta(first, before, "cachefsd_read_stall_seconds_total") > 0
    assert first["cachefsd_hit_ratio"] == 0.0
    # Each block is one file of its bare content in the hot tier, in 4 KiB allocation units.
    used = sum(disk_bytes(len(block)) for block in blocks)
    assert first["cachefsd_tier_used_bytes{tier=hot}"] == used
    assert first["cachefsd_tier_blocks{tier=hot}"] == len(blocks)

    drop_page_cache()
    _read_all(mount, objects)
    again = mount.metrics()
    # Re-read past the page cache: all of it from the hot tier, none from the bucket.
    assert _delta(again, first, "cachefsd_read_bytes_total{source=cold}") == 0
    assert _delta(again, first, "cachefsd_read_bytes_total{source=cache}") == total
    assert _delta(again, first, "cachefsd_served_bytes_total{tier=hot}") == total
    assert _delta(again, first, "cachefsd_fetch_seconds_count{kind=demand}") == 0
    assert _delta(again, first, "cachefsd_reads_total{source=cold}") == 0
    assert _delta(again, first, "cachefsd_reads_total{source=cache}") > 0
    assert again["cachefsd_hit_ratio"] == 0.5
    assert again["cachefsd_tier_used_bytes{tier=hot}"] == used


def _read_in_a_process(mount: Mount, keys: list[str], new_session: bool) -> int:
    """Read ``keys`` through the mount from a child process (in a session
    of its own, or in this one's process group); its process group."""
    script = "import sys\nfor path in sys.argv[1:]:\n    open(path, 'rb').read()\n"
    paths = [str(mount.path(key)) for key in keys]
    child = subprocess.Popen([sys.executable, "-c", script, *paths], start_new_session=new_session)
    assert child.wait(timeout=60) == 0
    return child.pid if new_session else os.getpgid(0)


def test_reads_are_counted_per_job(s3_client: Any, s3_server: S3TestServer, mounter: MountFactory) -> None:
    """A job is a process group: a child of this test's process is in this
    job, one started in a session of its own is another."""
    objects = _dataset(4, {f"d/{index}.bin": 20 * KiB + index for index in range(6)})
    bucket = new_bucket(s3_client)
    put_objects(s3_client, bucket, objects)
    mount = _mount(mounter, s3_server, bucket)
    keys = sorted(objects)
    mine = _read_in_a_process(mount, keys[:2], new_session=False)
    other = _read_in_a_process(mount, keys[2:], new_session=True)
    samples = mount.metrics()
    by_job = {
        name.partition("reader_job=")[2].partition(",")[0]: value
        for name, value in samples.items()
        if name.startswith("cachefsd_job_read_bytes_total{") and "source=cold" in name
    }
    assert sorted(by_job.values()) == sorted(
        [sum(len(objects[key]) for key in keys[:2]), sum(len(objects[key]) for key in keys[2:])]
    )
    assert {job.rpartition("[")[2] for job in by_job} == {f"{mine}]", f"{other}]"}
    assert all(samples[f"cachefsd_job_read_stall_seconds_total{{reader_job={job}}}"] > 0 for job in by_job)


def test_two_jobs_on_one_prefix_keep_their_own_epochs(
    s3_client: Any, s3_server: S3TestServer, mounter: MountFactory
) -> None:
    """Two jobs started in sessions of their own read the same files in
    their own shuffles at once: each is a job with its own epochs (3
    passes: epoch 2), where one workload model for both counted an epoch at
    nearly every open. One more is possible: the pages of a file are both
    jobs', and one job dropping them while the other reads the file makes
    the kernel read it twice, which looks like a new pass."""
    objects = _dataset(5, {f"d/{index}.bin": 8 * KiB for index in range(40)})
    bucket = new_bucket(s3_client)
    put_objects(s3_client, bucket, objects)
    mount = _mount(mounter, s3_server, bucket)
    paths = [str(mount.path(key)) for key in sorted(objects)]
    jobs = [
        subprocess.Popen(
            [sys.executable, "-m", "cachefsd.testing.epochs", str(seed), "3", *paths], start_new_session=True
        )
        for seed in (1, 2)
    ]
    for job in jobs:
        assert job.wait(timeout=120) == 0
    result = run_cli("stats", str(mount.mountpoint), "--json")
    assert result.returncode == 0, result.stderr
    epochs = json.loads(result.stdout)["epoch"]["workloads"]
    mine = {
        name: epoch
        for name, epoch in epochs.items()
        if name.endswith(tuple(f"[{job.pid}]:d" for job in jobs))
    }
    assert len(mine) == 2, epochs
    assert all(2 <= epoch <= 3 for epoch in mine.values()), epochs
    # The same per job in the metrics, with each job's hit ratio.
    samples = mount.metrics()
    for job in jobs:
        (epoch,) = [
            v for k, v in samples.items() if k.startswith("cachefsd_job_epoch{") and f"[{job.pid}]" in k
        ]
        assert epoch == next(value for name, value in mine.items() if name.endswith(f"[{job.pid}]:d"))
        (ratio,) = [
            v for k, v in samples.items() if k.startswith("cachefsd_job_hit_ratio{") and f"[{job.pid}]" in k
        ]
        assert ratio >= 2 / 3  # epochs 1 and 2 read the cache only


def test_stats_json_agrees_with_the_metrics_and_shows_residency(
    s3_client: Any, s3_server: S3TestServer, mounter: MountFactory
) -> None:
    train = _dataset(2, {f"train/{i:02d}.bin": 40 * KiB + 1000 * i for i in range(6)})
    val = _dataset(3, {"val/x.bin": 100 * KiB, "top.txt": 10})
    bucket = new_bucket(s3_client)
    put_objects(s3_client, bucket, {**train, **val})
    mount = _mount(mounter, s3_server, bucket)

    _read_all(mount, train)
    # The kernel serves a re-read from its pages without asking: dropped, as
    # for a dataset larger than RAM, the second pass reaches the daemon.
    Path("/proc/sys/vm/drop_caches").write_text("1\n")
    _read_all(mount, train)  # a second pass over the job's files: its epoch 1
    # Scraped first: the epoch gauge is the model's at the scrape, with no
    # stats call (nor prefetcher, here) to bring it up to date.
    metrics = mount.metrics()
    result = run_cli("stats", str(mount.mountpoint), "--json")
    assert result.returncode == 0, result.stderr
    stats = json.loads(result.stdout)

    assert stats["source"] == f"s3://{bucket}"
    assert stats["reads"]["bytes"]["cold"] == metrics["cachefsd_read_bytes_total{source=cold}"]
    assert stats["reads"]["bytes"]["cache"] == metrics["cachefsd_read_bytes_total{source=cache}"]
    assert stats["reads"]["bytes"]["cold"] == sum(len(data) for data in train.values())
    assert stats["reads"]["served_bytes"]["cold"] == metrics["cachefsd_served_bytes_total{tier=cold}"]
    assert stats["hit_ratio"]["since_mount"] == metrics["cachefsd_hit_ratio"]
    assert stats["fetch"]["demand"]["count"] == metrics["cachefsd_fetch_seconds_count{kind=demand}"]
    assert stats["fetch"]["demand"]["p50_seconds"] is not None
    assert stats["fetch"]["demand"]["p50_seconds"] <= stats["fetch"]["demand"]["p99_seconds"]
    assert stats["stall_seconds"] == metrics["cachefsd_read_stall_seconds_total"]
    (hot,) = stats["tiers"]
    assert hot["used_bytes"] == metrics["cachefsd_tier_used_bytes{tier=hot}"] > 0
    assert hot["blocks"] == metrics["cachefsd_tier_blocks{tier=hot}"]
    assert stats["epoch"]["current"] == metrics["cachefsd_epoch"] == 1
    # The job is this test's: its process group's, on train/.
    (epoch,) = [v for k, v in stats["epoch"]["workloads"].items() if k.endswith(f"[{os.getpgid(0)}]:train")]
    assert epoch == 1

    # All of train/ is resident, in the hot tier; nothing of val/ or the root.
    train_bytes = sum(len(data) for data in train.values())
    residency = stats["residency"]
    assert residency["source"] == f"s3://{bucket}"
    assert residency["prefixes"] == [
        {"prefix": "train", "bytes": {"hot": train_bytes}, "total_bytes": train_bytes}
    ]
    label = f"cachefsd_resident_bytes{{prefix=train,source=s3://{bucket},tier=hot}}"
    assert metrics[label] == train_bytes
    assert not any(name.startswith("cachefsd_resident_bytes{prefix=val") for name in metrics)

    table = run_cli("stats", str(mount.mountpoint))
    assert table.returncode == 0, table.stderr
    assert "tiers" in table.stdout
    assert "train" in table.stdout


def test_stats_of_a_path_that_is_not_a_mount_fails_in_one_line(tmp_path: Path) -> None:
    result = run_cli("stats", str(tmp_path))
    assert result.returncode == 1
    assert result.stderr.strip() == f"cachefsd: error: {tmp_path} is not a cachefsd mount"


def _read_until(fd: int, done: Callable[[str], bool], seconds: float, seen: bytearray) -> bool:
    """Read ``fd`` into ``seen`` until ``done(text so far)`` or the deadline."""
    deadline = time.monotonic() + seconds
    while not done(seen.decode(errors="replace")):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        readable, _, _ = select.select([fd], [], [], remaining)
        if readable:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # EIO: the other side has closed
                return done(seen.decode(errors="replace"))
            if not chunk:
                return done(seen.decode(errors="replace"))
            seen.extend(chunk)
    return True


def _drain_until_exit(fd: int, process: subprocess.Popen[bytes], seconds: float) -> int | None:
    """Keep reading ``fd`` (a full terminal would block the writer) until
    ``process`` exits or the deadline; its exit status, or None."""
    deadline = time.monotonic() + seconds
    while process.poll() is None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        readable, _, _ = select.select([fd], [], [], min(remaining, 0.1))
        if readable:
            try:
                os.read(fd, 65536)
            except OSError:
                break
    try:
        return process.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return None


def test_top_draws_the_tiers_and_a_sparkline_and_quits_on_q(
    s3_client: Any, s3_server: S3TestServer, mounter: MountFactory
) -> None:
    objects = _dataset(4, {"train/a.bin": 100 * KiB})
    bucket = new_bucket(s3_client)
    put_objects(s3_client, bucket, objects)
    mount = _mount(mounter, s3_server, bucket)
    _read_all(mount, objects)

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", TERMINAL_ROWS, TERMINAL_COLUMNS, 0, 0))
    env = {
        **os.environ,
        "TERM": "xterm-256color",
        "LANG": "C.UTF-8",
        "PYTHONIOENCODING": "utf-8",
        "COLUMNS": str(TERMINAL_COLUMNS),
        "LINES": str(TERMINAL_ROWS),
    }
    top = subprocess.Popen(
        [sys.executable, "-m", "cachefsd", "top", str(mount.mountpoint), "--interval", TOP_INTERVAL],
        stdin=follower,
        stdout=follower,
        stderr=follower,
        env=env,
        start_new_session=True,
    )
    os.close(follower)
    screen = bytearray()
    try:
        drawn = _read_until(
            leader,
            lambda text: "tiers" in text and "hot" in text and any(char in text for char in SPARK_CHARS),
            TOP_DRAW_SECONDS,
            screen,
        )
        assert drawn, (
            f"top did not draw its tables and sparkline: {screen.decode(errors='replace')[-2000:]!r}"
        )
        assert top.poll() is None, "top exited on its own"
        text = screen.decode(errors="replace")
        assert f"s3://{bucket}" in text
        assert "resident" in text
        os.write(leader, b"q")
        status = _drain_until_exit(leader, top, TOP_EXIT_SECONDS)
        assert status == 0, f"top did not exit 0 within {TOP_EXIT_SECONDS:g}s after q (status {status})"
    finally:
        if top.poll() is None:
            top.kill()
            top.wait(timeout=TOP_EXIT_SECONDS)
        os.close(leader)


def test_top_without_a_terminal_appends_a_snapshot_per_refresh(
    s3_client: Any, s3_server: S3TestServer, mounter: MountFactory
) -> None:
    """Piped (``| tee``, ``kubectl exec`` without ``-t``), a live screen
    would show nothing: each refresh is printed after the last instead."""
    objects = _dataset(4, {"train/a.bin": 100 * KiB})
    bucket = new_bucket(s3_client)
    put_objects(s3_client, bucket, objects)
    mount = _mount(mounter, s3_server, bucket)
    _read_all(mount, objects)
    top = subprocess.Popen(
        [sys.executable, "-m", "cachefsd", "top", str(mount.mountpoint), "--interval", TOP_INTERVAL],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    assert top.stdout is not None
    output = bytearray()
    try:
        shown = _read_until(
            top.stdout.fileno(), lambda text: text.count(f"s3://{bucket}") >= 2, TOP_DRAW_SECONDS, output
        )
        text = output.decode(errors="replace")
        assert shown, f"top printed no second snapshot: {text[-2000:]!r}"
        assert "\x1b[?1049h" not in text, "top switched a pipe to the alternate screen"
        first = text.split(f"s3://{bucket}")[1]
        assert "tiers" in first
        assert "hot" in first
    finally:
        top.kill()
        top.wait(timeout=TOP_EXIT_SECONDS)
        top.stdout.close()
