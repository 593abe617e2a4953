"""The shared tier: blocks in a bucket every node's daemon reads below its
local tiers and above the origin, and fills after an origin fetch.

Layout under the shared URL's prefix (an S3-compatible bucket, or GCS; any
store ``obstore`` opens from a URL):

- ``blocks/<block size>/<hash>``: one block, named by its content hash, as a frame of
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

Writes go to a few writer threads, a version always to the same one, with
at most ``WRITE_QUEUE_BYTES`` waiting: an origin fetch never waits for them,
and what does not fit is dropped (counted).
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import json
import logging
import os
import queue
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import obstore
from obstore.store import GCSStore, S3Store

if TYPE_CHECKING:
    from obstore.store import ClientConfig, RetryConfig, S3Config

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
# Writer threads: a shared bucket answers a PUT in milliseconds, and one
# writer fell behind an origin that brings 130 small files a second. A
# version always goes to the same writer, so its mapping is never written by
# two threads of one node at once.
WRITERS = 8
# Bytes of blocks waiting for the writers at most: a node that outruns the
# shared bucket drops the rest (counted) rather than hold them in memory.
WRITE_QUEUE_BYTES = 256 << 20
# A read's requests to the shared tier (a mapping, then its blocks at once)
# each end after this long as a miss: the origin then serves the read, and
# the fetch deadline keeps nearly all of its time for that.
REQUEST_SECONDS = 2.0
# After a failed request, reads skip the shared tier this long: a bucket that
# is down costs one timeout, not one a read.
DOWN_SECONDS = 30.0
# A version's mapping is looked up again after this long: blocks another
# node writes meanwhile are found (and a missing mapping is not asked for
# at every read of the file's blocks).
MAPPING_SECONDS = 10.0
MAPPING_LOCKS = 64
# How long an unmount waits for the writes still queued: a healthy shared
# bucket takes their PUTs in well under a second.
CLOSE_SECONDS = 10.0


# A queued write: source, key, etag, size, and the blocks (index -> hash, content).
# Blocks to write: index -> (hash, content).
_Blocks = dict[int, tuple[str, bytes | bytearray]]
_Write = tuple[str, str, str, int, _Blocks]


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


class _Missing:
    """A GET that found nothing there (as opposed to one that failed)."""


MISSING = _Missing()


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
        # path -> (size, blocks, looked up at); an empty mapping is "none there".
        self._mappings: OrderedDict[str, tuple[int, dict[int, str], float]] = OrderedDict()
        self._down_until = 0.0  # guarded by _lock: no reads before then
        self.last_error = ""  # the last failure's message, for a stage to report
        self._queued_bytes = 0  # guarded by _lock
        # One read-modify-write of a mapping at a time per path (striped): a
        # stage's workers write runs of one large object at once.
        self._mapping_locks = [threading.Lock() for _ in range(MAPPING_LOCKS)]
        self._queues: list[queue.SimpleQueue[_Write | None]] = [queue.SimpleQueue() for _ in range(WRITERS)]
        self._writers = [
            threading.Thread(target=self._write_all, args=(writes,), name="cachefsd-shared", daemon=True)
            for writes in self._queues
        ]
        for writer in self._writers:
            writer.start()

    def close(self) -> None:
        """Stop the writers once the writes queued are done, waiting at most
        ``CLOSE_SECONDS`` in all: an unmount does not wait on a slow shared
        bucket, and what is left then is not written."""
        for writes in self._queues:
            writes.put(None)
        deadline = self._clock() + CLOSE_SECONDS
        for writer in self._writers:
            writer.join(max(0.0, deadline - self._clock()))

    def check(self) -> None:
        """Prove the shared bucket readable and writable (a fleet stage's
        first step); ``CachefsdError`` saying why not."""
        probe = b"cachefsd"
        if not self._put("cachefsd-check", probe):
            raise CachefsdError(f"the shared tier cannot be written: {self.last_error}")
        if self._get("cachefsd-check") != probe:
            raise CachefsdError(
                f"the shared tier cannot be read: {self.last_error or 'the check object is gone'}"
            )

    def fetch(
        self, source: str, key: str, etag: str, size: int, indices: list[int]
    ) -> dict[int, tuple[str, bytes]]:
        """The hashes and verified contents of those of ``indices`` the shared tier
        holds for version (``key``, ``etag``) of ``source``; a block it does
        not have, or has wrong, is left out (the origin's then). The
        mapping, then every block at once: at most two requests' time,
        each within ``REQUEST_SECONDS``, and nothing at all while the tier
        is down (``DOWN_SECONDS`` after a failure)."""
        with self._lock:
            if self._clock() < self._down_until:
                return {}
        mapping = self._mapping(source, key, etag, size)
        wanted = {index: mapping[index] for index in indices if index in mapping}
        if not wanted:
            return {}
        started = self._clock()
        blobs = self._get_all([self._block_path(digest) for digest in wanted.values()])
        seconds = self._clock() - started
        found: dict[int, tuple[str, bytes]] = {}
        for (index, digest), blob in zip(wanted.items(), blobs, strict=True):
            if not isinstance(blob, bytes):
                continue
            try:
                content = unpack(blob, digest, self._block_size)
            except CorruptBlock as exc:
                log.warning("shared tier: %s; read from the origin instead", exc)
                self._events.block_corrupt("shared")
                continue
            found[index] = (digest, content)
            self._events.fetch_done("shared", seconds, len(content))
        return found

    def mapped(self, source: str, key: str, etag: str, size: int) -> set[int]:
        """The blocks of a version the shared tier maps (which a fetch would
        try); what ``cachefsd stage --shared-tier`` counts as staged."""
        return set(self._mapping(source, key, etag, size))

    def store_later(self, source: str, key: str, etag: str, size: int, blocks: _Blocks) -> None:
        """Queue blocks fetched from the origin (index -> hash, content) for the shared tier."""
        if not blocks:
            return
        nbytes = sum(len(content) for _, content in blocks.values())
        with self._lock:
            full = self._queued_bytes + nbytes > WRITE_QUEUE_BYTES
            if not full:
                self._queued_bytes += nbytes
        if full:
            for _ in blocks:
                self._events.shared_written(False)
            return
        writer = zlib.crc32(f"{source}\0{key}".encode()) % WRITERS
        self._queues[writer].put((source, key, etag, size, blocks))

    def store_now(self, source: str, key: str, etag: str, size: int, blocks: _Blocks) -> bool:
        """Write blocks, then add them to their version's mapping, before
        returning: whether all of it was written (``last_error`` says why not)."""
        written = {}
        for index, (digest, content) in blocks.items():
            ok = self._put(self._block_path(digest), pack(content, digest, self._block_size))
            self._events.shared_written(ok)
            if not ok:
                break  # the bucket is failing: the rest would fail the same way
            written[index] = digest
        if not written or not self._write_mapping(source, key, etag, size, written):
            return False
        return len(written) == len(blocks)

    def _block_path(self, digest: str) -> str:
        """A block's name. Under its block size: a small file is the same
        bytes at any block size, and a node at another size must not take
        this one's copy for damage."""
        return f"blocks/{self._block_size}/{digest}"

    def _mapping(self, source: str, key: str, etag: str, size: int) -> dict[int, str]:
        """The version's mapping: remembered for ``MAPPING_SECONDS``, so a
        block that another node writes meanwhile is found soon after."""
        path = mapping_path(source, key, etag, self._block_size)
        now = self._clock()
        with self._lock:
            known = self._mappings.get(path)
            if known is not None and known[0] == size and now - known[2] < MAPPING_SECONDS:
                self._mappings.move_to_end(path)
                return known[1]
        blob = self._get(path)
        if blob is None:  # failed: nothing learnt, nothing remembered
            return {}
        mapping = {} if blob is MISSING else self._parsed(blob, source, key, etag, size)
        with self._lock:
            self._mappings[path] = (size, mapping, now)
            while len(self._mappings) > MAPPINGS_REMEMBERED:
                self._mappings.popitem(last=False)
        return mapping

    def _parsed(self, blob: bytes | _Missing, source: str, key: str, etag: str, size: int) -> dict[int, str]:
        """A stored mapping's blocks, if it is the one of this version: a
        stale or foreign one (another etag, size or block size) is none."""
        if not isinstance(blob, bytes):
            return {}
        try:
            data = json.loads(blob)
            expected = (source, key, etag, size, self._block_size)
            if (data["source"], data["key"], data["etag"], data["size"], data["block_size"]) != expected:
                return {}
            return {int(index): str(digest) for index, digest in data["blocks"].items()}
        except (ValueError, KeyError, TypeError, AttributeError):
            log.warning("shared tier: the mapping of %s is not one this daemon wrote; ignored", key)
            return {}

    def _get(self, path: str) -> bytes | _Missing | None:
        """The object at ``path``; ``MISSING`` if there is none; None if the request failed."""
        return self._get_all([path])[0]

    def _get_all(self, paths: list[str]) -> list[bytes | _Missing | None]:
        """The objects at ``paths``, fetched at once, as ``_get`` answers each."""

        async def get(path: str) -> bytes | _Missing | None:
            try:
                result = await obstore.get_async(self._store, path)
                return bytes(await result.bytes_async())
            except FileNotFoundError:
                return MISSING
            except Exception as exc:  # any failure is a miss
                self._failed(f"GET {path}: {exc}")
                return None

        async def get_all() -> list[bytes | _Missing | None]:
            return list(await asyncio.gather(*(get(path) for path in paths)))

        try:
            return self._io.run(get_all(), REQUEST_SECONDS)
        except Exception as exc:  # the loop's deadline, or the daemon stopping
            self._failed(f"GET of {len(paths)} objects: {exc}")
            return [None] * len(paths)

    def _put(self, path: str, data: bytes) -> bool:
        async def put() -> None:
            await obstore.put_async(self._store, path, data)

        try:
            self._io.run(put(), REQUEST_SECONDS)
        except Exception as exc:  # a failed write only costs the fleet a later fetch
            self._failed(f"PUT {path}: {exc}")
            return False
        return True

    def _failed(self, why: str) -> None:
        """A request failed: reads leave the tier alone for ``DOWN_SECONDS``."""
        log.info("shared tier: %s", why)
        with self._lock:
            self.last_error = why
            self._down_until = self._clock() + DOWN_SECONDS

    def _write_all(self, writes: queue.SimpleQueue[_Write | None]) -> None:
        while (item := writes.get()) is not None:
            try:
                self.store_now(*item)
            finally:
                with self._lock:
                    self._queued_bytes -= sum(len(content) for _, content in item[4].values())

    def _write_mapping(self, source: str, key: str, etag: str, size: int, written: dict[int, str]) -> bool:
        """Add ``written`` to the version's mapping. Within a node one writer
        at a time per mapping; two nodes that write one version at once may
        each lose the other's entries: fewer shared hits later, never a
        wrong one. A mapping that could not be read is not rewritten."""
        path = mapping_path(source, key, etag, self._block_size)
        with self._mapping_locks[zlib.crc32(path.encode()) % MAPPING_LOCKS]:
            stored = self._get(path)
            if stored is None:
                return False
            blocks = self._parsed(stored, source, key, etag, size)
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


def open_shared(
    url: str,
    endpoint_url: str | None,
    credentials_env_prefix: str | None = None,
    environ: Mapping[str, str] = os.environ,
) -> Obstore:
    """The store behind a shared tier URL (``s3://bucket/prefix``,
    ``gs://bucket/prefix``), with the environment's credentials for it, or
    for S3 those of ``<credentials_env_prefix>AWS_*``: the origin's may differ."""
    client_options: ClientConfig = {"timeout": datetime.timedelta(seconds=REQUEST_SECONDS)}
    # No retries: a miss costs one origin fetch, a retry's backoff would cost every read more.
    retry: RetryConfig = {
        "max_retries": 0,
        "retry_timeout": datetime.timedelta(seconds=REQUEST_SECONDS),
        "backoff": {"init_backoff": datetime.timedelta(0), "max_backoff": datetime.timedelta(0), "base": 2},
    }
    credentials: S3Config = {}
    if credentials_env_prefix is not None:
        names = [f"{credentials_env_prefix}AWS_{name}" for name in ("ACCESS_KEY_ID", "SECRET_ACCESS_KEY")]
        missing = [name for name in names if not environ.get(name)]
        if missing:
            raise CachefsdError(
                f"cache.shared.credentials_env_prefix: {', '.join(missing)} not set in the environment"
            )
        credentials = {"access_key_id": environ[names[0]], "secret_access_key": environ[names[1]]}
        token = environ.get(f"{credentials_env_prefix}AWS_SESSION_TOKEN")
        if token:
            credentials["session_token"] = token
    try:
        if url.startswith("gs://"):
            return GCSStore.from_url(url, client_options=client_options, retry_config=retry)
        if endpoint_url is None:
            return S3Store.from_url(
                url, config=credentials, client_options=client_options, retry_config=retry
            )
        client_options["allow_http"] = endpoint_url.startswith("http://")
        return S3Store.from_url(
            url,
            config=credentials,
            client_options=client_options,
            retry_config=retry,
            endpoint=endpoint_url,
            region=environ.get("AWS_REGION", DEFAULT_REGION),
            virtual_hosted_style_request=False,
        )
    except Exception as exc:  # a message naming the URL, never a credential
        raise CachefsdError(f"cache.shared.url: cannot open {url}: {type(exc).__name__}") from None
