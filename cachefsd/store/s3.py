"""S3 (and S3-compatible endpoints) as the cold store, over aiobotocore.

One aiobotocore client per store, created on first use inside the daemon's
event loop (aiohttp sessions belong to the loop that made them) and closed
by ``close()``. Every call is a single attempt: the fetcher owns retries,
backoff and the total deadline, so botocore's own retries are switched off
(they would multiply the fetcher's and could outlive its deadline).

A read is pinned to a version: ``GetObject`` carries ``If-Match`` with the
etag the namespace saw, S3 answers 412 when the object was replaced, and the
response's ETag is compared as well, so bytes of another version are never
returned even by an endpoint that ignores ``If-Match``.

Etags are kept without their surrounding quotes (as in ``ObjectInfo`` from
every other store: for a single-part upload it is the content's MD5, the same
value ``MemoryStore`` computes) and quoted again for ``If-Match``, which is
the form HTTP specifies. moto 5 and S3 accept both forms.

Backend errors become ``cachefsd.errors`` types in ``_translate`` and only
there. Messages name the bucket, key and endpoint; never credentials, and
never a URL with a query string or user info.
"""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import AsyncGenerator, Mapping
from contextlib import AsyncExitStack
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiobotocore.config import AioConfig
from aiobotocore.session import AioSession, get_session
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    CredentialRetrievalError,
    HTTPClientError,
    IncompleteReadError,
    NoCredentialsError,
    PartialCredentialsError,
    TokenRetrievalError,
)
from botocore.exceptions import ConnectionError as BotoConnectionError
from botocore.utils import parse_timestamp

from cachefsd.config import StoreSettings
from cachefsd.errors import AccessDenied, ObjectChanged, ObjectNotFound, StoreError
from cachefsd.store.base import Listing, ListingPage, ObjectInfo, gathered, redact_url

# Used when neither the settings nor the AWS config name a region. Requests to
# a bucket in another region are redirected by S3 itself; us-east-1 is what
# the AWS CLI and Mountpoint assume too.
DEFAULT_REGION = "us-east-1"

# ListObjectsV2 returns at most 1000 keys a page; asking for the maximum keeps
# a 10,000-entry directory at ten round trips.
_LIST_PAGE_SIZE = 1000
# AWS's own S3 endpoints (global, regional, FIPS, dual-stack, VPC).
_AWS_DOMAIN = ".amazonaws.com"

# Error codes S3 (and compatible stores) return, by the type they become.
# HEAD responses have no body, so their "code" is the bare status.
_ERROR_BY_CODE: Mapping[str, type[StoreError]] = {
    "NoSuchKey": ObjectNotFound,
    "NoSuchBucket": ObjectNotFound,
    "NotFound": ObjectNotFound,
    "404": ObjectNotFound,
    "AccessDenied": AccessDenied,
    "AllAccessDisabled": AccessDenied,
    "AccountProblem": AccessDenied,
    "InvalidAccessKeyId": AccessDenied,
    "SignatureDoesNotMatch": AccessDenied,
    "InvalidObjectState": AccessDenied,  # archived (Glacier) and not restored: retrying will not help
    "401": AccessDenied,
    "403": AccessDenied,
    "PreconditionFailed": ObjectChanged,
    "412": ObjectChanged,
}
# When the code is unknown, the status decides; anything else (5xx, 429,
# SlowDown, RequestTimeout, ...) is a retryable StoreError.
_ERROR_BY_STATUS: Mapping[int, type[StoreError]] = {
    401: AccessDenied,
    403: AccessDenied,
    404: ObjectNotFound,
    412: ObjectChanged,
}
_RANGE_NOT_SATISFIABLE = 416

_NO_CREDENTIALS = (
    "no usable AWS credentials: set them through the standard chain "
    "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE and ~/.aws/credentials, "
    "or an instance/container role)"
)


def _strip_quotes(etag: str) -> str:
    return etag.strip('"')


# Failures to reach the endpoint or to finish a response: always retryable.
_TRANSPORT_ERRORS = (
    BotoConnectionError,
    HTTPClientError,
    IncompleteReadError,
    aiohttp.ClientError,
    TimeoutError,
    OSError,
)


def _translate(exc: BaseException, *, target: str, endpoint: str) -> StoreError:
    """The one place S3 and transport failures become cachefsd errors.

    ``target`` names what was asked for (``s3://bucket/key``), ``endpoint``
    the server; both are safe to show. The original exception is kept as
    ``__cause__`` by the caller's ``raise ... from exc``."""
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
        error_type = _ERROR_BY_CODE.get(code) or _ERROR_BY_STATUS.get(status, StoreError)
        if code == "NoSuchBucket":
            bucket = urlsplit(target).netloc
            return ObjectNotFound(f"bucket '{bucket}' does not exist (endpoint {endpoint})")
        detail = str(error.get("Message") or "").splitlines()[0:1]
        suffix = f": {detail[0]}" if detail else ""
        return error_type(f"{target}: {code or 'error'} (HTTP {status}){suffix}")
    if isinstance(exc, NoCredentialsError | PartialCredentialsError | CredentialRetrievalError):
        return AccessDenied(f"{target}: {_NO_CREDENTIALS}")
    if isinstance(exc, TokenRetrievalError):
        return AccessDenied(f"{target}: the AWS SSO token could not be refreshed; run `aws sso login`")
    if isinstance(exc, _TRANSPORT_ERRORS):
        # Class names only: botocore's messages for these embed request URLs.
        return StoreError(f"{target}: cannot reach S3 endpoint {endpoint} ({type(exc).__name__})")
    if isinstance(exc, BotoCoreError):
        return StoreError(f"{target}: S3 client error ({type(exc).__name__})")
    raise TypeError(f"not an S3 error: {type(exc).__name__}") from exc


# Everything _translate understands; anything else is a bug and propagates.
_S3_ERRORS = (ClientError, BotoCoreError, aiohttp.ClientError, TimeoutError, OSError)


def _normalise_prefix(prefix: str) -> str:
    return prefix.strip("/")


def _parse_timestamp(value: str) -> datetime.datetime:
    """What botocore's default parser returns, about 250 times faster for the
    ISO 8601 form of every ``LastModified`` in a listing.

    botocore parses each timestamp with dateutil, about 60 µs apiece: 60 ms
    of CPU for a 1,000-key page, half of what the daemon spends on a cold
    listing, and a cold ``find`` or ImageFolder scan of a large dataset is
    one page after another. Anything ``fromisoformat`` does not read as a
    zoned time (HEAD's RFC 1123 header, epoch numbers) goes to botocore's."""
    try:
        parsed: datetime.datetime | None = datetime.datetime.fromisoformat(value)
    except (TypeError, ValueError):
        parsed = None
    if parsed is None or parsed.tzinfo is None:
        botocores: datetime.datetime = parse_timestamp(value)
        return botocores
    return parsed


class S3Store:
    """Objects under ``s3://bucket/prefix``, keys relative to the prefix."""

    def __init__(self, bucket: str, prefix: str, settings: StoreSettings, attempt_timeout: float) -> None:
        # Immutable after construction.
        self._bucket = bucket
        self._prefix = _normalise_prefix(prefix)
        self._root = f"{self._prefix}/" if self._prefix else ""
        self._settings = settings
        self._attempt_timeout = attempt_timeout
        # Owned by the event loop thread; _client_lock serialises the first use.
        self._session: AioSession = get_session()
        self._session.get_component("response_parser_factory").set_parser_defaults(
            timestamp_parser=_parse_timestamp
        )
        self._client: Any = None
        self._exit_stack: AsyncExitStack | None = None
        self._client_lock = asyncio.Lock()
        self._endpoint = redact_url(settings.endpoint_url) if settings.endpoint_url else "AWS S3"
        self._resolved_endpoint: str | None = None  # the client's, once created

    @property
    def uri(self) -> str:
        return f"s3://{self._bucket}/{self._prefix}" if self._prefix else f"s3://{self._bucket}"

    @property
    def cache_key(self) -> str:
        """The URI, plus the endpoint unless it is AWS's own (bucket names
        are global there, so a regional or VPC endpoint keeps the key). The
        endpoint the client resolved once it exists (botocore also takes it
        from AWS_ENDPOINT_URL and a profile's endpoint_url); ``check``
        creates it, before anything is keyed."""
        endpoint = self._resolved_endpoint or self._settings.endpoint_url
        if endpoint is None or (urlsplit(endpoint).hostname or "").endswith(_AWS_DOMAIN):
            return self.uri
        return f"{self.uri}@{redact_url(endpoint)}"

    @property
    def content_etags(self) -> bool:
        # A single-part upload's etag is its MD5; a multipart one is the MD5
        # of the parts' MD5s plus "-<parts>", so equal strings (and sizes)
        # still mean equal content. SSE-KMS etags are opaque but unique.
        return True

    def _target(self, key: str = "") -> str:
        return f"s3://{self._bucket}/{self._root}{key}" if key else self.uri

    async def _get_client(self) -> Any:
        if self._client is not None:
            return self._client
        async with self._client_lock:
            if self._client is None:
                config = AioConfig(
                    retries={"total_max_attempts": 1, "mode": "standard"},
                    connect_timeout=self._settings.connect_timeout,
                    read_timeout=self._attempt_timeout,
                    max_pool_connections=self._settings.max_connections,
                    # Ranged GETs carry no whole-object checksum, and some
                    # S3-compatible stores reject the newer default headers.
                    request_checksum_calculation="when_required",
                    response_checksum_validation="when_required",
                )
                stack = AsyncExitStack()
                try:
                    region = (
                        self._settings.region or self._session.get_config_variable("region") or DEFAULT_REGION
                    )
                    client = await stack.enter_async_context(
                        self._session.create_client(
                            "s3",
                            region_name=region,
                            endpoint_url=self._settings.endpoint_url,
                            config=config,
                        )
                    )
                except _S3_ERRORS as exc:
                    await stack.aclose()
                    raise _translate(exc, target=self._target(), endpoint=self._endpoint) from exc
                self._resolved_endpoint = client.meta.endpoint_url
                if self._settings.endpoint_url is None:
                    self._endpoint = redact_url(client.meta.endpoint_url)
                self._exit_stack = stack
                self._client = client
        return self._client

    async def check(self) -> bool:
        client = await self._get_client()
        try:
            page = await client.list_objects_v2(Bucket=self._bucket, Prefix=self._root, MaxKeys=1)
        except _S3_ERRORS as exc:
            raise _translate(exc, target=self._target(), endpoint=self._endpoint) from exc
        return bool(page.get("Contents"))

    async def list_page(self, prefix: str, token: str | None) -> ListingPage:
        client = await self._get_client()
        cut = len(self._root)
        request: dict[str, Any] = {
            "Bucket": self._bucket,
            "Prefix": self._root + prefix,
            "Delimiter": "/",
            "MaxKeys": _LIST_PAGE_SIZE,
        }
        if token is not None:
            request["ContinuationToken"] = token
        try:
            page = await client.list_objects_v2(**request)
        except _S3_ERRORS as exc:
            raise _translate(exc, target=self._target(prefix), endpoint=self._endpoint) from exc
        objects = tuple(
            ObjectInfo(
                key=item["Key"][cut:],
                size=int(item["Size"]),
                etag=_strip_quotes(item["ETag"]),
                mtime=item["LastModified"].timestamp(),
            )
            for item in page.get("Contents", ())
        )
        prefixes = tuple(entry["Prefix"][cut:] for entry in page.get("CommonPrefixes", ()))
        next_token = page.get("NextContinuationToken") if page.get("IsTruncated") else None
        return ListingPage(Listing(objects=objects, prefixes=prefixes), next_token)

    async def head(self, key: str) -> ObjectInfo:
        full_key = self._root + key
        if not full_key:
            raise ObjectNotFound(self._target(key))
        client = await self._get_client()
        try:
            response = await client.head_object(Bucket=self._bucket, Key=full_key)
        except _S3_ERRORS as exc:
            raise _translate(exc, target=self._target(key), endpoint=self._endpoint) from exc
        return ObjectInfo(
            key=key,
            size=int(response["ContentLength"]),
            etag=_strip_quotes(response["ETag"]),
            mtime=response["LastModified"].timestamp(),
        )

    async def get_range(self, key: str, start: int, end: int, etag: str) -> bytes | bytearray:
        return await gathered(self.stream_range(key, start, end, etag, max(1, end - start)))

    async def stream_range(
        self, key: str, start: int, end: int, etag: str, piece: int
    ) -> AsyncGenerator[bytes | bytearray, None]:
        if end <= start:
            # "bytes=5-4" is not a range: S3 would send the whole object.
            # Answer from HEAD so a missing or changed object still raises.
            info = await self.head(key)
            if info.etag != _strip_quotes(etag):
                raise ObjectChanged(f"{self._target(key)}: etag is now {info.etag}, read pinned to {etag}")
            return
        full_key = self._root + key
        if not full_key:
            raise ObjectNotFound(self._target(key))
        client = await self._get_client()
        try:
            response = await client.get_object(
                Bucket=self._bucket,
                Key=full_key,
                Range=f"bytes={start}-{end - 1}",
                IfMatch=f'"{_strip_quotes(etag)}"',
            )
        except ClientError as exc:
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status == _RANGE_NOT_SATISFIABLE:
                # The range starts at or past the end (or the object is
                # empty). S3 evaluates If-Match first, so the version matched.
                return
            raise _translate(exc, target=self._target(key), endpoint=self._endpoint) from exc
        except _S3_ERRORS as exc:
            raise _translate(exc, target=self._target(key), endpoint=self._endpoint) from exc
        got = _strip_quotes(response.get("ETag", ""))
        if got != _strip_quotes(etag):
            async with response["Body"]:  # its connection is closed now, not at garbage collection
                pass
            raise ObjectChanged(f"{self._target(key)}: endpoint returned etag {got}, read pinned to {etag}")
        async with response["Body"] as body:
            try:
                if "ContentRange" not in response:
                    await _skip(body, start)  # an endpoint that ignores Range sends the whole object
                position = start
                while position < end:
                    size = min(piece, end - position)
                    data = await _read_body(body, size)
                    if data:
                        yield data
                    position += len(data)
                    if len(data) < size:
                        return  # the body ended: the end of the object
            except _S3_ERRORS as exc:
                raise _translate(exc, target=self._target(key), endpoint=self._endpoint) from exc

    async def close(self) -> None:
        stack, self._exit_stack, self._client = self._exit_stack, None, None
        if stack is not None:
            await stack.aclose()


async def _read_body(body: Any, length: int) -> bytearray:
    """The next ``length`` bytes of a response body, read into one buffer
    (``read()`` gathers chunks and then joins them, twice the size in RAM);
    fewer only where the body ends. Chunked bodies (no Content-Length, from
    a proxy or an S3-compatible store) are read the same way."""
    buffer = bytearray(length)
    view = memoryview(buffer)
    filled = 0
    while filled < length:
        got = await body.readinto(view[filled:])
        if not got:
            break
        filled += got
    return buffer if filled == length else buffer[:filled]


async def _skip(body: Any, length: int) -> None:
    """Read and drop the first ``length`` bytes of a response body."""
    while length > 0:
        dropped = await body.read(min(length, 1 << 20))
        if not dropped:
            return
        length -= len(dropped)
