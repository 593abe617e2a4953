"""S3Store's uploads and copies when something goes wrong on the way: a part
the server refuses, a file that changes while it is read, bytes corrupted
in transit. The store talks to the moto server through a small HTTP proxy
that forwards every request and can refuse, hold or alter one; the store
itself is not mocked. A failed upload must leave the previous object as it
was and no unfinished multipart upload behind (``ListMultipartUploads``).
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from cachefsd.config import StoreSettings
from cachefsd.errors import ObjectNotFound, SourceChanged, StoreError, UploadCorrupted
from cachefsd.store.s3 import S3Store, UploadTuning, part_size_for
from cachefsd.store.source import part_ranges
from cachefsd.testing.s3_server import S3TestServer
from tests.proxy import Decision, Rule, through_proxy

ATTEMPT_TIMEOUT_SECONDS = 5.0
MIB = 1 << 20
# S3's smallest part (but the last): the smallest sizes a test can use.
SMALLEST_PART = 5 * MIB
TUNING = UploadTuning(part_size=SMALLEST_PART, single_copy_limit=SMALLEST_PART, copy_part_size=SMALLEST_PART)
THREE_PARTS = 2 * SMALLEST_PART + 1


def _is_part(request: web.Request, number: int) -> bool:
    return request.method == "PUT" and request.query.get("partNumber") == str(number)


def _internal_error() -> web.Response:
    body = b"<Error><Code>InternalError</Code><Message>injected</Message></Error>"
    return web.Response(status=500, body=body, content_type="application/xml")


def _upload_ids(s3_client: Any, bucket: str) -> list[str]:
    return [
        upload["UploadId"] for upload in s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads", ())
    ]


def _through_proxy(
    s3_server: S3TestServer, bucket: str, rule: Rule, body: Callable[[S3Store], Awaitable[Any]]
) -> Any:
    """Run ``body`` with a store of ``bucket`` whose requests pass the proxy."""

    def open_store(endpoint: str) -> S3Store:
        settings = StoreSettings(endpoint_url=endpoint, region="us-east-1")
        return S3Store(bucket, "p", settings, ATTEMPT_TIMEOUT_SECONDS, upload=TUNING)

    return through_proxy(s3_server.endpoint_url, rule, open_store, body)


@pytest.fixture(name="bucket")
def fixture_bucket(s3_client: Any) -> str:
    """A fresh bucket holding ``p/old`` (the version a failed write must leave)."""
    bucket = f"upload-{uuid.uuid4().hex[:12]}"
    s3_client.create_bucket(Bucket=bucket)
    s3_client.put_object(Bucket=bucket, Key="p/old", Body=b"the previous version")
    return bucket


async def _forward_all(request: web.Request, body: bytes) -> Decision:
    return body


def _file(tmp_path: Path, size: int) -> Path:
    path = tmp_path / "upload.bin"
    path.write_bytes(os.urandom(size))
    return path


@pytest.mark.parametrize("failing_part", [1, 3])
def test_a_refused_part_leaves_the_old_object_and_no_upload(
    s3_server: S3TestServer, s3_client: Any, bucket: str, tmp_path: Path, failing_part: int
) -> None:
    """Refused at every attempt: the first part, and the last (which
    obstore awaits while it completes the upload)."""
    path = _file(tmp_path, THREE_PARTS)

    async def refuse_one_part(request: web.Request, body: bytes) -> Decision:
        return _internal_error() if _is_part(request, failing_part) else body

    async def upload(store: S3Store) -> None:
        with pytest.raises(StoreError) as caught:
            await store.put_file("old", path)
        assert caught.value.retryable

    _through_proxy(s3_server, bucket, refuse_one_part, upload)

    assert s3_client.get_object(Bucket=bucket, Key="p/old")["Body"].read() == b"the previous version"
    assert _upload_ids(s3_client, bucket) == []


def test_a_part_refused_once_is_sent_again(
    s3_server: S3TestServer, s3_client: Any, bucket: str, tmp_path: Path
) -> None:
    """S3 answers some requests 503 SlowDown as a matter of course: a part
    is retried, not the whole upload."""
    path = _file(tmp_path, THREE_PARTS)
    refused: list[str] = []

    async def refuse_part_two_once(request: web.Request, body: bytes) -> Decision:
        if _is_part(request, 2) and not refused:
            refused.append(request.raw_path)
            return _internal_error()
        return body

    async def upload(store: S3Store) -> Any:
        return await store.put_file("old", path)

    written = _through_proxy(s3_server, bucket, refuse_part_two_once, upload)

    assert len(refused) == 1
    assert written.etag.endswith("-3")
    assert s3_client.get_object(Bucket=bucket, Key="p/old")["Body"].read() == path.read_bytes()


def test_a_cancelled_upload_leaves_the_old_object_and_no_upload(
    s3_server: S3TestServer, s3_client: Any, bucket: str, tmp_path: Path
) -> None:
    """Cancelled (a deadline, the daemon stopping) while a part is in flight."""
    path = _file(tmp_path, THREE_PARTS)
    arrived, released = asyncio.Event(), asyncio.Event()

    async def hold_part_two(request: web.Request, body: bytes) -> Decision:
        if _is_part(request, 2):
            arrived.set()
            await released.wait()
            return _internal_error()
        return body

    async def upload(store: S3Store) -> None:
        task = asyncio.ensure_future(store.put_file("old", path))
        await arrived.wait()
        task.cancel()
        try:
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            released.set()

    _through_proxy(s3_server, bucket, hold_part_two, upload)

    assert s3_client.get_object(Bucket=bucket, Key="p/old")["Body"].read() == b"the previous version"
    assert _upload_ids(s3_client, bucket) == []


def test_a_file_changed_while_it_uploads_is_not_published(
    s3_server: S3TestServer, s3_client: Any, bucket: str, tmp_path: Path
) -> None:
    """The file grows once the upload has begun (it was opened, the upload
    created, none of it read yet): the bytes read no longer are the file."""
    path = _file(tmp_path, THREE_PARTS)

    async def append_when_created(request: web.Request, body: bytes) -> Decision:
        if request.method == "POST" and "uploads" in request.query:
            with path.open("ab") as file:
                file.write(b"more")
        return body

    async def upload(store: S3Store) -> None:
        with pytest.raises(SourceChanged):
            await store.put_file("old", path)

    _through_proxy(s3_server, bucket, append_when_created, upload)

    assert s3_client.get_object(Bucket=bucket, Key="p/old")["Body"].read() == b"the previous version"
    assert _upload_ids(s3_client, bucket) == []


@pytest.mark.parametrize("size", [1000, THREE_PARTS], ids=["one-put", "three-parts"])
def test_bytes_corrupted_in_transit_are_reported(
    s3_server: S3TestServer, s3_client: Any, bucket: str, tmp_path: Path, size: int
) -> None:
    """moto checks no body (not the signed SHA-256, nor Content-MD5 or
    x-amz-checksum-*), so the corrupted bytes are stored; the etag they
    get is not the file's, and the upload fails."""
    path = _file(tmp_path, size)

    async def flip_a_byte(request: web.Request, body: bytes) -> Decision:
        if request.method == "PUT" and body:
            return bytes([body[0] ^ 0xFF]) + body[1:]
        return body

    async def upload(store: S3Store) -> None:
        with pytest.raises(UploadCorrupted) as caught:
            await store.put_file("new", path)
        assert caught.value.retryable

    _through_proxy(s3_server, bucket, flip_a_byte, upload)


def test_an_object_over_the_single_copy_limit_is_copied_in_parts(
    s3_server: S3TestServer, s3_client: Any, bucket: str
) -> None:
    data = os.urandom(THREE_PARTS)
    s3_client.put_object(Bucket=bucket, Key="p/big", Body=data)

    async def copy(store: S3Store) -> tuple[Any, Any]:
        return await store.copy("big", "copied"), await store.head("copied")

    copied, headed = _through_proxy(s3_server, bucket, _forward_all, copy)

    assert copied == headed
    assert copied.etag.endswith("-3")
    assert s3_client.get_object(Bucket=bucket, Key="p/copied")["Body"].read() == data


def test_a_refused_part_copy_leaves_no_object_and_no_upload(
    s3_server: S3TestServer, s3_client: Any, bucket: str
) -> None:
    s3_client.put_object(Bucket=bucket, Key="p/big", Body=os.urandom(THREE_PARTS))

    async def refuse_part_two(request: web.Request, body: bytes) -> Decision:
        return _internal_error() if _is_part(request, 2) else body

    async def copy(store: S3Store) -> None:
        with pytest.raises(StoreError):
            await store.copy("big", "copied")
        with pytest.raises(ObjectNotFound):
            await store.head("copied")

    _through_proxy(s3_server, bucket, refuse_part_two, copy)

    assert _upload_ids(s3_client, bucket) == []


@pytest.mark.parametrize(
    ("size", "minimum", "expected"),
    [(0, 8 * MIB, 8 * MIB), (80_000 * MIB, 8 * MIB, 8 * MIB), (80_000 * MIB + 1, 8 * MIB, 9 * MIB)],
)
def test_parts_grow_past_ten_thousand(size: int, minimum: int, expected: int) -> None:
    """S3 takes at most 10,000 parts: a larger file gets larger parts."""
    assert part_size_for(size, minimum) == expected


def test_part_ranges_cover_the_object() -> None:
    assert part_ranges(11, 5) == [(0, 5), (5, 10), (10, 11)]
    assert part_ranges(10, 5) == [(0, 5), (5, 10)]
    assert part_ranges(0, 5) == []
