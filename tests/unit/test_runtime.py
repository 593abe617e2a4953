"""systemd readiness (the sd_notify datagram) and the log line format."""

from __future__ import annotations

import logging
import socket
import sys
from pathlib import Path

import pytest

from cachefsd.cli import LogfmtFormatter
from cachefsd.runtime import notify_systemd


def test_ready_is_sent_to_the_notify_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    address = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as systemd:
        systemd.bind(address)
        systemd.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", address)
        notify_systemd("READY=1")
        assert systemd.recv(64) == b"READY=1"


def test_without_systemd_nothing_is_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    notify_systemd("READY=1")  # must not raise


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
