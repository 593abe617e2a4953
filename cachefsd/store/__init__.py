"""Cold stores behind one small async Protocol (``base.ObjectStore``), and
the one place a SOURCE string becomes a store."""

from __future__ import annotations

import os
import re
from pathlib import Path

from cachefsd.config import FetchSettings, StoreSettings
from cachefsd.errors import ConfigError
from cachefsd.store.azure_location import is_azure_source, parse_source
from cachefsd.store.base import Credentials, ObjectStore
from cachefsd.store.local import LocalStore

# Bucket names as the services have allowed them: letters, digits, dots,
# dashes and underscores, 3 to 255 characters. Today's rules are stricter
# (lowercase, at most 63, or 222 for dotted GCS names), but legacy S3
# buckets in us-east-1 may have capitals, underscores and 255 characters,
# and the service, not us, says whether a bucket exists.
_BUCKET = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{1,253}[A-Za-z0-9]$")


def open_store(
    source: str,
    settings: StoreSettings,
    fetch: FetchSettings,
    credentials: Credentials | None = None,
    writable: bool = False,
) -> ObjectStore:
    """The store for ``s3://bucket[/prefix]``, ``gs://bucket[/prefix]``,
    an Azure container (``az://container[/prefix]`` and the other forms
    ``azure.parse_source`` reads), ``file:///dir`` or ``/dir``, each
    attempt of a request cut at ``fetch.attempt_timeout``; ``ConfigError``
    naming ``source`` otherwise. An S3 store signs with ``credentials`` if
    given; ``writable`` for a store that is written to (GCS then asks for a
    token that may write)."""
    if is_azure_source(source):
        from cachefsd.store.azure import AzureStore  # noqa: PLC0415 - load an SDK only when used

        location = parse_source(source, settings.endpoint_url, os.environ)
        return AzureStore(location, fetch.attempt_timeout, settings.connect_timeout, settings.max_connections)
    scheme, sep, rest = source.partition("://")
    if sep and scheme in ("s3", "gs"):
        bucket, _, prefix = rest.partition("/")
        if not _BUCKET.match(bucket):
            raise ConfigError(f"source: invalid bucket name {bucket!r} in {source!r}")
        if scheme == "s3":
            from cachefsd.store.s3 import S3Store  # noqa: PLC0415 - load an SDK only when used

            return S3Store(bucket, prefix.strip("/"), settings, fetch.attempt_timeout, credentials)
        from cachefsd.store.gcs import GcsStore  # noqa: PLC0415 - load an SDK only when used

        return GcsStore(bucket, prefix.strip("/"), fetch.attempt_timeout, fetch.concurrency, writable)
    if sep and scheme != "file":
        raise ConfigError(
            f"source: unsupported scheme {scheme!r}: use s3://, gs://, az://, file:// or a directory"
        )
    path = Path(rest if sep else source).expanduser()
    if not path.is_dir():
        raise ConfigError(f"source: {path} is not a directory")
    return LocalStore(path)
