"""Azurite's Blob service on 127.0.0.1, for tests and benchmarks.

Azurite is Microsoft's Azure Storage emulator, from npm; ``scripts/
bootstrap.sh test`` installs it under ``.node/`` in the checkout. It runs
here with in-memory persistence (nothing is left on disk), bound to
127.0.0.1 on a free port, and without its API version check: the Azure
SDK may speak a newer service version than the emulator was released
with. Its one account is the well-known ``devstoreaccount1`` with the key
Microsoft publishes for it; URLs are path-style,
``http://127.0.0.1:PORT/devstoreaccount1``.

Its process is run as ``testing.emulator`` runs one: a test can hang it
(``signal``), or stop it and start it again on the same port.
"""

from __future__ import annotations

from pathlib import Path

from cachefsd.testing.emulator import Emulator

ACCOUNT = "devstoreaccount1"
# Published with the emulator (and in Microsoft's documentation): not a secret.
ACCOUNT_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def binary_path() -> Path:
    """``azurite-blob`` as ``scripts/bootstrap.sh test`` installs it."""
    return Path(__file__).resolve().parents[2] / ".node" / "node_modules" / ".bin" / "azurite-blob"


class Azurite(Emulator):
    """``azurite-blob`` in a subprocess; ``endpoint_url`` is the account's URL."""

    name = "azurite-blob"
    # Node starts Azurite in 1-2 s; 30 s only trips on a broken install or a
    # machine too loaded to run the tests anyway.
    ready_timeout_seconds = 30.0

    @property
    def endpoint_url(self) -> str:
        """``http://127.0.0.1:PORT/devstoreaccount1``, what ``--endpoint-url`` takes."""
        if self.port == 0:
            raise RuntimeError("Azurite has no port until start() is called")
        return f"http://{self.bind_host}:{self.port}/{ACCOUNT}"

    def command(self) -> list[str]:
        binary = binary_path()
        if not binary.exists():
            raise RuntimeError(f"{binary} is missing: run scripts/bootstrap.sh test")
        # In-memory persistence writes nothing (and refuses a --location).
        return [
            str(binary),
            "--blobHost",
            self.bind_host,
            "--blobPort",
            str(self.port),
            "--inMemoryPersistence",
            "--skipApiVersionCheck",
            "--silent",
        ]

    def probe_url(self) -> str:
        # Any answer (403: the request is not signed) means it serves.
        return f"{self.endpoint_url}?comp=list"
