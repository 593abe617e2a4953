"""An in-memory bucket for unit tests and benchmarks of the layers above the store."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from pathlib import Path

from cachefsd.errors import ObjectChanged, ObjectNotFound
from cachefsd.store.base import Listing, ListingPage, ObjectInfo
from cachefsd.store.listing import one_level
from cachefsd.store.source import SourceFile


class MemoryStore:
    """A dict of key -> bytes. Safe to mutate from a test thread while the
    daemon reads it; the etag is the content's MD5, as for S3 single-part uploads.
    """

    def __init__(
        self,
        objects: dict[str, bytes] | None = None,
        uri: str = "memory://test",
        page_size: int | None = None,
    ) -> None:
        """``page_size`` objects a listing page, as a bucket pages them (the
        prefixes come with the last page); one page for all when None."""
        self._uri = uri
        self._page_size = page_size
        self._lock = threading.Lock()
        self._objects: dict[str, tuple[ObjectInfo, bytes]] = {}
        self.get_count = 0
        self.list_count = 0
        for key, data in (objects or {}).items():
            self.put(key, data)

    @property
    def uri(self) -> str:
        return self._uri

    @property
    def cache_key(self) -> str:
        return self._uri

    @property
    def content_etags(self) -> bool:
        return True  # the etag is the content's MD5

    def put(self, key: str, data: bytes) -> ObjectInfo:
        info = ObjectInfo(key=key, size=len(data), etag=hashlib.md5(data).hexdigest(), mtime=time.time())
        with self._lock:
            self._objects[key] = (info, bytes(data))
        return info

    def get(self, key: str) -> bytes | None:
        """``key``'s bytes (None if absent), as a test checks what was written."""
        with self._lock:
            entry = self._objects.get(key)
        return None if entry is None else entry[1]

    def keys(self) -> list[str]:
        with self._lock:
            return sorted(self._objects)

    def remove(self, key: str) -> None:
        """Remove ``key``, which must exist: a test's change behind the daemon's back."""
        with self._lock:
            del self._objects[key]

    async def check(self) -> bool:
        with self._lock:
            return bool(self._objects)

    async def list_page(self, prefix: str, token: str | None) -> ListingPage:
        with self._lock:
            self.list_count += 1
            infos = [info for info, _ in self._objects.values()]
        listing = one_level(prefix, infos)
        if self._page_size is None:
            return ListingPage(listing, None)
        start = int(token or 0)
        end = start + self._page_size
        if end >= len(listing.objects):
            return ListingPage(Listing(listing.objects[start:], listing.prefixes), None)
        return ListingPage(Listing(listing.objects[start:end], ()), str(end))

    async def head(self, key: str) -> ObjectInfo:
        with self._lock:
            entry = self._objects.get(key)
        if entry is None:
            raise ObjectNotFound(key)
        return entry[0]

    async def get_range(self, key: str, start: int, end: int, etag: str) -> bytes:
        with self._lock:
            self.get_count += 1
            entry = self._objects.get(key)
        if entry is None:
            raise ObjectNotFound(key)
        info, data = entry
        if info.etag != etag:
            raise ObjectChanged(key)
        return data[start:end]

    async def get_object(self, key: str) -> bytes:
        with self._lock:
            self.get_count += 1
            entry = self._objects.get(key)
        if entry is None:
            raise ObjectNotFound(key)
        return entry[1]

    async def put_object(self, key: str, data: bytes) -> None:
        self.put(key, data)

    async def put_file(self, key: str, path: Path) -> ObjectInfo:
        return self.put(key, await asyncio.to_thread(_read_whole, path))

    async def delete(self, key: str) -> None:
        with self._lock:
            self._objects.pop(key, None)

    async def copy(self, source: str, target: str) -> ObjectInfo:
        return self.put(target, await self.get_object(source))

    async def close(self) -> None:
        return None


def _read_whole(path: Path) -> bytes:
    source = SourceFile(path)
    try:
        data = source.read(0, source.size)
        source.check_unchanged()
        return data
    finally:
        source.close()
