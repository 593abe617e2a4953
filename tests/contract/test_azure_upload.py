"""AzureStore's uploads when something goes wrong on the way: a block the
service refuses, a file that changes while it is read, bytes corrupted in
transit. The store talks to Azurite through the proxy of
``test_s3_upload`` (which forwards every request and can refuse or alter
one); the store itself is not mocked. A failed upload must leave the
previous blob as it was.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from azure.storage.blob import BlobServiceClient, ContainerClient

from cachefsd.errors import SourceChanged, StoreError, UploadCorrupted
from cachefsd.store.azure import AzureStore, AzureTuning
from cachefsd.store.azure_location import AzureLocation
from cachefsd.testing.azurite import ACCOUNT, Azurite
from tests.proxy import Decision, Rule, through_proxy

ATTEMPT_TIMEOUT_SECONDS = 5.0
CONNECT_TIMEOUT_SECONDS = 2.0
MAX_CONNECTIONS = 8
MIB = 1 << 20
# Blocks of 1 MiB: a 2.5 MiB file is three.
TUNING = AzureTuning(block_size=MIB, blocks_in_flight=2)
THREE_BLOCKS = 2 * MIB + MIB // 2
PREVIOUS = b"the previous version"


def _through_proxy(
    azurite: Azurite, container: str, rule: Rule, body: Callable[[AzureStore], Awaitable[Any]]
) -> Any:
    """Run ``body`` with a store of ``container`` whose requests pass the proxy."""

    def open_store(endpoint: str) -> AzureStore:
        location = AzureLocation(ACCOUNT, container, "p", f"{endpoint}/{ACCOUNT}")
        return AzureStore(location, ATTEMPT_TIMEOUT_SECONDS, CONNECT_TIMEOUT_SECONDS, MAX_CONNECTIONS, TUNING)

    return through_proxy(azurite.endpoint_url.removesuffix(f"/{ACCOUNT}"), rule, open_store, body)


@pytest.fixture(name="container")
def fixture_container(azure_client: BlobServiceClient) -> ContainerClient:
    """A fresh container holding ``p/old`` (the version a failed write must leave)."""
    container = azure_client.create_container(f"upload-{uuid.uuid4().hex[:12]}")
    container.upload_blob("p/old", PREVIOUS)
    return container


def _file(tmp_path: Path, size: int) -> Path:
    path = tmp_path / "upload.bin"
    path.write_bytes(os.urandom(size))
    return path


def _is_block(request: web.Request) -> bool:
    return request.method == "PUT" and request.query.get("comp") == "block"


def _previous(container: ContainerClient) -> bytes:
    data: bytes = container.download_blob("p/old").readall()
    return data


def test_a_refused_block_leaves_the_old_blob(
    azurite: Azurite, container: ContainerClient, tmp_path: Path
) -> None:
    path = _file(tmp_path, THREE_BLOCKS)

    async def refuse_blocks(request: web.Request, body: bytes) -> Decision:
        if _is_block(request):
            body = b"<Error><Code>InternalError</Code><Message>injected</Message></Error>"
            return web.Response(status=500, body=body, content_type="application/xml")
        return body

    async def upload(store: AzureStore) -> None:
        with pytest.raises(StoreError) as caught:
            await store.put_file("old", path)
        assert caught.value.retryable

    _through_proxy(azurite, container.container_name, refuse_blocks, upload)

    assert _previous(container) == PREVIOUS


def test_a_block_refused_once_is_sent_again(
    azurite: Azurite, container: ContainerClient, tmp_path: Path
) -> None:
    path = _file(tmp_path, THREE_BLOCKS)
    refused: list[str] = []

    async def refuse_one_block_once(request: web.Request, body: bytes) -> Decision:
        if _is_block(request) and not refused:
            refused.append(request.query["blockid"])
            return web.Response(status=503, body=b"<Error><Code>ServerBusy</Code></Error>")
        return body

    async def upload(store: AzureStore) -> Any:
        return await store.put_file("old", path)

    written = _through_proxy(azurite, container.container_name, refuse_one_block_once, upload)

    assert refused
    assert written.size == THREE_BLOCKS
    assert container.download_blob("p/old").readall() == path.read_bytes()


def test_a_file_changed_while_it_uploads_is_not_published(
    azurite: Azurite, container: ContainerClient, tmp_path: Path
) -> None:
    path = _file(tmp_path, THREE_BLOCKS)

    async def append_at_the_first_block(request: web.Request, body: bytes) -> Decision:
        if _is_block(request):
            with path.open("ab") as file:
                file.write(b"more")
        return body

    async def upload(store: AzureStore) -> None:
        with pytest.raises(SourceChanged):
            await store.put_file("old", path)

    _through_proxy(azurite, container.container_name, append_at_the_first_block, upload)

    assert _previous(container) == PREVIOUS


def test_bytes_corrupted_in_transit_are_reported(
    azurite: Azurite, container: ContainerClient, tmp_path: Path
) -> None:
    """obstore sends no Content-MD5, so the service stores the corrupted
    bytes; the MD5 it computes of them is not the file's, and the upload
    fails (a file of one Put Blob: see the module docstring of store.azure
    for blocks)."""
    path = _file(tmp_path, 1000)

    async def flip_a_byte(request: web.Request, body: bytes) -> Decision:
        if request.method == "PUT" and body:
            return bytes([body[0] ^ 0xFF]) + body[1:]
        return body

    async def upload(store: AzureStore) -> None:
        with pytest.raises(UploadCorrupted) as caught:
            await store.put_file("new", path)
        assert caught.value.retryable

    _through_proxy(azurite, container.container_name, flip_a_byte, upload)
