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

from cachefsd import runtime
from cachefsd.cli import LogfmtFormatter
from cachefsd.errors import CachefsdError
from cachefsd.runtime import MountState, notify_systemd, pid_alive, read_state, write_state
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


def test_writing_a_state_removes_those_of_dead_daemons(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon killed with -9 leaves its state file and socket behind; the
    next mount clears them, and leaves live daemons' alone."""
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # the runtime directory under XDG_RUNTIME_DIR
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()

    def state(pid: int, name: str) -> MountState:
        return MountState(pid, str(tmp_path / name), "file:///data", str(tmp_path / "cache"), None)

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
    monkeypatch.setattr(runtime, "FUSE_DEVICE", str(tmp_path / "fuse"))
    with pytest.raises(CachefsdError, match=r"cannot use .*/fuse as uid \d+: FUSE needs it present"):
        runtime.check_fuse_device()
