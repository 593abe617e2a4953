"""S3 (and S3-compatible endpoints) as the cold store: data over obstore,
listings over aiobotocore.

Data GETs go through obstore (Rust ``object_store``): its HTTP, signing and
body reads run outside the GIL, at about a quarter of aiobotocore's CPU per
GET (``doc/benchmarks.md``), and a GET is the cold path's unit of work.
Listings stay on aiobotocore: a listing is paged by continuation token, one
bounded request a page, which obstore does not expose (it lists a whole
level in one call, which no deadline could bound for a directory of a
million keys). botocore also resolves credentials (profiles, SSO, roles)
and the region, and hands them to obstore, so both clients sign as the
same principal.

Both clients are created on first use inside the daemon's event loop
(aiohttp sessions belong to the loop that made them) and closed by
``close()``. Every call is a single attempt: the fetcher owns retries,
backoff and the total deadline, so both clients' own retries are switched
off (they would multiply the fetcher's and could outlive its deadline).
The exception is ``put_file``, whose own obstore client retries a failed
part: its caller retries whole files, and a part is much less to send.

A read is pinned to a version: ``GetObject`` carries ``If-Match`` with the
etag the namespace saw, S3 answers 412 when the object was replaced, and the
response's ETag is compared as well, so bytes of another version are never
returned even by an endpoint that ignores ``If-Match``.

Etags are kept without their surrounding quotes (as in ``ObjectInfo`` from
every other store: for a single-part upload it is the content's MD5, the same
value ``MemoryStore`` computes) and quoted again for ``If-Match``, which is
the form HTTP specifies. moto 5 and S3 accept both forms.

Uploads (``put_file``) go through obstore too, fed the file's parts by
``source.FileParts``: each part is read with ``pread`` and its MD5 taken in a worker
thread (hashlib releases the GIL), four parts at once, and obstore signs
and sends them from its own threads. Files up to one part (8 MiB,
Mountpoint's part size) are one PUT; larger ones a multipart upload with
16 parts in flight, and S3 publishes the object only at
CompleteMultipartUpload, so readers see the old object or the whole new
one. Measured on moto (``python -m benchmarks.upload_bench --mib 256
--in-flight 16``, 8 MiB parts): obstore alone 1.7-1.8 ms of client CPU a
MiB, 0.00 of it on the event loop thread; ``put_file`` 3.4-3.6 ms a MiB,
0.14 on the loop (the rest is MD5 and obstore, outside the GIL);
aiobotocore part by part with Content-MD5 4.6-5.0 ms a MiB, 2.3-2.6 on the
loop, which alone would fill the daemon's one core at 400 MiB/s. moto
takes 60-80 MB/s whichever client sends. Reading and hashing one part at
a time ran at 420 MiB/s on a loaded 2-core machine, four at once at
630-670 MiB/s.

The bytes are checked end to end. obstore signs every request's payload
(SigV4's x-amz-content-sha256), which S3 checks before it accepts a PUT or
a part, so a body corrupted on the way is refused there; it cannot send
Content-MD5. After the upload the etag S3 gives is compared with the one
the parts' MD5s make (the MD5, or the MD5 of the part MD5s and ``-N``),
which is what catches corruption where the endpoint checks nothing: moto
5 accepts a wrong Content-MD5, a wrong x-amz-checksum-sha256 or -crc32 and
a body that does not match the signed SHA-256 alike (``tests/contract/
test_s3_upload.py`` corrupts bytes in transit through a proxy). Then the
object is already there and ``UploadCorrupted`` says so; the next upload
replaces it. SSE-KMS and SSE-C etags are not MD5s: for those objects the
signed payload is the check, and a HEAD, sent only when the etags differ,
tells them apart (a matching upload costs no request after it). The file is pinned while it is read
(``store.source``): one that changes meanwhile is not published.

Failures become ``cachefsd.errors`` types in ``_translate``, and only
there, from one table (``_ERRORS``) of typed errors: S3's error code and
HTTP status in botocore's ``ClientError``, obstore's exception types,
botocore's credential errors; anything else is a retryable ``StoreError``.
Never from a message's text. Messages name the bucket, key and endpoint,
and S3's request id where botocore gives one (obstore gives none); never
credentials, and never a URL with a query string or user info.

obstore types only the statuses it acts on (401, 403, 404, 412, and 304 and
409, which no request here can get); everything else is one
``GenericError`` whose message alone tells a 416 (a range at or past the
end, which is an empty read), a 503 SlowDown, a refused connection and a
reply it will not read (a chunked body with no Content-Length, a whole
object sent for a range, both of which HTTP allows and some S3-compatible
stores and proxies send) apart. So a GET obstore fails that way is sent
again through botocore, whose reply says which by status, code and
headers: a 416 reads as empty, an error keeps S3's code and request id,
and a reply without Content-Range or Content-Length (``_conforms``) moves
the endpoint's GETs to botocore for good, at several times the CPU a GET.
That second request is paid on the failure path alone (under SlowDown,
two requests an attempt; after a stall, a second read timeout), and
usually answers the read. ``get_object``, ``put_object`` and ``put_file``
keep obstore's ``GenericError`` as a retryable ``StoreError``: the table
gives every untyped failure that type, so a second request could only add
a code to the message.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections.abc import Awaitable, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

import aiohttp
from aiobotocore.config import AioConfig
from aiobotocore.session import AioSession, get_session
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    CredentialRetrievalError,
    NoCredentialsError,
    PartialCredentialsError,
    SSOError,
    TokenRetrievalError,
)
from botocore.exceptions import ConnectionError as BotoConnectionError
from botocore.utils import parse_timestamp
from obstore import get_async, put_async
from obstore.exceptions import BaseError as ObstoreError
from obstore.exceptions import GenericError, PermissionDeniedError, PreconditionError, UnauthenticatedError
from obstore.store import S3Store as ObstoreS3

from cachefsd.config import StoreSettings
from cachefsd.errors import AccessDenied, ObjectChanged, ObjectNotFound, StoreError, UploadCorrupted
from cachefsd.store.base import Credentials, Listing, ListingPage, ObjectInfo, redact_url
from cachefsd.store.obstore_client import obstore_config, send_file
from cachefsd.store.source import SourceFile, multipart_etag, part_ranges

T = TypeVar("T")

if TYPE_CHECKING:
    from obstore.store import S3Credential

log = logging.getLogger(__name__)

# Used when neither the settings nor the AWS config name a region. Requests to
# a bucket in another region are redirected by S3 itself; us-east-1 is what
# the AWS CLI and Mountpoint assume too.
DEFAULT_REGION = "us-east-1"

# ListObjectsV2 returns at most 1000 keys a page; asking for the maximum keeps
# a 10,000-entry directory at ten round trips.
_LIST_PAGE_SIZE = 1000
# AWS's own S3 endpoints (global, regional, FIPS, dual-stack, VPC).
_AWS_DOMAIN = ".amazonaws.com"

# The one table of the S3 store's failures: what each typed error its two
# clients raise becomes. A botocore ``ClientError`` is looked up by the S3
# error code in its reply, then by its HTTP status (a HEAD reply has no body,
# so no code); any other exception by its type, most derived first.
# Anything unlisted is a retryable ``StoreError``: 5xx, 429, SlowDown,
# RequestTimeout, a transport failure, obstore's ``GenericError``.
_ERRORS: Mapping[str | int | type[BaseException], type[StoreError]] = {
    # S3 error codes (botocore).
    "NoSuchKey": ObjectNotFound,
    "NoSuchBucket": ObjectNotFound,
    "AccessDenied": AccessDenied,
    "AllAccessDisabled": AccessDenied,
    "AccountProblem": AccessDenied,
    "InvalidAccessKeyId": AccessDenied,
    "SignatureDoesNotMatch": AccessDenied,
    "InvalidObjectState": AccessDenied,  # archived (Glacier) and not restored: retrying will not help
    "PreconditionFailed": ObjectChanged,
    # HTTP statuses (botocore), when the code is not listed.
    401: AccessDenied,
    403: AccessDenied,
    404: ObjectNotFound,
    412: ObjectChanged,
    # obstore's types: the statuses it tells apart (404 is Python's own).
    FileNotFoundError: ObjectNotFound,
    UnauthenticatedError: AccessDenied,
    PermissionDeniedError: AccessDenied,
    PreconditionError: ObjectChanged,
    # botocore's credential chain.
    NoCredentialsError: AccessDenied,
    PartialCredentialsError: AccessDenied,
    CredentialRetrievalError: AccessDenied,
    TokenRetrievalError: AccessDenied,
    SSOError: AccessDenied,  # no IAM Identity Center token: `aws sso login`
}
_RANGE_NOT_SATISFIABLE = 416
# How long obstore may sign with one set of credentials before it asks
# again, and how often they are taken again from botocore (which refreshes
# expiring ones, such as a role's, itself): well within the first.
_CREDENTIALS_LIFETIME_SECONDS = 300.0
_CREDENTIALS_REFRESH_SECONDS = 60.0

_MIB = 1 << 20
# S3's limits on multipart uploads: parts an upload, and the largest object
# one CopyObject may copy.
_MAX_PARTS = 10_000
_MAX_SINGLE_COPY_BYTES = 5 << 30
# Server-side encryption whose etags are not the content's MD5 (SSE-KMS,
# its dual-layer form; SSE-C is told by its own header).
_OPAQUE_ETAG_ENCRYPTION = ("aws:kms", "aws:kms:dsse")


@dataclass(frozen=True, slots=True)
class UploadTuning:
    """How ``S3Store`` sends files and copies objects. Tests inject small
    sizes, so that a multipart upload or copy needs only a few MiB."""

    # Mountpoint's part size: large enough that a part's request overhead
    # (a round trip, a signature) is lost in its transfer time, small enough
    # that a multi-GiB file is hundreds of parts in flight together; S3
    # refuses parts under 5 MiB (but the last). Files up to one part go in
    # one PUT. The etag check computes the multipart etag from this size.
    part_size: int = 8 * _MIB
    # Parts in flight an upload: an S3 connection carries 50-100 MB/s, so
    # 16 fill a 10 Gb/s link. With the parts read ahead, an upload holds up
    # to 20 parts of 8 MiB, 160 MiB: the caller bounds uploads at once.
    parts_in_flight: int = 16
    # Objects above this are copied in parts (UploadPartCopy), S3 copying
    # each: its limit for one CopyObject.
    single_copy_limit: int = _MAX_SINGLE_COPY_BYTES
    # A part of a copy is copied by S3 in well under a request's timeout;
    # 5 GiB + 1 is then 81 parts.
    copy_part_size: int = 64 * _MIB


def part_size_for(size: int, minimum: int) -> int:
    """The part size for an object of ``size`` bytes: ``minimum``, or a
    whole number of MiB above it when the object would otherwise need more
    parts than S3 allows."""
    if size <= minimum * _MAX_PARTS:
        return minimum
    return -(-size // (_MAX_PARTS * _MIB)) * _MIB


_NO_CREDENTIALS = (
    "no usable AWS credentials: set them through the standard chain "
    "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE and ~/.aws/credentials, "
    "or an instance/container role)"
)


def _strip_quotes(etag: str) -> str:
    return etag.strip('"')


def _error_type(exc: BaseException) -> type[StoreError]:
    """The cachefsd error ``exc`` becomes, from ``_ERRORS``."""
    if isinstance(exc, ClientError):
        found = _ERRORS.get(_error_code(exc)) or _ERRORS.get(_http_status(exc))
        return found or StoreError
    for kind in type(exc).__mro__:
        if kind in _ERRORS:
            return _ERRORS[kind]
    return StoreError


def _error_code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _http_status(exc: ClientError) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))


# What the two clients raise and ``_translate`` understands; anything else
# is a bug and propagates. Python's own OSError (FileNotFoundError among
# them) and TimeoutError come from both.
_S3_ERRORS = (ClientError, BotoCoreError, aiohttp.ClientError, ObstoreError, TimeoutError, OSError)


def _translate(exc: BaseException, *, target: str, endpoint: str) -> StoreError:
    """The one place the S3 store's failures become cachefsd errors, typed
    by ``_ERRORS``. ``target`` names what was asked for (``s3://bucket/key``),
    ``endpoint`` the server; both are safe to show. Messages carry S3's
    error code, HTTP status and request id where botocore gives them, and
    the exception's type otherwise: the clients' own messages embed request
    URLs and replies. The original exception is kept as ``__cause__`` by
    the caller's ``raise ... from exc``."""
    kind = _error_type(exc)
    if isinstance(exc, ClientError):
        return kind(_reply_message(exc, target=target, endpoint=endpoint))
    return kind(f"{target}: {_failure_message(exc, kind, endpoint)}")


def _reply_message(exc: ClientError, *, target: str, endpoint: str) -> str:
    """S3's error code, HTTP status, request id and the first line of its message."""
    code = _error_code(exc)
    metadata = exc.response.get("ResponseMetadata", {})
    request_id = metadata.get("RequestId") or metadata.get("HTTPHeaders", {}).get("x-amz-request-id")
    at = f", request id {request_id}" if request_id else ""
    if code == "NoSuchBucket":
        return f"bucket '{urlsplit(target).netloc}' does not exist (endpoint {endpoint}{at})"
    detail = str(exc.response.get("Error", {}).get("Message") or "").splitlines()[0:1]
    suffix = f": {detail[0]}" if detail else ""
    return f"{target}: {code or 'error'} (HTTP {_http_status(exc)}{at}){suffix}"


def _failure_message(exc: BaseException, kind: type[StoreError], endpoint: str) -> str:
    """What failed, by the exception's type: a client's own message embeds URLs."""
    if isinstance(exc, TokenRetrievalError | SSOError):
        return "the AWS SSO token could not be refreshed; run `aws sso login`"
    if kind is AccessDenied and isinstance(exc, BotoCoreError):
        return _NO_CREDENTIALS
    if isinstance(exc, BotoConnectionError):
        return f"cannot reach S3 endpoint {endpoint} ({type(exc).__name__})"
    return f"{kind.__name__} from S3 endpoint {endpoint} ({type(exc).__name__})"


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

    def __init__(
        self,
        bucket: str,
        prefix: str,
        settings: StoreSettings,
        attempt_timeout: float,
        credentials: Credentials | None = None,
        upload: UploadTuning = UploadTuning(),
    ) -> None:
        """Signed with ``credentials`` when given, else with those of
        botocore's chain (environment, profiles, roles)."""
        # Immutable after construction.
        self._bucket = bucket
        self._prefix = _normalise_prefix(prefix)
        self._root = f"{self._prefix}/" if self._prefix else ""
        self._settings = settings
        self._attempt_timeout = attempt_timeout
        self._upload = upload
        # Owned by the event loop thread; _client_lock serialises the first use.
        self._session: AioSession = get_session()
        self._session.get_component("response_parser_factory").set_parser_defaults(
            timestamp_parser=_parse_timestamp
        )
        if credentials is not None:
            self._session.set_credentials(
                credentials.access_key_id, credentials.secret_access_key, credentials.session_token
            )
        self._client: Any = None
        self._exit_stack: AsyncExitStack | None = None
        self._client_lock = asyncio.Lock()
        self._endpoint = redact_url(settings.endpoint_url) if settings.endpoint_url else "AWS S3"
        self._resolved_endpoint: str | None = None  # the client's, once created
        self._bucket_region: str | None = None  # AWS's answer to ``check``
        # The data client, made from the listing client's endpoint, region and credentials.
        self._data: ObstoreS3 | None = None
        self._uploads: ObstoreS3 | None = None  # put_file's, which retries parts
        self._credentials: S3Credential | None = None
        self._credentials_taken = float("-inf")
        self._nonconforming = False  # the endpoint's replies are read through botocore

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
            if self._settings.endpoint_url is None and self._settings.region is None:
                # botocore follows S3's redirects to a bucket's region; obstore
                # does not, so its GETs must be sent there from the start.
                headers = (await client.head_bucket(Bucket=self._bucket))["ResponseMetadata"]["HTTPHeaders"]
                self._bucket_region = headers.get("x-amz-bucket-region")
        except _S3_ERRORS as exc:
            raise _translate(exc, target=self._target(), endpoint=self._endpoint) from exc
        return bool(page.get("Contents"))

    async def _data_client(self) -> ObstoreS3:
        """The obstore client for reads and small writes, made on first use:
        one attempt a request, since the fetcher owns retries."""
        await self._take_credentials()
        if self._data is None:
            self._data = await self._obstore(upload=False)
        return self._data

    async def _upload_client(self) -> ObstoreS3:
        """The obstore client for ``put_file``, which retries a failed part
        (or the request that creates or completes the upload) on its own,
        after a growing pause: a multi-GiB upload is hundreds of requests,
        and S3 answers some of them 503 SlowDown or 500 as a matter of
        course; failing the whole upload would send every part again."""
        await self._take_credentials()
        if self._uploads is None:
            self._uploads = await self._obstore(upload=True)
        return self._uploads

    async def _take_credentials(self) -> None:
        """botocore's credentials for obstore, taken again every ``_CREDENTIALS_REFRESH_SECONDS``."""
        await self._get_client()
        now = time.monotonic()
        if now - self._credentials_taken >= _CREDENTIALS_REFRESH_SECONDS:
            self._credentials = await self._frozen_credentials()
            self._credentials_taken = now

    async def _obstore(self, upload: bool) -> ObstoreS3:
        """An obstore client on the listing client's endpoint, region and
        credentials, for reads or for ``upload`` (``store.obstore_client``)."""
        client = await self._get_client()
        options, retry = obstore_config(
            self._settings.connect_timeout, self._attempt_timeout, self._settings.max_connections, upload
        )
        endpoint: dict[str, Any] = {}
        if self._settings.endpoint_url is not None:
            endpoint = {"endpoint": self._resolved_endpoint, "virtual_hosted_style_request": False}
            options["allow_http"] = urlsplit(self._settings.endpoint_url).scheme == "http"
        return ObstoreS3(
            self._bucket,
            region=self._bucket_region or client.meta.region_name,
            client_options=options,
            retry_config=retry,
            credential_provider=self._current_credentials,
            **endpoint,
        )

    def _current_credentials(self) -> S3Credential:
        """For obstore, from its own threads: what ``_data_client`` took last."""
        assert self._credentials is not None  # taken before the client is made
        return self._credentials

    async def _frozen_credentials(self) -> S3Credential:
        try:
            credentials = await self._session.get_credentials()
            frozen = None if credentials is None else await credentials.get_frozen_credentials()
        except _S3_ERRORS as exc:
            raise _translate(exc, target=self._target(), endpoint=self._endpoint) from exc
        if frozen is None or not frozen.access_key:
            raise AccessDenied(f"{self._target()}: {_NO_CREDENTIALS}")
        return {
            "access_key_id": frozen.access_key,
            "secret_access_key": frozen.secret_key,
            "token": frozen.token,
            "expires_at": datetime.datetime.now(datetime.UTC)
            + datetime.timedelta(seconds=_CREDENTIALS_LIFETIME_SECONDS),
        }

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
        return _head_info(key, await self._head_object(key))

    async def _head_object(self, key: str) -> dict[str, Any]:
        full_key = self._root + key
        if not full_key:
            raise ObjectNotFound(self._target(key))
        client = await self._get_client()
        try:
            response: dict[str, Any] = await client.head_object(Bucket=self._bucket, Key=full_key)
        except _S3_ERRORS as exc:
            raise _translate(exc, target=self._target(key), endpoint=self._endpoint) from exc
        return response

    async def get_range(self, key: str, start: int, end: int, etag: str) -> bytes | bytearray:
        if end <= start:
            # "bytes=5-4" is not a range: S3 would send the whole object.
            # Answer from HEAD so a missing or changed object still raises.
            info = await self.head(key)
            if info.etag != _strip_quotes(etag):
                raise ObjectChanged(f"{self._target(key)}: etag is now {info.etag}, read pinned to {etag}")
            return b""
        full_key = self._root + key
        if not full_key:
            raise ObjectNotFound(self._target(key))
        if self._nonconforming:
            return await self._get_through_botocore(full_key, start, end, etag)
        data = await self._data_client()
        try:
            response = await get_async(
                data, full_key, options={"range": (start, end), "if_match": f'"{_strip_quotes(etag)}"'}
            )
        except GenericError:
            # What obstore does not type (see the module's docstring): the
            # same GET through botocore, whose reply says it by status,
            # code and headers, and answers it when it can.
            return await self._get_through_botocore(full_key, start, end, etag)
        except _S3_ERRORS as exc:
            raise _translate(exc, target=self._target(key), endpoint=self._endpoint) from exc
        got = _strip_quotes(response.meta.get("e_tag") or "")
        if got != _strip_quotes(etag):
            raise ObjectChanged(f"{self._target(key)}: endpoint returned etag {got}, read pinned to {etag}")
        try:
            # The body in one buffer, gathered by obstore outside the GIL;
            # one copy into bytes, which the cache and the FUSE edge take.
            return bytes(await response.bytes_async())
        except _S3_ERRORS as exc:
            raise _translate(exc, target=self._target(key), endpoint=self._endpoint) from exc

    async def _get_through_botocore(
        self, full_key: str, start: int, end: int, etag: str
    ) -> bytes | bytearray:
        """``get_range`` through aiobotocore: after obstore failed in a way
        it does not type, and from then on for an endpoint whose replies
        obstore refuses (``_conforms``), read exactly all the same."""
        key = full_key[len(self._root) :]
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
                return b""
            raise _translate(exc, target=self._target(key), endpoint=self._endpoint) from exc
        except _S3_ERRORS as exc:
            raise _translate(exc, target=self._target(key), endpoint=self._endpoint) from exc
        if not self._nonconforming and not _conforms(response):
            log.warning(
                "%s answers ranged GETs without Content-Length or Content-Range; "
                "reading it through botocore, at several times the CPU a GET",
                self._endpoint,
            )
            self._nonconforming = True
        got = _strip_quotes(response.get("ETag", ""))
        if got != _strip_quotes(etag):
            async with response["Body"]:  # its connection is closed now, not at garbage collection
                pass
            raise ObjectChanged(f"{self._target(key)}: endpoint returned etag {got}, read pinned to {etag}")
        async with response["Body"] as body:
            try:
                if "ContentRange" not in response:
                    await _skip(body, start)  # an endpoint that ignores Range sends the whole object
                return await _read_body(body, end - start)
            except _S3_ERRORS as exc:
                raise _translate(exc, target=self._target(key), endpoint=self._endpoint) from exc

    async def get_object(self, key: str) -> bytes:
        full_key = self._root + key
        if not full_key:
            raise ObjectNotFound(self._target(key))
        data = await self._data_client()
        try:
            response = await get_async(data, full_key)
            return bytes(await response.bytes_async())
        except _S3_ERRORS as exc:
            raise _translate(exc, target=self._target(key), endpoint=self._endpoint) from exc

    async def put_object(self, key: str, data: bytes) -> None:
        full_key = self._root + key
        if not full_key:
            raise StoreError(f"{self._target(key)}: not an object name")
        client = await self._data_client()
        try:
            await put_async(client, full_key, data)
        except _S3_ERRORS as exc:
            raise _translate(exc, target=self._target(key), endpoint=self._endpoint) from exc

    def _object_key(self, key: str) -> str:
        """The bucket key a write of ``key`` goes to; a key naming no object is refused."""
        if not key or key.endswith("/"):
            raise StoreError(f"{self._target(key)}: not an object name")
        return self._root + key

    async def put_file(self, key: str, path: Path) -> ObjectInfo:
        """One PUT up to ``part_size``, a multipart upload above (see the module docstring)."""
        full_key = self._object_key(key)
        target = self._target(key)
        source = await asyncio.to_thread(SourceFile, path)
        part_size = part_size_for(source.size, self._upload.part_size)
        try:
            client = await self._upload_client()
            sent = send_file(client, full_key, source, part_size, self._upload.parts_in_flight)
            result, md5s = await self._put(target, sent)
        except BaseException:
            if source.size > part_size:
                await self._abort_unfinished_uploads(full_key)
            raise
        finally:
            source.close()
        expected = md5s[0].hex() if source.size <= part_size else multipart_etag(md5s)
        written = _strip_quotes(result.get("e_tag") or "")
        if written != expected:
            # Only a HEAD tells an encrypted object's etag (not an MD5) from
            # bytes the store got wrong: a round trip paid on that path alone.
            response = await self._head_object(key)
            written = written or _head_info(key, response).etag
            if written != expected and not _etag_is_opaque(response):
                raise UploadCorrupted(
                    f"{target}: the store holds etag {written}, the file's bytes give {expected};"
                    " upload it again"
                )
        return ObjectInfo(key=key, size=source.size, etag=written, mtime=time.time())

    async def _put(self, target: str, put: Awaitable[T]) -> T:
        try:
            return await put
        except _S3_ERRORS as exc:
            raise _translate(exc, target=target, endpoint=self._endpoint) from exc

    async def _abort_unfinished_uploads(self, full_key: str) -> None:
        """Abort every unfinished multipart upload of ``full_key``. obstore
        aborts its upload when reading the file or a part fails, but not
        when the call is cancelled (its future is dropped), and it does not
        say its upload's id: so every upload of the key goes, another
        writer's of the same key too (whose completion then fails, and
        which it uploads again). Best effort: a failure here is logged, and
        the upload's own failure is raised."""
        client = await self._get_client()
        try:
            listing = await client.list_multipart_uploads(Bucket=self._bucket, Prefix=full_key)
            for upload in listing.get("Uploads", ()):
                if upload["Key"] == full_key:
                    await client.abort_multipart_upload(
                        Bucket=self._bucket, Key=full_key, UploadId=upload["UploadId"]
                    )
        except _S3_ERRORS as exc:
            error = _translate(exc, target=f"s3://{self._bucket}/{full_key}", endpoint=self._endpoint)
            log.warning("could not abort the unfinished upload of %s: %s", full_key, error)

    async def delete(self, key: str) -> None:
        """DeleteObject (obstore sends a bulk DeleteObjects, which not every
        S3-compatible endpoint speaks); S3 answers 204 for an absent key too."""
        # A directory's marker object ("a/") may be deleted, never written.
        full_key = self._object_key(key.removesuffix("/")) + ("/" if key.endswith("/") else "")
        client = await self._get_client()
        try:
            await client.delete_object(Bucket=self._bucket, Key=full_key)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") == "NoSuchKey":  # some S3-compatible stores
                return
            raise _translate(exc, target=self._target(key), endpoint=self._endpoint) from exc
        except _S3_ERRORS as exc:
            raise _translate(exc, target=self._target(key), endpoint=self._endpoint) from exc

    async def copy(self, source: str, target: str) -> ObjectInfo:
        """CopyObject, pinned to the version ``head`` saw (S3 answers 412,
        ``ObjectChanged``, if the source is replaced meanwhile; moto 5 ignores
        the pin, the file-backed endpoint honours it); in parts above
        ``single_copy_limit`` (S3 copies each, no byte passes through here)."""
        full_target = self._object_key(target)
        origin = await self.head(source)
        client = await self._get_client()
        copy_source = {"Bucket": self._bucket, "Key": self._root + source}
        if_match = f'"{origin.etag}"'
        try:
            if origin.size <= self._upload.single_copy_limit:
                response = await client.copy_object(
                    Bucket=self._bucket, Key=full_target, CopySource=copy_source, CopySourceIfMatch=if_match
                )
                written = _strip_quotes(response["CopyObjectResult"]["ETag"])
            else:
                written = await self._copy_in_parts(full_target, copy_source, if_match, origin.size)
        except _S3_ERRORS as exc:
            raise _translate(exc, target=self._target(target), endpoint=self._endpoint) from exc
        current = await self.head(target)
        if current.etag != written:  # replaced again since
            return ObjectInfo(key=target, size=origin.size, etag=written, mtime=time.time())
        return current

    async def _copy_in_parts(
        self, full_target: str, copy_source: dict[str, str], if_match: str, size: int
    ) -> str:
        """A multipart upload of ``full_target`` whose parts S3 copies from
        ``copy_source``; aborted on any failure. The new etag."""
        client = await self._get_client()
        upload = await client.create_multipart_upload(Bucket=self._bucket, Key=full_target)
        upload_id = upload["UploadId"]
        slots = asyncio.Semaphore(self._upload.parts_in_flight)
        failed = asyncio.Event()

        async def copy_part(number: int, start: int, end: int) -> dict[str, Any]:
            async with slots:
                if failed.is_set():
                    raise asyncio.CancelledError
                response = await client.upload_part_copy(
                    Bucket=self._bucket,
                    Key=full_target,
                    UploadId=upload_id,
                    PartNumber=number,
                    CopySource=copy_source,
                    CopySourceRange=f"bytes={start}-{end - 1}",
                    CopySourceIfMatch=if_match,
                )
                return {"PartNumber": number, "ETag": response["CopyPartResult"]["ETag"]}

        ranges = part_ranges(size, part_size_for(size, self._upload.copy_part_size))
        tasks = [
            asyncio.ensure_future(copy_part(number, start, end))
            for number, (start, end) in enumerate(ranges, 1)
        ]
        try:
            try:
                parts = await asyncio.gather(*tasks)
            except asyncio.CancelledError:
                for task in tasks:
                    task.cancel()
                raise
            finally:
                # A part the store is still copying may land after an abort
                # and outlive it: after a failure no part starts, and those in
                # flight end before the abort.
                failed.set()
                await asyncio.gather(*tasks, return_exceptions=True)
            response = await client.complete_multipart_upload(
                Bucket=self._bucket, Key=full_target, UploadId=upload_id, MultipartUpload={"Parts": parts}
            )
        except BaseException:
            await self._abort_upload(full_target, upload_id)
            raise
        return _strip_quotes(response["ETag"])

    async def _abort_upload(self, full_key: str, upload_id: str) -> None:
        """Best effort: a failure is logged; the caller raises its own."""
        client = await self._get_client()
        try:
            await client.abort_multipart_upload(Bucket=self._bucket, Key=full_key, UploadId=upload_id)
        except _S3_ERRORS as exc:
            error = _translate(exc, target=f"s3://{self._bucket}/{full_key}", endpoint=self._endpoint)
            log.warning("could not abort the unfinished upload of %s: %s", full_key, error)

    async def close(self) -> None:
        stack, self._exit_stack, self._client = self._exit_stack, None, None
        if stack is not None:
            await stack.aclose()


def _conforms(response: Mapping[str, Any]) -> bool:
    """Whether a reply to a ranged GET is one obstore reads: a 206 with
    Content-Range, and a Content-Length (not a chunked body)."""
    headers = response["ResponseMetadata"]["HTTPHeaders"]
    return "ContentRange" in response and "content-length" in headers


def _head_info(key: str, response: Mapping[str, Any]) -> ObjectInfo:
    return ObjectInfo(
        key=key,
        size=int(response["ContentLength"]),
        etag=_strip_quotes(response["ETag"]),
        mtime=response["LastModified"].timestamp(),
    )


def _etag_is_opaque(response: Mapping[str, Any]) -> bool:
    """Whether the object's etag is not its MD5 (nor a multipart etag of
    MD5s): SSE-KMS and SSE-C. S3 has then checked each request's body
    against its signed SHA-256 (obstore signs payloads), the check left."""
    return (
        response.get("ServerSideEncryption") in _OPAQUE_ETAG_ENCRYPTION or "SSECustomerAlgorithm" in response
    )


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
