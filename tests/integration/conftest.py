"""Real mounts: the ``cachefsd`` CLI in a subprocess, mounted through /dev/fuse.

Every wait is bounded and every mount is unmounted in ``finally`` (lazily if
it is wedged), so a broken daemon fails its test instead of hanging the run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cachefsd.control.mounts import pid_alive, read_state
from tests.conftest import TEST_REGION
from tests.net import free_port
from tests.polling import wait_until

# Shared test helpers with asserts of their own: rewrite them as pytest does
# test modules, so their failures say what the values were.
pytest.register_assert_rewrite("tests.integration.torture")

MOUNT_TIMEOUT_SECONDS = 90.0
SERVER_START_SECONDS = 60.0
UNMOUNT_TIMEOUT_SECONDS = 30.0


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test here mounts; it may skip only when the machine has no /dev/fuse."""
    has_fuse = os.path.exists("/dev/fuse")
    for item in items:
        if Path(__file__).parent in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.fuse)
            if not has_fuse:
                item.add_marker(pytest.mark.skip(reason="/dev/fuse is absent"))


def wait_dead(pid: int, timeout: float = UNMOUNT_TIMEOUT_SECONDS) -> None:
    wait_until(lambda: not pid_alive(pid), f"daemon pid {pid} to die", timeout)


def run_cli(*args: str, timeout: float = MOUNT_TIMEOUT_SECONDS) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cachefsd", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def force_unmount(mountpoint: Path) -> None:
    """Last resort for a test's ``finally``: lazy unmount never blocks."""
    for flags in ("-u", "-uz"):
        if not os.path.ismount(mountpoint):
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            subprocess.run(
                ["fusermount3", flags, str(mountpoint)], capture_output=True, timeout=10, check=False
            )


def drop_page_cache() -> None:
    """Drop the kernel's pages, dentries and inodes, so the next read and
    lookup through a mount reaches the daemon, or the cache file a
    passthrough open reads (needs root, as in CI)."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


@dataclass
class Mount:
    mountpoint: Path
    cache_dir: Path
    metrics_url: str
    pid: int
    warnings: str  # what the mount command printed on stderr

    def path(self, relative: str) -> Path:
        return self.mountpoint / relative

    def metrics(self) -> dict[str, float]:
        """Every sample as ``name{label=value,...}`` -> value."""
        with urllib.request.urlopen(self.metrics_url, timeout=10) as response:
            text = response.read().decode()
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return samples

    def unmount(self) -> None:
        result = run_cli("unmount", str(self.mountpoint), timeout=UNMOUNT_TIMEOUT_SECONDS)
        assert result.returncode == 0, result.stderr

    @property
    def alive(self) -> bool:
        return pid_alive(self.pid)


MountFactory = Callable[..., Mount]


@pytest.fixture(name="mounter")
def fixture_mounter(tmp_path: Path) -> Iterator[MountFactory]:
    """``mounter(source, *flags, name="mnt", cache_dir=None, joining=None)``
    mounts ``source`` in the background and returns once the mount is
    ready; ``joining`` a mount whose daemon it joins (on its cache
    directory, with its metrics endpoint). Everything mounted is unmounted
    when the test ends."""
    mounted: list[Path] = []

    def mount(
        source: str,
        *flags: str,
        name: str = "mnt",
        cache_dir: Path | None = None,
        joining: Mount | None = None,
    ) -> Mount:
        mountpoint = tmp_path / name
        mountpoint.mkdir(exist_ok=True)
        if joining is not None:
            cache_dir, metrics_url, metrics_flags = joining.cache_dir, joining.metrics_url, ()
        else:
            port = free_port()
            cache_dir = cache_dir or tmp_path / f"{name}-cache"
            metrics_url = f"http://127.0.0.1:{port}/metrics"
            metrics_flags = ("--metrics-addr", f"127.0.0.1:{port}")
        mounted.append(mountpoint)
        result = run_cli(
            "mount", source, str(mountpoint), "--cache-dir", str(cache_dir), *metrics_flags, *flags
        )
        assert result.returncode == 0, f"mount failed: {result.stderr}"
        assert os.path.ismount(mountpoint)
        state = read_state(mountpoint)
        assert state is not None
        return Mount(mountpoint, cache_dir, metrics_url, state.pid, result.stderr)

    try:
        yield mount
    finally:
        for mountpoint in mounted:
            if os.path.ismount(mountpoint):
                state = read_state(mountpoint)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    run_cli("unmount", str(mountpoint), timeout=UNMOUNT_TIMEOUT_SECONDS)
                force_unmount(mountpoint)
                # A daemon that still serves this mount is wedged; one that
                # serves only others (it joined them) is left to them.
                if state is not None and pid_alive(state.pid) and read_state(mountpoint) is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(state.pid, 9)


class ServerProcess:
    """``python -m cachefsd.testing.s3_server`` on a fixed port, which the
    test can hang, resume, kill and start again on the same port."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-m", "cachefsd.testing.s3_server", "--port", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_until(self._accepts, f"the S3 server on port {self.port} to listen", SERVER_START_SECONDS)

    def _accepts(self) -> bool:
        with socket.socket() as probe:
            probe.settimeout(1.0)
            return probe.connect_ex(("127.0.0.1", self.port)) == 0

    def signal(self, signum: int) -> None:
        assert self._process is not None
        self._process.send_signal(signum)

    def client(self) -> Any:
        return boto3.client("s3", endpoint_url=self.endpoint_url, region_name=TEST_REGION)

    def kill(self) -> None:
        if self._process is not None:
            self._process.send_signal(signal.SIGCONT)  # a stopped process dies only once resumed
            self._process.kill()
            self._process.wait(timeout=30)
            self._process = None


@pytest.fixture(name="server")
def fixture_server() -> Iterator[ServerProcess]:
    """An S3 server of the test's own, to hang (SIGSTOP), resume, kill and start again."""
    server = ServerProcess()
    server.start()
    try:
        yield server
    finally:
        server.kill()
