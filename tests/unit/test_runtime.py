"""systemd readiness (the sd_notify datagram), the log line format, and
runtime state files."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from cachefsd.cache.lock import CacheDirLock, create_cache_directory
from cachefsd.cli.logs import LogfmtFormatter
from cachefsd.control.mounts import MountState, pid_alive, read_state, runtime_dir, state_path, write_state
from cachefsd.errors import CachefsdError, ConfigError
from cachefsd.preflight import check_allow_other, check_fuse_device, notify_systemd
from tests.polling import wait_until


def test_ready_is_sent_to_the_notify_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    address = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as systemd:
        systemd.bind(address)
        systemd.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", address)
        notify_systemd("READY=1")
        assert systemd.recv(64) == b"READY=1"


def test_log_lines_are_single_line_logfmt() -> None:
    formatter = LogfmtFormatter()
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord(
            "cachefsd.x", logging.ERROR, __file__, 1, 'bad "%s"', ("thing",), sys.exc_info()
        )
    line = formatter.format(record)
    assert "\n" not in line
    assert line.startswith("ts=")
    assert ' level=error logger=cachefsd.x msg="bad \\"thing\\"" exc="Traceback' in line
    assert "ValueError: boom" in line


def test_a_zombie_is_not_a_live_daemon() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    wait_until(
        lambda: Path(f"/proc/{child.pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z",
        "the child to exit",
        10,
    )
    assert not pid_alive(child.pid)  # exited, not yet reaped
    child.wait()
    assert not pid_alive(child.pid)
    assert pid_alive(os.getpid())


def _as_user(uid: int, runtime_base: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Be user ``uid`` (as far as ``runtime_dir`` asks), with its runtime
    directory under ``runtime_base`` as XDG_RUNTIME_DIR, made and owned by it."""
    monkeypatch.setattr(os, "geteuid", lambda: uid)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime_base))
    directory = runtime_base / "cachefsd"
    directory.mkdir(mode=0o700, parents=True)
    os.chown(directory, uid, uid)
    return directory


@pytest.mark.parametrize("squatted", ["another user's", "a symlink"])
def test_a_runtime_directory_not_privately_this_users_is_refused(
    squatted: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without XDG_RUNTIME_DIR it is /tmp/cachefsd-UID, a name another user
    can create first and fill with symlinks where state files are written."""
    theirs = _as_user(1001, tmp_path / "theirs", monkeypatch)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    if squatted == "a symlink":
        _as_user(1000, tmp_path / "mine", monkeypatch).rmdir()
        (tmp_path / "mine" / "cachefsd").symlink_to(theirs)
    else:
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "theirs"))
    with pytest.raises(CachefsdError, match="is not a directory of this user's"):
        runtime_dir()


def test_a_runtime_directory_of_this_users_is_made_private(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = _as_user(1000, tmp_path, monkeypatch)
    directory.chmod(0o777)
    assert runtime_dir() == directory
    assert directory.stat().st_mode & 0o777 == 0o700


def test_a_state_is_never_written_through_a_symlink(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _as_user(1000, tmp_path, monkeypatch)
    state = MountState(os.getpid(), str(tmp_path / "mnt"), "file:///data", str(tmp_path / "cache"), None, "")
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me")
    state_path(Path(state.mountpoint)).with_suffix(".tmp").symlink_to(victim)
    written = write_state(state)
    assert victim.read_text() == "keep me"
    assert read_state(Path(state.mountpoint)) == state
    assert written.stat().st_mode & 0o777 == 0o600


def test_writing_a_state_removes_those_of_dead_daemons(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon killed with -9 leaves its state file and socket behind; the
    next mount clears them, and leaves live daemons' alone."""
    _as_user(1000, tmp_path, monkeypatch)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()

    def state(pid: int, name: str) -> MountState:
        return MountState(pid, str(tmp_path / name), "file:///data", str(tmp_path / "cache"), None, "")

    dead_path = write_state(state(dead.pid, "dead"))
    dead_path.with_suffix(".sock").touch()
    # A daemon restarting on a mountpoint binds its socket before it
    # replaces the dead one's state file: that socket must stay.
    restarting_path = write_state(state(dead.pid, "restarting"))
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listening.bind(str(restarting_path.with_suffix(".sock")))
    listening.listen()
    live_path = write_state(state(os.getpid(), "live"))
    write_state(state(os.getpid(), "new"))
    listening.close()
    assert not dead_path.exists()
    assert not dead_path.with_suffix(".sock").exists()
    assert restarting_path.with_suffix(".sock").exists()
    assert live_path.exists()
    assert read_state(tmp_path / "new") is not None


def test_a_fuse_device_out_of_reach_is_named_before_libfuse_tries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """libfuse says only "mount failed: 4" when it cannot open the device."""
    with pytest.raises(CachefsdError, match=r"cannot use .*/fuse as uid \d+: FUSE needs it present"):
        check_fuse_device(str(tmp_path / "fuse"))


def test_a_shared_cache_directory_is_refused(tmp_path: Path) -> None:
    """/tmp or a tmpfs root: others may write there whoever owns it."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    refusal = rf"cache.hot.dir: {shared} is writable by other users \(mode 1777\)"
    with pytest.raises(ConfigError, match=refusal):
        create_cache_directory("cache.hot.dir", shared)
    assert shared.stat().st_mode & 0o7777 == 0o1777  # refused, not changed


def test_a_cache_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    """Its owner could replace the index, or plant symlinks where the daemon writes."""
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 1001, 1001)
    with pytest.raises(ConfigError, match=rf"cache.dir: {theirs} belongs to uid 1001, not to this user"):
        create_cache_directory("cache.dir", theirs)


@pytest.mark.parametrize(("mode", "private"), [(0o775, 0o755), (0o777, 0o755), (0o770, 0o750)])
def test_a_cache_directory_of_ones_own_others_could_write_is_made_private(
    mode: int, private: int, tmp_path: Path
) -> None:
    """``mkdir -p`` under a umask of 002 gives 775."""
    mine = tmp_path / "mine"
    mine.mkdir()
    mine.chmod(mode)
    create_cache_directory("cache.dir", mine)
    assert mine.stat().st_mode & 0o7777 == private
    create_cache_directory("cache.dir", tmp_path / "new")
    assert (tmp_path / "new").stat().st_mode & 0o777 == 0o700


def test_allow_other_for_a_user_needs_user_allow_other_in_fuse_conf(tmp_path: Path) -> None:
    """fusermount3 refuses it, and libfuse said only "unexpected error: 4"."""
    conf = tmp_path / "fuse.conf"
    conf.write_text("# user_allow_other\nmount_max = 1000\n")
    with pytest.raises(ConfigError, match=r"^fuse\.allow_other: .* has the line user_allow_other"):
        check_allow_other(True, uid=1000, fuse_conf=conf)
    check_allow_other(False, uid=1000, fuse_conf=conf)
    check_allow_other(True, uid=0, fuse_conf=conf)  # root's mount needs no permission
    conf.write_text("user_allow_other  # for cachefsd\n")
    check_allow_other(True, uid=1000, fuse_conf=conf)
    with pytest.raises(ConfigError, match=r"^fuse\.allow_other: "):
        check_allow_other(True, uid=1000, fuse_conf=tmp_path / "absent")


def test_a_directory_that_cannot_be_locked_is_named_by_its_setting(tmp_path: Path) -> None:
    """A tier on a read-only filesystem said only "cannot lock cache directory /x"."""
    not_a_directory = tmp_path / "file"
    not_a_directory.write_bytes(b"")
    with pytest.raises(ConfigError, match=r"^cache\.hot\.dir: cannot lock .*file: Not a directory$"):
        CacheDirLock(not_a_directory, setting="cache.hot.dir")


def test_a_file_named_lock_that_is_not_ours_is_left_as_it_is(tmp_path: Path) -> None:
    """The lock is truncated and given our pid: in a directory given as a
    cache (or named by a damaged record) a user's own file of that name was
    overwritten."""
    (tmp_path / "lock").write_text("the user's own notes\n")
    with pytest.raises(ConfigError, match=r"^cache\.dir: .*lock is not cachefsd's lock file; move it$"):
        CacheDirLock(tmp_path)
    assert (tmp_path / "lock").read_text() == "the user's own notes\n"
    for ours in ("12345", "\0\0\0\0"):  # from a daemon that is gone; zeros after a power loss
        (tmp_path / "lock").write_text(ours)
        CacheDirLock(tmp_path).release()
        assert (tmp_path / "lock").read_text() == str(os.getpid())
