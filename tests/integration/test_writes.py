"""Writable mounts over moto, as a training job writes its checkpoints:
``torch.save``, ``torch.distributed.checkpoint`` from two processes, and
the POSIX calls beneath them, checked against the bucket with boto3.

The promises under test (SEMANTICS.md, "Writes"): a write lands on the
hot tier and reads back at once; close = on this node's disk, fsync and
``cachefsd sync`` = in the bucket; nothing written is lost to a hung
store or a ``kill -9`` of the daemon; a staged byte is never evicted, and
a write the hot tier cannot hold fails with ENOSPC; what a bucket cannot
do fails with a clear errno.
"""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import shutil
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cachefsd.testing.s3_server import S3TestServer
from tests.integration.conftest import Mount, MountFactory, ServerProcess, run_cli, wait_dead
from tests.integration.datasets import KiB, MiB, new_bucket
from tests.net import free_port

BLOCK_FLAG = ("--block-size", "64K")
SYNC_SECONDS = 60.0
# A short deadline, so an upload to a hung store fails its attempt soon.
DEADLINE_FLAG = ("--fetch-deadline", "3s")


def _object(client: Any, bucket: str, key: str) -> bytes:
    return bytes(client.get_object(Bucket=bucket, Key=key)["Body"].read())


def _keys(client: Any, bucket: str) -> set[str]:
    return {item["Key"] for item in client.list_objects_v2(Bucket=bucket).get("Contents", [])}


def _errno(call: Callable[[], object]) -> int:
    """The errno ``call`` failed with (0 if it did not)."""
    try:
        call()
    except OSError as exc:
        return exc.errno or -1
    return 0


def _write_chunks(path: Path, chunks: int, size: int) -> None:
    with open(path, "wb") as file:
        for _ in range(chunks):
            file.write(os.urandom(size))
            file.flush()


def _sync(mount: Mount, *flags: str) -> Any:
    return run_cli("sync", str(mount.mountpoint), *flags, timeout=SYNC_SECONDS)


@pytest.fixture(name="writable")
def fixture_writable(mounter: MountFactory, s3_server: S3TestServer, s3_client: Any) -> Any:
    """``writable(*flags) -> (mount, bucket)``: a new bucket mounted writable."""

    def mount(*flags: str, objects: dict[str, bytes] | None = None) -> tuple[Mount, str]:
        bucket = new_bucket(s3_client)
        for key, body in (objects or {}).items():
            s3_client.put_object(Bucket=bucket, Key=key, Body=body)
        mounted = mounter(
            f"s3://{bucket}", "--endpoint-url", s3_server.endpoint_url, "--writable", *BLOCK_FLAG, *flags
        )
        return mounted, bucket

    return mount


@pytest.mark.parametrize("through", [True, False], ids=["passthrough", "daemon"])
def test_written_files_read_back_at_once_and_reach_the_bucket_whole(
    writable: Any, s3_client: Any, through: bool
) -> None:
    """Written through the kernel (passthrough on the staged file), or by
    the daemon, request by request."""
    mount, bucket = writable() if through else writable("-o", "nopassthrough")
    files = {
        "top.bin": os.urandom(10 * KiB),
        "ckpt/step-1/model.bin": os.urandom(3 * MiB + 123),  # many blocks, and a part the last
        "ckpt/step-1/empty": b"",
    }
    os.makedirs(mount.path("ckpt/step-1"))
    for name, data in files.items():
        mount.path(name).write_bytes(data)
        assert mount.path(name).read_bytes() == data  # from the staged file
    assert sorted(os.listdir(mount.path("ckpt/step-1"))) == ["empty", "model.bin"]
    assert os.stat(mount.path("ckpt/step-1/model.bin")).st_size == len(files["ckpt/step-1/model.bin"])

    result = _sync(mount)
    assert result.returncode == 0, result.stderr
    for name, data in files.items():
        assert _object(s3_client, bucket, name) == data
    # Uploaded, the file is an object of the bucket, its blocks cached:
    # read back, it costs no GET.
    before = mount.metrics()
    for name, data in files.items():
        assert mount.path(name).read_bytes() == data
    after = mount.metrics()
    assert (
        after["cachefsd_fetch_bytes_total{kind=demand}"] == before["cachefsd_fetch_bytes_total{kind=demand}"]
    )
    assert sorted(os.listdir(mount.path("ckpt/step-1"))) == ["empty", "model.bin"]


def test_torch_save_then_load_through_the_mount(writable: Any, s3_client: Any) -> None:
    import torch  # noqa: PLC0415 - torch is slow to import

    mount, bucket = writable()
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    path = mount.path("run/model.pt")
    path.parent.mkdir()
    torch.save(model.state_dict(), path)
    loaded = torch.load(path, weights_only=True)
    assert loaded.keys() == model.state_dict().keys()
    assert all(torch.equal(loaded[name], tensor) for name, tensor in model.state_dict().items())
    assert _sync(mount).returncode == 0
    assert _object(s3_client, bucket, "run/model.pt") == path.read_bytes()


def _dcp_rank(rank: int, port: int, directory: str, errors: Any) -> None:
    try:
        import torch  # noqa: PLC0415
        import torch.distributed as dist  # noqa: PLC0415
        import torch.distributed.checkpoint as dcp  # noqa: PLC0415

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        try:
            torch.manual_seed(0)
            state = {"shared": torch.randn(300, 300), f"rank{rank}": torch.full((1000,), float(rank))}
            dcp.save(state, checkpoint_id=directory)
            loaded = {"shared": torch.zeros(300, 300), f"rank{rank}": torch.zeros(1000)}
            dcp.load(loaded, checkpoint_id=directory)
            assert all(torch.equal(loaded[name], state[name]) for name in state)
        finally:
            dist.destroy_process_group()
    except BaseException as exc:
        errors.put(f"rank {rank}: {exc!r}")
        raise


def test_distributed_checkpoint_from_two_processes(writable: Any, s3_client: Any) -> None:
    mount, bucket = writable()
    directory = mount.path("dcp/step-10")
    context = multiprocessing.get_context("spawn")
    errors = context.Queue()
    port = free_port()
    ranks = [context.Process(target=_dcp_rank, args=(rank, port, str(directory), errors)) for rank in (0, 1)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(180)
    assert [process.exitcode for process in ranks] == [0, 0], (
        errors.get(timeout=1) if not errors.empty() else ""
    )
    assert _sync(mount).returncode == 0
    written = {path.name: path.read_bytes() for path in directory.iterdir()}
    assert ".metadata" in written
    assert {f"dcp/step-10/{name}" for name in written} == _keys(s3_client, bucket)
    for name, data in written.items():
        assert _object(s3_client, bucket, f"dcp/step-10/{name}") == data


def test_fsync_returns_once_the_object_is_in_the_bucket(writable: Any, s3_client: Any) -> None:
    mount, bucket = writable()
    data = os.urandom(200 * KiB)
    with open(mount.path("f.bin"), "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
        # Still open: the bucket holds what was fsynced.
        assert _object(s3_client, bucket, "f.bin") == data
        file.seek(0)
        file.write(b"in place")  # the size stays: the change must still be seen
    assert _sync(mount).returncode == 0
    assert _object(s3_client, bucket, "f.bin") == b"in place" + data[8:]


def _hung_after_mounting(
    mounter: MountFactory, server: ServerProcess, cache_dir: Path | None = None
) -> tuple[Mount, Any, tuple[str, ...]]:
    """A writable mount of a new bucket of ``server``, its root listed (a
    name is created where its directory was listed: whether the bucket
    holds it is known without the store), then the store hung: the mount,
    a client of the store, and the mount's flags."""
    client = server.client()
    client.create_bucket(Bucket="writes")
    flags = ("--endpoint-url", server.endpoint_url, "--writable", *BLOCK_FLAG, *DEADLINE_FLAG)
    mount = mounter("s3://writes", *flags, cache_dir=cache_dir)
    os.listdir(mount.mountpoint)
    server.signal(signal.SIGSTOP)
    return mount, client, flags


def test_a_hung_store_loses_nothing_sync_names_the_file_and_it_completes_once_back(
    mounter: MountFactory, server: ServerProcess
) -> None:
    mount, client, _ = _hung_after_mounting(mounter, server)
    data = os.urandom(300 * KiB)
    try:
        mount.path("ckpt.bin").write_bytes(data)  # close returns: the bytes are staged
        failed = _sync(mount, "--timeout", "20")
        assert failed.returncode == 1
        assert "ckpt.bin" in failed.stderr
        assert mount.path("ckpt.bin").read_bytes() == data
    finally:
        server.signal(signal.SIGCONT)
    result = _sync(mount)
    assert result.returncode == 0, result.stderr
    assert _object(client, "writes", "ckpt.bin") == data


def test_kill_9_before_the_upload_then_a_remount_uploads_it_whole(
    mounter: MountFactory, server: ServerProcess, tmp_path: Path
) -> None:
    cache_dir = tmp_path / "cache"
    mount, client, flags = _hung_after_mounting(mounter, server, cache_dir)
    data = os.urandom(2 * MiB + 5)
    try:
        mount.path("model.pt").write_bytes(data)
        with open(mount.path("partial.pt"), "wb") as unfinished:
            unfinished.write(b"half a checkpoint")
            os.kill(mount.pid, signal.SIGKILL)
            wait_dead(mount.pid)
    except OSError:
        pass  # the write after the kill: the mount is gone
    finally:
        server.signal(signal.SIGCONT)
    run_cli("unmount", str(mount.mountpoint))
    assert "model.pt" not in _keys(client, "writes")

    again = mounter("s3://writes", *flags, cache_dir=cache_dir, name="again")
    result = _sync(again)
    assert result.returncode == 0, result.stderr
    assert _object(client, "writes", "model.pt") == data
    # The file being written when the daemon died is no object anyone
    # finished: never uploaded, kept aside.
    assert "partial.pt" not in _keys(client, "writes")
    assert (again.path("model.pt")).read_bytes() == data


def test_unmount_names_what_stays_staged_and_the_next_mount_uploads_it(
    mounter: MountFactory, server: ServerProcess, tmp_path: Path
) -> None:
    cache_dir = tmp_path / "cache"
    mount, client, flags = _hung_after_mounting(mounter, server, cache_dir)
    try:
        mount.path("last.pt").write_bytes(b"the last checkpoint")
        result = run_cli("unmount", str(mount.mountpoint))
    finally:
        server.signal(signal.SIGCONT)
    assert result.returncode == 0, result.stderr
    assert "last.pt is not in the bucket" in result.stderr
    again = mounter("s3://writes", *flags, cache_dir=cache_dir, name="again")
    assert _sync(again).returncode == 0
    assert _object(client, "writes", "last.pt") == b"the last checkpoint"


def test_enospc_when_the_hot_tier_is_full_of_staged_data(writable: Any) -> None:
    mount, _ = writable("--cache-size", "1M")
    assert _errno(lambda: _write_chunks(mount.path("big.bin"), 4, 512 * KiB)) == errno.ENOSPC
    mount.path("big.bin").unlink()
    mount.path("small.bin").write_bytes(b"x" * 100 * KiB)  # the room came back
    assert _sync(mount).returncode == 0


def test_a_mount_without_writable_refuses_writes_with_erofs(
    mounter: MountFactory, s3_server: S3TestServer, s3_client: Any
) -> None:
    bucket = new_bucket(s3_client)
    mount = mounter(f"s3://{bucket}", "--endpoint-url", s3_server.endpoint_url)
    assert _errno(lambda: mount.path("new.bin").write_bytes(b"x")) == errno.EROFS
    result = _sync(mount)
    assert result.returncode != 0
    assert "read-only" in result.stderr


def test_rename_and_unlink_of_staged_and_uploaded_files(writable: Any, s3_client: Any) -> None:
    old = os.urandom(100 * KiB)
    mount, bucket = writable(objects={"old.bin": old, "dir/a.bin": b"a"})
    # The pattern of frameworks: write a temporary name, then replace.
    mount.path("latest.tmp").write_bytes(b"new checkpoint")
    os.replace(mount.path("latest.tmp"), mount.path("latest"))
    directory = os.open(mount.mountpoint, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(directory)  # the rename made durable, as a careful writer does
    finally:
        os.close(directory)
    mount.path("gone.bin").write_bytes(b"never uploaded")
    mount.path("gone.bin").unlink()
    os.rename(mount.path("old.bin"), mount.path("moved.bin"))  # in the bucket: a copy and a delete
    assert mount.path("moved.bin").read_bytes() == old
    assert not mount.path("old.bin").exists()
    mount.path("dir/a.bin").unlink()
    assert _sync(mount).returncode == 0
    assert _keys(s3_client, bucket) == {"latest", "moved.bin"}
    assert _object(s3_client, bucket, "latest") == b"new checkpoint"
    assert _object(s3_client, bucket, "moved.bin") == old
    # An uploaded file renamed and unlinked.
    os.rename(mount.path("latest"), mount.path("final"))
    mount.path("moved.bin").unlink()
    assert _keys(s3_client, bucket) == {"final"}
    # Directories: one of staged files moves here; one the bucket holds is copied by mv.
    os.makedirs(mount.path("tmp-checkpoint-1"))
    mount.path("tmp-checkpoint-1/w.bin").write_bytes(b"w")
    os.rename(mount.path("tmp-checkpoint-1"), mount.path("checkpoint-1"))
    assert mount.path("checkpoint-1/w.bin").read_bytes() == b"w"
    assert _sync(mount).returncode == 0
    assert _errno(lambda: os.rename(mount.path("checkpoint-1"), mount.path("checkpoint-2"))) == errno.EXDEV
    os.makedirs(mount.path("empty"))
    os.rmdir(mount.path("empty"))
    assert not mount.path("empty").exists()
    assert _keys(s3_client, bucket) == {"final", "checkpoint-1/w.bin"}
    # An old checkpoint's tree removed, as a job prunes them.
    os.makedirs(mount.path("checkpoint-0/optimizer"))
    mount.path("checkpoint-0/optimizer/state.pt").write_bytes(b"s")
    assert _sync(mount).returncode == 0
    shutil.rmtree(mount.path("checkpoint-0"))
    assert not mount.path("checkpoint-0").exists()
    assert _keys(s3_client, bucket) == {"final", "checkpoint-1/w.bin"}


def test_what_a_bucket_cannot_do_fails_with_a_clear_errno(writable: Any, s3_client: Any) -> None:
    mount, bucket = writable(objects={"data.bin": b"0123456789"})
    for call in (
        lambda: open(mount.path("data.bin"), "r+b").close(),
        lambda: os.chmod(mount.path("data.bin"), 0o644),
        lambda: os.link(mount.path("data.bin"), mount.path("hard")),
        lambda: os.symlink("data.bin", mount.path("soft")),
    ):
        assert _errno(call) == errno.EPERM
    assert _errno(lambda: mount.path("x" * 256).write_bytes(b"")) == errno.ENAMETOOLONG
    # Replaced whole, it is written.
    mount.path("data.bin").write_bytes(b"replaced")
    assert mount.path("data.bin").read_bytes() == b"replaced"
    assert _sync(mount).returncode == 0
    assert _object(s3_client, bucket, "data.bin") == b"replaced"
    assert oct(os.stat(mount.path("data.bin")).st_mode & 0o777) == "0o600"


def test_stats_and_metrics_count_what_a_sync_uploaded(writable: Any, s3_client: Any) -> None:
    """Issue 31 item 8: ``cachefsd stats --json`` and the metrics endpoint
    say the same of a writable mount's uploads, and nothing stays staged
    after a sync."""
    mount, bucket = writable()
    data = os.urandom(2 * MiB + 321)
    mount.path("ckpt.pt").write_bytes(data)
    result = _sync(mount)
    assert result.returncode == 0, result.stderr
    assert _object(s3_client, bucket, "ckpt.pt") == data

    answer = run_cli("stats", str(mount.mountpoint), "--json")
    assert answer.returncode == 0, answer.stderr
    writes = json.loads(answer.stdout)["writes"]
    metrics = mount.metrics()
    label = f"mount={mount.mountpoint}"
    assert writes["uploaded_files"] == metrics[f"cachefsd_uploads_total{{{label},result=ok}}"] == 1
    assert writes["uploaded_bytes"] == metrics[f"cachefsd_upload_bytes_total{{{label}}}"] == len(data)
    assert metrics[f"cachefsd_upload_seconds_count{{{label}}}"] == 1
    assert writes["upload_p50_seconds"] is not None
    assert writes["failed_attempts"] == metrics[f"cachefsd_uploads_total{{{label},result=failed}}"] == 0
    assert writes["staged_bytes"] == metrics[f"cachefsd_staged_bytes{{{label}}}"] == 0
    assert writes["staged_files"] == writes["uploads_due"] == writes["uploads_failing"] == 0
    assert writes["uploads_in_flight"] == metrics[f"cachefsd_uploads_in_flight{{{label}}}"] == 0
    assert writes["oldest_due_seconds"] == metrics[f"cachefsd_upload_oldest_pending_seconds{{{label}}}"] == 0
    assert writes["oldest_failure"] is None

    table = run_cli("stats", str(mount.mountpoint))
    assert table.returncode == 0, table.stderr
    assert "uploads due" in table.stdout
