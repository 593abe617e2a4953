"""The ``cachefsd`` command as users meet it: failures that are one line and
fast, signals and ``unmount`` that leave nothing behind, secrets that never
reach a log, and the demo."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cachefsd.cache.lock import CacheDirLock
from cachefsd.config import parse_size
from cachefsd.control.mounts import pid_alive, read_state, state_path
from cachefsd.testing.s3_server import S3TestServer
from tests.integration.conftest import MountFactory, force_unmount, free_port, run_cli
from tests.integration.datasets import new_bucket, put_objects
from tests.polling import wait_until

# A failed mount must say so well inside this (the source check is bounded
# by a 5 s connect timeout and a 15 s mount check).
FAIL_FAST_SECONDS = 20.0
EXIT_DEADLINE_SECONDS = 30.0
DEMO_TIMEOUT_SECONDS = 300.0


def cli(*args: str, env: Mapping[str, str] | None = None, timeout: float = 60.0) -> tuple[int, str, str]:
    """``cachefsd ARGS`` with an optional extra environment: (status, stdout, stderr)."""
    result = subprocess.run(
        [sys.executable, "-m", "cachefsd", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, **(env or {})},
    )
    return result.returncode, result.stdout, result.stderr


# -- mount failures --------------------------------------------------------------


def _case_unreachable(tmp_path: Path, s3_server: S3TestServer) -> tuple[list[str], dict[str, str], str]:
    port = free_port()  # nothing listens here once the probe socket is closed
    return ["s3://bucket", "--endpoint-url", f"http://127.0.0.1:{port}"], {}, f"127.0.0.1:{port}"


def _case_missing_bucket(tmp_path: Path, s3_server: S3TestServer) -> tuple[list[str], dict[str, str], str]:
    return (
        ["s3://no-such-bucket-cachefsd", "--endpoint-url", s3_server.endpoint_url],
        {},
        "no-such-bucket-cachefsd",
    )


def _case_bad_flag(tmp_path: Path, s3_server: S3TestServer) -> tuple[list[str], dict[str, str], str]:
    return ["s3://bucket", "--cache-size", "abc"], {}, "cache.size"


def _case_unknown_toml_key(tmp_path: Path, s3_server: S3TestServer) -> tuple[list[str], dict[str, str], str]:
    config = tmp_path / "cachefsd.toml"
    config.write_text('[cache]\nsize = "1G"\nsize_limit = "2G"\n')
    return ["s3://bucket", "--config", str(config)], {}, "cache.size_limit"


def _case_bad_env(tmp_path: Path, s3_server: S3TestServer) -> tuple[list[str], dict[str, str], str]:
    return ["s3://bucket"], {"CACHEFSD_CACHE__SIZE": "-5"}, "cache.size"


def _case_cache_dir_is_a_file(
    tmp_path: Path, s3_server: S3TestServer
) -> tuple[list[str], dict[str, str], str]:
    (tmp_path / "a-file").write_bytes(b"")
    return ["s3://bucket", "--cache-dir", str(tmp_path / "a-file")], {}, "cache.dir: cannot create"


def _case_cache_dir_in_the_mount(
    tmp_path: Path, s3_server: S3TestServer
) -> tuple[list[str], dict[str, str], str]:
    return ["s3://bucket", "--cache-dir", str(tmp_path / "mnt" / "cache")], {}, "is inside the mountpoint"


def _case_a_file_in_the_tiers_way(
    tmp_path: Path, s3_server: S3TestServer
) -> tuple[list[str], dict[str, str], str]:
    (tmp_path / "cache").mkdir(mode=0o700)
    (tmp_path / "cache" / "blocks").write_bytes(b"not ours to remove")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "sample.bin").write_bytes(b"data")
    return [str(tmp_path / "src")], {}, "is in the way"


MOUNT_FAILURES = {
    "unreachable endpoint": _case_unreachable,
    "missing bucket": _case_missing_bucket,
    "bad flag value": _case_bad_flag,
    "unknown TOML key": _case_unknown_toml_key,
    "bad environment value": _case_bad_env,
    "cache dir is a file": _case_cache_dir_is_a_file,
    "cache dir inside the mountpoint": _case_cache_dir_in_the_mount,
    "a file in the tier's way": _case_a_file_in_the_tiers_way,
}


def _assert_one_line_failure(status: int, stdout: str, stderr: str, elapsed: float, names: str) -> str:
    assert status != 0, stdout
    assert elapsed < FAIL_FAST_SECONDS, f"took {elapsed:.1f}s"
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("cachefsd: error: "), stderr
    assert names in lines[0], stderr
    return lines[0]


@pytest.mark.parametrize("case", list(MOUNT_FAILURES))
def test_mount_failures_are_one_line_and_fast(case: str, tmp_path: Path, s3_server: S3TestServer) -> None:
    args, env, names = MOUNT_FAILURES[case](tmp_path, s3_server)
    source, *flags = args
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    started = time.monotonic()
    status, stdout, stderr = cli(
        "mount",
        source,
        str(mountpoint),
        "--cache-dir",
        str(tmp_path / "cache"),
        "--no-metrics",
        *flags,
        env=env,
    )
    _assert_one_line_failure(status, stdout, stderr, time.monotonic() - started, names)
    assert not os.path.ismount(mountpoint)


@pytest.mark.parametrize(
    ("problem", "message"), [("not empty", "is not empty"), ("missing", "not a directory")]
)
def test_mount_on_a_bad_mountpoint_fails(
    problem: str, message: str, tmp_path: Path, s3_client: Any, s3_server: S3TestServer
) -> None:
    bucket = new_bucket(s3_client)
    put_objects(s3_client, bucket, {"a.txt": b"a"})
    mountpoint = tmp_path / "mnt"
    if problem == "not empty":
        mountpoint.mkdir()
        (mountpoint / "already-here.txt").write_text("user data")
    started = time.monotonic()
    status, stdout, stderr = cli(
        "mount",
        f"s3://{bucket}",
        str(mountpoint),
        "--cache-dir",
        str(tmp_path / "cache"),
        "--no-metrics",
        "--endpoint-url",
        s3_server.endpoint_url,
    )
    line = _assert_one_line_failure(status, stdout, stderr, time.monotonic() - started, "mountpoint")
    assert message in line, line
    assert not os.path.ismount(mountpoint)
    if problem == "not empty":
        assert (mountpoint / "already-here.txt").read_text() == "user data"
    assert not (tmp_path / "cache").exists(), "a mount that cannot happen created a cache directory"


def test_a_second_mount_on_a_mountpoint_says_what_holds_it(
    tmp_path: Path, s3_client: Any, s3_server: S3TestServer, mounter: MountFactory
) -> None:
    """A live daemon is named; one killed with -9 leaves a dead mount, and the
    error says how to clear it (the remount after clearing it works)."""
    bucket = new_bucket(s3_client)
    put_objects(s3_client, bucket, {"a.txt": b"a"})
    mount = mounter(f"s3://{bucket}", "--endpoint-url", s3_server.endpoint_url)

    def mount_again() -> str:
        started = time.monotonic()
        status, stdout, stderr = cli(
            "mount",
            f"s3://{bucket}",
            str(mount.mountpoint),
            "--cache-dir",
            str(tmp_path / "other-cache"),
            "--no-metrics",
            "--endpoint-url",
            s3_server.endpoint_url,
        )
        return _assert_one_line_failure(status, stdout, stderr, time.monotonic() - started, "mountpoint")

    assert f"already mounted by cachefsd (pid {mount.pid})" in mount_again()
    held = open(mount.path("a.txt"), "rb")  # noqa: SIM115 - a loader's worker, killed with its daemon's data
    os.kill(mount.pid, signal.SIGKILL)
    wait_until(lambda: not mount.alive, "the daemon dies", EXIT_DEADLINE_SECONDS)
    assert f"daemon that died; `cachefsd unmount {mount.mountpoint}` clears it" in mount_again()
    # Another mount starting clears dead daemons' states, but not this one's,
    # whose mount is still there: without it the mount looks like another user's.
    mounter(f"s3://{bucket}", "--endpoint-url", s3_server.endpoint_url, name="elsewhere")
    stats = run_cli("stats", str(mount.mountpoint))
    assert f"the daemon of {mount.mountpoint} is not running" in stats.stderr, stats.stderr
    try:
        # A file still open under it makes a plain unmount "busy": detached lazily.
        result = run_cli("unmount", str(mount.mountpoint))
        assert result.returncode == 0, result.stderr
        assert not os.path.ismount(mount.mountpoint)
    finally:
        with contextlib.suppress(OSError):  # ENOTCONN: its FLUSH has no daemon to go to
            held.close()
    again = mounter(f"s3://{bucket}", "--endpoint-url", s3_server.endpoint_url, cache_dir=mount.cache_dir)
    assert again.path("a.txt").read_bytes() == b"a"


def test_a_mount_of_another_users_daemon_is_named_as_such(
    tmp_path: Path, s3_client: Any, s3_server: S3TestServer, mounter: MountFactory
) -> None:
    """A root daemon (systemd, the DaemonSet) keeps its state and control
    socket owner-only: a training user's stats, hint or stage must say so,
    not that the path is no cachefsd mount (nor stage it as a directory).
    Hiding the state file stands in for not being allowed to read it."""
    bucket = new_bucket(s3_client)
    put_objects(s3_client, bucket, {"a.txt": b"a"})
    mount = mounter(f"s3://{bucket}", "--endpoint-url", s3_server.endpoint_url)
    state = state_path(mount.mountpoint)
    hidden = state.with_suffix(".hidden")
    state.rename(hidden)
    try:
        for command in (("stats", str(mount.mountpoint)), ("stage", str(mount.path("a.txt")), "--check")):
            status, stdout, stderr = cli(*command)
            line = _assert_one_line_failure(status, stdout, stderr, 0.0, "another user's cachefsd daemon")
            assert str(mount.mountpoint) in line
    finally:
        hidden.rename(state)


def test_a_cache_larger_than_its_disk_is_a_warning_at_mount(tmp_path: Path, mounter: MountFactory) -> None:
    """Not an error (the tier holds what the disk has room for), but the
    user who typed the size sees that it will not be met, at the terminal."""
    source = tmp_path / "source"
    source.mkdir()
    (source / "a.txt").write_bytes(b"a")
    mount = mounter(str(source), "--cache-size", "1000T")
    assert mount.path("a.txt").read_bytes() == b"a"
    lines = mount.warnings.strip().splitlines()
    assert len(lines) == 1, mount.warnings
    assert lines[0].startswith("cachefsd: warning: hot tier: capacity 1000.0 TiB"), mount.warnings
    assert f"filesystem of {mount.cache_dir} has room for" in lines[0]
    assert mounter(str(source), name="fits").warnings == ""


@dataclass
class _HeldMount:
    """A ``cachefsd mount`` whose daemon has started and waits for the cache
    lock the test holds: past the point where the command launched it, and
    not ready."""

    command: subprocess.Popen[str]
    daemon: int
    mountpoint: Path
    cache: Path
    lock: CacheDirLock
    released: bool = False

    def release(self) -> None:
        """Let the daemon go on (if it still lives)."""
        if not self.released:
            self.released = True
            self.lock.release()


@pytest.fixture(name="held_mount")
def fixture_held_mount(tmp_path: Path) -> Iterator[Callable[[], _HeldMount]]:
    """``held_mount()`` starts one; at teardown a daemon the test left alive
    (it failed) is killed and its mount cleared before the lock goes, so a
    failure leaves no mount behind."""
    started: list[_HeldMount] = []

    def start() -> _HeldMount:
        source, mountpoint, cache = tmp_path / "source", tmp_path / "mnt", tmp_path / "cache"
        for directory in (source, mountpoint, cache):
            directory.mkdir()
        lock = CacheDirLock(cache)
        mount = ["mount", str(source), str(mountpoint), "--cache-dir", str(cache), "--no-metrics"]
        command = subprocess.Popen(
            [sys.executable, "-m", "cachefsd", *mount],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        lock_path = cache / "lock"
        waiting = "the daemon to wait for the lock"
        wait_until(lambda: _waiting_daemon(mountpoint, lock_path) is not None, waiting, FAIL_FAST_SECONDS)
        daemon = _waiting_daemon(mountpoint, lock_path)
        assert daemon is not None
        started.append(_HeldMount(command, daemon, mountpoint, cache, lock))
        return started[-1]

    yield start
    for held in started:
        if pid_alive(held.daemon):
            os.kill(held.daemon, signal.SIGKILL)
        if os.path.ismount(held.mountpoint):
            subprocess.run(["fusermount3", "-uz", str(held.mountpoint)], check=False, timeout=10)
        held.release()
        if held.command.poll() is None:
            held.command.kill()
        held.command.communicate(timeout=EXIT_DEADLINE_SECONDS)


def _waiting_daemon(mountpoint: Path, lock: Path) -> int | None:
    """The pid of a daemon starting for ``mountpoint`` (by its command line)
    once it has opened ``lock``, to wait for it."""
    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")
            ours = b"--ready-fd" in command and os.fsencode(mountpoint) in command
            if ours and any(os.readlink(fd) == str(lock) for fd in (entry / "fd").iterdir()):
                return int(entry.name)
        except OSError:  # not a process, or gone
            continue
    return None


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_mount_stopped_before_it_is_ready_leaves_no_daemon_behind(
    signum: int, held_mount: Callable[[], _HeldMount]
) -> None:
    """``timeout 2 cachefsd mount ...`` or Ctrl-C reports a failure: the
    mount must not appear later behind the caller's back."""
    held = held_mount()
    held.command.send_signal(signum)
    _, stderr = held.command.communicate(timeout=EXIT_DEADLINE_SECONDS)
    held.release()
    assert held.command.returncode != 0, stderr
    assert "Traceback" not in stderr, stderr
    # The command waited for its daemon: had it not stopped it, the daemon
    # would now go on to mount, with the lock released.
    assert not pid_alive(held.daemon), "the daemon outlived the mount command that was stopped"
    assert not os.path.ismount(held.mountpoint)


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["top", "/mnt", "--interval", "nan"], "--interval"),
        (["top", "/mnt", "--interval", "inf"], "--interval"),
        (["top", "/mnt", "--interval", "0"], "--interval"),
        (["top", "/mnt", "--interval", "1e300"], "--interval"),
        (["demo", "--workers", "0"], "--workers"),
    ],
)
def test_bad_flag_values_are_usage_errors_naming_the_flag(args: list[str], flag: str) -> None:
    status, _, stderr = cli(*args)
    assert status == 2, stderr
    assert "Traceback" not in stderr, stderr
    assert f"argument {flag}: expected" in stderr, stderr


def test_a_mount_command_killed_before_the_mount_is_ready_leaves_no_mount(
    held_mount: Callable[[], _HeldMount],
) -> None:
    """SIGKILL (``timeout -s KILL``, the OOM killer) gives the command no
    chance to stop its daemon: the daemon finds nobody reading its "ready"
    and unmounts itself."""
    held = held_mount()
    held.command.kill()
    held.command.communicate(timeout=EXIT_DEADLINE_SECONDS)
    held.release()
    wait_until(lambda: not pid_alive(held.daemon), "the daemon to unmount and exit", EXIT_DEADLINE_SECONDS)
    assert not os.path.ismount(held.mountpoint)
    log = (held.cache / "cachefsd.log").read_text()
    assert "the mounting command is gone: unmounting" in log, log


# -- stopping --------------------------------------------------------------------


def test_sigterm_unmounts_cleanly(s3_client: Any, s3_server: S3TestServer, mounter: MountFactory) -> None:
    bucket = new_bucket(s3_client)
    put_objects(s3_client, bucket, {"a.txt": b"a"})
    mount = mounter(f"s3://{bucket}", "--endpoint-url", s3_server.endpoint_url)
    assert mount.path("a.txt").read_bytes() == b"a"

    os.kill(mount.pid, signal.SIGTERM)
    wait_until(lambda: not os.path.ismount(mount.mountpoint), "the mount goes away", EXIT_DEADLINE_SECONDS)
    wait_until(lambda: not mount.alive, "the daemon exits", EXIT_DEADLINE_SECONDS)
    assert read_state(mount.mountpoint) is None, "the runtime state file is removed"
    log = (mount.cache_dir / "cachefsd.log").read_text()
    assert "Traceback" not in log, log
    assert " ERROR " not in log, log
    assert f"unmounted {mount.mountpoint}" in log, log
    assert os.listdir(mount.mountpoint) == []


def test_unmount_of_a_path_that_is_not_mounted_fails_clearly(tmp_path: Path) -> None:
    status, stdout, stderr = cli("unmount", str(tmp_path))
    line = _assert_one_line_failure(status, stdout, stderr, 0.0, "not mounted")
    assert str(tmp_path) in line
    status, stdout, stderr = cli("unmount", str(tmp_path / "missing"))
    _assert_one_line_failure(status, stdout, stderr, 0.0, "not mounted")


def test_unmount_leaves_a_mount_of_another_filesystem_alone(tmp_path: Path) -> None:
    """As root (the systemd unit, the DaemonSet), fusermount3 -u unmounts
    anything: ``cachefsd unmount`` of a path that is not ours must refuse."""
    other = tmp_path / "tmpfs"
    other.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "none", str(other)], check=True, timeout=10)
    try:
        status, stdout, stderr = cli("unmount", str(other))
        line = _assert_one_line_failure(status, stdout, stderr, 0.0, "is a tmpfs mount, not cachefsd's")
        assert str(other) in line
        assert os.path.ismount(other)
    finally:
        subprocess.run(["umount", str(other)], check=False, timeout=10)


@pytest.mark.parametrize("flags", [(), ("--no-prefetch",)], ids=["default", "no-prefetch"])
def test_unmount_returns_after_the_daemon_exits_cleanly(
    flags: tuple[str, ...], s3_client: Any, s3_server: S3TestServer, mounter: MountFactory
) -> None:
    bucket = new_bucket(s3_client)
    put_objects(s3_client, bucket, {"a.txt": b"a"})
    mount = mounter(f"s3://{bucket}", "--endpoint-url", s3_server.endpoint_url, *flags)
    assert mount.path("a.txt").read_bytes() == b"a"

    result = run_cli("unmount", str(mount.mountpoint))
    assert result.returncode == 0, result.stderr
    assert not mount.alive, "unmount returned before the daemon exited"
    assert not os.path.ismount(mount.mountpoint)
    assert read_state(mount.mountpoint) is None, "the runtime state file is removed"
    log = (mount.cache_dir / "cachefsd.log").read_text()
    assert "Traceback" not in log, log
    # The cache directory is free again: a new mount of it succeeds at once.
    again = mounter(f"s3://{bucket}", "--endpoint-url", s3_server.endpoint_url, cache_dir=mount.cache_dir)
    assert again.path("a.txt").read_bytes() == b"a"


# -- secrets ---------------------------------------------------------------------


def test_credentials_never_reach_logs_or_errors(
    s3_client: Any,
    s3_server: S3TestServer,
    mounter: MountFactory,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    key_id = "AKIACACHEFSDTESTKEY77"
    secret = "s3cr3t-Z9q8w7e6r5t4y3u2i1o0-cachefsd-never-log-me"
    bucket = new_bucket(s3_client)
    put_objects(s3_client, bucket, {"a.txt": b"a", "gone.txt": b"deleted upstream after listing"})
    # The mounter's CLI (and so the daemon) inherits this environment.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)

    # No prefetch: gone.txt must still be uncached when it is deleted.
    mount = mounter(
        f"s3://{bucket}", "--endpoint-url", s3_server.endpoint_url, "--log-level", "debug", "--no-prefetch"
    )
    assert sorted(os.listdir(mount.mountpoint)) == ["a.txt", "gone.txt"]
    assert mount.path("a.txt").read_bytes() == b"a"
    s3_client.delete_object(Bucket=bucket, Key="gone.txt")
    with pytest.raises(OSError):  # noqa: PT011 - ENOENT or EIO; the point is what gets logged
        mount.path("gone.txt").read_bytes()
    with pytest.raises(FileNotFoundError):
        mount.path("missing.txt").read_bytes()
    mount.unmount()

    # And failing mounts with the same credentials in the environment.
    env = {"AWS_ACCESS_KEY_ID": key_id, "AWS_SECRET_ACCESS_KEY": secret}
    outputs = []
    for source, endpoint in (
        (f"s3://{bucket}", f"http://127.0.0.1:{free_port()}"),
        ("s3://no-such-bucket-cachefsd", s3_server.endpoint_url),
    ):
        mountpoint = tmp_path / "failing"
        mountpoint.mkdir(exist_ok=True)
        status, stdout, stderr = cli(
            "mount",
            source,
            str(mountpoint),
            "--cache-dir",
            str(mount.cache_dir),
            "--endpoint-url",
            endpoint,
            "--no-metrics",
            "--log-level",
            "debug",
            env=env,
        )
        assert status != 0
        outputs.extend([stdout, stderr])

    log = (mount.cache_dir / "cachefsd.log").read_text()
    assert "mount ready" in log, "the log should hold the daemon's records"
    for text in [log, *outputs]:
        assert secret not in text
        assert key_id not in text
    # Nor anywhere else the daemon wrote (index, runtime state).
    for path in mount.cache_dir.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path


# -- demo ------------------------------------------------------------------------


def test_demo_reads_two_epochs_and_the_second_hits_the_cache() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "cachefsd", "demo"],
        capture_output=True,
        text=True,
        timeout=DEMO_TIMEOUT_SECONDS,
        check=False,
        env={**os.environ, "COLUMNS": "120"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {}
    for line in result.stdout.splitlines():
        cells = [cell.strip() for cell in re.split(r"[│|┃]", line) if cell.strip()]
        if len(cells) == 5 and cells[0].isdigit():
            rows[int(cells[0])] = cells
    assert sorted(rows) == [1, 2], result.stdout
    for cells in rows.values():
        assert cells[4] == "all match", result.stdout
    assert rows[2][3] == "100.0%", result.stdout
    # Both epochs reached the daemon (the second its hot tier, not just the
    # kernel's page cache), so its own counters hold two datasets' bytes.
    read = re.search(r"read from cache / cold\s*[│|]\s*([\d.]+ \w+) / ([\d.]+ \w+)", result.stdout)
    assert read is not None, result.stdout
    total = sum(parse_size(amount.replace(" ", "")) for amount in (read[1], read[2]))
    assert abs(total - (2 * 64 << 20)) <= 2 * (1 << 20) / 10, result.stdout  # each shown to 0.1 MiB
    # The scan before epoch 1 was the prefetcher's first guess of its files.
    prefetched = re.search(r"prefetch\s*[│|]\s*issued ([\d.]+ \w+)", result.stdout)
    assert prefetched is not None, result.stdout
    assert parse_size(prefetched[1].replace(" ", "")) > 0, result.stdout
    assert "unmounted" in result.stdout


def test_a_source_holding_nothing_is_a_warning_at_mount(tmp_path: Path, mounter: MountFactory) -> None:
    """A mistyped prefix mounted an empty tree without a word."""
    source = tmp_path / "source"
    source.mkdir()
    mount = mounter(str(source))
    assert os.listdir(mount.mountpoint) == []
    expected = f"cachefsd: warning: file://{source} holds no objects: is its prefix mistyped?"
    assert mount.warnings.strip() == expected


def _block_files(*directories: Path) -> int:
    files = (path for directory in directories for path in directory.rglob("*"))
    return sum(1 for path in files if path.parent.parent.name == "blocks")


def test_an_offline_stage_keeps_the_cache_as_its_daemon_laid_it_out(
    tmp_path: Path, mounter: MountFactory
) -> None:
    """``stage SOURCE --cache-dir D`` (the README's form, even ``--check``)
    laid the cache out anew from its defaults: a tiered cache lost its warm
    tier's blocks, a large one was trimmed to 10G."""
    source = tmp_path / "source"
    source.mkdir()
    for i in range(6):
        (source / f"f{i}.bin").write_bytes(os.urandom(200_000))
    cache, hot, warm = tmp_path / "cache", tmp_path / "hot", tmp_path / "warm"
    tiers = ("--hot", str(hot), "--hot-size", "512K", "--warm", str(warm), "--warm-size", "8M")
    mount = mounter(str(source), "--block-size", "64K", *tiers, cache_dir=cache)
    for i in range(6):
        assert mount.path(f"f{i}.bin").read_bytes() == (source / f"f{i}.bin").read_bytes()
    mount.unmount()
    blocks = _block_files(hot, warm)
    assert blocks >= 6 * 3

    check = ("stage", str(source), "--cache-dir", str(cache), "--block-size", "64K", "--check")
    status, stdout, stderr = cli(*check)
    assert status == 0, stderr
    assert stdout.startswith("resident: 100.0% of 6 files"), stdout
    assert _block_files(hot, warm) == blocks
    assert "the cache's own tiers apply" in stderr


def test_a_failed_mount_or_a_size_without_its_unit_leaves_the_cache_as_it_was(
    tmp_path: Path, mounter: MountFactory
) -> None:
    """The cache was trimmed to the new size before the source was checked:
    a mount that then failed on a missing bucket had emptied it anyway; and
    "500" (for 500G) was a valid size."""
    source = tmp_path / "source"
    source.mkdir()
    (source / "f.bin").write_bytes(os.urandom(1_000_000))
    cache = tmp_path / "cache"
    # Without passthrough, so the file read to its end gets no whole file
    # (``cache.whole``) beside its blocks.
    mount = mounter(str(source), "-o", "nopassthrough", "--block-size", "64K", cache_dir=cache)
    assert mount.path("f.bin").read_bytes() == (source / "f.bin").read_bytes()
    mount.unmount()
    blocks = _block_files(cache)
    assert blocks == 16
    mountpoint = tmp_path / "again"
    mountpoint.mkdir()
    flags = ("--cache-dir", str(cache), "--block-size", "64K", "--no-metrics")
    try:
        missing = str(tmp_path / "missing")
        status, _, stderr = cli("mount", missing, str(mountpoint), *flags, "--cache-size", "128K")
        assert status != 0
        assert "missing" in stderr
        assert _block_files(cache) == blocks
        status, _, stderr = cli("mount", str(source), str(mountpoint), *flags, "--cache-size", "500")
        assert status != 0
        assert "cache.size: 500 B is too small for a cache (no unit?)" in stderr
        assert _block_files(cache) == blocks
    finally:
        force_unmount(mountpoint)  # only if a bug mounted it


def test_a_daemon_dying_at_start_is_reported_as_such(tmp_path: Path) -> None:
    """Its ready pipe closes a moment before it can be reaped: that was
    reported as "the mount was not ready within 60s"."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    # Only the daemon (the one process given --ready-fd) closes its pipe, then dies.
    (hooks / "sitecustomize.py").write_text(
        "import os, sys, time\n"
        "if '--ready-fd' in sys.argv:\n"
        "    os.close(int(sys.argv[sys.argv.index('--ready-fd') + 1]))\n"
        "    time.sleep(0.5)\n"
        "    os._exit(3)\n"
    )
    source, mountpoint = tmp_path / "source", tmp_path / "mnt"
    source.mkdir()
    mountpoint.mkdir()
    path = os.pathsep.join([str(hooks), os.environ.get("PYTHONPATH", "")])
    command = ("mount", str(source), str(mountpoint), "--cache-dir", str(tmp_path / "cache"), "--no-metrics")
    try:
        status, _, stderr = cli(*command, env={"PYTHONPATH": path})
    finally:
        force_unmount(mountpoint)  # only if a bug mounted it
    assert status == 1
    assert stderr.startswith("cachefsd: error: the daemon exited with status 3"), stderr
