"""The shared tier: blocks in a bucket every node's daemon reads below its
local tiers and above the origin, and fills after an origin fetch.

Layout under the shared URL's prefix (an S3-compatible bucket, or GCS; any
store ``obstore`` opens from a URL):

- ``blocks/<hash>``: one block, named by its content hash, as a frame of
  ``SHARED_HEADER`` (magic ``CFSS``, format version, block size, content
  length) followed by the cache's own frame (``codec.encode``: its header
  carries the hash again). A block is the same bytes whatever object holds
  it, so the tier is deduplicated across objects, versions and nodes.
- ``maps/<block size>/<sha256 of source, key, etag>``: which block hashes
  make up one object version, as JSON (``{"source", "key", "etag", "size",
  "block_size", "blocks": {index: hash}}``), written once the blocks are.

Nothing read there is trusted by its name: a mapping whose source, key,
etag, size or block size differ from the version asked for is ignored, and
a block is served only if its header matches (magic, version, block size,
length) and its content hashes to the name the mapping gave. Anything else
(missing, corrupt, another format, an error, a timeout) is a miss: the
reader goes to the origin. The daemon never deletes there; a lifecycle rule
on the prefix does.

Writes go on a bounded queue to one writer thread: an origin fetch never
waits for them, and when the queue is full a write is dropped (counted).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import queue
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import obstore
from obstore.store import GCSStore, S3Store

if TYPE_CHECKING:
    from obstore.store import ClientConfig, RetryConfig

from cachefsd.aio import LoopThread
from cachefsd.cache.codec import CorruptBlock, decode, encode
from cachefsd.errors import CachefsdError
from cachefsd.store.s3 import DEFAULT_REGION

# The stores a shared tier can be in.
Obstore = S3Store | GCSStore

log = logging.getLogger(__name__)

SHARED_MAGIC = b"CFSS"
SHARED_FORMAT_VERSION = 1
SHARED_HEADER = struct.Struct(">4sB3xII")  # magic, version, padding, block size, content length
# Mappings of the object versions read lately: a reader's every block asks.
MAPPINGS_REMEMBERED = 4096
# Writes waiting for the writer: a node that outruns the shared bucket drops
# the rest rather than hold their blocks in memory.
WRITE_QUEUE_BLOCKS = 256
# A request to the shared tier that takes longer is a miss: the origin then
# serves the read, so a slow shared bucket costs at most this.
REQUEST_SECONDS = 10.0


class SharedEvents(Protocol):
    def fetch_done(self, kind: Any, seconds: float, nbytes: int) -> None: ...
    def shared_written(self, ok: bool) -> None: ...
    def block_corrupt(self, tier: str) -> None: ...


def pack(content: bytes | bytearray, digest: str, block_size: int) -> bytes:
    """A block as the shared tier stores it."""
    return SHARED_HEADER.pack(SHARED_MAGIC, SHARED_FORMAT_VERSION, block_size, len(content)) + bytes(
        encode(content, digest=digest)
    )


def unpack(blob: bytes, digest: str, block_size: int) -> bytes:
    """The content of a stored block that is block ``digest`` of a cache of
    ``block_size`` blocks; ``CorruptBlock`` for anything else."""
    if len(blob) < SHARED_HEADER.size:
        raise CorruptBlock(f"shared block {digest}: {len(blob)} bytes, shorter than its header")
    magic, version, size, length = SHARED_HEADER.unpack_from(blob)
    if magic != SHARED_MAGIC or version != SHARED_FORMAT_VERSION:
        raise CorruptBlock(f"shared block {digest}: not a format {SHARED_FORMAT_VERSION} block")
    if size != block_size:
        raise CorruptBlock(f"shared block {digest}: of {size}-byte blocks, not {block_size}")
    content = decode(blob[SHARED_HEADER.size :], digest)  # checks the length and the hash
    if len(content) != length:
        raise CorruptBlock(f"shared block {digest}: {len(content)} bytes, its header says {length}")
    return content


def mapping_path(source: str, key: str, etag: str, block_size: int) -> str:
    name = hashlib.sha256("\0".join((source, key, etag)).encode()).hexdigest()
    return f"maps/{block_size}/{name}"


class SharedTier:
    """The shared tier of one node: verified reads, queued writes."""

    def __init__(
        self,
        store: Obstore,
        io: LoopThread,
        block_size: int,
        events: SharedEvents,
        clock: Callable[[], float],
    ) -> None:
        self._store = store
        self._io = io
        self._block_size = block_size
        self._events = events
        self._clock = clock
        self._lock = threading.Lock()
        self._mappings: OrderedDict[str, tuple[int, dict[int, str]]] = OrderedDict()  # path -> (size, blocks)
        self._writes: queue.Queue[tuple[str, str, str, int, dict[int, tuple[str, bytes]]] | None]
        self._writes = queue.Queue(WRITE_QUEUE_BLOCKS)
        self._writer = threading.Thread(target=self._write_all, name="cachefsd-shared", daemon=True)
        self._writer.start()

    def close(self) -> None:
        """Stop the writer once the writes queued are done (or dropped)."""
        self._writes.put(None)
        self._writer.join(REQUEST_SECONDS)

    def fetch(self, source: str, key: str, etag: str, size: int, indices: list[int]) -> dict[int, bytes]:
        """The verified contents of those of ``indices`` the shared tier
        holds for version (``key``, ``etag``) of ``source``; a block it does
        not have, or has wrong, is left out (the origin's then)."""
        mapping = self._mapping(source, key, etag, size)
        found: dict[int, bytes] = {}
        for index in indices:
            digest = mapping.get(index)
            if digest is None:
                continue
            started = self._clock()
            blob = self._get(f"blocks/{digest}")
            if blob is None:
                continue
            try:
                found[index] = unpack(blob, digest, self._block_size)
            except CorruptBlock as exc:
                log.warning("shared tier: %s; read from the origin instead", exc)
                self._events.block_corrupt("shared")
                continue
            self._events.fetch_done("shared", self._clock() - started, len(found[index]))
        return found

    def store_later(
        self, source: str, key: str, etag: str, size: int, blocks: dict[int, tuple[str, bytes]]
    ) -> None:
        """Queue blocks fetched from the origin (index -> hash, content) for the shared tier."""
        if not blocks:
            return
        try:
            self._writes.put_nowait((source, key, etag, size, blocks))
        except queue.Full:
            self._events.shared_written(False)

    def _mapping(self, source: str, key: str, etag: str, size: int) -> dict[int, str]:
        path = mapping_path(source, key, etag, self._block_size)
        with self._lock:
            known = self._mappings.get(path)
            if known is not None and known[0] == size:
                self._mappings.move_to_end(path)
                return known[1]
        blob = self._get(path)
        mapping = {} if blob is None else self._parsed(blob, source, key, etag, size)
        if mapping:
            with self._lock:
                self._mappings[path] = (size, mapping)
                while len(self._mappings) > MAPPINGS_REMEMBERED:
                    self._mappings.popitem(last=False)
        return mapping

    def _parsed(self, blob: bytes, source: str, key: str, etag: str, size: int) -> dict[int, str]:
        """A stored mapping's blocks, if it is the one of this version: a
        stale or foreign one (another etag, size or block size) is none."""
        try:
            data = json.loads(blob)
            expected = (source, key, etag, size, self._block_size)
            if (data["source"], data["key"], data["etag"], data["size"], data["block_size"]) != expected:
                return {}
            return {int(index): str(digest) for index, digest in data["blocks"].items()}
        except (ValueError, KeyError, TypeError, AttributeError):
            log.warning("shared tier: the mapping of %s is not one this daemon wrote; ignored", key)
            return {}

    def _get(self, path: str) -> bytes | None:
        async def get() -> bytes:
            result = await obstore.get_async(self._store, path)
            return bytes(await result.bytes_async())

        try:
            return self._io.run(get(), REQUEST_SECONDS)
        except FileNotFoundError:
            return None
        except (CachefsdError, Exception) as exc:  # any failure is a miss
            log.info("shared tier: GET %s failed: %s", path, exc)
            return None

    def _put(self, path: str, data: bytes) -> bool:
        async def put() -> None:
            await obstore.put_async(self._store, path, data)

        try:
            self._io.run(put(), REQUEST_SECONDS)
        except (CachefsdError, Exception) as exc:  # a failed write only costs the fleet a later fetch
            log.info("shared tier: PUT %s failed: %s", path, exc)
            return False
        return True

    def mapped(self, source: str, key: str, etag: str, size: int) -> set[int]:
        """The blocks of a version the shared tier maps (which a fetch would
        try); what ``cachefsd stage --shared-tier`` counts as staged."""
        return set(self._mapping(source, key, etag, size))

    def store_now(
        self, source: str, key: str, etag: str, size: int, blocks: dict[int, tuple[str, bytes]]
    ) -> bool:
        """Write blocks and their mapping before returning: whether all of it was written."""
        return self._store_blocks(source, key, etag, size, blocks)

    def _write_all(self) -> None:
        while (item := self._writes.get()) is not None:
            self._store_blocks(*item)

    def _store_blocks(
        self, source: str, key: str, etag: str, size: int, blocks: dict[int, tuple[str, bytes]]
    ) -> bool:
        written = {}
        for index, (digest, content) in blocks.items():
            ok = self._put(f"blocks/{digest}", pack(content, digest, self._block_size))
            self._events.shared_written(ok)
            if ok:
                written[index] = digest
        return (
            bool(written)
            and self._write_mapping(source, key, etag, size, written)
            and len(written) == len(blocks)
        )

    def _write_mapping(self, source: str, key: str, etag: str, size: int, written: dict[int, str]) -> bool:
        """Add ``written`` to the version's mapping. Two nodes that write one
        version at once may each lose the other's entries: fewer shared hits
        later, never a wrong one."""
        path = mapping_path(source, key, etag, self._block_size)
        stored = self._get(path)
        blocks = {} if stored is None else self._parsed(stored, source, key, etag, size)
        blocks.update(written)
        body = {
            "source": source,
            "key": key,
            "etag": etag,
            "size": size,
            "block_size": self._block_size,
            "blocks": {str(index): digest for index, digest in sorted(blocks.items())},
        }
        if not self._put(path, json.dumps(body, separators=(",", ":")).encode()):
            return False
        with self._lock:
            self._mappings.pop(path, None)  # read afresh with the new entries
        return True


def open_shared(url: str, endpoint_url: str | None) -> Obstore:
    """The store behind a shared tier URL (``s3://bucket/prefix``,
    ``gs://bucket/prefix``), with the environment's credentials for it."""
    client_options: ClientConfig = {"timeout": datetime.timedelta(seconds=REQUEST_SECONDS)}
    # No retries: a miss costs one origin fetch, a retry's backoff would cost every read more.
    retry: RetryConfig = {
        "max_retries": 0,
        "retry_timeout": datetime.timedelta(seconds=REQUEST_SECONDS),
        "backoff": {"init_backoff": datetime.timedelta(0), "max_backoff": datetime.timedelta(0), "base": 2},
    }
    try:
        if url.startswith("gs://"):
            return GCSStore.from_url(url, client_options=client_options, retry_config=retry)
        if endpoint_url is None:
            return S3Store.from_url(url, client_options=client_options, retry_config=retry)
        client_options["allow_http"] = endpoint_url.startswith("http://")
        return S3Store.from_url(
            url,
            client_options=client_options,
            retry_config=retry,
            endpoint=endpoint_url,
            region=os.environ.get("AWS_REGION", DEFAULT_REGION),
            virtual_hosted_style_request=False,
        )
    except Exception as exc:
        raise CachefsdError(f"cache.shared.url: cannot open {url}: {exc}") from exc
