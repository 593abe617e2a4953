"""systemd readiness (the sd_notify datagram) and the log line format."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from cachefsd.cli import LogfmtFormatter
from cachefsd.runtime import notify_systemd, pid_alive
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
