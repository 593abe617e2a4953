"""Azurite's Blob service on 127.0.0.1, for tests and benchmarks.

Azurite is Microsoft's Azure Storage emulator, from npm; ``scripts/
bootstrap.sh test`` installs it under ``.node/`` in the checkout. It runs
here with in-memory persistence (nothing is left on disk), bound to
127.0.0.1 on a free port, and without its API version check: the Azure
SDK may speak a newer service version than the emulator was released
with. Its one account is the well-known ``devstoreaccount1`` with the key
Microsoft publishes for it; URLs are path-style,
``http://127.0.0.1:PORT/devstoreaccount1``.

The emulator takes the port it is given and does not report one it
chose, so a free port is picked first and the start is retried on the
rare race where another process takes it in between. A test can hang it
(``signal``), or stop it and start it again on the same port.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO

ACCOUNT = "devstoreaccount1"
# Published with the emulator (and in Microsoft's documentation): not a secret.
ACCOUNT_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
DEFAULT_HOST = "127.0.0.1"

# Node starts Azurite in 1-2 s; 30 s only trips on a broken install or a
# machine too loaded to run the tests anyway.
_READY_TIMEOUT_SECONDS = 30.0
_READY_POLL_SECONDS = 0.05
_STOP_TIMEOUT_SECONDS = 5.0
# Picking a free port and binding it is racy; a few tries make that moot.
_PORT_ATTEMPTS = 3


def binary_path() -> Path:
    """``azurite-blob`` as ``scripts/bootstrap.sh test`` installs it."""
    return Path(__file__).resolve().parents[2] / ".node" / "node_modules" / ".bin" / "azurite-blob"


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


class Azurite:
    """``azurite-blob`` in a subprocess; ``endpoint_url`` is the account's URL."""

    def __init__(self, host: str = DEFAULT_HOST) -> None:
        self._host = host
        self.port = 0
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._workdir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def endpoint_url(self) -> str:
        """``http://127.0.0.1:PORT/devstoreaccount1``, what ``--endpoint-url`` takes."""
        if self.port == 0:
            raise RuntimeError("Azurite has no port until start() is called")
        return f"http://{self._host}:{self.port}/{ACCOUNT}"

    def start(self) -> None:
        """Start on a free port; started again after ``stop``, on the port
        it had (a store that comes back where it was), empty."""
        if self._process is not None:
            return
        if self.port != 0:
            self._spawn()
            return
        last_error: RuntimeError | None = None
        for _ in range(_PORT_ATTEMPTS):
            self.port = _free_port(self._host)
            try:
                self._spawn()
                return
            except RuntimeError as exc:
                last_error = exc
        self.port = 0
        assert last_error is not None
        raise last_error

    def _spawn(self) -> None:
        binary = binary_path()
        if not binary.exists():
            raise RuntimeError(f"{binary} is missing: run scripts/bootstrap.sh test")
        # Owned by the emulator until stop(), so no `with` here. Azurite
        # writes nothing with in-memory persistence (which refuses a
        # --location); its working directory is a temporary one all the
        # same, so a stray file lands there.
        workdir = tempfile.TemporaryDirectory(prefix="azurite-")
        log = tempfile.TemporaryFile()  # noqa: SIM115
        process = subprocess.Popen(
            [
                str(binary),
                "--blobHost",
                self._host,
                "--blobPort",
                str(self.port),
                "--inMemoryPersistence",
                "--skipApiVersionCheck",
                "--silent",
            ],
            cwd=workdir.name,
            stdin=subprocess.DEVNULL,
            stdout=log,
            # A file, not a pipe: nobody reads a pipe while tests run, and a
            # full one would block the server.
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + _READY_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            if process.poll() is not None:
                log.seek(0)
                output = log.read().decode(errors="replace")
                log.close()
                workdir.cleanup()
                raise RuntimeError(f"azurite-blob exited with {process.returncode}: {output.strip()}")
            try:
                with urllib.request.urlopen(f"{self.endpoint_url}?comp=list", timeout=1.0):
                    pass
            except urllib.error.HTTPError:
                pass  # an answer (403: the request is not signed) is what was waited for
            except (urllib.error.URLError, OSError):
                time.sleep(_READY_POLL_SECONDS)
                continue
            self._process, self._log, self._workdir = process, log, workdir
            return
        process.kill()
        process.wait()
        log.close()
        workdir.cleanup()
        raise RuntimeError(
            f"azurite-blob did not answer on {self.endpoint_url} within {_READY_TIMEOUT_SECONDS:.0f}s"
        )

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the emulator: SIGSTOP hangs it (connections
        are accepted, never answered), SIGCONT resumes it."""
        if self._process is None:
            raise RuntimeError("Azurite is not running")
        self._process.send_signal(signum)

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
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

    def __enter__(self) -> Azurite:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
