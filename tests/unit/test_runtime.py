"""systemd readiness: the sd_notify datagram."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

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
