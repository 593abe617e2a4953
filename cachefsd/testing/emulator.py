"""A storage emulator's binary in a subprocess on 127.0.0.1: what the
Azurite and fake-gcs-server wrappers share.

Neither binary reports a port it chose, so a free port is picked first
and the start is retried on the rare race where another process takes it
in between. After ``stop`` the port is kept: started again, the emulator
comes back where it was (a store that returns after an outage), empty.
The emulator runs in a temporary working directory (a stray file lands
there) and writes its output to a temporary file, not a pipe: nobody
reads a pipe while tests run, and a full one would block the server.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from typing import IO, Self

DEFAULT_HOST = "127.0.0.1"

_READY_POLL_SECONDS = 0.05
_STOP_TIMEOUT_SECONDS = 5.0
# Picking a free port and binding it is racy; a few tries make that moot.
_PORT_ATTEMPTS = 3


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _answers(url: str) -> bool:
    """Whether an HTTP server answers at ``url``, whatever its status."""
    try:
        with urllib.request.urlopen(url, timeout=1.0):
            return True
    except urllib.error.HTTPError:
        return True
    except (urllib.error.URLError, OSError):
        return False


class Emulator:
    """One emulator process on ``host``:``port`` (0: a free one). A
    subclass names it, says how to run it (``command``), where it answers
    once ready (``probe_url``) and how long that may take."""

    name = "emulator"
    ready_timeout_seconds = 10.0

    def __init__(self, host: str = DEFAULT_HOST, port: int = 0) -> None:
        self.bind_host = host
        self.port = port
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._workdir: tempfile.TemporaryDirectory[str] | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def probe_url(self) -> str:
        raise NotImplementedError

    def start(self) -> None:
        if self._process is not None:
            return
        kept = self.port
        last_error: RuntimeError | None = None
        for _ in range(1 if kept else _PORT_ATTEMPTS):
            self.port = kept or _free_port(self.bind_host)
            try:
                self._spawn()
                return
            except RuntimeError as exc:
                last_error = exc
        self.port = kept
        assert last_error is not None
        raise last_error

    def _spawn(self) -> None:
        command = self.command()
        # Owned by the emulator until stop(), so no `with` here.
        workdir = tempfile.TemporaryDirectory(prefix=f"{self.name}-")
        log = tempfile.TemporaryFile()  # noqa: SIM115
        process = subprocess.Popen(
            command, cwd=workdir.name, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
        )
        self._process, self._log, self._workdir = process, log, workdir
        deadline = time.monotonic() + self.ready_timeout_seconds
        while time.monotonic() < deadline:
            if process.poll() is not None:
                log.seek(0)
                output = log.read().decode(errors="replace").strip()
                self.stop()
                raise RuntimeError(f"{self.name} exited with {process.returncode}: {output}")
            if _answers(self.probe_url()):
                return
            time.sleep(_READY_POLL_SECONDS)
        self.stop()
        raise RuntimeError(
            f"{self.name} did not answer on {self.probe_url()} within {self.ready_timeout_seconds:.0f}s"
        )

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the emulator: SIGSTOP hangs it (connections
        are accepted, never answered), SIGCONT resumes it."""
        if self._process is None:
            raise RuntimeError(f"{self.name} is not running")
        self._process.send_signal(signum)

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            process.send_signal(signal.SIGCONT)  # a stopped process acts on SIGTERM only once resumed
            process.terminate()
            try:
                process.wait(_STOP_TIMEOUT_SECONDS)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        log, self._log = self._log, None
        if log is not None:
            log.close()
        workdir, self._workdir = self._workdir, None
        if workdir is not None:
            workdir.cleanup()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
