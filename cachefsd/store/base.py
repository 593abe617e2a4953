"""The seam between cachefsd and a bucket.

Every cold store (S3, GCS, a local directory, the in-memory and fault
injecting fakes) implements ``ObjectStore``. Keys are relative to the
store's root (the bucket prefix or the directory), use ``/`` as separator and
are passed through unvalidated: deciding which keys may become paths is the
namespace's job, not the store's.

Errors leave a store only as ``cachefsd.errors.StoreError`` subclasses, with
the backend's own exception as ``__cause__``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol
from urllib.parse import urlsplit


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """One version of one object. ``etag`` identifies the bytes: a changed
    object has a new etag, and cached blocks are only ever found through it."""

    key: str
    size: int
    etag: str
    mtime: float


@dataclass(frozen=True, slots=True)
class Listing:
    """One level of a delimiter listing under a prefix ending in ``/`` (or ``""``).

    ``objects`` holds the objects directly under the prefix (the marker object
    equal to the prefix itself included, if any); ``prefixes`` the full common
    prefixes one level down, each ending in ``/``.
    """

    objects: tuple[ObjectInfo, ...]
    prefixes: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ListingPage:
    """One page of a listing, and the token of the next (None after the last)."""

    listing: Listing
    next_token: str | None


@dataclass(frozen=True, slots=True)
class Credentials:
    """Keys a store signs with instead of its client's own chain (the shared
    tier's, which may differ from the origin's). Never shown: only the key
    id is in the repr."""

    access_key_id: str
    secret_access_key: str = field(repr=False)
    session_token: str | None = field(default=None, repr=False)


class ObjectStore(Protocol):
    """What cachefsd needs from a bucket. All methods are coroutines run on
    the daemon's event loop thread."""

    @property
    def uri(self) -> str:
        """The source as users name it (``s3://bucket/prefix``), for display."""
        ...

    @property
    def cache_key(self) -> str:
        """What the cache keys listings and blocks by: the ``uri``, plus
        the endpoint when one is configured, since a bucket named ``data``
        on a MinIO and on an emulator are two buckets."""
        ...

    @property
    def content_etags(self) -> bool:
        """True when equal etags (with equal sizes) mean equal bytes across
        objects and buckets, so cached blocks can be shared without a GET."""
        ...

    async def check(self) -> bool:
        """Prove the source exists and the credentials work, or raise
        ``ObjectNotFound`` / ``AccessDenied`` / ``StoreError`` quickly;
        whether it holds anything (a mistyped prefix holds nothing)."""
        ...

    async def list_page(self, prefix: str, token: str | None) -> ListingPage:
        """One page of the entries one level under ``prefix``: the first
        when ``token`` is None, else the one ``token`` names. A page is one
        request, so the caller bounds and retries pages, not a whole
        listing: a directory of 100k keys is 100 pages, which may together
        take longer than any one request may."""
        ...

    async def head(self, key: str) -> ObjectInfo:
        """The current version of ``key``; ``ObjectNotFound`` if absent."""
        ...

    async def get_range(self, key: str, start: int, end: int, etag: str) -> bytes | bytearray:
        """Bytes ``[start, end)`` of the version ``etag`` of ``key``, in one
        buffer: the reader asks for a block at a time (at most 64 MiB).

        Raises ``ObjectChanged`` when the object's current version is not
        ``etag``: a store never returns bytes of another version. May return
        fewer bytes only when ``end`` is past the end of the object."""
        ...

    async def get_object(self, key: str) -> bytes:
        """The whole current content of ``key`` (a small object: a block or
        a mapping of the shared tier); ``ObjectNotFound`` if absent."""
        ...

    async def put_object(self, key: str, data: bytes) -> None:
        """Store ``data`` as ``key``, replacing any object there; readers
        see the old content or the new, never a part."""
        ...

    async def put_file(self, key: str, path: Path) -> ObjectInfo:
        """Upload the file at ``path`` as ``key``, replacing any object
        there, whole or not at all: readers see the old object or the whole
        new one, and a failed upload leaves nothing behind (no object, no
        unfinished multipart upload). The new version's ``ObjectInfo`` as
        ``head`` shows it. The bytes the store holds are checked against the
        file's (``UploadCorrupted``); ``SourceChanged`` when the file changes
        while it is read, ``SourceUnreadable`` when it cannot be read."""
        ...

    async def delete(self, key: str) -> None:
        """Remove ``key``; an absent key is not an error."""
        ...

    async def copy(self, source: str, target: str) -> ObjectInfo:
        """Copy ``source`` to ``target`` inside the store (no bytes pass
        through this process where the store can copy itself), replacing
        any object there, whole or not at all; the new version's
        ``ObjectInfo``. ``ObjectNotFound`` if ``source`` is absent."""
        ...

    async def close(self) -> None:
        """Release connections. The store is not used afterwards."""
        ...


def redact_url(url: str) -> str:
    """``[scheme://]host[:port][/path]`` of an endpoint URL, to name it in a
    message or a cache key: a URL may carry user info (and a query), and
    the path names a gateway's bucket namespace. Never raises: a malformed
    port is left out."""
    scheme, separator, _ = url.partition("://")
    parts = urlsplit(url if separator else f"//{url}")
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    try:
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        port = ""
    prefix = f"{scheme}://" if separator else ""
    return f"{prefix}{host}{port}{parts.path.rstrip('/')}"
