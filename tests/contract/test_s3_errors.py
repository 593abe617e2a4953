"""The S3 store's failure table (``s3._ERRORS``), row by row, on the wire.

Each row is produced by a real client reading a real reply: moto's for what
moto answers, a proxy in front of it (``tests/proxy.py``) for what moto
cannot be made to say (a 403, a 503 SlowDown, S3's error codes, a reply
HTTP allows and obstore refuses), and botocore's own credential chain for
the credential rows. Which client sent a request is told by its
User-Agent: obstore's data path, or botocore's.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from botocore.exceptions import (
    ClientError,
    CredentialRetrievalError,
    NoCredentialsError,
    PartialCredentialsError,
    SSOError,
    TokenRetrievalError,
)
from botocore.tokens import SSOTokenProvider
from obstore.exceptions import GenericError, PermissionDeniedError, PreconditionError, UnauthenticatedError

from cachefsd.config import StoreSettings
from cachefsd.errors import AccessDenied, StoreError
from cachefsd.store import s3 as s3_module
from cachefsd.store.s3 import S3Store
from cachefsd.testing.s3_server import S3TestServer
from tests.aws import without_aws_credentials
from tests.proxy import Decision, through_proxy

ATTEMPT_TIMEOUT_SECONDS = 5.0
REQUEST_ID = "INJECTED4REQUEST"
DATA = bytes(range(256)) * 40
KEY = "k"

# The status that makes obstore raise each of its types in the table.
_OBSTORE_STATUS = {
    FileNotFoundError: 404,
    UnauthenticatedError: 401,
    PermissionDeniedError: 403,
    PreconditionError: 412,
}
_CREDENTIAL_ROWS = (
    NoCredentialsError,
    PartialCredentialsError,
    CredentialRetrievalError,
    TokenRetrievalError,
    SSOError,
)
_CODES = sorted(key for key in s3_module._ERRORS if isinstance(key, str))
_STATUSES = sorted(key for key in s3_module._ERRORS if isinstance(key, int))


def test_every_row_of_the_table_has_a_test() -> None:
    """A row added to the table fails here until a test below produces it."""
    tested = {*_CODES, *_STATUSES, *_OBSTORE_STATUS, *_CREDENTIAL_ROWS}
    assert set(s3_module._ERRORS) == tested


class Sent:
    """The requests the proxy saw: method and the client that sent it."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str]] = []

    def record(self, request: web.Request) -> None:
        agent = request.headers.get("User-Agent", "")
        client = "obstore" if agent.startswith("object_store/") else "botocore"
        self.requests.append((request.method, client))

    def gets(self) -> list[str]:
        return [client for method, client in self.requests if method == "GET"]


def _error_reply(status: int, code: str | None) -> web.Response:
    """S3's error reply: a code in an XML body (none for a HEAD) and the request id."""
    body = (
        b""
        if code is None
        else (
            f"<Error><Code>{code}</Code><Message>injected</Message>"
            f"<RequestId>{REQUEST_ID}</RequestId></Error>"
        ).encode()
    )
    return web.Response(
        status=status, body=body, content_type="application/xml", headers={"x-amz-request-id": REQUEST_ID}
    )


def _is_listing(request: web.Request) -> bool:
    return request.method == "GET" and "list-type" in request.query


def _is_object_get(request: web.Request) -> bool:
    return request.method == "GET" and request.path.endswith(f"/{KEY}")


@pytest.fixture(name="bucket")
def fixture_bucket(s3_client: Any) -> str:
    bucket = f"errors-{uuid.uuid4().hex[:12]}"
    s3_client.create_bucket(Bucket=bucket)
    s3_client.put_object(Bucket=bucket, Key=KEY, Body=DATA)
    return bucket


def _through_proxy(
    s3_server: S3TestServer,
    bucket: str,
    answer: Callable[[web.Request], web.Response | None],
    body: Callable[[S3Store], Awaitable[Any]],
) -> tuple[Any, Sent]:
    """``body``'s result with a store of ``bucket`` whose requests pass a
    proxy that answers a request itself when ``answer`` gives a reply, and
    the requests it saw."""
    sent = Sent()

    async def rule(request: web.Request, forwarded: bytes) -> Decision:
        sent.record(request)
        return answer(request) or forwarded

    def open_store(endpoint: str) -> S3Store:
        settings = StoreSettings(endpoint_url=endpoint, region="us-east-1")
        return S3Store(bucket, "", settings, ATTEMPT_TIMEOUT_SECONDS)

    return through_proxy(s3_server.endpoint_url, rule, open_store, body), sent


async def _failure(call: Awaitable[Any]) -> StoreError:
    with pytest.raises(StoreError) as raised:
        await call
    return raised.value


@pytest.mark.parametrize("code", _CODES)
def test_an_s3_error_code_decides_the_type(s3_server: S3TestServer, bucket: str, code: str) -> None:
    """A listing refused with the code, at a status the table does not
    list (400): the code alone decides; the request id is in the message."""

    def answer(request: web.Request) -> web.Response | None:
        return _error_reply(400, code) if _is_listing(request) else None

    error, _ = _through_proxy(s3_server, bucket, answer, lambda store: _failure(store.list_page("", None)))
    assert type(error) is s3_module._ERRORS[code]
    assert REQUEST_ID in str(error)
    assert "\n" not in str(error)


@pytest.mark.parametrize(
    ("code", "status"),
    [("SlowDown", 503), ("InternalError", 500), ("ThrottlingException", 400), ("RequestTimeout", 400)],
)
def test_an_unlisted_code_is_retryable(s3_server: S3TestServer, bucket: str, code: str, status: int) -> None:
    def answer(request: web.Request) -> web.Response | None:
        return _error_reply(status, code) if _is_listing(request) else None

    error, _ = _through_proxy(s3_server, bucket, answer, lambda store: _failure(store.list_page("", None)))
    assert type(error) is StoreError
    assert error.retryable
    assert f"{code} (HTTP {status}, request id {REQUEST_ID})" in str(error)


@pytest.mark.parametrize("status", _STATUSES)
def test_an_http_status_decides_the_type_when_there_is_no_code(
    s3_server: S3TestServer, bucket: str, status: int
) -> None:
    """A HEAD refused with a bare status (a HEAD reply has no body)."""

    def answer(request: web.Request) -> web.Response | None:
        return _error_reply(status, None) if request.method == "HEAD" else None

    error, _ = _through_proxy(s3_server, bucket, answer, lambda store: _failure(store.head(KEY)))
    assert type(error) is s3_module._ERRORS[status]
    assert f"HTTP {status}, request id {REQUEST_ID}" in str(error)


@pytest.mark.parametrize("kind", list(_OBSTORE_STATUS))
def test_obstores_types_decide_the_type(s3_server: S3TestServer, bucket: str, kind: type[Exception]) -> None:
    """A data GET refused with the status obstore types: one request, no second through botocore."""

    def answer(request: web.Request) -> web.Response | None:
        return _error_reply(_OBSTORE_STATUS[kind], "Injected") if _is_object_get(request) else None

    async def read(store: S3Store) -> StoreError:
        etag = (await store.head(KEY)).etag
        return await _failure(store.get_range(KEY, 0, 10, etag))

    error, sent = _through_proxy(s3_server, bucket, answer, read)
    assert type(error.__cause__) is kind
    assert type(error) is s3_module._ERRORS[kind]
    assert sent.gets() == ["obstore"]


# A profile signing in through AWS IAM Identity Center (SSO), whose login
# endpoint is a closed local port: nothing leaves the machine.
_SSO_PROFILE = """
[profile sso]
sso_session = session
sso_account_id = 111111111111
sso_role_name = reader
[sso-session session]
sso_start_url = https://127.0.0.1:1/start
sso_region = us-east-1
[profile process]
credential_process = /bin/false
"""


def _expired_sso_token(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The token `aws sso login` leaves, expired, with nothing to refresh it by."""
    cache = home / ".aws" / "sso" / "cache"
    cache.mkdir(parents=True)
    # botocore fixes the directory when it is imported, from HOME then.
    monkeypatch.setattr(SSOTokenProvider, "_SSO_TOKEN_CACHE_DIR", str(cache))
    token = {
        "startUrl": "https://127.0.0.1:1/start",
        "region": "us-east-1",
        "accessToken": "expired",
        "expiresAt": "2020-01-01T00:00:00Z",
    }
    (cache / f"{hashlib.sha1(b'session').hexdigest()}.json").write_text(json.dumps(token))


@pytest.mark.parametrize("kind", _CREDENTIAL_ROWS, ids=lambda kind: kind.__name__)
def test_credential_failures_are_access_denied(
    kind: type[Exception], s3_settings: StoreSettings, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    without_aws_credentials(monkeypatch, tmp_path)
    (tmp_path / "config").write_text(_SSO_PROFILE)
    if kind is PartialCredentialsError:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAHALF")
    elif kind is CredentialRetrievalError:
        monkeypatch.setenv("AWS_PROFILE", "process")
    elif kind in (TokenRetrievalError, SSOError):
        monkeypatch.setenv("AWS_PROFILE", "sso")
        if kind is TokenRetrievalError:
            _expired_sso_token(tmp_path, monkeypatch)
    store = S3Store("bkt", "", s3_settings, ATTEMPT_TIMEOUT_SECONDS)

    async def check() -> StoreError:
        try:
            return await _failure(store.check())
        finally:
            await store.close()

    error = asyncio.run(check())
    assert isinstance(error.__cause__, kind)
    assert type(error) is AccessDenied
    assert ("aws sso login" in str(error)) is (kind in (TokenRetrievalError, SSOError))


def test_an_error_obstore_does_not_type_is_read_from_botocores_reply(
    s3_server: S3TestServer, bucket: str
) -> None:
    """A 503 SlowDown is obstore's GenericError: the GET sent again through
    botocore keeps S3's code, status and request id, retryably; the
    endpoint's GETs stay on obstore."""
    refusals = iter([_error_reply(503, "SlowDown"), _error_reply(503, "SlowDown")])

    def answer(request: web.Request) -> web.Response | None:
        return next(refusals, None) if _is_object_get(request) else None

    async def read(store: S3Store) -> tuple[StoreError, bytes | bytearray]:
        etag = (await store.head(KEY)).etag
        error = await _failure(store.get_range(KEY, 0, 10, etag))
        return error, await store.get_range(KEY, 5, 20, etag)

    (error, data), sent = _through_proxy(s3_server, bucket, answer, read)
    assert type(error) is StoreError
    assert error.retryable
    assert f"SlowDown (HTTP 503, request id {REQUEST_ID})" in str(error)
    assert isinstance(error.__cause__, ClientError)
    assert isinstance(error.__cause__.__context__, GenericError)  # obstore's, kept in the chain
    assert data == DATA[5:20]
    assert sent.gets() == ["obstore", "botocore", "obstore"]


def test_a_range_past_the_end_reads_empty_and_keeps_obstore(s3_server: S3TestServer, bucket: str) -> None:
    """moto's 416 (obstore's GenericError) is read from botocore's status."""

    async def read(store: S3Store) -> list[bytes | bytearray]:
        etag = (await store.head(KEY)).etag
        return [
            await store.get_range(KEY, len(DATA), len(DATA) + 10, etag),
            await store.get_range(KEY, 0, 10, etag),
        ]

    data, sent = _through_proxy(s3_server, bucket, lambda request: None, read)
    assert data == [b"", DATA[:10]]
    assert sent.gets() == ["obstore", "botocore", "obstore"]


def test_an_endpoint_that_ignores_range_is_read_through_botocore_from_then_on(
    s3_server: S3TestServer, bucket: str
) -> None:
    """The whole object sent for a range (200, no Content-Range): botocore's
    reply shows it, and later GETs skip obstore."""

    def answer(request: web.Request) -> web.Response | None:
        if not _is_object_get(request):
            return None
        etag = f'"{hashlib.md5(DATA).hexdigest()}"'
        return web.Response(body=DATA, headers={"ETag": etag})

    async def read(store: S3Store) -> list[bytes | bytearray]:
        etag = (await store.head(KEY)).etag
        return [await store.get_range(KEY, 100, 300, etag), await store.get_range(KEY, 7, 9, etag)]

    data, sent = _through_proxy(s3_server, bucket, answer, read)
    assert data == [DATA[100:300], DATA[7:9]]
    assert sent.gets() == ["obstore", "botocore", "botocore"]


def test_whole_object_calls_keep_an_untyped_failure_retryable(s3_server: S3TestServer, bucket: str) -> None:
    def answer(request: web.Request) -> web.Response | None:
        return _error_reply(500, "InternalError") if request.method in ("GET", "PUT") else None

    async def calls(store: S3Store) -> list[StoreError]:
        return [await _failure(store.get_object(KEY)), await _failure(store.put_object("new", b"x"))]

    errors, sent = _through_proxy(s3_server, bucket, answer, calls)
    for error in errors:
        assert type(error) is StoreError
        assert error.retryable
        assert isinstance(error.__cause__, GenericError)
    assert [client for _, client in sent.requests] == ["obstore", "obstore"]
