"""Google Cloud Storage as the cold store, over google-cloud-storage.

Why the synchronous official client in threads, not gcsfs: gcsfs is async
(aiohttp) but brings fsspec's own event-loop thread, caches and retry
policy, all of which this daemon already owns (fetch.py), and it is not a
dependency. The official client's calls are plain request/response pairs
whose retries can be switched off (``retry=None``), which is what the
fetcher needs. Its calls block, so they run on a dedicated thread pool sized
to the fetch concurrency (not the loop's default executor, which the local
store and others share), and the HTTP connection pool is sized to match so
parallel range reads reuse connections instead of dropping them. A call
abandoned by the fetcher's deadline keeps its thread until its own
``attempt_timeout`` expires, which bounds the damage.

Credentials come from Google's default chain. With ``STORAGE_EMULATOR_HOST``
set (tests, benchmarks) the client talks to the emulator with anonymous
credentials and no project, so no metadata server is ever probed.

Versions: the etag of an ``ObjectInfo`` is the object's *generation* (a
decimal string), not GCS's etag. A read sends ``ifGenerationMatch`` and
checks the generation the download response reports, so a replaced object
raises ``ObjectChanged`` even where the precondition is ignored (the
fake-gcs-server emulator ignores it on media downloads). A server that
reports no generation (gcp-storage-emulator) has it read back after the GET.
"""

from __future__ import annotations

import asyncio
import io
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import google.auth
import requests
from google.api_core import exceptions as api_exceptions
from google.auth import exceptions as auth_exceptions
from google.auth.credentials import AnonymousCredentials, Credentials
from google.auth.transport.requests import AuthorizedSession
from google.cloud import storage
from google.cloud.storage import exceptions as storage_exceptions
from requests.adapters import HTTPAdapter

from cachefsd.errors import AccessDenied, ObjectChanged, ObjectNotFound, StoreError, UploadCorrupted
from cachefsd.store.base import Listing, ListingPage, ObjectInfo, redact_url
from cachefsd.store.source import SourceFile

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

_T = TypeVar("_T")

EMULATOR_ENV = "STORAGE_EMULATOR_HOST"
_READ_ONLY_SCOPE = "https://www.googleapis.com/auth/devstorage.read_only"
# A store that is written to (the shared tier) asks for this one instead.
_READ_WRITE_SCOPE = "https://www.googleapis.com/auth/devstorage.read_write"

# The JSON API's maximum page size; a 10,000-entry directory is ten requests.
_LIST_PAGE_SIZE = 1000

# Backend error types by the type they become; first match wins, so the
# specific API errors come before their transport-level bases.
_ERROR_TABLE: tuple[tuple[type[BaseException] | tuple[type[BaseException], ...], type[StoreError]], ...] = (
    (api_exceptions.NotFound, ObjectNotFound),
    ((api_exceptions.Forbidden, api_exceptions.Unauthorized), AccessDenied),
    (api_exceptions.PreconditionFailed, ObjectChanged),
    ((auth_exceptions.DefaultCredentialsError, auth_exceptions.RefreshError), AccessDenied),
    (api_exceptions.GoogleAPIError, StoreError),  # 5xx, 429, other 4xx
    (auth_exceptions.TransportError, StoreError),  # the token endpoint was unreachable
    (auth_exceptions.GoogleAuthError, AccessDenied),  # e.g. a malformed credentials file
    (requests.exceptions.RequestException, StoreError),  # connect/read timeouts, resets
    ((storage_exceptions.InvalidResponse, storage_exceptions.DataCorruption), StoreError),
    ((TimeoutError, OSError), StoreError),
)
# Everything the table understands; anything else is a bug and propagates.
_GCS_ERRORS: tuple[type[BaseException], ...] = (
    api_exceptions.GoogleAPIError,
    auth_exceptions.GoogleAuthError,
    requests.exceptions.RequestException,
    storage_exceptions.InvalidResponse,
    storage_exceptions.DataCorruption,
    TimeoutError,
    OSError,
)

_NO_CREDENTIALS = (
    "no usable Google credentials: set them through the standard chain "
    "(GOOGLE_APPLICATION_CREDENTIALS, `gcloud auth application-default login`, "
    "or the instance's service account)"
)


def _translate(exc: BaseException, *, target: str) -> StoreError:
    """The one place GCS and transport failures become cachefsd errors.

    Messages carry the class name and status only: the library's own
    messages embed request URLs."""
    error_type = next((mapped for types, mapped in _ERROR_TABLE if isinstance(exc, types)), None)
    if error_type is None:
        raise TypeError(f"not a GCS error: {type(exc).__name__}") from exc
    if isinstance(exc, auth_exceptions.DefaultCredentialsError):
        return error_type(f"{target}: {_NO_CREDENTIALS}")
    if isinstance(exc, requests.exceptions.ConnectionError):
        emulator = os.environ.get(EMULATOR_ENV)
        endpoint = redact_url(emulator) if emulator else "storage.googleapis.com"
        return error_type(f"{target}: cannot reach Google Cloud Storage at {endpoint} ({type(exc).__name__})")
    code = getattr(exc, "code", None)
    status = f" (HTTP {int(code)})" if isinstance(code, int) else ""
    return error_type(f"{target}: {type(exc).__name__}{status}")


def _mtime(blob: storage.Blob) -> float:
    updated = blob.updated
    return updated.timestamp() if updated is not None else 0.0


def _info(key: str, blob: storage.Blob) -> ObjectInfo:
    return ObjectInfo(key=key, size=int(blob.size or 0), etag=str(blob.generation), mtime=_mtime(blob))


class _SourceReader(io.RawIOBase):
    """A ``SourceFile`` as the file object the client uploads from, which
    checks the file unchanged when its last byte is read: before the last
    request of the upload, which is the one that publishes the object."""

    def __init__(self, source: SourceFile) -> None:
        super().__init__()
        self._source = source
        self._offset = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer) -> int:
        view = memoryview(buffer).cast("B")
        size = min(len(view), self._source.size - self._offset)
        view[:size] = self._source.read(self._offset, size)
        self._offset += size
        if self._offset == self._source.size:
            self._source.check_unchanged()
        return size

    def tell(self) -> int:
        return self._offset


class GcsStore:
    """Objects under ``gs://bucket/prefix``, keys relative to the prefix."""

    def __init__(
        self, bucket: str, prefix: str, attempt_timeout: float, threads: int, writable: bool = False
    ) -> None:
        """``writable`` for a store that ``put_object`` writes to: its token
        then allows writes (a source's is read-only)."""
        # Immutable after construction.
        self._scope = _READ_WRITE_SCOPE if writable else _READ_ONLY_SCOPE
        self._bucket_name = bucket
        self._prefix = prefix.strip("/")
        self._root = f"{self._prefix}/" if self._prefix else ""
        self._attempt_timeout = attempt_timeout
        emulator = os.environ.get(EMULATOR_ENV)  # read by the client when it is made
        self._cache_key = f"{self.uri}@{redact_url(emulator)}" if emulator else self.uri
        # Threads (and pooled HTTP connections) for blocking client calls: as
        # many as requests the fetcher has in flight, so none waits for a thread.
        self._threads = threads
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="cachefsd-gcs")
        # Set once by _get_bucket on the loop thread (under _client_lock),
        # then only read. One client serves every pool thread, as in the
        # library's own transfer_manager thread mode.
        self._client: storage.Client | None = None
        self._session: requests.Session | None = None
        self._bucket: storage.Bucket | None = None
        self._client_lock = asyncio.Lock()

    @property
    def uri(self) -> str:
        return f"gs://{self._bucket_name}/{self._prefix}" if self._prefix else f"gs://{self._bucket_name}"

    @property
    def cache_key(self) -> str:
        return self._cache_key

    @property
    def content_etags(self) -> bool:
        return False  # the etag used here is the generation: a version, not content

    def _target(self, key: str = "") -> str:
        return f"gs://{self._bucket_name}/{self._root}{key}" if key else self.uri

    async def _run(self, target: str, call: Callable[[], _T]) -> _T:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor, call)
        except _GCS_ERRORS as exc:
            raise _translate(exc, target=target) from exc

    def _make_client(self) -> tuple[storage.Client, requests.Session]:
        credentials: Credentials
        if os.environ.get(EMULATOR_ENV):
            credentials = AnonymousCredentials()
        else:
            credentials, _ = google.auth.default(scopes=[self._scope])
        session = AuthorizedSession(credentials)
        adapter = HTTPAdapter(pool_connections=1, pool_maxsize=self._threads)
        session.mount("https://", adapter)
        session.mount("http://", adapter)
        # project=None: bucket and object calls need no project, and looking
        # one up would probe the metadata server.
        client = storage.Client(project=None, credentials=credentials, _http=session)
        return client, session

    async def _get_bucket(self) -> storage.Bucket:
        if self._bucket is not None:
            return self._bucket
        async with self._client_lock:
            if self._bucket is None:
                client, session = await self._run(self._target(), self._make_client)
                self._client, self._session = client, session
                self._bucket = client.bucket(self._bucket_name)
        return self._bucket

    async def check(self) -> bool:
        """Lists one key: needs only object read permission, unlike fetching
        the bucket's metadata, and fails with 404 for a missing bucket."""
        bucket = await self._get_bucket()

        def call() -> bool:
            assert self._client is not None
            blobs = self._client.list_blobs(
                bucket, prefix=self._root, max_results=1, timeout=self._attempt_timeout, retry=None
            )
            return any(blobs)

        try:
            return await self._run(self._target(), call)
        except ObjectNotFound as exc:
            raise ObjectNotFound(f"bucket '{self._bucket_name}' does not exist") from exc.__cause__

    async def list_page(self, prefix: str, token: str | None) -> ListingPage:
        bucket = await self._get_bucket()
        cut = len(self._root)

        def call() -> ListingPage:
            assert self._client is not None
            iterator = self._client.list_blobs(
                bucket,
                prefix=self._root + prefix,
                delimiter="/",
                page_size=_LIST_PAGE_SIZE,
                page_token=token,
                timeout=self._attempt_timeout,
                retry=None,
            )
            page = next(iterator.pages)  # the first page, even when empty
            objects = tuple(
                ObjectInfo(
                    key=blob.name[cut:],
                    size=int(blob.size or 0),
                    etag=str(blob.generation),
                    mtime=_mtime(blob),
                )
                for blob in page
            )
            prefixes = tuple(entry[cut:] for entry in page.prefixes)
            return ListingPage(Listing(objects=objects, prefixes=prefixes), iterator.next_page_token)

        return await self._run(self._target(prefix), call)

    async def head(self, key: str) -> ObjectInfo:
        full_key = self._root + key
        if not full_key:
            raise ObjectNotFound(self._target(key))
        bucket = await self._get_bucket()

        def call() -> storage.Blob | None:
            return bucket.get_blob(full_key, timeout=self._attempt_timeout, retry=None)

        blob = await self._run(self._target(key), call)
        if blob is None:
            raise ObjectNotFound(self._target(key))
        return _info(key, blob)

    async def _require_version(self, key: str, etag: str) -> None:
        info = await self.head(key)
        if info.etag != etag:
            raise ObjectChanged(f"{self._target(key)}: generation is now {info.etag}, read pinned to {etag}")

    async def get_range(self, key: str, start: int, end: int, etag: str) -> bytes:
        if end <= start:
            await self._require_version(key, etag)
            return b""
        full_key = self._root + key
        if not full_key:
            raise ObjectNotFound(self._target(key))
        try:
            generation = int(etag)
        except ValueError:
            raise ObjectChanged(f"{self._target(key)}: {etag!r} is not a GCS generation") from None
        bucket = await self._get_bucket()

        def call() -> tuple[bytes, str | None]:
            blob = bucket.blob(full_key)
            data = blob.download_as_bytes(
                start=start,
                end=end - 1,  # inclusive
                # Bytes as stored: decompressive transcoding would change the
                # size and ignore the range for gzip-encoded objects.
                raw_download=True,
                if_generation_match=generation,
                # A range has no whole-object checksum to check against.
                checksum=None,
                timeout=self._attempt_timeout,
                retry=None,
            )
            # Set from the response's x-goog-generation header, if sent.
            return data, None if blob.generation is None else str(blob.generation)

        try:
            data, served = await self._run(self._target(key), call)
        except StoreError as exc:
            if not isinstance(exc.__cause__, api_exceptions.RequestRangeNotSatisfiable):
                raise
            # The range starts at or past the end (or the object is empty);
            # the emulator answers 416 without checking the generation.
            await self._require_version(key, etag)
            return b""
        if served is None:
            # No x-goog-generation (gcp-storage-emulator, which also ignores
            # ifGenerationMatch): the generation current after the GET is the
            # pinned one only if the object did not change before it either,
            # since generations only grow.
            await self._require_version(key, etag)
        elif served != etag:
            raise ObjectChanged(f"{self._target(key)}: served generation {served}, read pinned to {etag}")
        return data

    async def get_object(self, key: str) -> bytes:
        full_key = self._root + key
        bucket = await self._get_bucket()

        def call() -> bytes:
            data: bytes = bucket.blob(full_key).download_as_bytes(
                raw_download=True, timeout=self._attempt_timeout, retry=None
            )
            return data

        return await self._run(self._target(key), call)

    async def put_object(self, key: str, data: bytes) -> None:
        full_key = self._root + key
        bucket = await self._get_bucket()

        def call() -> None:
            bucket.blob(full_key).upload_from_string(data, timeout=self._attempt_timeout, retry=None)

        await self._run(self._target(key), call)

    def _object_key(self, key: str) -> str:
        """The object name a write of ``key`` goes to; a key naming no object is refused."""
        if not key or key.endswith("/"):
            raise StoreError(f"{self._target(key)}: not an object name")
        return self._root + key

    async def put_file(self, key: str, path: Path) -> ObjectInfo:
        """One request up to the client's multipart limit (8 MiB), a
        resumable upload in sequential chunks above; GCS publishes the
        object only when the last request succeeds. The client sends the
        file's checksum (CRC32C, or MD5 without the C extension) and the
        service refuses an object whose bytes do not match it, or the client
        compares the service's after a resumable upload (``UploadCorrupted``)."""
        full_key = self._object_key(key)
        bucket = await self._get_bucket()
        source = await asyncio.to_thread(SourceFile, path)

        def call() -> ObjectInfo:
            blob = bucket.blob(full_key)
            blob.upload_from_file(
                _SourceReader(source), size=source.size, timeout=self._attempt_timeout, retry=None
            )
            return _info(key, blob)

        try:
            return await self._run(self._target(key), call)
        except StoreError as exc:
            if isinstance(exc.__cause__, storage_exceptions.DataCorruption):
                raise UploadCorrupted(f"{self._target(key)}: the stored checksum is not the file's") from exc
            raise
        finally:
            source.close()

    async def delete(self, key: str) -> None:
        # A directory's marker object ("a/") may be deleted, never written.
        full_key = self._object_key(key.removesuffix("/")) + ("/" if key.endswith("/") else "")
        bucket = await self._get_bucket()

        def call() -> None:
            try:
                bucket.blob(full_key).delete(timeout=self._attempt_timeout, retry=None)
            except api_exceptions.NotFound:
                return

        await self._run(self._target(key), call)

    async def copy(self, source: str, target: str) -> ObjectInfo:
        """The rewrite API: GCS copies, in as many calls as it asks for (one
        within a location, several across locations or storage classes)."""
        full_target = self._object_key(target)
        bucket = await self._get_bucket()

        def call() -> ObjectInfo:
            origin = bucket.blob(self._root + source)
            copied = bucket.blob(full_target)
            token: str | None = None
            while True:
                token, _, _ = copied.rewrite(origin, token=token, timeout=self._attempt_timeout, retry=None)
                if token is None:
                    return _info(target, copied)

        return await self._run(self._target(target), call)

    async def close(self) -> None:
        client, session = self._client, self._session
        self._client = self._session = self._bucket = None
        if client is not None:
            client.close()
        if session is not None:
            session.close()
        # Threads blocked in a request finish within attempt_timeout; the
        # loop does not wait for them.
        self._executor.shutdown(wait=False, cancel_futures=True)
