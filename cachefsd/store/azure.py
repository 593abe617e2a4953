"""Azure Blob Storage as the cold store: data over obstore, listings (and
HEAD, DELETE) over azure-storage-blob.

Data (``get_range``, ``get_object``, ``put_object``, ``put_file``,
``copy``) goes through obstore's ``AzureStore`` (Rust ``object_store``),
whose HTTP, signing and body reads run outside the GIL, as for S3.

Listings go through azure-storage-blob's aio ``ContainerClient``:
``walk_blobs(delimiter="/").by_page(token)`` sends one List Blobs request
a page, continued from the caller's token (the service's ``NextMarker``),
which is what ``list_page`` promises. obstore cannot: its
``list_with_delimiter`` pages through a whole level in one call (no
deadline could bound a directory of a million blobs), and its ``list`` is
recursive (every blob under a prefix, not one level). A List Blobs request
of our own would sign Shared Key, SAS and OAuth requests a second time
here; the official client does all three. The same client answers
``head`` and ``delete``, since obstore's paths drop a trailing ``/`` and
refuse empty segments: it cannot name a directory marker (``dir/``) or
``a//b``, which a listing shows and a HEAD must then find (reads of such
keys go through it too).

Credentials are resolved once, here, and both clients sign as the same
principal: ``AZURE_STORAGE_ACCOUNT_KEY`` (Shared Key), else
``AZURE_STORAGE_SAS_TOKEN`` (a SAS), else azure-identity's
``DefaultAzureCredential`` (a service principal from ``AZURE_CLIENT_ID``
and ``AZURE_CLIENT_SECRET``, workload identity from
``AZURE_FEDERATED_TOKEN_FILE``, managed identity, the Azure CLI's login).
obstore gets the same key, SAS or OAuth token through its
``credential_provider``, which it calls from its own threads: the token is
taken on the event loop before a data request and again before it expires.

Every call is a single attempt (both clients' retries are off): the
fetcher owns retries and the deadline. ``put_file``'s client retries a
failed block, as S3's retries a part.

A read is pinned to a version: the etag is Azure's ETag (unquoted; a
version, not a content hash), sent as ``If-Match``, and the response's
ETag is compared as well. Azure answers 412 both when the blob was
replaced and when it is gone: a HEAD after a 412 tells ``ObjectNotFound``
from ``ObjectChanged``. A range
that starts at or past the end is answered 416, which obstore reports as
an untyped ``GenericError`` (the status is only in its message): after an
untyped failure of a ranged GET a HEAD tells a changed version
(``ObjectChanged``) and a range past the end (``b""``) from a failure.

Uploads (``put_file``): a file up to one block (8 MiB) is one Put Blob;
a larger one blocks (Put Block, 16 in flight, read and hashed ahead by
``source.FileParts``) committed by one Put Block List, and readers see
the old blob or the whole new one. A failed or cancelled upload leaves
only uncommitted blocks, which no reader sees and the service discards
(within a week); Azure has no upload to abort. The check: obstore sends
neither Content-MD5 nor CRC64 with a blob or a block, so the service
verifies nothing on the way in; what it reports is compared instead. For
a Put Blob, Azure stores the MD5 it computes of the bytes it received
(Content-MD5), which must be the file's (``UploadCorrupted``); for a
block blob it computes none, and its committed size is compared (the
blocks' bytes are covered by TLS on an https endpoint, not by a check of
ours: Content-MD5 per block needs a client that sends it). The Get Blob
Properties this takes is pinned to the etag the upload returned, and also
gives the ``ObjectInfo``. The file is pinned while it is read
(``store.source``).

Backend errors become ``cachefsd.errors`` types in ``_translate`` only,
from one table: typed exceptions (obstore's kinds, azure-core's transport
errors) and, for the service's answers, the ``x-ms-error-code`` and the
HTTP status, with the request id in the message. Messages name the
container, key and endpoint; never a key, SAS or token.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import time
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar
from urllib.parse import urlsplit

import aiohttp
from azure.core import MatchConditions
from azure.core.async_paging import AsyncPageIterator
from azure.core.credentials import AzureSasCredential
from azure.core.exceptions import (
    AzureError,
    ClientAuthenticationError,
    HttpResponseError,
    ServiceRequestError,
    ServiceResponseError,
)
from azure.identity.aio import DefaultAzureCredential
from azure.storage.blob import BlobProperties
from azure.storage.blob.aio import BlobPrefix, ContainerClient
from obstore import copy_async, get_async, put_async
from obstore.exceptions import BaseError as ObstoreError
from obstore.exceptions import NotFoundError, PermissionDeniedError, PreconditionError, UnauthenticatedError
from obstore.store import AzureStore as ObstoreAzure

from cachefsd.errors import AccessDenied, ObjectChanged, ObjectNotFound, StoreError, UploadCorrupted
from cachefsd.store.azure_location import AzureLocation
from cachefsd.store.base import Listing, ListingPage, ObjectInfo, redact_url
from cachefsd.store.obstore_client import UPLOAD_REQUEST_SECONDS, obstore_config, send_file
from cachefsd.store.source import SourceFile

T = TypeVar("T")

if TYPE_CHECKING:
    from obstore.store import AzureCredential


# obstore's names for the same secrets (``AzureConfig``), so one
# environment serves both.
_KEY_ENVS = ("AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_ACCESS_KEY")
_SAS_ENVS = ("AZURE_STORAGE_SAS_TOKEN", "AZURE_STORAGE_SAS_KEY")
_TOKEN_SCOPE = "https://storage.azure.com/.default"
# A token is taken again before a request when it has less than this
# left (Entra ID's live 60-90 minutes): obstore signs an upload's every
# block with the token taken before the upload began, so an upload may
# last this long (a 10 GiB file at 10 MB/s) before its token expires and
# the service refuses the rest, which the caller then uploads again.
_TOKEN_MARGIN_SECONDS = 1200.0

_MIB = 1 << 20
# A Copy Blob within an account is usually done when it answers; one the
# service still runs ("pending") is polled this often, up to
# UPLOAD_REQUEST_SECONDS (a Put Block List, like a copy, may take minutes).
_COPY_POLL_SECONDS = 0.5


@dataclass(frozen=True, slots=True)
class AzureTuning:
    """How ``AzureStore`` pages listings and sends files. Tests inject
    small sizes, so that a listing or an upload needs few blobs or MiB."""

    # List Blobs' maximum: a 10,000-blob directory is two requests.
    list_page_size: int = 5000
    # As S3's part: a block's request overhead is lost in its transfer
    # time, and a multi-GiB file is hundreds of blocks in flight together
    # (Azure allows 50,000 blocks of up to 4000 MiB). Files up to one block
    # go in one Put Blob, which Azure checksums itself.
    block_size: int = 8 * _MIB
    # An Azure connection carries 50-100 MB/s: 16 fill a 10 Gb/s link.
    blocks_in_flight: int = 16


_NO_CREDENTIALS = (
    "no usable Azure credentials (the credential chain got no token): set "
    "AZURE_STORAGE_ACCOUNT_KEY or AZURE_STORAGE_SAS_TOKEN, or use Azure's chain "
    "(AZURE_CLIENT_ID with AZURE_CLIENT_SECRET or AZURE_FEDERATED_TOKEN_FILE, "
    "a managed identity, or `az login`)"
)

# Azure's error codes (x-ms-error-code) by the type they become; a code
# not here is decided by the HTTP status, and anything else (5xx, 429
# ServerBusy, OperationTimedOut, other 4xx) is a retryable StoreError.
_ERROR_BY_CODE: Mapping[str, type[StoreError]] = {
    "ContainerNotFound": ObjectNotFound,
    "BlobNotFound": ObjectNotFound,
    "ResourceNotFound": ObjectNotFound,
    "AuthenticationFailed": AccessDenied,
    "AuthorizationFailure": AccessDenied,
    "AuthorizationPermissionMismatch": AccessDenied,
    "AuthorizationSourceIPMismatch": AccessDenied,
    "AuthorizationProtocolMismatch": AccessDenied,
    "InsufficientAccountPermissions": AccessDenied,
    "AccountIsDisabled": AccessDenied,
    "BlobArchived": AccessDenied,  # in the archive tier until rehydrated: retrying will not help
    "ConditionNotMet": ObjectChanged,
}
_ERROR_BY_STATUS: Mapping[int, type[StoreError]] = {
    401: AccessDenied,
    403: AccessDenied,
    404: ObjectNotFound,
    412: ObjectChanged,
}
# Failures with no HTTP status, by type; first match wins. obstore's
# exceptions carry only their kind, and an untyped one (GenericError: a
# 5xx, a 416, a refused connection) is retryable.
_ERROR_BY_TYPE: tuple[tuple[type[BaseException] | tuple[type[BaseException], ...], type[StoreError]], ...] = (
    (PreconditionError, ObjectChanged),
    ((NotFoundError, FileNotFoundError), ObjectNotFound),
    ((PermissionDeniedError, UnauthenticatedError, PermissionError), AccessDenied),
    (ClientAuthenticationError, AccessDenied),  # no token (CredentialUnavailableError is one)
    ((ServiceRequestError, ServiceResponseError), StoreError),  # unreachable, dropped, timed out
    ((ObstoreError, AzureError), StoreError),
    ((aiohttp.ClientError, TimeoutError, OSError), StoreError),
)
# Everything _translate understands; anything else is a bug and propagates.
_AZURE_ERRORS = (ObstoreError, AzureError, aiohttp.ClientError, TimeoutError, OSError)


def _translate(exc: BaseException, *, target: str, container: str, endpoint: str) -> StoreError:
    """The one place Azure's failures become cachefsd errors. ``target``
    names what was asked for (``az://container/key``), ``endpoint`` the
    account's URL: both are safe to show. The clients' own messages are
    not kept (they embed request URLs, and the service's reply)."""
    if isinstance(exc, HttpResponseError) and exc.status_code is not None:
        return _translate_reply(exc, target=target, container=container, endpoint=endpoint)
    error_type = next((mapped for types, mapped in _ERROR_BY_TYPE if isinstance(exc, types)), None)
    if error_type is None:
        raise TypeError(f"not an Azure error: {type(exc).__name__}") from exc
    if isinstance(exc, ClientAuthenticationError):
        # No reply: the chain got no token, because it found no credentials
        # or they were refused (it raises one type for both).
        return AccessDenied(f"{target}: {_NO_CREDENTIALS}")
    if error_type is StoreError:
        return StoreError(f"{target}: cannot reach Azure Blob endpoint {endpoint} ({type(exc).__name__})")
    return error_type(f"{target}: {type(exc).__name__} from {endpoint}")


def _translate_reply(exc: HttpResponseError, *, target: str, container: str, endpoint: str) -> StoreError:
    """A reply of the service: by its error code, else its HTTP status."""
    # azure-storage-blob sets error_code from the reply's x-ms-error-code.
    code = str(getattr(exc, "error_code", None) or "")
    status = int(exc.status_code or 0)
    error_type = _ERROR_BY_CODE.get(code) or _ERROR_BY_STATUS.get(status, StoreError)
    headers: Mapping[str, str] = getattr(exc.response, "headers", None) or {}
    request_id = headers.get("x-ms-request-id")
    request = f", request id {request_id}" if request_id else ""
    if code == "ContainerNotFound":
        return ObjectNotFound(f"container '{container}' does not exist (endpoint {endpoint}{request})")
    if error_type is AccessDenied:
        return AccessDenied(f"{target}: access denied, {code or 'error'} (HTTP {status}{request})")
    return error_type(f"{target}: {code or 'error'} (HTTP {status}{request})")


def _strip_quotes(etag: str) -> str:
    return etag.strip('"')


def _obstore_names(full_key: str) -> bool:
    """Whether obstore's paths can name ``full_key``: they drop a trailing
    ``/`` and refuse empty segments."""
    return bool(full_key) and "" not in full_key.split("/")


def _info(key: str, properties: BlobProperties) -> ObjectInfo:
    return ObjectInfo(
        key=key,
        size=int(properties.size),
        etag=_strip_quotes(properties.etag),
        mtime=properties.last_modified.timestamp(),
    )


@dataclass(frozen=True, slots=True)
class _Secret:
    """A key or SAS from the environment; never shown."""

    kind: Literal["key", "sas"]
    value: str = field(repr=False)


def _secret_from(environ: Mapping[str, str]) -> _Secret | None:
    """The account key of the environment, else its SAS, else None."""
    key = next((environ[name] for name in _KEY_ENVS if environ.get(name)), None)
    if key is not None:
        return _Secret("key", key)
    sas = next((environ[name] for name in _SAS_ENVS if environ.get(name)), None)
    return None if sas is None else _Secret("sas", sas)


class AzureStore:
    """Blobs under ``az://container/prefix``, keys relative to the prefix."""

    def __init__(
        self,
        location: AzureLocation,
        attempt_timeout: float,
        connect_timeout: float,
        max_connections: int,
        tuning: AzureTuning = AzureTuning(),
    ) -> None:
        # Immutable after construction.
        self._location = location
        self._prefix = location.prefix.strip("/")
        self._root = f"{self._prefix}/" if self._prefix else ""
        self._attempt_timeout = attempt_timeout
        self._connect_timeout = connect_timeout
        self._max_connections = max_connections
        self._tuning = tuning
        self._endpoint = redact_url(location.account_url)
        # Owned by the event loop thread; _client_lock serialises the first use.
        self._client_lock = asyncio.Lock()
        self._container: ContainerClient | None = None
        self._identity: DefaultAzureCredential | None = None
        self._secret: _Secret | None = None
        self._data: ObstoreAzure | None = None
        self._uploads: ObstoreAzure | None = None  # put_file's, which retries blocks
        # What obstore signs with, read from its threads: replaced whole.
        self._credential: AzureCredential | None = None
        self._token_expires = float("-inf")  # time.time() of the token's expiry

    @property
    def uri(self) -> str:
        container = self._location.container
        return f"az://{container}/{self._prefix}" if self._prefix else f"az://{container}"

    @property
    def cache_key(self) -> str:
        """The URI and the account's endpoint: container names are unique
        within an account only."""
        return f"{self.uri}@{self._endpoint}"

    @property
    def content_etags(self) -> bool:
        return False  # an Azure ETag names a version, not the bytes

    def _target(self, key: str = "") -> str:
        return f"az://{self._location.container}/{self._root}{key}" if key else self.uri

    def _error(self, exc: BaseException, key: str = "") -> StoreError:
        return _translate(
            exc, target=self._target(key), container=self._location.container, endpoint=self._endpoint
        )

    async def _listing(self) -> ContainerClient:
        """The azure-storage-blob client, made on first use inside the
        daemon's loop (its aiohttp session belongs to that loop)."""
        await self._take_credentials()
        if self._container is None:
            credential: Any
            if self._secret is None:
                credential = self._identity
            elif self._secret.kind == "key":
                credential = {"account_name": self._location.account, "account_key": self._secret.value}
            else:
                credential = AzureSasCredential(self._secret.value.lstrip("?"))
            self._container = ContainerClient(
                self._location.account_url,
                self._location.container,
                credential=credential,
                retry_total=0,
                connection_timeout=self._connect_timeout,
                read_timeout=self._attempt_timeout,
            )
        return self._container

    async def _take_credentials(self) -> None:
        """The key or SAS of the environment, else a token of Azure's
        chain, taken again ``_TOKEN_MARGIN_SECONDS`` before it expires."""
        async with self._client_lock:
            if self._credential is None:
                self._secret = _secret_from(os.environ)
                if self._secret is not None and self._secret.kind == "key":
                    self._credential = {"access_key": self._secret.value, "expires_at": None}
                elif self._secret is not None:
                    self._credential = {"sas_token": self._secret.value.lstrip("?"), "expires_at": None}
                else:
                    self._identity = DefaultAzureCredential()
            if self._identity is not None and time.time() > self._token_expires - _TOKEN_MARGIN_SECONDS:
                try:
                    token = await self._identity.get_token(_TOKEN_SCOPE)
                except _AZURE_ERRORS as exc:
                    raise self._error(exc) from exc
                expires = datetime.datetime.fromtimestamp(token.expires_on, datetime.UTC)
                self._credential = {"token": token.token, "expires_at": expires}
                self._token_expires = token.expires_on

    def _current_credential(self) -> AzureCredential:
        """For obstore, from its own threads: what ``_take_credentials`` took last."""
        assert self._credential is not None  # taken before the client is made
        return self._credential

    async def _data_client(self) -> ObstoreAzure:
        """obstore for reads and small writes: one attempt a request."""
        await self._take_credentials()
        if self._data is None:
            self._data = self._obstore(upload=False)
        return self._data

    async def _upload_client(self) -> ObstoreAzure:
        """obstore for ``put_file`` and ``copy``, which retries a failed
        block on its own: a multi-GiB upload is hundreds of requests."""
        await self._take_credentials()
        if self._uploads is None:
            self._uploads = self._obstore(upload=True)
        return self._uploads

    def _obstore(self, upload: bool) -> ObstoreAzure:
        """An obstore client for reads or for ``upload`` (``store.obstore_client``)."""
        options, retry = obstore_config(
            self._connect_timeout, self._attempt_timeout, self._max_connections, upload
        )
        options["allow_http"] = urlsplit(self._location.account_url).scheme == "http"
        return ObstoreAzure(
            self._location.container,
            account_name=self._location.account,
            endpoint=self._location.account_url,
            client_options=options,
            retry_config=retry,
            credential_provider=self._current_credential,
        )

    async def check(self) -> bool:
        container = await self._listing()
        try:
            pages = container.list_blobs(name_starts_with=self._root or None, results_per_page=1).by_page()
            async for page in pages:
                async for _ in page:
                    return True
                return False
        except _AZURE_ERRORS as exc:
            raise self._error(exc) from exc
        return False

    async def list_page(self, prefix: str, token: str | None) -> ListingPage:
        container = await self._listing()
        cut = len(self._root)
        objects: list[ObjectInfo] = []
        prefixes: list[str] = []
        try:
            pages = container.walk_blobs(
                name_starts_with=(self._root + prefix) or None,
                delimiter="/",
                results_per_page=self._tuning.list_page_size,
            ).by_page(continuation_token=token)
            assert isinstance(pages, AsyncPageIterator)  # what by_page returns, typed as an iterator
            async for page in pages:
                async for item in page:
                    if isinstance(item, BlobPrefix):
                        prefixes.append(item.name[cut:])
                    else:
                        objects.append(_info(item.name[cut:], item))
                break  # one page, one request
            next_token: str | None = pages.continuation_token or None
        except _AZURE_ERRORS as exc:
            raise self._error(exc, prefix) from exc
        return ListingPage(Listing(objects=tuple(objects), prefixes=tuple(prefixes)), next_token)

    async def _properties(self, key: str, etag: str | None = None) -> BlobProperties:
        """Get Blob Properties of ``key``, of version ``etag`` if given."""
        full_key = self._root + key
        if not full_key:
            raise ObjectNotFound(self._target(key))
        container = await self._listing()
        condition: dict[str, Any] = {}
        if etag is not None:
            condition = {"etag": f'"{etag}"', "match_condition": MatchConditions.IfNotModified}
        try:
            return await container.get_blob_client(full_key).get_blob_properties(**condition)
        except _AZURE_ERRORS as exc:
            raise self._error(exc, key) from exc

    async def head(self, key: str) -> ObjectInfo:
        return _info(key, await self._properties(key))

    async def _require_version(self, key: str, etag: str) -> ObjectInfo:
        info = await self.head(key)
        if info.etag != _strip_quotes(etag):
            raise ObjectChanged(f"{self._target(key)}: etag is now {info.etag}, read pinned to {etag}")
        return info

    async def get_range(self, key: str, start: int, end: int, etag: str) -> bytes | bytearray:
        if end <= start:
            await self._require_version(key, etag)
            return b""
        full_key = self._root + key
        if not _obstore_names(full_key):
            return await self._download(key, start, end, etag)
        data = await self._data_client()
        try:
            response = await get_async(
                data, full_key, options={"range": (start, end), "if_match": f'"{_strip_quotes(etag)}"'}
            )
            got = _strip_quotes(response.meta.get("e_tag") or "")
            if got != _strip_quotes(etag):
                raise ObjectChanged(
                    f"{self._target(key)}: endpoint returned etag {got}, read pinned to {etag}"
                )
            # The body in one buffer, gathered by obstore outside the GIL.
            return bytes(await response.bytes_async())
        except _AZURE_ERRORS as exc:
            error = self._error(exc, key)
            if isinstance(error, ObjectChanged):
                # Azure answers If-Match on a missing blob with 412 too.
                await self.head(key)
            if type(error) is not StoreError:
                raise error from exc
            failure = exc
        # An untyped failure: a range past the end (416) or a real one.
        info = await self._require_version(key, etag)
        if start >= info.size:
            return b""
        raise error from failure

    async def _download(self, key: str, start: int, end: int, etag: str) -> bytes:
        """A ranged read of a key obstore cannot name, through the listing client."""
        container = await self._listing()
        info = await self._require_version(key, etag)
        if start >= info.size:
            return b""
        try:
            stream = await container.get_blob_client(self._root + key).download_blob(
                offset=start,
                length=min(end, info.size) - start,
                etag=f'"{_strip_quotes(etag)}"',
                match_condition=MatchConditions.IfNotModified,
            )
            return await stream.readall()
        except _AZURE_ERRORS as exc:
            raise self._error(exc, key) from exc

    async def get_object(self, key: str) -> bytes:
        full_key = self._root + key
        if not _obstore_names(full_key):
            raise ObjectNotFound(f"{self._target(key)}: not an object name")
        data = await self._data_client()
        try:
            response = await get_async(data, full_key)
            return bytes(await response.bytes_async())
        except _AZURE_ERRORS as exc:
            raise self._error(exc, key) from exc

    def _object_key(self, key: str) -> str:
        """The blob name a write of ``key`` goes to; a key naming no object is refused."""
        full_key = self._root + key
        if not _obstore_names(full_key) or not key:
            raise StoreError(f"{self._target(key)}: not an object name")
        return full_key

    async def put_object(self, key: str, data: bytes) -> None:
        full_key = self._object_key(key)
        client = await self._data_client()
        try:
            await put_async(client, full_key, data, use_multipart=False)
        except _AZURE_ERRORS as exc:
            raise self._error(exc, key) from exc

    async def put_file(self, key: str, path: Path) -> ObjectInfo:
        """One Put Blob up to ``block_size``, blocks above (see the module docstring)."""
        full_key = self._object_key(key)
        target = self._target(key)
        source = await asyncio.to_thread(SourceFile, path)
        block_size = self._tuning.block_size
        try:
            client = await self._upload_client()
            sent = send_file(client, full_key, source, block_size, self._tuning.blocks_in_flight)
            result, md5s = await self._put(key, sent)
        finally:
            source.close()
        # Azure keeps an MD5 of a blob sent whole, none of one sent in blocks.
        expected_md5 = md5s[0] if source.size <= block_size else None
        written = _strip_quotes(result.get("e_tag") or "")
        try:
            properties = await self._properties(key, written)
        except ObjectChanged:
            # Replaced again since: what this upload wrote is gone, and
            # there is nothing left of it to check.
            return ObjectInfo(key=key, size=source.size, etag=written, mtime=time.time())
        stored_md5 = properties.content_settings.content_md5
        if properties.size != source.size or (
            expected_md5 is not None and stored_md5 is not None and bytes(stored_md5) != expected_md5
        ):
            raise UploadCorrupted(
                f"{target}: the store holds {properties.size} bytes"
                f"{' with another MD5' if properties.size == source.size else ''}, the file {source.size};"
                " upload it again"
            )
        return _info(key, properties)

    async def _put(self, key: str, put: Awaitable[T]) -> T:
        try:
            return await put
        except _AZURE_ERRORS as exc:
            raise self._error(exc, key) from exc

    async def delete(self, key: str) -> None:
        """Delete Blob; an absent blob is not an error. A directory's
        marker (``a/``) may be deleted, never written."""
        full_key = self._root + key.removesuffix("/")
        if not key or not full_key:
            raise StoreError(f"{self._target(key)}: not an object name")
        container = await self._listing()
        try:
            await container.delete_blob(full_key + ("/" if key.endswith("/") else ""))
        except HttpResponseError as exc:
            if exc.status_code == 404 and getattr(exc, "error_code", None) == "BlobNotFound":
                return
            raise self._error(exc, key) from exc
        except _AZURE_ERRORS as exc:
            raise self._error(exc, key) from exc

    async def copy(self, source: str, target: str) -> ObjectInfo:
        """Copy Blob: the service copies, no byte passes through here. A
        copy the service still runs when it answers is waited for. Not
        pinned to the source's version (obstore sends no source
        condition): a source replaced meanwhile is copied as it is then."""
        full_target = self._object_key(target)
        full_source = self._object_key(source)
        await self.head(source)  # ObjectNotFound names the source, not the target
        client = await self._upload_client()
        try:
            await copy_async(client, full_source, full_target)
        except _AZURE_ERRORS as exc:
            raise self._error(exc, target) from exc
        deadline = time.monotonic() + UPLOAD_REQUEST_SECONDS
        properties = await self._properties(target)
        while properties.copy.status == "pending" and time.monotonic() < deadline:
            await asyncio.sleep(_COPY_POLL_SECONDS)
            properties = await self._properties(target)
        if properties.copy.status not in (None, "success"):
            raise StoreError(f"{self._target(target)}: the copy from {source} ended {properties.copy.status}")
        return _info(target, properties)

    async def close(self) -> None:
        container, self._container = self._container, None
        identity, self._identity = self._identity, None
        self._data = self._uploads = None
        if container is not None:
            await container.close()
        if identity is not None:
            await identity.close()
