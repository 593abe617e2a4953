"""The ObjectStore contract, run over every implementation.

Each backend is seeded with the same objects (the awkward ones included: a
directory marker, an empty object, spaces, unicode, a 255-byte name, a key
that is also a prefix, and 1,100 keys in one directory so listings must
page) and must answer list/head/get_range exactly as the reference
(``listing.one_level`` over the seed) does. Since every backend is compared
with the same reference, their listings are identical to each other.

The exception is the local directory, which cannot hold an object named
``dir/`` or both a file ``x`` and a directory ``x/``: it is seeded without
those two keys and compared with the reference over its own seed.

S3 runs against the real moto server over HTTP and against the
file-backed endpoint (``cachefsd.testing.file_s3``, "s3-file"), GCS against
the fake-gcs-server emulator, Azure against Azurite; nothing under test is
mocked. Azure's List Blobs pages up to 5000 blobs: its store is given
pages of 1000, as S3's and GCS's are, so the large directory pages there too. Each test runs its
coroutines in one ``asyncio.run``, opening and closing the store inside it,
because S3Store's aiohttp session belongs to the loop that created it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import hashlib
import os
import random
import socket
import time
import traceback
import uuid
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import boto3
import pytest
import requests
from aiohttp import web
from azure.core.exceptions import (
    ClientAuthenticationError,
    HttpResponseError,
    ServiceRequestError,
    ServiceResponseError,
)
from azure.identity import CredentialUnavailableError
from azure.storage.blob import BlobServiceClient, ContainerSasPermissions, generate_container_sas
from google.api_core import exceptions as api_exceptions
from google.auth import exceptions as auth_exceptions
from google.cloud import storage
from obstore import exceptions as obstore_exceptions

from cachefsd.config import FetchSettings, StoreSettings
from cachefsd.errors import AccessDenied, ObjectChanged, ObjectNotFound, SourceUnreadable, StoreError
from cachefsd.store import azure as azure_module
from cachefsd.store import gcs as gcs_module
from cachefsd.store.azure import AzureStore, AzureTuning
from cachefsd.store.azure_location import AzureLocation
from cachefsd.store.base import Credentials, Listing, ObjectInfo, ObjectStore
from cachefsd.store.faulty import Faults, FaultyStore
from cachefsd.store.gcs import GcsStore
from cachefsd.store.listing import merged, one_level
from cachefsd.store.local import LocalStore
from cachefsd.store.memory import MemoryStore
from cachefsd.store.s3 import S3Store, UploadTuning
from cachefsd.testing.azurite import ACCOUNT, ACCOUNT_KEY, Azurite
from cachefsd.testing.file_s3 import FileS3Server
from cachefsd.testing.s3_server import S3TestServer
from tests.aws import without_aws_credentials

T = TypeVar("T")

# No single store call in these tests should come near this; it turns a hang
# into a failure that names the test.
CALL_TIMEOUT_SECONDS = 60.0
# "Quickly", for a missing bucket or an unreachable endpoint.
FAST_FAILURE_SECONDS = 5.0
# Per-attempt timeout given to the network stores.
ATTEMPT_TIMEOUT_SECONDS = 5.0
# Seconds to connect, and connections pooled, for the Azure store under test.
TEST_CONNECT_TIMEOUT = 2.0
MAX_CONNECTIONS = 16
# Listing pages hold 1000 keys; one directory must need two.
MANY_KEYS = 1100
# The longest name a Linux filesystem allows in one path component.
MAX_NAME_BYTES = 255
DEEP_SIZE = 200_000

# The network stores are rooted under a prefix, with look-alike neighbours
# outside it, so keys must come back relative and nothing may leak in.
REMOTE_PREFIX = "datasets/v1"
OUTSIDE_KEYS = ("datasets/v1-other/zzz.bin", "datasets/outside.bin", "top-level-outside.bin")

LONG_NAME = "long/" + "n" * MAX_NAME_BYTES
UNICODE_KEY = "unicode/naïve-数据-ü.txt"
SPACES_KEY = "spaces/a file with spaces.txt"
DEEP_KEY = "a/b/c/deep.bin"


def _seed() -> dict[str, bytes]:
    rng = random.Random(20240601)
    objects = {
        "top.txt": b"top level\n",
        "empty.bin": b"",
        DEEP_KEY: rng.randbytes(DEEP_SIZE),
        "a/b/sibling.txt": b"sibling\n",
        "a/first.txt": b"first\n",
        "dir/": b"",  # a directory marker, as consoles and s3fs create them
        "dir/inside.txt": b"inside\n",
        SPACES_KEY: b"spaces\n",
        UNICODE_KEY: "unicode ✓\n".encode(),
        LONG_NAME: b"long name\n",
        "x": b"object x\n",
        "x/y": b"object x/y\n",
        "scratch/.keep": b"",  # tests write their own keys under scratch/
    }
    for i in range(MANY_KEYS):
        objects[f"many/{i:05d}"] = f"{i}\n".encode()
    return objects


SEED: Mapping[str, bytes] = _seed()
# Keys a directory tree cannot represent.
NOT_ON_A_FILESYSTEM = frozenset({"dir/", "x"})

LISTED_PREFIXES = ("", "a/", "a/b/", "a/b/c/", "dir/", "spaces/", "unicode/", "long/", "x/", "many/", "nope/")

# Seeding over HTTP is I/O bound; a few threads make 1,100 PUTs take ~1 s.
SEED_THREADS = 16
# Threads of a GcsStore under test: as many as the fetcher's default requests in flight.
GCS_THREADS = FetchSettings().concurrency


@dataclass(frozen=True)
class Backend:
    """One implementation under test: how to open a store, how to write an
    object behind its back, and what it was seeded with."""

    name: str
    open: Callable[[], ObjectStore]
    put: Callable[[str, bytes], None]
    seed: Mapping[str, bytes]
    open_empty: Callable[[], ObjectStore]  # the same kind of source, holding nothing


def run(backend: Backend, body: Callable[[ObjectStore], Awaitable[T]]) -> T:
    """Open a store, run ``body`` with it and close it, all on one fresh loop."""

    async def main() -> T:
        store = backend.open()
        try:
            return await asyncio.wait_for(body(store), CALL_TIMEOUT_SECONDS)
        finally:
            await store.close()

    return asyncio.run(main())


def _seed_concurrently(put: Callable[[str, bytes], None], objects: Mapping[str, bytes]) -> None:
    with ThreadPoolExecutor(SEED_THREADS) as pool:
        for future in [pool.submit(put, key, data) for key, data in objects.items()]:
            future.result()


def _memory_backend() -> Backend:
    store = MemoryStore(dict(SEED))

    def put(key: str, data: bytes) -> None:
        store.put(key, data)

    return Backend("memory", lambda: store, put, SEED, lambda: MemoryStore({}))


def _local_backend(root: Path) -> Backend:
    def put(key: str, data: bytes) -> None:
        path = root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        # A new file renamed over the old one, as a sync tool would: the
        # version changes even when size and mtime happen to match.
        temp = path.with_name(f".{path.name[:200]}.{uuid.uuid4().hex}")
        temp.write_bytes(data)
        os.replace(temp, path)

    seed = {key: data for key, data in SEED.items() if key not in NOT_ON_A_FILESYSTEM}
    for key, data in seed.items():
        path = root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    empty = root.with_name(root.name + "-empty")
    empty.mkdir()
    return Backend("local", lambda: LocalStore(root), put, seed, lambda: LocalStore(empty))


def _s3_backend(name: str, client: Any, settings: StoreSettings) -> Backend:
    bucket = f"contract-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)

    def put(key: str, data: bytes) -> None:
        client.put_object(Bucket=bucket, Key=f"{REMOTE_PREFIX}/{key}", Body=data)

    _seed_concurrently(put, SEED)
    for key in OUTSIDE_KEYS:
        client.put_object(Bucket=bucket, Key=key, Body=b"outside")
    return Backend(
        name,
        lambda: S3Store(bucket, f"/{REMOTE_PREFIX}/", settings, ATTEMPT_TIMEOUT_SECONDS),
        put,
        SEED,
        lambda: S3Store(bucket, f"/{REMOTE_PREFIX}-typo/", settings, ATTEMPT_TIMEOUT_SECONDS),
    )


def _gcs_backend(client: storage.Client) -> Backend:
    bucket_name = f"contract-{uuid.uuid4().hex[:12]}"
    bucket = client.create_bucket(bucket_name)

    def put(key: str, data: bytes) -> None:
        bucket.blob(f"{REMOTE_PREFIX}/{key}").upload_from_string(data)

    _seed_concurrently(put, SEED)
    for key in OUTSIDE_KEYS:
        bucket.blob(key).upload_from_string(b"outside")
    return Backend(
        "gcs",
        lambda: GcsStore(bucket_name, f"/{REMOTE_PREFIX}/", ATTEMPT_TIMEOUT_SECONDS, GCS_THREADS),
        put,
        SEED,
        lambda: GcsStore(bucket_name, f"/{REMOTE_PREFIX}-typo/", ATTEMPT_TIMEOUT_SECONDS, GCS_THREADS),
    )


# Azure's List Blobs pages up to 5000; pages of 1000 make the large directory two.
AZURE_TUNING = AzureTuning(list_page_size=1000)


def _azure_store(
    endpoint_url: str, container: str, prefix: str, tuning: AzureTuning = AZURE_TUNING
) -> AzureStore:
    location = AzureLocation(ACCOUNT, container, prefix, endpoint_url)
    return AzureStore(location, ATTEMPT_TIMEOUT_SECONDS, TEST_CONNECT_TIMEOUT, MAX_CONNECTIONS, tuning)


def _azure_backend(client: BlobServiceClient, server: Azurite) -> Backend:
    container_name = f"contract-{uuid.uuid4().hex[:12]}"
    container = client.create_container(container_name)

    def put(key: str, data: bytes) -> None:
        container.upload_blob(f"{REMOTE_PREFIX}/{key}", data, overwrite=True)

    _seed_concurrently(put, SEED)
    for key in OUTSIDE_KEYS:
        container.upload_blob(key, b"outside")
    return Backend(
        "azure",
        lambda: _azure_store(server.endpoint_url, container_name, f"/{REMOTE_PREFIX}/"),
        put,
        SEED,
        lambda: _azure_store(server.endpoint_url, container_name, f"/{REMOTE_PREFIX}-typo/"),
    )


@pytest.fixture(name="backend", scope="session", params=["memory", "local", "s3", "s3-file", "gcs", "azure"])
def fixture_backend(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Backend:
    """Every ObjectStore implementation, seeded once per session. The servers
    are only started when their backend is selected (``-k memory`` needs none)."""
    if request.param == "memory":
        return _memory_backend()
    if request.param == "local":
        return _local_backend(tmp_path_factory.mktemp("local-store"))
    if request.param == "s3":
        return _s3_backend("s3", request.getfixturevalue("s3_client"), request.getfixturevalue("s3_settings"))
    if request.param == "s3-file":
        server: FileS3Server = request.getfixturevalue("file_s3_server")
        settings = StoreSettings(endpoint_url=server.endpoint_url, region="us-east-1")
        return _s3_backend("s3-file", request.getfixturevalue("file_s3_client"), settings)
    if request.param == "azure":
        return _azure_backend(request.getfixturevalue("azure_client"), request.getfixturevalue("azurite"))
    return _gcs_backend(request.getfixturevalue("gcs_client"))


def _reference(backend: Backend, prefix: str) -> tuple[list[tuple[str, int]], list[str]]:
    infos = [ObjectInfo(key=key, size=len(data), etag="", mtime=0.0) for key, data in backend.seed.items()]
    expected = one_level(prefix, infos)
    return [(info.key, info.size) for info in expected.objects], list(expected.prefixes)


# -- the contract ---------------------------------------------------------------


def test_check_passes_and_says_whether_the_source_holds_anything(backend: Backend) -> None:
    """A mistyped prefix mounted an empty tree without a word."""

    async def body(store: ObjectStore) -> bool:
        return await store.check()

    assert run(backend, body) is True
    empty = dataclasses.replace(backend, open=backend.open_empty)
    assert run(empty, body) is False


@pytest.mark.parametrize("prefix", LISTED_PREFIXES)
def test_list_matches_reference(backend: Backend, prefix: str) -> None:
    listing = run(backend, lambda store: list_one(store, prefix))

    objects, prefixes = _reference(backend, prefix)
    assert [(info.key, info.size) for info in listing.objects] == objects
    assert list(listing.prefixes) == prefixes
    assert all(info.etag for info in listing.objects)


def test_list_pages_through_a_large_directory(backend: Backend) -> None:
    listing, pages = run(backend, lambda store: list_all(store, "many/"))

    # A bucket pages 1000 keys at most; a directory or a dict is one page.
    assert pages == (2 if backend.name in ("s3", "s3-file", "gcs", "azure") else 1)
    assert len(listing.objects) == MANY_KEYS
    assert listing.objects[-1].key == f"many/{MANY_KEYS - 1:05d}"


def test_key_that_is_also_a_prefix(backend: Backend) -> None:
    listing = run(backend, lambda store: list_one(store, ""))

    assert "x/" in listing.prefixes
    assert ("x" in {info.key for info in listing.objects}) == ("x" in backend.seed)


@pytest.mark.parametrize("key", [DEEP_KEY, "empty.bin", SPACES_KEY, UNICODE_KEY, LONG_NAME, "x/y", "dir/"])
def test_head_agrees_with_list(backend: Backend, key: str) -> None:
    if key not in backend.seed:
        return  # the local directory cannot hold this key (see the module docstring)
    # A directory marker is listed in its own directory, not its parent's.
    parent = key if key.endswith("/") else key[: key.rfind("/") + 1]

    async def body(store: ObjectStore) -> tuple[ObjectInfo, list[ObjectInfo]]:
        return await store.head(key), list((await list_one(store, parent)).objects)

    info, listed = run(backend, body)

    assert info.key == key
    assert info.size == len(backend.seed[key])
    assert info.etag
    assert info.mtime > 0
    assert [entry.etag for entry in listed if entry.key == key] == [info.etag]
    if backend.name in ("memory", "s3", "s3-file"):
        # Both use the content MD5 (S3 single-part uploads), unquoted.
        assert info.etag == hashlib.md5(backend.seed[key]).hexdigest()


def _ranges(size: int) -> list[tuple[int, int]]:
    rng = random.Random(size)
    ranges = [(0, size), (0, 1), (5, 5), (size - 1, size + 10), (size, size + 10), (size + 100, size + 200)]
    for _ in range(20):
        start = rng.randrange(0, size)
        ranges.append((start, rng.randrange(start, size + 5000)))
    return ranges


def test_get_range_returns_exact_bytes(backend: Backend) -> None:
    data = backend.seed[DEEP_KEY]

    async def body(store: ObjectStore) -> list[bytes]:
        info = await store.head(DEEP_KEY)
        return [await store.get_range(DEEP_KEY, start, end, info.etag) for start, end in _ranges(len(data))]

    results = run(backend, body)

    for (start, end), got in zip(_ranges(len(data)), results, strict=True):
        assert got == data[start:end], f"range [{start}, {end})"


@pytest.mark.parametrize("key", ["empty.bin", SPACES_KEY, UNICODE_KEY, LONG_NAME, "x/y"])
def test_get_range_of_awkward_keys(backend: Backend, key: str) -> None:
    data = backend.seed[key]

    async def body(store: ObjectStore) -> bytes:
        info = await store.head(key)
        return await store.get_range(key, 0, len(data) + 10, info.etag)

    assert run(backend, body) == data


def test_missing_key_raises_object_not_found(backend: Backend) -> None:
    async def body(store: ObjectStore) -> None:
        with pytest.raises(ObjectNotFound):
            await store.head("missing/nothing.bin")
        with pytest.raises(ObjectNotFound):
            await store.get_range("missing/nothing.bin", 0, 10, "1234")
        etag = (await store.head("top.txt")).etag
        with pytest.raises(ObjectNotFound):
            await store.get_range("missing/nothing.bin", 0, 10, etag)

    run(backend, body)


def test_overwritten_object_raises_object_changed(backend: Backend) -> None:
    key = f"scratch/{uuid.uuid4().hex}.bin"
    backend.put(key, b"version one")

    async def read_v1(store: ObjectStore) -> tuple[str, bytes]:
        info = await store.head(key)
        return info.etag, await store.get_range(key, 0, 100, info.etag)

    etag, data = run(backend, read_v1)
    assert data == b"version one"

    backend.put(key, b"version two")  # same length: only the version tells them apart

    async def read_pinned(store: ObjectStore) -> str:
        for start, end in [(0, 100), (3, 5), (500, 600), (4, 4)]:
            with pytest.raises(ObjectChanged):
                await store.get_range(key, start, end, etag)
        info = await store.head(key)
        assert await store.get_range(key, 0, 100, info.etag) == b"version two"
        return info.etag

    assert run(backend, read_pinned) != etag


def test_whole_objects_are_read_and_written(backend: Backend) -> None:
    """``get_object`` and ``put_object`` (the shared tier's blocks and
    mappings): a missing key is ``ObjectNotFound``, a write replaces."""
    key = f"scratch/{uuid.uuid4().hex}.bin"

    async def body(store: ObjectStore) -> tuple[bytes, bytes, bytes]:
        with pytest.raises(ObjectNotFound):
            await store.get_object(key)
        await store.put_object(key, b"one")
        first = await store.get_object(key)
        await store.put_object(key, b"two, and longer")
        return await store.get_object(DEEP_KEY), first, await store.get_object(key)

    assert run(backend, body) == (backend.seed[DEEP_KEY], b"one", b"two, and longer")


def test_a_faulty_store_injects_into_whole_object_calls() -> None:
    store = FaultyStore(MemoryStore(), Faults(failures_left=2, error=AccessDenied))

    async def body() -> bytes:
        with pytest.raises(AccessDenied):
            await store.put_object("k", b"x")
        with pytest.raises(AccessDenied):
            await store.get_object("k")
        await store.put_object("k", b"x")
        return await store.get_object("k")

    assert asyncio.run(body()) == b"x"
    assert store.calls == 4


# S3Store's default part size: a file one byte over it is a two-part upload.
PART_SIZE = UploadTuning().part_size


def _scratch_key() -> str:
    return f"scratch/{uuid.uuid4().hex}.bin"


async def _listed(store: ObjectStore, key: str) -> ObjectInfo:
    listing = await list_one(store, key[: key.rfind("/") + 1])
    return next(info for info in listing.objects if info.key == key)


@pytest.mark.parametrize("size", [0, 1000, PART_SIZE + 1], ids=["empty", "small", "two-parts"])
def test_put_file_round_trips(backend: Backend, size: int, tmp_path: Path) -> None:
    """The returned version is the one ``head`` and the listing show, and
    reads return the file's bytes."""
    data = random.Random(size).randbytes(size)
    path = tmp_path / "upload.bin"
    path.write_bytes(data)
    key = _scratch_key()

    async def body(store: ObjectStore) -> tuple[ObjectInfo, ObjectInfo, ObjectInfo, bytes]:
        written = await store.put_file(key, path)
        return written, await store.head(key), await _listed(store, key), await store.get_object(key)

    written, headed, listed, stored = run(backend, body)

    # The upload's own answer, no HEAD after it: its mtime is the client's
    # clock, within the store's second-granular one.
    assert (written.key, written.size, written.etag) == (headed.key, headed.size, headed.etag)
    assert abs(written.mtime - headed.mtime) < 5
    assert (listed.key, listed.size, listed.etag) == (key, size, written.etag)
    assert stored == data


def test_put_file_replaces_an_object(backend: Backend, tmp_path: Path) -> None:
    key = _scratch_key()
    first, second = tmp_path / "first", tmp_path / "second"
    first.write_bytes(b"first version")
    second.write_bytes(b"second version, longer")

    async def body(store: ObjectStore) -> tuple[ObjectInfo, ObjectInfo, bytes]:
        old = await store.put_file(key, first)
        new = await store.put_file(key, second)
        return old, new, await store.get_object(key)

    old, new, stored = run(backend, body)

    assert new.etag != old.etag
    assert new.size == len(b"second version, longer")
    assert stored == b"second version, longer"


def test_put_file_of_a_missing_file_uploads_nothing(backend: Backend, tmp_path: Path) -> None:
    key = _scratch_key()

    async def body(store: ObjectStore) -> None:
        with pytest.raises(SourceUnreadable) as caught:
            await store.put_file(key, tmp_path / "missing")
        assert not caught.value.retryable
        with pytest.raises(ObjectNotFound):
            await store.head(key)

    run(backend, body)


def test_delete_removes_and_absent_is_not_an_error(backend: Backend) -> None:
    key = _scratch_key()
    backend.put(key, b"doomed")

    async def body(store: ObjectStore) -> None:
        await store.delete(key)
        with pytest.raises(ObjectNotFound):
            await store.head(key)
        await store.delete(key)
        await store.delete("missing/never-there.bin")

    run(backend, body)


def test_delete_of_a_directory_marker_drops_the_empty_directory(backend: Backend) -> None:
    """``rmdir`` of a directory the bucket shows deletes its marker (``d/``):
    an empty directory is gone from its parent's listing after it."""
    directory = f"scratch/{uuid.uuid4().hex}/"
    backend.put(directory + "only.bin", b"x")

    async def body(store: ObjectStore) -> tuple[str, ...]:
        await store.delete(directory + "only.bin")
        await store.delete(directory)
        await store.delete(directory)  # absent: not an error
        return (await list_one(store, "scratch/")).prefixes

    assert directory not in run(backend, body)


def test_copy_makes_a_new_object_with_the_same_bytes(backend: Backend) -> None:
    target = _scratch_key()
    backend.put(target, b"to be replaced")

    async def body(store: ObjectStore) -> tuple[ObjectInfo, ObjectInfo, bytes, bytes]:
        copied = await store.copy(DEEP_KEY, target)
        return (
            copied,
            await store.head(target),
            await store.get_object(target),
            await store.get_object(DEEP_KEY),
        )

    copied, headed, stored, source = run(backend, body)

    assert copied == headed
    assert (copied.key, copied.size) == (target, len(backend.seed[DEEP_KEY]))
    assert stored == source == backend.seed[DEEP_KEY]


def test_copy_of_a_missing_object_raises_object_not_found(backend: Backend) -> None:
    target = _scratch_key()

    async def body(store: ObjectStore) -> None:
        with pytest.raises(ObjectNotFound):
            await store.copy("missing/nothing.bin", target)
        with pytest.raises(ObjectNotFound):
            await store.head(target)

    run(backend, body)


def test_a_faulty_store_injects_into_writes(tmp_path: Path) -> None:
    path = tmp_path / "upload.bin"
    path.write_bytes(b"bytes")
    store = FaultyStore(MemoryStore({"k": b"x"}), Faults(failures_left=3, error=AccessDenied))

    async def body() -> ObjectInfo:
        with pytest.raises(AccessDenied):
            await store.put_file("new", path)
        with pytest.raises(AccessDenied):
            await store.delete("k")
        with pytest.raises(AccessDenied):
            await store.copy("k", "copied")
        return await store.put_file("new", path)

    assert asyncio.run(body()).size == len(b"bytes")
    assert store.calls == 4


# -- S3 --------------------------------------------------------------------------


def _closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _full_text(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))


async def list_all(store: ObjectStore, prefix: str) -> tuple[Listing, int]:
    """Every page of the listing of ``prefix``, merged, and how many pages."""
    pages: list[Listing] = []
    token: str | None = None
    while not pages or token is not None:
        page = await store.list_page(prefix, token)
        pages.append(page.listing)
        token = page.next_token
    return merged(pages), len(pages)


async def list_one(store: ObjectStore, prefix: str) -> Listing:
    return (await list_all(store, prefix))[0]


def _run_alone(coro_fn: Callable[[], Awaitable[T]]) -> T:
    async def main() -> T:
        return await asyncio.wait_for(coro_fn(), CALL_TIMEOUT_SECONDS)

    return asyncio.run(main())


@pytest.mark.parametrize(
    ("prefix", "uri"),
    [("", "s3://bkt"), ("/", "s3://bkt"), ("data", "s3://bkt/data"), ("/data/v1/", "s3://bkt/data/v1")],
)
def test_s3_uri_is_normalised(prefix: str, uri: str) -> None:
    assert S3Store("bkt", prefix, StoreSettings(), ATTEMPT_TIMEOUT_SECONDS).uri == uri


async def _check_then_close(store: ObjectStore) -> None:
    try:
        await store.check()
    finally:
        await store.close()


def test_s3_missing_bucket_fails_fast(s3_settings: StoreSettings, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = f"secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    store = S3Store("no-such-bucket-here", "x", s3_settings, ATTEMPT_TIMEOUT_SECONDS)

    began = time.monotonic()
    with pytest.raises(ObjectNotFound, match="bucket 'no-such-bucket-here' does not exist") as caught:
        _run_alone(lambda: _check_then_close(store))

    assert time.monotonic() - began < FAST_FAILURE_SECONDS
    assert secret not in _full_text(caught.value)


def test_s3_keys_the_cache_by_the_endpoint_botocore_resolved(
    s3_server: S3TestServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An endpoint from AWS_ENDPOINT_URL (or a profile) is the endpoint all
    the same: two buckets named alike on two endpoints are two sources."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint_url)
    s3_server_client = boto3.client("s3", endpoint_url=s3_server.endpoint_url, region_name="us-east-1")
    s3_server_client.create_bucket(Bucket="keyed-by-endpoint")
    store = S3Store("keyed-by-endpoint", "", StoreSettings(region="us-east-1"), ATTEMPT_TIMEOUT_SECONDS)
    _run_alone(lambda: _check_then_close(store))
    assert store.cache_key == f"s3://keyed-by-endpoint@{s3_server.endpoint_url}"


def test_s3_unreachable_endpoint_is_a_retryable_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # moto accepts any credentials, so a wrong secret cannot be refused here;
    # what can be tested is that a real failure's message never carries it.
    secret = f"secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    port = _closed_port()
    settings = StoreSettings(endpoint_url=f"http://127.0.0.1:{port}", region="us-east-1", connect_timeout=2.0)
    store = S3Store("bkt", "", settings, ATTEMPT_TIMEOUT_SECONDS)

    began = time.monotonic()
    with pytest.raises(StoreError) as caught:
        _run_alone(lambda: _check_then_close(store))

    assert time.monotonic() - began < FAST_FAILURE_SECONDS
    assert type(caught.value) is StoreError
    assert caught.value.retryable
    assert f"127.0.0.1:{port}" in str(caught.value)
    assert "\n" not in str(caught.value)
    assert secret not in _full_text(caught.value)
    assert caught.value.__cause__ is not None


@pytest.mark.parametrize("call", ["put_file", "delete", "copy"])
def test_s3_writes_to_an_unreachable_endpoint_fail_retryably(
    call: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = f"secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    upload = tmp_path / "upload.bin"
    upload.write_bytes(b"upload")
    port = _closed_port()
    settings = StoreSettings(endpoint_url=f"http://127.0.0.1:{port}", region="us-east-1", connect_timeout=2.0)
    store = S3Store("bkt", "", settings, ATTEMPT_TIMEOUT_SECONDS)
    calls: dict[str, Callable[[], Awaitable[object]]] = {
        "put_file": lambda: store.put_file("k", upload),
        "delete": lambda: store.delete("k"),
        "copy": lambda: store.copy("k", "k2"),
    }

    async def body() -> None:
        try:
            await calls[call]()
        finally:
            await store.close()

    with pytest.raises(StoreError) as caught:
        _run_alone(body)

    assert type(caught.value) is StoreError
    assert caught.value.retryable
    assert f"127.0.0.1:{port}" in str(caught.value)
    assert secret not in _full_text(caught.value)


def test_gcs_unreachable_endpoint_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """By its URL without the credentials it may carry, in the message as in the cache key."""
    port = _closed_port()
    monkeypatch.setenv(gcs_module.EMULATOR_ENV, f"http://emu:Secret9@127.0.0.1:{port}")
    store = GcsStore("bkt", "", ATTEMPT_TIMEOUT_SECONDS, GCS_THREADS)
    assert store.cache_key == f"gs://bkt@http://127.0.0.1:{port}"

    began = time.monotonic()
    with pytest.raises(StoreError) as caught:
        _run_alone(lambda: _check_then_close(store))

    assert time.monotonic() - began < FAST_FAILURE_SECONDS
    assert caught.value.retryable
    assert f"cannot reach Google Cloud Storage at http://127.0.0.1:{port}" in str(caught.value)
    assert "Secret9" not in _full_text(caught.value)


@pytest.mark.parametrize("endpoint", ["sends chunked bodies", "ignores Range"])
def test_s3_reads_what_odd_endpoints_send(endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A proxy or an S3-compatible store may send a GET's body chunked, with
    no Content-Length, or ignore Range and send the whole object: the range
    is still read exactly, in pieces as in one. obstore refuses both: from
    botocore's reply to the same GET on, the store reads through botocore."""
    data = os.urandom(1 << 20)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    agents: list[str] = []

    async def get(request: web.Request) -> web.StreamResponse:
        agents.append(request.headers.get("User-Agent", "").split("/")[0])
        if endpoint == "ignores Range":
            return web.Response(body=data, headers={"ETag": '"abc"'})
        first, last = (int(end) for end in request.headers["Range"].removeprefix("bytes=").split("-"))
        headers = {"ETag": '"abc"', "Content-Range": f"bytes {first}-{last}/{len(data)}"}
        response = web.StreamResponse(status=206, headers=headers)
        response.enable_chunked_encoding()
        await response.prepare(request)
        await response.write(data[first : last + 1])
        await response.write_eof()
        return response

    async def body() -> list[bytes | bytearray]:
        app = web.Application()
        app.router.add_get("/{tail:.*}", get)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
        store = S3Store(
            "bkt", "", StoreSettings(endpoint_url=f"http://127.0.0.1:{port}"), ATTEMPT_TIMEOUT_SECONDS
        )
        try:
            return [
                await store.get_range("k", 4096, 4096 + 70_000, "abc"),
                await store.get_range("k", 10, 20, "abc"),
            ]
        finally:
            await store.close()
            await runner.cleanup()

    assert _run_alone(body) == [data[4096 : 4096 + 70_000], data[10:20]]
    assert agents == ["object_store", "aiobotocore", "aiobotocore"]


def test_s3_without_credentials_is_access_denied(
    s3_settings: StoreSettings, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    without_aws_credentials(monkeypatch, tmp_path)
    store = S3Store("bkt", "", s3_settings, ATTEMPT_TIMEOUT_SECONDS)

    with pytest.raises(AccessDenied, match="standard chain"):
        _run_alone(lambda: _check_then_close(store))


def test_s3_signs_with_credentials_of_its_own(
    s3_client: Any, s3_settings: StoreSettings, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The shared tier's (``credentials_env_prefix``): none in the
    environment, and the store still reads and writes."""
    bucket = f"own-{uuid.uuid4().hex[:12]}"
    s3_client.create_bucket(Bucket=bucket)
    without_aws_credentials(monkeypatch, tmp_path)
    store = S3Store(bucket, "p", s3_settings, ATTEMPT_TIMEOUT_SECONDS, Credentials("AKIAOWN", "s3cr3t"))

    async def body() -> bytes:
        try:
            await store.put_object("k", b"signed")
            return await store.get_object("k")
        finally:
            await store.close()

    assert _run_alone(body) == b"signed"


def test_s3_store_survives_an_endpoint_outage(s3_client: Any) -> None:
    """The server goes away and comes back on the same port: reads fail with
    a retryable error meanwhile and work again after, on the same store."""
    bucket = f"outage-{uuid.uuid4().hex[:12]}"
    s3_client.create_bucket(Bucket=bucket)
    s3_client.put_object(Bucket=bucket, Key="k", Body=b"0123456789")
    server = S3TestServer()
    server.start()
    settings = StoreSettings(endpoint_url=server.endpoint_url, region="us-east-1", connect_timeout=2.0)
    store = S3Store(bucket, "", settings, ATTEMPT_TIMEOUT_SECONDS)

    async def body() -> None:
        info = await store.head("k")
        server.reset_counts()
        assert await store.get_range("k", 2, 5, info.etag) == b"234"
        assert server.get_object_count == 1
        assert server.request_count == 1

        server.stop()
        with pytest.raises(StoreError) as caught:
            await store.get_range("k", 2, 5, info.etag)
        assert caught.value.retryable

        server.start()
        assert await store.get_range("k", 2, 5, info.etag) == b"234"

    async def main() -> None:
        try:
            await body()
        finally:
            await store.close()

    try:
        _run_alone(main)
    finally:
        server.stop()


def test_s3_test_server_injects_latency(s3_server: S3TestServer, s3_settings: StoreSettings) -> None:
    store = S3Store("no-such-bucket-here", "", s3_settings, ATTEMPT_TIMEOUT_SECONDS)
    latency = 0.3

    async def timed() -> float:
        began = time.monotonic()
        try:
            with pytest.raises(ObjectNotFound):
                await store.check()
        finally:
            await store.close()
        return time.monotonic() - began

    s3_server.latency_seconds = latency
    try:
        assert _run_alone(timed) >= latency
    finally:
        s3_server.latency_seconds = 0.0


# -- GCS -------------------------------------------------------------------------


@pytest.mark.parametrize(("prefix", "uri"), [("", "gs://bkt"), ("/data/v1/", "gs://bkt/data/v1")])
def test_gcs_uri_is_normalised(prefix: str, uri: str) -> None:
    assert GcsStore("bkt", prefix, ATTEMPT_TIMEOUT_SECONDS, GCS_THREADS).uri == uri


def test_gcs_missing_bucket_fails_fast(gcs_emulator: object) -> None:
    store = GcsStore("no-such-bucket-here", "x", ATTEMPT_TIMEOUT_SECONDS, GCS_THREADS)

    began = time.monotonic()
    with pytest.raises(ObjectNotFound, match="bucket 'no-such-bucket-here' does not exist"):
        _run_alone(lambda: _check_then_close(store))
    assert time.monotonic() - began < FAST_FAILURE_SECONDS


@pytest.mark.parametrize(
    ("status", "expected"),
    [(404, ObjectNotFound), (403, AccessDenied), (401, AccessDenied), (412, ObjectChanged)]
    + [(status, StoreError) for status in (400, 429, 500, 503)],
)
def test_gcs_error_table(status: int, expected: type[StoreError]) -> None:
    error = gcs_module._translate(api_exceptions.from_http_status(status, "m"), target="gs://bkt/k")
    assert type(error) is expected


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (auth_exceptions.DefaultCredentialsError("none"), AccessDenied),
        (auth_exceptions.RefreshError("revoked"), AccessDenied),
        (auth_exceptions.TransportError("unreachable"), StoreError),
        (requests.exceptions.ConnectTimeout("slow"), StoreError),
        (requests.exceptions.ConnectionError("reset"), StoreError),
    ],
)
def test_gcs_error_table_for_transport_and_auth(exc: Exception, expected: type[StoreError]) -> None:
    assert type(gcs_module._translate(exc, target="gs://bkt/k")) is expected


# -- local directory ----------------------------------------------------------------


@pytest.fixture(name="local_root")
def fixture_local_root(tmp_path: Path) -> Path:
    """A root holding one file and two symlinks that point out of it."""
    root = tmp_path / "root"
    root.mkdir()
    (root / "inside.txt").write_bytes(b"inside")
    (tmp_path / "secret.txt").write_bytes(b"outside the root")
    (root / "escape").symlink_to(tmp_path / "secret.txt")
    (root / "escape-dir").symlink_to(tmp_path)
    return root


@pytest.mark.parametrize(
    "key",
    ["../secret.txt", "a/../../secret.txt", "/etc/passwd", "inside.txt\0", "escape", "escape-dir/secret.txt"],
)
def test_local_refuses_keys_outside_the_root(local_root: Path, key: str) -> None:
    store = LocalStore(local_root)

    async def body() -> None:
        with pytest.raises(ObjectNotFound):
            await store.head(key)
        with pytest.raises(ObjectNotFound):
            await store.get_range(key, 0, 10, "etag")

    _run_alone(body)


def test_local_lists_directory_links_unless_they_lead_back_up(tmp_path: Path) -> None:
    """``latest -> v2`` is a view of a dataset; ``sub/up -> ..`` and a pair
    of links into each other would make every scan of the mount endless.
    Links that resolve to nothing (``loop1 -> loop2 -> loop1``) are hidden
    and leave the rest of their directory readable."""
    root = tmp_path / "root"
    for directory in ("v2", "sub", "a", "b"):
        (root / directory).mkdir(parents=True)
    (root / "v2" / "x.bin").write_bytes(b"x")
    (root / "latest").symlink_to("v2")
    (root / "sub" / "up").symlink_to("..")
    (root / "a" / "to-b").symlink_to("../b")
    (root / "b" / "to-a").symlink_to("../a")
    (root / "loop1").symlink_to("loop2")
    (root / "loop2").symlink_to("loop1")
    (root / "v2" / "self").symlink_to("self")
    store = LocalStore(root)
    for key in ("loop1", "v2/self", "loop1/x.bin"):
        with pytest.raises(ObjectNotFound):
            _run_alone(lambda: store.head(key))  # noqa: B023 - awaited at once

    def walk() -> list[str]:
        """Every key and prefix below the root, breadth first; fails if endless."""
        found: list[str] = []
        pending = [""]
        while pending:
            assert len(found) < 100, f"an endless tree: {found[-5:]}"
            prefix = pending.pop(0)
            listing = _run_alone(lambda: list_one(store, prefix))  # noqa: B023 - awaited at once
            found += [info.key for info in listing.objects] + list(listing.prefixes)
            pending += listing.prefixes
        return sorted(found)

    assert walk() == sorted(
        ["a/", "b/", "latest/", "sub/", "v2/", "latest/x.bin", "v2/x.bin", "a/to-b/", "b/to-a/"]
    )


def test_local_does_not_list_symlinks_leaving_the_root(local_root: Path) -> None:
    listing = _run_alone(lambda: list_one(LocalStore(local_root), ""))

    assert [info.key for info in listing.objects] == ["inside.txt"]
    assert listing.prefixes == ()


@pytest.mark.parametrize(
    "key", ["../outside.bin", "a/../../outside.bin", "/tmp/outside.bin", "escape-dir/outside.bin"]
)
def test_local_writes_stay_inside_the_root(local_root: Path, tmp_path: Path, key: str) -> None:
    upload = tmp_path / "upload.bin"
    upload.write_bytes(b"upload")
    store = LocalStore(local_root)

    async def body() -> None:
        with pytest.raises(ObjectNotFound):
            await store.put_file(key, upload)
        with pytest.raises(ObjectNotFound):
            await store.copy("inside.txt", key)
        await store.delete(key)  # names no object of the store: nothing to delete
        await store.delete("escape")  # a link out of the root: its target stays

    _run_alone(body)

    assert not (tmp_path / "outside.bin").exists()
    assert (tmp_path / "secret.txt").read_bytes() == b"outside the root"


def test_local_put_file_makes_directories_and_leaves_no_temporary_file(
    local_root: Path, tmp_path: Path
) -> None:
    upload = tmp_path / "upload.bin"
    upload.write_bytes(b"upload")
    store = LocalStore(local_root)

    async def body() -> ObjectInfo:
        return await store.put_file("new/deeper/file.bin", upload)

    written = _run_alone(body)

    assert written == _run_alone(lambda: store.head("new/deeper/file.bin"))
    assert os.listdir(local_root / "new" / "deeper") == ["file.bin"]


# -- Azure -----------------------------------------------------------------------


def _reply_error(status: int, code: str | None) -> HttpResponseError:
    """An error as azure-storage-blob raises it for a reply of the service."""
    error = HttpResponseError(message="m")
    error.status_code = status
    error.error_code = code  # type: ignore[attr-defined] - set by azure-storage-blob from x-ms-error-code
    return error


# The service's replies and what each becomes: every row of the store's tables.
_AZURE_REPLIES: list[tuple[int, str | None, type[StoreError]]] = (
    [(404, code, ObjectNotFound) for code in ("ContainerNotFound", "BlobNotFound", "ResourceNotFound")]
    + [
        (403, code, AccessDenied)
        for code in (
            "AuthenticationFailed",
            "AuthorizationFailure",
            "AuthorizationPermissionMismatch",
            "AuthorizationSourceIPMismatch",
            "AuthorizationProtocolMismatch",
            "InsufficientAccountPermissions",
            "AccountIsDisabled",
        )
    ]
    + [
        (409, "BlobArchived", AccessDenied),
        (412, "ConditionNotMet", ObjectChanged),
        # No code (a HEAD's reply has no body): the status decides.
        (401, None, AccessDenied),
        (403, None, AccessDenied),
        (404, None, ObjectNotFound),
        (412, None, ObjectChanged),
        # Anything else is retryable.
        (500, "InternalError", StoreError),
        (503, "ServerBusy", StoreError),
        (500, "OperationTimedOut", StoreError),
        (429, None, StoreError),
        (400, "InvalidHeaderValue", StoreError),
    ]
)


@pytest.mark.parametrize(("status", "code", "expected"), _AZURE_REPLIES)
def test_azure_error_table_for_replies(status: int, code: str | None, expected: type[StoreError]) -> None:
    error = azure_module._translate(
        _reply_error(status, code), target="az://cont/k", container="cont", endpoint="http://h:1/acct"
    )
    assert type(error) is expected
    assert error.retryable == (expected is StoreError)


def test_azure_error_table_covers_every_code() -> None:
    """A row added to the table without a test fails here."""
    assert set(azure_module._ERROR_BY_CODE) <= {code for _, code, _ in _AZURE_REPLIES}
    assert set(azure_module._ERROR_BY_STATUS) <= {
        status for status, code, _ in _AZURE_REPLIES if code is None
    }


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (obstore_exceptions.PreconditionError("m"), ObjectChanged),
        (obstore_exceptions.NotFoundError("m"), ObjectNotFound),
        (FileNotFoundError("m"), ObjectNotFound),
        (obstore_exceptions.PermissionDeniedError("m"), AccessDenied),
        (obstore_exceptions.UnauthenticatedError("m"), AccessDenied),
        (PermissionError("m"), AccessDenied),
        (ClientAuthenticationError("refused"), AccessDenied),
        (CredentialUnavailableError("none"), AccessDenied),
        (ServiceRequestError("unreachable"), StoreError),
        (ServiceResponseError("dropped"), StoreError),
        (obstore_exceptions.GenericError("5xx, 416 or refused"), StoreError),
        (aiohttp.ClientConnectionError("reset"), StoreError),
        (TimeoutError(), StoreError),
        (OSError("unreachable"), StoreError),
    ],
)
def test_azure_error_table_for_typed_errors(exc: Exception, expected: type[StoreError]) -> None:
    error = azure_module._translate(exc, target="az://cont/k", container="cont", endpoint="http://h:1/acct")
    assert type(error) is expected


def test_azure_error_table_refuses_what_is_not_an_azure_error() -> None:
    with pytest.raises(TypeError):
        azure_module._translate(ValueError("bug"), target="az://c/k", container="c", endpoint="e")


def test_azure_reply_errors_carry_the_request_id(azurite: Azurite) -> None:
    """Container missing, named, with the id Azure's support asks for."""
    store = _azure_store(azurite.endpoint_url, "no-such-container", "x")

    began = time.monotonic()
    with pytest.raises(ObjectNotFound) as caught:
        _run_alone(lambda: _check_then_close(store))

    assert time.monotonic() - began < FAST_FAILURE_SECONDS
    message = str(caught.value)
    assert message.startswith("container 'no-such-container' does not exist")
    assert azurite.endpoint_url in message
    assert "request id " in message


def test_azure_wrong_key_is_access_denied_and_never_shown(
    azurite: Azurite, azure_client: BlobServiceClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    container = f"denied-{uuid.uuid4().hex[:12]}"
    azure_client.create_container(container)
    wrong = "V3JvbmdLZXlXcm9uZ0tleVdyb25nS2V5V3JvbmdLZXk="
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", wrong)
    store = _azure_store(azurite.endpoint_url, container, "")

    async def body() -> None:
        try:
            with pytest.raises(AccessDenied) as listing:
                await store.check()
            with pytest.raises(AccessDenied) as data:
                await store.get_object("k")
            for caught in (listing, data):
                assert container in str(caught.value)
                assert wrong not in _full_text(caught.value)
        finally:
            await store.close()

    _run_alone(body)


def test_azure_sas_signs_listings_and_data(
    azurite: Azurite, azure_client: BlobServiceClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SAS from the environment, and no key: both clients sign with it."""
    container = f"sas-{uuid.uuid4().hex[:12]}"
    azure_client.create_container(container).upload_blob("p/k", b"by sas")
    sas = generate_container_sas(
        ACCOUNT,
        container,
        account_key=ACCOUNT_KEY,
        permission=ContainerSasPermissions(read=True, list=True),
        expiry=datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=1),
    )
    monkeypatch.delenv("AZURE_STORAGE_ACCOUNT_KEY")
    monkeypatch.setenv("AZURE_STORAGE_SAS_TOKEN", sas)
    store = _azure_store(azurite.endpoint_url, container, "p")

    async def body() -> tuple[bool, bytes]:
        try:
            return await store.check(), await store.get_object("k")
        finally:
            await store.close()

    assert _run_alone(body) == (True, b"by sas")


def test_azure_without_credentials_is_access_denied(
    azurite: Azurite, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No key, no SAS, no identity: the chain's every link comes up empty
    (managed identity is pointed at a closed local port by conftest)."""
    for name in (
        "AZURE_STORAGE_ACCOUNT_KEY",
        "AZURE_STORAGE_ACCESS_KEY",
        "AZURE_STORAGE_SAS_TOKEN",
        "AZURE_STORAGE_SAS_KEY",
        "AZURE_CLIENT_ID",
        "AZURE_CLIENT_SECRET",
        "AZURE_TENANT_ID",
        "AZURE_FEDERATED_TOKEN_FILE",
        "IDENTITY_ENDPOINT",
        "MSI_ENDPOINT",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AZURE_POD_IDENTITY_AUTHORITY_HOST", f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.setenv("PATH", "/nonexistent")  # no az, azd or pwsh to ask
    store = _azure_store(azurite.endpoint_url, "any-container", "")

    with pytest.raises(AccessDenied, match="no usable Azure credentials") as caught:
        _run_alone(lambda: _check_then_close(store))
    assert "az://any-container" in str(caught.value)


@pytest.mark.parametrize("call", ["check", "get_range", "put_file"])
def test_azure_unreachable_endpoint_is_a_retryable_error(call: str, tmp_path: Path) -> None:
    upload = tmp_path / "upload.bin"
    upload.write_bytes(b"upload")
    port = _closed_port()
    store = _azure_store(f"http://127.0.0.1:{port}/{ACCOUNT}", "cont", "")
    calls: dict[str, Callable[[], Awaitable[object]]] = {
        "check": store.check,
        "get_range": lambda: store.get_range("k", 0, 10, "0x8D"),
        "put_file": lambda: store.put_file("k", upload),
    }

    async def body() -> None:
        try:
            await calls[call]()
        finally:
            await store.close()

    began = time.monotonic()
    with pytest.raises(StoreError) as caught:
        _run_alone(body)

    assert time.monotonic() - began < FAST_FAILURE_SECONDS
    assert type(caught.value) is StoreError
    assert caught.value.retryable
    assert f"cannot reach Azure Blob endpoint http://127.0.0.1:{port}/{ACCOUNT}" in str(caught.value)
    assert ACCOUNT_KEY not in _full_text(caught.value)


def test_azure_put_file_in_blocks_is_one_blob(
    azurite: Azurite, azure_client: BlobServiceClient, tmp_path: Path
) -> None:
    """Blocks of 1 MiB, so a 3.5 MiB file is four, committed as one blob."""
    container = f"blocks-{uuid.uuid4().hex[:12]}"
    azure_client.create_container(container)
    data = random.Random(7).randbytes(3 * (1 << 20) + (1 << 19))
    path = tmp_path / "upload.bin"
    path.write_bytes(data)
    tuning = dataclasses.replace(AZURE_TUNING, block_size=1 << 20, blocks_in_flight=2)
    store = _azure_store(azurite.endpoint_url, container, "p", tuning)

    async def body() -> tuple[ObjectInfo, ObjectInfo]:
        try:
            return await store.put_file("big.bin", path), await store.head("big.bin")
        finally:
            await store.close()

    written, headed = _run_alone(body)

    assert written == headed
    blob = azure_client.get_blob_client(container, "p/big.bin")
    assert len(blob.get_block_list("committed")[0]) == 4
    assert blob.download_blob().readall() == data


def test_azure_reads_keys_obstore_cannot_name(azurite: Azurite, azure_client: BlobServiceClient) -> None:
    """obstore drops a trailing ``/`` and refuses empty segments: a marker
    with bytes in it and ``a//b`` are read through the listing client,
    pinned to their version all the same."""
    container = azure_client.create_container(f"names-{uuid.uuid4().hex[:12]}")
    container.upload_blob("p/marker/", b"marker bytes")
    container.upload_blob("p/a//b", b"double slash")
    store = _azure_store(azurite.endpoint_url, container.container_name, "p")

    async def body() -> list[bytes | bytearray]:
        try:
            marker, double = await store.head("marker/"), await store.head("a//b")
            read = [
                await store.get_range("marker/", 0, 100, marker.etag),
                await store.get_range("a//b", 7, 9, double.etag),
                await store.get_range("a//b", 50, 60, double.etag),
            ]
            container.upload_blob("p/a//b", b"double slash, again", overwrite=True)
            with pytest.raises(ObjectChanged):
                await store.get_range("a//b", 0, 5, double.etag)
            return read
        finally:
            await store.close()

    assert _run_alone(body) == [b"marker bytes", b"sl", b""]
