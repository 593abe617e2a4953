"""Google Cloud Storage as the cold store: data GETs over obstore; listings,
metadata and uploads over google-cloud-storage.

Data GETs (``get_range``, ``get_object``) go through obstore (Rust
``object_store``), whose HTTP and body reads run outside the GIL. Measured
side by side on fake-gcs-server (``python -m benchmarks.gcs_client_bench``,
three runs of 7 rounds, 1 and 4 GETs in flight, medians; ``doc/
benchmarks.md``), this process's CPU through obstore against
google-cloud-storage in threads: 2.4-2.6 against 7.2-8.1 ms a 4 MiB ranged
GET pinned to its generation, 1.7-1.9 against 2.3-2.8 ms a MiB in 32 MiB
ranges, 0.26-0.35 against 1.3-1.6 ms a 4 KiB object. Of obstore's, only
what runs on the event loop holds the GIL (0.5-0.7 ms a block, mostly the
copy into ``bytes``); google-cloud-storage's is Python in pool threads
(requests, urllib3, joining the body), which holds it but for socket
reads. One core holds the GIL, so that is what caps a node's cold reads.

Listings stay on google-cloud-storage: ``list_blobs`` is paged by page
token, one request a page bounded by ``attempt_timeout``, which the
fetcher bounds and retries page by page; obstore's listing follows every
page of a level itself, in one call no deadline could bound for a
directory of a million keys. ``head``, ``copy`` (the rewrite API) and
``delete`` are metadata calls off the read path and stay there too.

Uploads (``put_object``, ``put_file``) stay on google-cloud-storage as
well: it sends the file's CRC32C (or MD5) with the upload and GCS refuses
an object whose bytes do not match, while obstore's GCS PUT carries no
checksum header at all (obstore 0.12.1 sends Content-Length,
Content-Type and Authorization only), so bytes corrupted on the way would be published. (The
emulator the tests use also answers obstore's XML API PUT 400 "invalid
uploadType", and obstore asks the metadata server for a token before a
PUT even when told to skip signing, so its uploads could not be tested
here.)

One principal signs both. Credentials come from Google's default chain
(``google.auth.default``); google-cloud-storage signs with them through
its ``AuthorizedSession``, and obstore is handed their access token by a
credential provider, taken again on the loop thread when it nears expiry.
With ``STORAGE_EMULATOR_HOST`` set (tests, benchmarks) both talk to the
emulator unsigned (anonymous credentials, no project), so no metadata
server is ever probed.

google-cloud-storage's calls block, so they run on a dedicated thread pool
sized to the fetch concurrency, with the HTTP connection pool sized to
match; a call abandoned by the fetcher's deadline keeps its thread until
its own ``attempt_timeout`` expires, which bounds the damage. Every call of
either client is one attempt: the fetcher owns retries.

Versions: the etag of an ``ObjectInfo`` is the object's *generation* (a
decimal string), not GCS's etag. A read asks for that generation
(``?generation=``) and checks the one the response reports; GCS answers
404 for a generation that is no longer live, and a HEAD then tells a
replaced object (``ObjectChanged``) from a deleted one. On a bucket with
object versioning a replaced generation stays readable, so a read pinned
to it returns that version's bytes (never another's) until the listing
is refreshed. Reads send ``Accept-Encoding: gzip``: the bytes as stored,
since decompressive transcoding would change the size and ignore the
range of a gzip-encoded object.

Failures become ``cachefsd.errors`` types in ``_translate``, by the
client's exception type (obstore's types stand for HTTP statuses: 404,
412, 401, 403) or, for google-cloud-storage, by HTTP status, through one
table. Messages name the object and the status, and GCS's request id
(``X-GUploader-UploadID``) where the client exposes the response; never a
URL or a credential.
"""

from __future__ import annotations

import asyncio
import datetime
import io
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar
from urllib.parse import urlsplit

import google.auth
import requests
from google.api_core import exceptions as api_exceptions
from google.auth import exceptions as auth_exceptions
from google.auth.credentials import AnonymousCredentials, Credentials
from google.auth.transport.requests import AuthorizedSession, Request
from google.cloud import storage
from google.cloud.storage import exceptions as storage_exceptions
from obstore import get_async
from obstore.exceptions import BaseError as ObstoreError
from obstore.exceptions import PermissionDeniedError, PreconditionError, UnauthenticatedError
from obstore.store import GCSStore as ObstoreGcs
from requests.adapters import HTTPAdapter

from cachefsd.errors import AccessDenied, ObjectChanged, ObjectNotFound, StoreError, UploadCorrupted
from cachefsd.store.base import Listing, ListingPage, ObjectInfo, redact_url
from cachefsd.store.obstore_client import obstore_config
from cachefsd.store.source import SourceFile

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer
    from obstore.store import GCSCredential

_T = TypeVar("_T")

EMULATOR_ENV = "STORAGE_EMULATOR_HOST"
_READ_ONLY_SCOPE = "https://www.googleapis.com/auth/devstorage.read_only"
# A store that is written to (the shared tier) asks for this one instead.
_READ_WRITE_SCOPE = "https://www.googleapis.com/auth/devstorage.read_write"

# The JSON API's maximum page size; a 10,000-entry directory is ten requests.
_LIST_PAGE_SIZE = 1000

# An access token is taken again for obstore when it has less than this
# left: obstore asks for a new one well before expiry, and this is longer.
_TOKEN_MARGIN = datetime.timedelta(minutes=10)
# GCS's id of a request, in every response; what Google's support asks for.
_REQUEST_ID_HEADER = "X-GUploader-UploadID"

# Failures by the type they become, first match wins: the specific before
# their bases. obstore's types stand for HTTP statuses (404, 401, 403, 412)
# and its GenericError for any other (5xx, 429, 416) and for transport
# failures and timeouts; google-api-core's types are one a status, and
# google-cloud-storage turns its transfer library's errors into them, but
# for a checksum that does not match after an upload. Each row is tested
# in tests/contract/test_gcs_errors.py.
_ERROR_TABLE: tuple[tuple[tuple[type[BaseException], ...], type[StoreError]], ...] = (
    ((api_exceptions.NotFound, FileNotFoundError), ObjectNotFound),
    (
        (api_exceptions.Forbidden, api_exceptions.Unauthorized, PermissionDeniedError, UnauthenticatedError),
        AccessDenied,
    ),
    ((api_exceptions.PreconditionFailed, PreconditionError), ObjectChanged),
    # No credentials, or ones the token endpoint refuses.
    ((auth_exceptions.DefaultCredentialsError, auth_exceptions.RefreshError), AccessDenied),
    ((api_exceptions.GoogleAPIError,), StoreError),  # 5xx, 429, other 4xx
    ((auth_exceptions.TransportError,), StoreError),  # the token endpoint was unreachable
    ((requests.exceptions.RequestException,), StoreError),  # connect/read timeouts, resets
    ((storage_exceptions.DataCorruption,), UploadCorrupted),
    ((ObstoreError,), StoreError),
)
# Everything the table understands; anything else is a bug and propagates.
_GCS_ERRORS: tuple[type[BaseException], ...] = tuple(kind for kinds, _ in _ERROR_TABLE for kind in kinds)

_NO_CREDENTIALS = (
    "no usable Google credentials: set them through the standard chain "
    "(GOOGLE_APPLICATION_CREDENTIALS, `gcloud auth application-default login`, "
    "or the instance's service account)"
)


def _endpoint() -> str:
    emulator = os.environ.get(EMULATOR_ENV)
    return redact_url(emulator) if emulator else "storage.googleapis.com"


def _translate(exc: BaseException, *, target: str) -> StoreError:
    """The one place GCS and transport failures become cachefsd errors.

    Messages carry the class name, the status and the request id only:
    both clients' own messages embed request URLs."""
    error_type = next((mapped for kinds, mapped in _ERROR_TABLE if isinstance(exc, kinds)), None)
    if error_type is None:
        raise TypeError(f"not a GCS error: {type(exc).__name__}") from exc
    name = type(exc).__name__
    if isinstance(exc, auth_exceptions.DefaultCredentialsError):
        return error_type(f"{target}: {_NO_CREDENTIALS}")
    if isinstance(exc, requests.exceptions.ConnectionError):
        return error_type(f"{target}: cannot reach Google Cloud Storage at {_endpoint()} ({name})")
    if error_type is StoreError and isinstance(exc, ObstoreError):
        return error_type(f"{target}: request to Google Cloud Storage at {_endpoint()} failed ({name})")
    code = getattr(exc, "code", None)
    status = f" (HTTP {int(code)})" if isinstance(code, int) else ""
    response = getattr(exc, "response", None)
    request_id = response.headers.get(_REQUEST_ID_HEADER) if isinstance(response, requests.Response) else None
    request = f" [request id {request_id}]" if request_id else ""
    return error_type(f"{target}: {name}{status}{request}")


def _obstore_names(full_key: str) -> bool:
    """Whether obstore can name the object: it refuses a key with an empty,
    ``.`` or ``..`` segment (a ``ValueError``), which no path of a mount
    reaches either (``namespace.names``)."""
    return all(segment not in ("", ".", "..") for segment in full_key.split("/"))


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
        # Read once: both clients are made against the same endpoint.
        self._emulator = os.environ.get(EMULATOR_ENV)
        self._cache_key = f"{self.uri}@{redact_url(self._emulator)}" if self._emulator else self.uri
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
        self._credentials: Credentials | None = None
        self._client_lock = asyncio.Lock()
        # Set once by _data_client on the loop thread, then only read.
        self._data: ObstoreGcs | None = None

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

    def _make_client(self) -> tuple[storage.Client, requests.Session, Credentials]:
        credentials: Credentials
        if self._emulator:
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
        return client, session, credentials

    async def _get_bucket(self) -> storage.Bucket:
        if self._bucket is not None:
            return self._bucket
        async with self._client_lock:
            if self._bucket is None:
                client, session, credentials = await self._run(self._target(), self._make_client)
                self._client, self._session, self._credentials = client, session, credentials
                self._bucket = client.bucket(self._bucket_name)
        return self._bucket

    async def _data_client(self) -> ObstoreGcs:
        """The obstore client for data GETs, made on first use, signing with
        the token of the credentials google-cloud-storage signs with."""
        await self._get_bucket()
        if self._emulator is None:
            await self._take_token()
        if self._data is None:
            self._data = self._make_data_client()
        return self._data

    def _make_data_client(self) -> ObstoreGcs:
        options, retry = obstore_config(
            self._attempt_timeout, self._attempt_timeout, self._threads, upload=False
        )
        # The bytes as stored (see the module docstring).
        options["default_headers"] = {"Accept-Encoding": "gzip"}
        if self._emulator:
            options["allow_http"] = urlsplit(self._emulator).scheme == "http"
            return ObstoreGcs(
                self._bucket_name,
                base_url=redact_url(self._emulator),
                skip_signature=True,
                client_options=options,
                retry_config=retry,
            )
        return ObstoreGcs(
            self._bucket_name, client_options=options, retry_config=retry, credential_provider=self._token
        )

    async def _take_token(self) -> None:
        """Refreshes the shared credentials' access token when it nears expiry."""
        credentials = self._credentials
        assert credentials is not None  # made by _get_bucket
        expiry = credentials.expiry  # naive UTC, as google-auth keeps it
        now = datetime.datetime.now(datetime.UTC).replace(tzinfo=None)
        if credentials.token and (expiry is None or expiry - now > _TOKEN_MARGIN):
            return
        await self._run(self._target(), lambda: credentials.refresh(Request()))

    def _token(self) -> GCSCredential:
        """For obstore, from its own threads: the token ``_take_token`` keeps fresh."""
        credentials = self._credentials
        assert credentials is not None  # made before the data client
        token = credentials.token
        assert isinstance(token, str)  # taken by _take_token before any request
        expiry = credentials.expiry
        return {
            "token": token,
            "expires_at": None if expiry is None else expiry.replace(tzinfo=datetime.UTC),
        }

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
        full_key = self._data_key(key)
        if not etag.isdigit():
            raise ObjectChanged(f"{self._target(key)}: {etag!r} is not a GCS generation")
        target = self._target(key)
        data = await self._data_client()
        try:
            response = await get_async(data, full_key, options={"range": (start, end), "version": etag})
            served = response.meta.get("version")
            if served != etag:
                # GCS serves the generation asked for, or nothing; a server
                # that reports none cannot prove it served that one.
                raise ObjectChanged(f"{target}: served generation {served}, read pinned to {etag}")
            body = bytes(await response.bytes_async())
        except _GCS_ERRORS as exc:
            error = _translate(exc, target=target)
            if isinstance(error, ObjectNotFound):
                # The generation is not live: the object was replaced
                # (ObjectChanged) or deleted (ObjectNotFound).
                await self._require_version(key, etag)
            elif type(error) is StoreError and await self._starts_past_end(key, start, etag):
                # GCS answers 416, which obstore types only as GenericError.
                return b""
            raise error from exc
        return body

    async def _starts_past_end(self, key: str, start: int, etag: str) -> bool:
        """Whether a failed ranged GET asked for nothing: the range starts at
        or past the end of version ``etag`` (or the object is empty). False
        when the HEAD fails too, so the GET's own error is raised."""
        try:
            info = await self.head(key)
        except StoreError:
            return False
        if info.etag != etag:
            raise ObjectChanged(f"{self._target(key)}: generation is now {info.etag}, read pinned to {etag}")
        return start >= info.size

    def _data_key(self, key: str) -> str:
        """The object name a data GET of ``key`` asks for."""
        full_key = self._root + key
        if not full_key:
            raise ObjectNotFound(self._target(key))
        if not _obstore_names(full_key):
            raise ObjectNotFound(
                f"{self._target(key)}: a name with an empty, '.' or '..' segment is not read"
            )
        return full_key

    async def get_object(self, key: str) -> bytes:
        full_key = self._data_key(key)
        data = await self._data_client()
        try:
            response = await get_async(data, full_key)
            return bytes(await response.bytes_async())
        except _GCS_ERRORS as exc:
            raise _translate(exc, target=self._target(key)) from exc

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
        self._client = self._session = self._bucket = self._data = None
        if client is not None:
            client.close()
        if session is not None:
            session.close()
        # Threads blocked in a request finish within attempt_timeout; the
        # loop does not wait for them.
        self._executor.shutdown(wait=False, cancel_futures=True)
