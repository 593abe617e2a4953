"""GcsStore's error table (``cachefsd.store.gcs._ERROR_TABLE``) row by row,
on fake-gcs-server: the real server where it produces the failure itself (a
missing object or bucket, an unreachable endpoint), and where it cannot, a
proxy in front of it that answers one kind of request with the status
under test as GCS does, request id included. Credentials fail in
google-auth itself, against a token endpoint on 127.0.0.1. Both of the
store's clients are covered: obstore (data GETs) and google-cloud-storage
(listings, uploads).
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from google.cloud import storage

from cachefsd.errors import AccessDenied, ObjectChanged, ObjectNotFound, StoreError, UploadCorrupted
from cachefsd.store.gcs import EMULATOR_ENV, GcsStore
from cachefsd.testing.gcs_emulator import GcsEmulator
from tests.net import free_port
from tests.proxy import Decision, Rule, through_proxy

CALL_TIMEOUT_SECONDS = 30.0
ATTEMPT_TIMEOUT_SECONDS = 5.0
THREADS = 4
REQUEST_ID = "injected-request-id-7f3a"
# Above google-cloud-storage's single-request limit (8 MiB): a resumable upload.
RESUMABLE_BYTES = 9 << 20

Body = Callable[[GcsStore], Awaitable[Any]]


@pytest.fixture(name="bucket")
def fixture_bucket(gcs_client: storage.Client) -> str:
    """A fresh bucket holding ``p/k``."""
    bucket = gcs_client.create_bucket(f"errors-{uuid.uuid4().hex[:12]}")
    bucket.blob("p/k").upload_from_string(b"0123456789")
    return str(bucket.name)


def _store(bucket: str) -> GcsStore:
    return GcsStore(bucket, "p", ATTEMPT_TIMEOUT_SECONDS, THREADS, writable=True)


def _run(bucket: str, body: Body) -> Any:
    async def main() -> Any:
        store = _store(bucket)
        try:
            return await asyncio.wait_for(body(store), CALL_TIMEOUT_SECONDS)
        finally:
            await store.close()

    return asyncio.run(main())


def _through_proxy(
    gcs_emulator: GcsEmulator, monkeypatch: pytest.MonkeyPatch, bucket: str, rule: Rule, body: Body
) -> Any:
    """Run ``body`` with a store of ``bucket`` whose requests pass the proxy."""

    def open_store(endpoint: str) -> GcsStore:
        monkeypatch.setenv(EMULATOR_ENV, endpoint)
        return _store(bucket)

    return through_proxy(gcs_emulator.host, rule, open_store, body)


def _gcs_error(status: int) -> web.Response:
    """An error as GCS's JSON API sends it, with its request id header."""
    body = {"error": {"code": status, "message": "injected", "errors": [{"message": "injected"}]}}
    return web.Response(
        status=status,
        text=json.dumps(body),
        content_type="application/json",
        headers={"X-GUploader-UploadID": REQUEST_ID},
    )


def _is_data_get(request: web.Request) -> bool:
    """obstore's GET of an object, on the XML API: ``/bucket/object``."""
    return request.method == "GET" and not request.path.startswith(("/storage/", "/download/", "/upload/"))


def _is_listing(request: web.Request) -> bool:
    return (
        request.method == "GET" and request.path.startswith("/storage/v1/b/") and request.path.endswith("/o")
    )


def _is_upload(request: web.Request) -> bool:
    return request.path.startswith("/upload/")


def _answering(status: int, matches: Callable[[web.Request], bool]) -> Rule:
    async def rule(request: web.Request, body: bytes) -> Decision:
        return _gcs_error(status) if matches(request) else body

    return rule


async def _get_range(store: GcsStore) -> Any:
    info = await store.head("k")
    return await store.get_range("k", 0, 4, info.etag)


async def _get_object(store: GcsStore) -> Any:
    return await store.get_object("k")


async def _list(store: GcsStore) -> Any:
    return await store.list_page("", None)


async def _put_object(store: GcsStore) -> Any:
    await store.put_object("new", b"data")


# -- the real server -------------------------------------------------------------


def test_a_missing_object_is_not_found_on_the_data_path(bucket: str) -> None:
    """obstore's 404 (FileNotFoundError)."""

    async def body(store: GcsStore) -> None:
        with pytest.raises(ObjectNotFound):
            await store.get_object("missing")
        with pytest.raises(ObjectNotFound):
            await store.get_range("missing", 0, 4, "1234")

    _run(bucket, body)


@pytest.mark.parametrize("key", ["a//b", "a/./b", "a/../b"])
def test_a_name_obstore_cannot_form_is_not_found(gcs_client: storage.Client, bucket: str, key: str) -> None:
    """obstore refuses empty, '.' and '..' segments before any request;
    the store says so instead of letting its ValueError out."""
    gcs_client.bucket(bucket).blob(f"p/{key}").upload_from_string(b"unreadable here")

    async def body(store: GcsStore) -> None:
        info = await store.head(key)
        with pytest.raises(ObjectNotFound, match="segment is not read"):
            await store.get_object(key)
        with pytest.raises(ObjectNotFound, match="segment is not read"):
            await store.get_range(key, 0, 4, info.etag)

    _run(bucket, body)


def test_a_missing_bucket_is_not_found_in_a_listing(gcs_emulator: GcsEmulator) -> None:
    """google-cloud-storage's 404 (NotFound)."""

    async def body(store: GcsStore) -> None:
        with pytest.raises(ObjectNotFound):
            await store.list_page("", None)

    _run(f"missing-{uuid.uuid4().hex[:12]}", body)


def test_an_unreachable_endpoint_fails_the_data_path_retryably(
    gcs_emulator: GcsEmulator, monkeypatch: pytest.MonkeyPatch, bucket: str
) -> None:
    """obstore's refused connection (GenericError). The store is made
    against the emulator (its HEAD answers) and its data client against the
    port that refuses."""
    port = free_port()

    async def body(store: GcsStore) -> None:
        info = await store.head("k")
        monkeypatch.setenv(EMULATOR_ENV, f"http://127.0.0.1:{port}")
        unreachable = _store(bucket)
        try:
            with pytest.raises(StoreError) as caught:
                await unreachable.get_object("k")
        finally:
            await unreachable.close()
        assert type(caught.value) is StoreError
        assert caught.value.retryable
        assert f"Google Cloud Storage at http://127.0.0.1:{port} failed" in str(caught.value)
        assert info.size == 10

    _run(bucket, body)


# -- statuses through the proxy -----------------------------------------------------


@pytest.mark.parametrize(
    ("status", "expected"),
    [(401, AccessDenied), (403, AccessDenied), (412, ObjectChanged), (429, StoreError), (500, StoreError)],
)
def test_a_data_get_answered_with_a_status(
    gcs_emulator: GcsEmulator,
    monkeypatch: pytest.MonkeyPatch,
    bucket: str,
    status: int,
    expected: type[StoreError],
) -> None:
    """obstore's UnauthenticatedError, PermissionDeniedError,
    PreconditionError, and GenericError for the rest."""

    async def body(store: GcsStore) -> StoreError:
        with pytest.raises(StoreError) as caught:
            await _get_range(store)
        return caught.value

    error = _through_proxy(gcs_emulator, monkeypatch, bucket, _answering(status, _is_data_get), body)
    assert type(error) is expected
    assert error.retryable == (expected is StoreError)
    assert "gs://" in str(error)


@pytest.mark.parametrize(
    ("status", "expected", "call"),
    [
        (403, AccessDenied, _list),
        (412, ObjectChanged, _put_object),
        (429, StoreError, _list),
        (503, StoreError, _list),
    ],
)
def test_a_json_api_call_answered_with_a_status_names_the_request(
    gcs_emulator: GcsEmulator,
    monkeypatch: pytest.MonkeyPatch,
    bucket: str,
    status: int,
    expected: type[StoreError],
    call: Body,
) -> None:
    """google-api-core's Forbidden, PreconditionFailed, and its other
    errors; GCS's request id in the message."""
    rule = _answering(status, lambda request: _is_listing(request) or _is_upload(request))

    async def body(store: GcsStore) -> StoreError:
        with pytest.raises(StoreError) as caught:
            await call(store)
        return caught.value

    error = _through_proxy(gcs_emulator, monkeypatch, bucket, rule, body)
    assert type(error) is expected
    assert f"HTTP {status}" in str(error)
    assert REQUEST_ID in str(error)


def test_a_json_api_call_answered_401_is_access_denied(
    gcs_emulator: GcsEmulator, monkeypatch: pytest.MonkeyPatch, bucket: str
) -> None:
    """The session answers a 401 by refreshing its credentials, which
    anonymous ones (the emulator's) refuse: google-auth's InvalidOperation,
    a DefaultCredentialsError. (Credentials that can refresh send the
    request again, and a second 401 is google-api-core's Unauthorized; no
    store made against an emulator has such credentials.)"""

    async def body(store: GcsStore) -> StoreError:
        with pytest.raises(StoreError) as caught:
            await _list(store)
        return caught.value

    error = _through_proxy(gcs_emulator, monkeypatch, bucket, _answering(401, _is_listing), body)
    assert type(error) is AccessDenied


def test_bytes_corrupted_in_a_resumable_upload_are_reported(
    gcs_emulator: GcsEmulator, monkeypatch: pytest.MonkeyPatch, bucket: str, tmp_path: Path
) -> None:
    """google-cloud-storage's DataCorruption: the checksum GCS computed is
    not the file's."""
    path = tmp_path / "upload.bin"
    path.write_bytes(os.urandom(RESUMABLE_BYTES))

    async def flip_a_byte(request: web.Request, body: bytes) -> Decision:
        if _is_upload(request) and request.method == "POST":
            # The upload's session URL, rewritten so its bytes pass here too.
            headers = {name: value for name, value in request.headers.items() if name.lower() != "host"}
            async with (
                aiohttp.ClientSession() as session,
                session.post(gcs_emulator.host + request.raw_path, headers=headers, data=body) as reply,
            ):
                location = reply.headers["Location"].replace(gcs_emulator.host, f"http://{request.host}")
                return web.Response(
                    status=reply.status, headers={"Location": location}, body=await reply.read()
                )
        if _is_upload(request) and request.method == "PUT" and body:
            return bytes([body[0] ^ 1]) + body[1:]
        return body

    async def upload(store: GcsStore) -> StoreError:
        with pytest.raises(StoreError) as caught:
            await store.put_file("uploaded", path)
        return caught.value

    error = _through_proxy(gcs_emulator, monkeypatch, bucket, flip_a_byte, upload)
    assert type(error) is UploadCorrupted


# -- credentials --------------------------------------------------------------------


def _service_account_file(tmp_path: Path, token_uri: str) -> Path:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()
    path = tmp_path / "service-account.json"
    path.write_text(
        json.dumps(
            {
                "type": "service_account",
                "project_id": "test",
                "private_key_id": "test",
                "private_key": pem,
                "client_email": "test@test.iam.gserviceaccount.com",
                "client_id": "1",
                "token_uri": token_uri,
            }
        )
    )
    return path


@pytest.fixture(name="no_emulator")
def fixture_no_emulator(monkeypatch: pytest.MonkeyPatch) -> None:
    """Google's default chain instead of the emulator; anything bound for
    Google itself goes to a proxy port that refuses, so nothing leaves."""
    monkeypatch.delenv(EMULATOR_ENV, raising=False)
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:1")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")


async def _token_endpoint(status: int) -> web.AppRunner:
    async def token(request: web.Request) -> web.Response:
        body = {"error": "invalid_grant", "error_description": "injected"}
        return web.Response(status=status, text=json.dumps(body), content_type="application/json")

    app = web.Application()
    app.router.add_post("/token", token)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner


def test_no_credentials_are_access_denied(
    no_emulator: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """google-auth's DefaultCredentialsError."""
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "absent.json"))

    async def body(store: GcsStore) -> None:
        with pytest.raises(AccessDenied, match="no usable Google credentials"):
            await store.get_object("k")

    _run("bkt", body)


@pytest.mark.parametrize("call", [_get_object, _list])
def test_a_refused_token_is_access_denied(
    no_emulator: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, call: Body
) -> None:
    """google-auth's RefreshError, on the data path and on a listing."""

    async def main() -> StoreError:
        runner = await _token_endpoint(400)
        port = runner.addresses[0][1]
        path = _service_account_file(tmp_path, f"http://127.0.0.1:{port}/token")
        monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(path))
        store = _store("bkt")
        try:
            with pytest.raises(StoreError) as caught:
                await asyncio.wait_for(call(store), CALL_TIMEOUT_SECONDS)
            return caught.value
        finally:
            await store.close()
            await runner.cleanup()

    assert type(asyncio.run(main())) is AccessDenied


def test_an_unreachable_token_endpoint_is_retryable(
    no_emulator: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """google-auth's TransportError."""
    path = _service_account_file(tmp_path, f"http://127.0.0.1:{free_port()}/token")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(path))

    async def body(store: GcsStore) -> None:
        with pytest.raises(StoreError) as caught:
            await store.get_object("k")
        assert type(caught.value) is StoreError
        assert caught.value.retryable

    _run("bkt", body)
