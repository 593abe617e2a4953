"""Client CPU a GCS GET: obstore's ``GCSStore`` against google-cloud-storage
as ``cachefsd/store/gcs.py`` called it for data (a blocking call in a
thread pool), side by side on one fake-gcs-server.

fake-gcs-server in its own process on 127.0.0.1 (its CPU is not counted),
anonymous credentials for google-cloud-storage and a static fake token for
obstore, so nothing leaves the machine. Three operations, each
``--batch`` GETs with ``--in-flight`` at once a sample, the clients
alternating sample by sample for ``--repeats`` rounds after one warm-up
round, on uvloop as in the daemon:

- ``block``: a 4 MiB range of a 64 MiB object, pinned to its generation
  (``generation=`` for obstore, ``ifGenerationMatch`` for the other);
- ``large``: a 32 MiB range, pinned alike, for the cost a MiB;
- ``small``: a whole 4 KiB object, unpinned (``get_object``).

Reported a GET (a MiB for ``large``), medians over the rounds: this
process's CPU (``time.process_time``: every thread, obstore's Rust ones
included), the event-loop thread's CPU (``time.thread_time``; for
google-cloud-storage the work is in pool threads, which hold the GIL as
much as the loop would), and wall time.

    PYTHONPATH=. .venv/bin/python -m benchmarks.gcs_client_bench [--repeats 7] [--batch 16] [--in-flight 4]
"""

from __future__ import annotations

import os

os.environ.setdefault("NO_GCE_CHECK", "true")
os.environ.setdefault("GCE_METADATA_HOST", "127.0.0.1:1")

import argparse
import asyncio
import datetime
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import uvloop
from google.auth.credentials import AnonymousCredentials
from google.auth.transport.requests import AuthorizedSession
from google.cloud import storage
from obstore import get_async
from obstore.store import GCSStore
from requests.adapters import HTTPAdapter

from cachefsd.store.gcs import EMULATOR_ENV
from cachefsd.testing.gcs_emulator import GcsEmulator

if TYPE_CHECKING:
    from obstore import GetOptions  # TypedDicts of the stubs only
    from obstore.store import GCSCredential

BUCKET = "bench"
_MIB = 1 << 20
BLOCK_BYTES = 4 * _MIB
LARGE_BYTES = 32 * _MIB
SMALL_BYTES = 4 << 10
# The object blocks and large ranges are read from, and the small objects.
DATA_BYTES = 64 * _MIB
SMALL_OBJECTS = 64
# Bounds one GET; the emulator on loopback answers in milliseconds.
REQUEST_SECONDS = 30.0


def _fake_token() -> GCSCredential:
    return {"token": "bench", "expires_at": None}


class ObstoreGets:
    """obstore's GCS client, one attempt a request, on the emulator."""

    name = "obstore"

    def __init__(self, base_url: str, in_flight: int) -> None:
        self._store = GCSStore(
            BUCKET,
            base_url=base_url,
            credential_provider=_fake_token,
            client_options={
                "allow_http": True,
                "timeout": datetime.timedelta(seconds=REQUEST_SECONDS),
                "pool_max_idle_per_host": str(in_flight),
            },
            retry_config={
                "max_retries": 0,
                "retry_timeout": datetime.timedelta(seconds=REQUEST_SECONDS),
                "backoff": {
                    "init_backoff": datetime.timedelta(0),
                    "max_backoff": datetime.timedelta(0),
                    "base": 2,
                },
            },
        )

    async def get_range(self, key: str, start: int, end: int, generation: int) -> int:
        options: GetOptions = {"range": (start, end), "version": str(generation)}
        response = await get_async(self._store, key, options=options)
        assert response.meta["version"] == str(generation)
        return len(bytes(await response.bytes_async()))

    async def get_object(self, key: str) -> int:
        response = await get_async(self._store, key)
        return len(bytes(await response.bytes_async()))

    def close(self) -> None:
        pass


class GoogleCloudStorageGets:
    """google-cloud-storage made and called as ``gcs.py`` did: one client on
    an ``AuthorizedSession`` pooled to the threads, a thread a request."""

    name = "google-cloud-storage"

    def __init__(self, in_flight: int) -> None:
        credentials = AnonymousCredentials()
        self._session = AuthorizedSession(credentials)
        adapter = HTTPAdapter(pool_connections=1, pool_maxsize=in_flight)
        self._session.mount("http://", adapter)
        self._client = storage.Client(project=None, credentials=credentials, _http=self._session)
        self._bucket = self._client.bucket(BUCKET)
        self._executor = ThreadPoolExecutor(max_workers=in_flight)

    async def _run(self, call: Callable[[], int]) -> int:
        return await asyncio.get_running_loop().run_in_executor(self._executor, call)

    async def get_range(self, key: str, start: int, end: int, generation: int) -> int:
        def call() -> int:
            blob = self._bucket.blob(key)
            data = blob.download_as_bytes(
                start=start,
                end=end - 1,
                raw_download=True,
                if_generation_match=generation,
                checksum=None,
                timeout=REQUEST_SECONDS,
                retry=None,
            )
            assert blob.generation == generation
            return len(data)

        return await self._run(call)

    async def get_object(self, key: str) -> int:
        def call() -> int:
            data: bytes = self._bucket.blob(key).download_as_bytes(
                raw_download=True, timeout=REQUEST_SECONDS, retry=None
            )
            return len(data)

        return await self._run(call)

    def close(self) -> None:
        self._executor.shutdown()
        self._client.close()
        self._session.close()


Client = ObstoreGets | GoogleCloudStorageGets


@dataclass(frozen=True)
class Operation:
    """One kind of GET: ``request`` makes the i-th of a batch."""

    name: str
    unit: str
    bytes_a_get: int
    request: Callable[[Client, int], Awaitable[int]]


@dataclass(frozen=True)
class Sample:
    cpu: float
    loop_cpu: float
    wall: float


def seed(emulator: GcsEmulator) -> int:
    """The bucket, its large object and the small ones; the large one's generation."""
    client = storage.Client(project="bench", credentials=AnonymousCredentials())
    bucket = client.create_bucket(BUCKET)
    rng = random.Random(32)
    blob = bucket.blob("data/large.bin")
    blob.upload_from_string(rng.randbytes(DATA_BYTES), timeout=REQUEST_SECONDS)
    for index in range(SMALL_OBJECTS):
        bucket.blob(f"data/small/{index}").upload_from_string(rng.randbytes(SMALL_BYTES))
    client.close()
    assert blob.generation is not None
    return int(blob.generation)


def operations(generation: int) -> list[Operation]:
    blocks = DATA_BYTES // BLOCK_BYTES
    larges = DATA_BYTES // LARGE_BYTES

    async def block(client: Client, index: int) -> int:
        start = (index % blocks) * BLOCK_BYTES
        return await client.get_range("data/large.bin", start, start + BLOCK_BYTES, generation)

    async def large(client: Client, index: int) -> int:
        start = (index % larges) * LARGE_BYTES
        return await client.get_range("data/large.bin", start, start + LARGE_BYTES, generation)

    async def small(client: Client, index: int) -> int:
        return await client.get_object(f"data/small/{index % SMALL_OBJECTS}")

    return [
        Operation("block", "GET", BLOCK_BYTES, block),
        Operation("large", "MiB", LARGE_BYTES, large),
        Operation("small", "GET", SMALL_BYTES, small),
    ]


async def sample(client: Client, operation: Operation, batch: int, in_flight: int) -> Sample:
    slots = asyncio.Semaphore(in_flight)

    async def one(index: int) -> None:
        async with slots:
            got = await asyncio.wait_for(operation.request(client, index), REQUEST_SECONDS)
            assert got == operation.bytes_a_get, (client.name, operation.name, got)

    cpu, loop_cpu, wall = time.process_time(), time.thread_time(), time.perf_counter()
    await asyncio.gather(*(one(index) for index in range(batch)))
    cpu, loop_cpu, wall = (
        time.process_time() - cpu,
        time.thread_time() - loop_cpu,
        time.perf_counter() - wall,
    )
    units = batch * (operation.bytes_a_get / _MIB if operation.unit == "MiB" else 1)
    return Sample(cpu / units, loop_cpu / units, wall / units)


async def measure(
    base_url: str, generation: int, repeats: int, batch: int, in_flight: int
) -> dict[tuple[str, str], list[Sample]]:
    clients: list[Client] = [ObstoreGets(base_url, in_flight), GoogleCloudStorageGets(in_flight)]
    found: dict[tuple[str, str], list[Sample]] = {}
    try:
        for round_number in range(repeats + 1):  # round 0 warms connections up
            order = clients if round_number % 2 else clients[::-1]
            for operation in operations(generation):
                for client in order:
                    taken = await sample(client, operation, batch, in_flight)
                    if round_number:
                        found.setdefault((operation.name, client.name), []).append(taken)
    finally:
        for client in clients:
            client.close()
    return found


def report(found: dict[tuple[str, str], list[Sample]], generation: int) -> None:
    units = {operation.name: operation.unit for operation in operations(generation)}
    print(f"{'op':6} {'client':21} {'CPU ms':>8} {'loop ms':>8} {'wall ms':>8}  (medians)")
    for (operation, client), samples in found.items():
        cpu = statistics.median(s.cpu for s in samples) * 1e3
        loop_cpu = statistics.median(s.loop_cpu for s in samples) * 1e3
        wall = statistics.median(s.wall for s in samples) * 1e3
        unit = units[operation]
        print(f"{operation:6} {client:21} {cpu:8.3f} {loop_cpu:8.3f} {wall:8.3f}  a {unit}, n={len(samples)}")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=7, help="rounds measured, after one warm-up round")
    parser.add_argument("--batch", type=int, default=16, help="GETs a sample")
    parser.add_argument("--in-flight", type=int, default=4, help="GETs at once")
    args = parser.parse_args()
    with GcsEmulator() as emulator:
        os.environ[EMULATOR_ENV] = emulator.host  # google-cloud-storage reads it when a client is made
        generation = seed(emulator)
        found = uvloop.run(measure(emulator.host, generation, args.repeats, args.batch, args.in_flight))
    print(f"fake-gcs-server, batch {args.batch}, {args.in_flight} in flight, {args.repeats} rounds")
    report(found, generation)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
