"""Shared fixtures: real servers (moto S3 over HTTP, the GCS emulator,
Azurite) and
clients to seed them. Session-scoped: starting them is the slow part, and
tests isolate themselves by bucket or key instead.

The environment is pinned at import time, before any boto or google client
exists: dummy AWS credentials (moto accepts any), and no instance-metadata
probes, which would otherwise wait on the network whenever a credential
chain comes up empty (Azure's managed identity is pointed at a closed
local port).
"""

from __future__ import annotations

import os

os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
os.environ.setdefault("NO_GCE_CHECK", "true")
os.environ.setdefault("GCE_METADATA_HOST", "127.0.0.1:1")
os.environ.setdefault("AZURE_POD_IDENTITY_AUTHORITY_HOST", "http://127.0.0.1:1")

from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from azure.storage.blob import BlobServiceClient
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

from cachefsd.config import StoreSettings
from cachefsd.store.gcs import EMULATOR_ENV
from cachefsd.testing.azurite import ACCOUNT, ACCOUNT_KEY, Azurite
from cachefsd.testing.file_s3 import FileS3Server
from cachefsd.testing.gcs_emulator import GcsEmulator
from cachefsd.testing.s3_server import S3TestServer

# The region moto buckets are created in and clients are configured for.
TEST_REGION = "us-east-1"
# Where AzureStore takes an account key from.
KEY_ENV = "AZURE_STORAGE_ACCOUNT_KEY"
# Short enough that a test of an unreachable endpoint finishes in seconds.
TEST_CONNECT_TIMEOUT = 2.0


@pytest.fixture(name="s3_server", scope="session")
def fixture_s3_server() -> Iterator[S3TestServer]:
    """moto S3 on 127.0.0.1 (random port), shared by the session. Create a
    bucket per test module or test; call ``reset_counts()`` before counting."""
    server = S3TestServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture(name="s3_settings", scope="session")
def fixture_s3_settings(s3_server: S3TestServer) -> StoreSettings:
    """Store settings pointing at ``s3_server``."""
    return StoreSettings(
        endpoint_url=s3_server.endpoint_url,
        region=TEST_REGION,
        connect_timeout=TEST_CONNECT_TIMEOUT,
    )


@pytest.fixture(name="s3_client", scope="session")
def fixture_s3_client(s3_server: S3TestServer) -> Any:
    """A plain boto3 client on ``s3_server``, for seeding and mutating buckets."""
    return boto3.client("s3", endpoint_url=s3_server.endpoint_url, region_name=TEST_REGION)


@pytest.fixture(name="file_s3_server", scope="session")
def fixture_file_s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FileS3Server]:
    """The file-backed S3 endpoint on 127.0.0.1 (random port), shared by the
    session, its objects under the session's temporary directory."""
    server = FileS3Server(tmp_path_factory.mktemp("file-s3"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(name="file_s3_client", scope="session")
def fixture_file_s3_client(file_s3_server: FileS3Server) -> Any:
    """A plain boto3 client on ``file_s3_server``."""
    return boto3.client("s3", endpoint_url=file_s3_server.endpoint_url, region_name=TEST_REGION)


@pytest.fixture(name="gcs_emulator", scope="session")
def fixture_gcs_emulator() -> Iterator[GcsEmulator]:
    """fake-gcs-server on 127.0.0.1, with ``STORAGE_EMULATOR_HOST`` set for the
    session so every google-cloud-storage client (``GcsStore`` included) uses it."""
    emulator = GcsEmulator()
    emulator.start()
    previous = os.environ.get(EMULATOR_ENV)
    os.environ[EMULATOR_ENV] = emulator.host
    yield emulator
    if previous is None:
        os.environ.pop(EMULATOR_ENV, None)
    else:
        os.environ[EMULATOR_ENV] = previous
    emulator.stop()


@pytest.fixture(name="gcs_client", scope="session")
def fixture_gcs_client(gcs_emulator: GcsEmulator) -> storage.Client:
    """A google-cloud-storage client on ``gcs_emulator``, for seeding buckets."""
    return storage.Client(project="test", credentials=AnonymousCredentials())


@pytest.fixture(name="azurite", scope="session")
def fixture_azurite() -> Iterator[Azurite]:
    """Azurite's Blob service on 127.0.0.1 (a free port, in memory), shared
    by the session, with its account's key in ``AZURE_STORAGE_ACCOUNT_KEY``
    for the session, so that every ``AzureStore`` signs with it. Its
    account is ``devstoreaccount1``; create a container per test module or test."""
    server = Azurite()
    server.start()
    previous = os.environ.get(KEY_ENV)
    os.environ[KEY_ENV] = ACCOUNT_KEY
    try:
        yield server
    finally:
        if previous is None:
            os.environ.pop(KEY_ENV, None)
        else:
            os.environ[KEY_ENV] = previous
        server.stop()


@pytest.fixture(name="azure_client", scope="session")
def fixture_azure_client(azurite: Azurite) -> Iterator[BlobServiceClient]:
    """A plain azure-storage-blob client on ``azurite``, for seeding containers."""
    client = BlobServiceClient(
        azurite.endpoint_url, credential={"account_name": ACCOUNT, "account_key": ACCOUNT_KEY}
    )
    try:
        yield client
    finally:
        client.close()
