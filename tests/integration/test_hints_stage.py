"""``cachefsd stage``, ``cachefsd hint`` and ``HintingSampler`` against real
mounts of a moto S3 bucket.

The promises under test: after a stage, reading the selection makes no GET;
a rerun fetches nothing; ``--check`` tells what is resident, by tier;
``--include`` and ``--tier`` are honoured; an offline stage fills the cache
a later mount serves from; a file that cannot be fetched fails the command
and is named; hints, right or wrong, never change the bytes a reader gets.
"""

from __future__ import annotations

import json
import os
import random
import signal
from pathlib import Path
from typing import Any

import pytest

from cachefsd.control.answers import HintCounts
from cachefsd.control.client import ControlClient
from cachefsd.control.mounts import read_state
from cachefsd.testing.s3_server import S3TestServer
from tests.integration.conftest import Mount, MountFactory, run_cli, wait_dead
from tests.integration.datasets import KiB, RawFileDataset, collate_list, new_bucket, put_objects

BLOCK_FLAGS = ("--block-size", "64K")
# Bounded waits on a daemon's exit.
EXIT_WAIT_SECONDS = 10.0


def _dataset(seed: int) -> dict[str, bytes]:
    """Small and multi-block files in nested directories (64 KiB blocks)."""
    rng = random.Random(seed)
    objects = {
        f"train/class_{label}/{index:02d}.raw": rng.randbytes(rng.randrange(1, 150 * KiB))
        for label in range(3)
        for index in range(8)
    }
    objects.update({f"val/{index}.tar": rng.randbytes(200 * KiB) for index in range(3)})
    objects["empty"] = b""
    return objects


def _mount(mounter: MountFactory, s3_server: S3TestServer, bucket: str, *flags: str, **kwargs: Any) -> Mount:
    return mounter(f"s3://{bucket}", "--endpoint-url", s3_server.endpoint_url, *BLOCK_FLAGS, *flags, **kwargs)


def _seed_and_mount(
    s3_client: Any,
    s3_server: S3TestServer,
    mounter: MountFactory,
    stem: str,
    objects: dict[str, bytes],
    *flags: str,
) -> tuple[str, Mount]:
    """A new bucket holding ``objects``, and a mount of it (see ``_mount``)."""
    bucket = new_bucket(s3_client, stem)
    put_objects(s3_client, bucket, objects)
    return bucket, _mount(mounter, s3_server, bucket, *flags)


def _hint_stats(mount: Mount) -> HintCounts:
    """The daemon's hint counters, asked over its control socket."""
    state = read_state(mount.mountpoint)
    assert state is not None
    assert state.control_socket is not None
    return ControlClient(state.control_socket).stats().hints


def _stage(*args: str) -> tuple[int, dict[str, Any], str]:
    """Run ``cachefsd stage ... --json``: exit code, summary, stderr."""
    result = run_cli("stage", *args, "--json")
    lines = result.stdout.strip().splitlines()
    summary = json.loads(lines[-1]) if lines else {}
    return result.returncode, summary, result.stderr


def _read_all(mount: Mount, objects: dict[str, bytes]) -> None:
    for key, data in objects.items():
        assert mount.path(key).read_bytes() == data, key


def test_stage_through_the_mount_then_reads_make_no_get(
    s3_client: Any, s3_server: S3TestServer, mounter: MountFactory
) -> None:
    objects = _dataset(1)
    total = sum(len(data) for data in objects.values())
    _, mount = _seed_and_mount(s3_client, s3_server, mounter, "stage", objects)

    # Through a symlink to the mount (/data -> /mnt/imagenet), as a job may.
    link = mount.mountpoint.parent / "link"
    link.symlink_to(mount.mountpoint)
    code, before, _ = _stage(str(link), "--check")
    assert code == 0
    assert before["files"] == len(objects)
    assert before["bytes"] == total
    assert before["resident"] == {}
    assert before["missing_bytes"] == total

    result = run_cli("stage", str(mount.mountpoint))  # plain output: not a terminal
    assert result.returncode == 0, result.stderr
    assert f"staged {len(objects)} of {len(objects)} files" in result.stdout
    assert "0 failed" in result.stdout

    code, after, _ = _stage(str(mount.mountpoint), "--check")
    assert after["resident"] == {"hot": total}
    assert after["missing_bytes"] == 0

    s3_server.reset_counts()
    code, rerun, _ = _stage(str(mount.mountpoint))
    assert code == 0
    assert rerun["fetched_bytes"] == 0
    assert rerun["cached_bytes"] == total
    assert s3_server.get_object_count == 0

    _read_all(mount, objects)
    assert s3_server.get_object_count == 0, s3_server.counts()


def test_include_and_subdirectory_select_a_subset(
    s3_client: Any, s3_server: S3TestServer, mounter: MountFactory
) -> None:
    objects = _dataset(2)
    _, mount = _seed_and_mount(s3_client, s3_server, mounter, "include", objects)

    tars = {key: data for key, data in objects.items() if key.endswith(".tar")}
    code, summary, _ = _stage(str(mount.mountpoint), "--include", "*.tar")
    assert code == 0
    assert summary["files"] == len(tars)
    assert summary["fetched_bytes"] == sum(len(data) for data in tars.values())

    class_1 = {key: data for key, data in objects.items() if key.startswith("train/class_1/")}
    code, summary, _ = _stage(str(mount.path("train")), "--include", "train/class_1/**")
    assert code == 0
    assert summary["files"] == len(class_1)

    # Nothing outside the selection was staged (checked before any read, which
    # would let the prefetcher fetch the rest).
    code, rest, _ = _stage(str(mount.mountpoint), "--include", "train/class_[02]/*", "--check")
    assert rest["files"] == 16
    assert rest["resident"] == {}

    # A glob that matches nothing (a typo) fails, checked or staged, and says so.
    for check in ((), ("--check",)):
        result = run_cli("stage", str(mount.mountpoint), "--include", "*.jpeg", *check)
        assert result.returncode == 1, result.stdout
        assert "nothing selected: no file under / matching --include '*.jpeg'" in result.stderr

    s3_server.reset_counts()
    _read_all(mount, {**tars, **class_1})
    assert s3_server.get_object_count == 0


def test_tier_warm_places_blocks_in_the_warm_tier(
    tmp_path: Path, s3_client: Any, s3_server: S3TestServer, mounter: MountFactory
) -> None:
    objects = {f"shard-{i}.bin": os.urandom(100 * KiB) for i in range(4)}
    total = sum(len(data) for data in objects.values())
    tiers = ("--hot", str(tmp_path / "hot"), "--hot-size", "4M", "--warm", str(tmp_path / "warm"))
    _, mount = _seed_and_mount(s3_client, s3_server, mounter, "warm", objects, *tiers, "--warm-size", "16M")

    code, summary, _ = _stage(str(mount.mountpoint), "--tier", "warm")
    assert code == 0
    assert summary["fetched_bytes"] == total
    code, check, _ = _stage(str(mount.mountpoint), "--check")
    assert check["tiers"] == ["hot", "warm"]
    assert check["resident"] == {"warm": total}

    s3_server.reset_counts()
    _read_all(mount, objects)
    assert s3_server.get_object_count == 0


def test_offline_stage_fills_the_cache_a_later_mount_reads(
    tmp_path: Path, s3_client: Any, s3_server: S3TestServer, mounter: MountFactory
) -> None:
    objects = _dataset(3)
    bucket = new_bucket(s3_client, "offline")
    put_objects(s3_client, bucket, objects)
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    cache_dir.chmod(0o755)  # made by the user, world-readable
    source = f"s3://{bucket}"
    offline = (source, "--endpoint-url", s3_server.endpoint_url, "--cache-dir", str(cache_dir), *BLOCK_FLAGS)

    code, summary, stderr = _stage(*offline)
    assert code == 0, stderr
    assert summary["files"] == len(objects)
    assert summary["fetched_bytes"] == sum(len(data) for data in objects.values())

    mount = _mount(mounter, s3_server, bucket, cache_dir=cache_dir)
    s3_server.reset_counts()
    _read_all(mount, objects)
    assert s3_server.get_object_count == 0, s3_server.counts()
    # The index and the log name every key: what either run made is owner-only.
    readable = [str(path) for path in cache_dir.rglob("*") if path.stat().st_mode & 0o077]
    assert readable == []

    # The daemon now holds the cache: an offline stage is refused in one line.
    result = run_cli("stage", *offline)
    assert result.returncode != 0
    assert f"stage through the mount: cachefsd stage {mount.mountpoint}" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_file_deleted_after_listing_fails_the_stage_by_name(
    s3_client: Any, s3_server: S3TestServer, mounter: MountFactory
) -> None:
    objects = _dataset(4)
    bucket, mount = _seed_and_mount(s3_client, s3_server, mounter, "deleted", objects)
    walked = list(os.walk(mount.mountpoint))  # the listings are now cached
    assert walked
    gone = "train/class_2/03.raw"
    s3_client.delete_object(Bucket=bucket, Key=gone)

    result = run_cli("stage", str(mount.mountpoint))
    assert result.returncode == 1
    assert f"failed: /{gone}: " in result.stderr
    assert "1 failed" in result.stdout
    # Every other file was staged. (Counted by residency, not GETs: the
    # prefetcher, woken by the walk above, may still be trying the gone file.)
    code, check, _ = _stage(str(mount.mountpoint), "--check")
    assert code == 0
    assert check["missing_bytes"] == len(objects[gone])
    _read_all(mount, {key: data for key, data in objects.items() if key != gone})


def test_a_mount_without_its_daemon_names_the_source(
    s3_client: Any, s3_server: S3TestServer, mounter: MountFactory
) -> None:
    bucket, mount = _seed_and_mount(s3_client, s3_server, mounter, "dead", {"a": b"x"})
    os.kill(mount.pid, signal.SIGKILL)
    wait_dead(mount.pid, EXIT_WAIT_SECONDS)
    result = run_cli("stage", str(mount.mountpoint))
    assert result.returncode != 0
    assert f"cachefsd stage s3://{bucket}" in result.stderr


def test_hint_command_counts_and_wrong_hints_keep_bytes_right(
    tmp_path: Path, s3_client: Any, s3_server: S3TestServer, mounter: MountFactory
) -> None:
    objects = _dataset(5)
    _, mount = _seed_and_mount(s3_client, s3_server, mounter, "hint", objects)
    keys = sorted(objects, reverse=True)  # not the order they will be read in
    order = tmp_path / "order.txt"
    link = tmp_path / "link"
    link.symlink_to(mount.mountpoint)
    into_a_class = tmp_path / "class_1"
    into_a_class.symlink_to(mount.path("train/class_1"))
    in_class_1 = [key for key in keys if key.startswith("train/class_1/")]
    rest = [key for key in keys if key not in in_class_1]
    # Absolute, through a symlink to the mount or to a directory in it, with
    # . and .., and relative.
    lines = (
        [str(mount.path(key)) for key in rest[:3]]
        + [f"{link}/{key}" for key in rest[3:5]]
        + [f"{into_a_class}/{key.rpartition('/')[2]}" for key in in_class_1]
        + [f"{mount.mountpoint}/./no/../{key}" for key in rest[5:7]]
        + [f"./{key}" for key in rest[7:]]
        + ["no/such/file", "", "train"]
    )
    order.write_text("\n".join(lines) + "\n")

    result = run_cli("hint", str(mount.mountpoint), "--order", str(order))
    assert result.returncode == 0, result.stderr
    assert f"{len(objects)} accepted, 2 unknown" in result.stdout

    _read_all(mount, dict(sorted(objects.items())))
    assert _hint_stats(mount).received >= 1

    outside = tmp_path / "outside.txt"
    outside.write_text("/etc/passwd\n")
    result = run_cli("hint", str(mount.mountpoint), "--order", str(outside))
    assert result.returncode != 0
    assert "is not under" in result.stderr


def test_hint_command_takes_each_line_as_one_exact_path(
    tmp_path: Path, s3_client: Any, s3_server: S3TestServer, mounter: MountFactory
) -> None:
    """Names may begin or end with spaces; a file written on Windows ends
    its lines with CRLF: neither is a reason to call a path unknown."""
    objects = {" leading.bin": b"l", "trailing .bin": b"t", "plain.bin": b"p"}
    _, mount = _seed_and_mount(s3_client, s3_server, mounter, "hint-names", objects)
    order = tmp_path / "order.txt"
    order.write_bytes(b"".join(key.encode() + b"\r\n" for key in objects) + b"   \r\n")
    result = run_cli("hint", str(mount.mountpoint), "--order", str(order))
    assert result.returncode == 0, result.stderr
    assert "3 accepted, 0 unknown" in result.stdout


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_hinting_sampler_with_a_dataloader(
    s3_client: Any, s3_server: S3TestServer, mounter: MountFactory
) -> None:
    import torch  # noqa: PLC0415 - torch is slow to import
    from torch.utils.data import DataLoader, RandomSampler  # noqa: PLC0415

    from cachefsd.hints import HintingSampler  # noqa: PLC0415

    objects = {key: data for key, data in _dataset(6).items() if key.startswith("train/")}
    _, mount = _seed_and_mount(s3_client, s3_server, mounter, "sampler", objects)
    dataset = RawFileDataset(mount.path("train"))
    sampler = HintingSampler(
        RandomSampler(dataset, generator=torch.Generator().manual_seed(0)),
        [path for path, _ in dataset.samples],
    )
    loader = DataLoader(dataset, batch_size=4, sampler=sampler, num_workers=2, collate_fn=collate_list)

    for _epoch in range(2):
        seen = []
        for batch in loader:
            for index, _label, data in batch:
                key = str(Path(dataset.samples[index][0]).relative_to(mount.mountpoint))
                assert data == objects[key], key
                seen.append(index)
        assert sorted(seen) == list(range(len(dataset)))
        assert sampler.wait(30.0)
        assert [(r.sent, r.accepted, r.unknown) for r in sampler.results] == [(len(dataset), len(dataset), 0)]

    hints = _hint_stats(mount)
    assert hints.received == 2
    assert hints.accepted == 2 * len(dataset)
