"""What a writable mount does in the bucket while a process waits: the
DELETE of an unlink, the copy of a rename. Each is one request, retried
within the fetch deadline like a listing (``fetch.Fetcher.call``); a copy,
which the store makes server-side at its own speed, is given the time its
bytes take at the upload floor besides."""

from __future__ import annotations

import functools

from cachefsd.aio import LoopThread
from cachefsd.fetch import Fetcher
from cachefsd.namespace.tree import BRIDGE_MARGIN_SECONDS
from cachefsd.store.base import ObjectInfo, ObjectStore
from cachefsd.writes.uploads import FLOOR_BYTES_PER_SECOND


class Bucket:
    """``fs.Bucket`` over a store."""

    def __init__(self, store: ObjectStore, fetcher: Fetcher, io: LoopThread) -> None:
        self._store = store
        self._fetcher = fetcher
        self._io = io

    def delete(self, key: str) -> None:
        request = self._fetcher.call(f"delete {key}", functools.partial(self._store.delete, key), "metadata")
        self._io.run(request, self._fetcher.deadline + BRIDGE_MARGIN_SECONDS)

    def copy(self, source: str, target: str, size: int) -> ObjectInfo:
        timeout = self._fetcher.deadline + size / FLOOR_BYTES_PER_SECOND
        return self._io.run(self._store.copy(source, target), timeout)
