"""The shared tier: blocks in a bucket every node's daemon reads below its
local tiers and above the origin, and fills after an origin fetch. As a
level of the block cache (``blocks.BlockCache``) it is the remote one:
asked only for blocks no local level holds, a run's blocks at once.

Layout under the shared URL's prefix (any store ``store.open_store`` opens:
an S3-compatible bucket, GCS):

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
(missing, corrupt, another format, a store error, a timeout) is a miss: the
reader goes to the origin. The daemon never deletes there; a lifecycle rule
on the prefix does.

Reads go through a fetcher of their own (``SHARED_FETCH``: a short
deadline, no retries), so a demand read's requests go before a prefetch's,
and are counted as fetches of kind ``shared``. Writes go to a few writer
threads, a version always to the same one, with at most
``WRITE_QUEUE_BYTES`` waiting: an origin fetch never waits for them, and
what does not fit is dropped (counted). A fleet stage writes instead as it
puts (``write_behind=False``), and learns of a failure.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import queue
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from pydantic import ValidationError

from cachefsd.aio import LoopThread
from cachefsd.cache.blocks import Block, BlockCache, Use, Version
from cachefsd.cache.codec import CorruptBlock, decode, encode
from cachefsd.config import FetchSettings, StoreSettings
from cachefsd.errors import CachefsdError, ConfigError, StoreError
from cachefsd.fetch import Fetcher, FetchEvents, FetchKind
from cachefsd.singleflight import SingleFlight
from cachefsd.store import open_store
from cachefsd.store.base import Credentials, ObjectStore

log = logging.getLogger(__name__)

SHARED = "shared"
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
# the fetch deadline keeps nearly all of its time for that. No retries: a
# miss costs one origin fetch, a retry's backoff would cost every read more.
REQUEST_SECONDS = 2.0
SHARED_FETCH = FetchSettings(deadline=REQUEST_SECONDS, attempt_timeout=REQUEST_SECONDS)
# The reading thread's own wait on the fetcher, on top of its deadline, so
# the fetcher's error (with its cause) arrives first.
WAIT_MARGIN_SECONDS = 1.0
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


# Blocks to write: index -> (hash, content).
_Blocks = Mapping[int, tuple[str, bytes | bytearray]]
# A queued write: a version and its blocks.
_Write = tuple[Version, _Blocks]


class SharedEvents(Protocol):
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


class SharedCache(BlockCache):
    """The shared tier of one node: verified reads, queued (or, for a fleet
    stage, immediate) writes. ``last_error`` is the last failure's message,
    for a stage to report."""

    def __init__(
        self,
        store: ObjectStore,
        io: LoopThread,
        block_size: int,
        events: SharedEvents,
        fetches: FetchEvents,
        clock: Callable[[], float],
        write_behind: bool = True,
    ) -> None:
        self._store = store
        self._fetcher = Fetcher(store, SHARED_FETCH, fetches, retries=False)
        self._io = io
        self._block_size = block_size
        self._events = events
        self._clock = clock
        self._write_behind = write_behind
        self._lock = threading.Lock()
        # path -> (size, blocks, looked up at); an empty mapping is "none there".
        self._mappings: OrderedDict[str, tuple[int, dict[int, str], float]] = OrderedDict()
        # Concurrent readers of one version's blocks share one GET of its mapping.
        self._mapping_gets: SingleFlight[str, dict[int, str]] = SingleFlight()
        self._down_until = 0.0  # guarded by _lock: no reads before then
        self.last_error = ""
        self._queued_bytes = 0  # guarded by _lock
        # One read-modify-write of a mapping at a time per path (striped): a
        # stage's workers write runs of one large object at once.
        self._mapping_locks = [threading.Lock() for _ in range(MAPPING_LOCKS)]
        self._queues: list[queue.SimpleQueue[_Write | None]] = []
        self._writers: list[threading.Thread] = []
        if write_behind:
            self._queues = [queue.SimpleQueue() for _ in range(WRITERS)]
            self._writers = [
                threading.Thread(target=self._write_all, args=(writes,), name="cachefsd-shared", daemon=True)
                for writes in self._queues
            ]
            for writer in self._writers:
                writer.start()

    def close(self) -> None:
        """Stop the writers once the writes queued are done, waiting at most
        ``CLOSE_SECONDS`` in all (an unmount does not wait on a slow shared
        bucket, and what is left then is not written), and the store."""
        for writes in self._queues:
            writes.put(None)
        deadline = self._clock() + CLOSE_SECONDS
        for writer in self._writers:
            writer.join(max(0.0, deadline - self._clock()))
        try:
            self._io.run(self._store.close(), REQUEST_SECONDS)
        except StoreError as exc:
            log.info("shared tier: closing its store: %s", exc)

    def check(self) -> None:
        """Prove the shared bucket readable and writable (a fleet stage's
        first step); ``CachefsdError`` saying why not."""
        probe = b"cachefsd"
        if not self._put("cachefsd-check", probe):
            raise CachefsdError(f"the shared tier cannot be written: {self.last_error}")
        if self._get_all(["cachefsd-check"], "demand")[0] != probe:
            raise CachefsdError(
                f"the shared tier cannot be read: {self.last_error or 'the check object is gone'}"
            )

    # -- as a level of the block cache -------------------------------------

    @property
    def remote(self) -> bool:
        return True

    def get(self, version: Version, index: int, use: Use) -> Block | None:
        return self.get_many(version, [index], use).get(index)

    def get_many(self, version: Version, indices: Sequence[int], use: Use) -> dict[int, Block]:
        """The verified blocks of ``indices`` the tier holds; a block it
        does not have, or has wrong, is left out (the origin's then). The
        mapping, then every block at once: at most two requests' time, and
        nothing at all while the tier is down (``DOWN_SECONDS`` after a
        failure). Requests of kind ``use.kind``."""
        with self._lock:
            if self._clock() < self._down_until:
                return {}
        mapping = self._mapping(version, use.kind)
        wanted = {index: mapping[index] for index in indices if index in mapping}
        if not wanted:
            return {}
        blobs = self._get_all([self._block_path(digest) for digest in wanted.values()], use.kind)
        found: dict[int, Block] = {}
        for (index, digest), blob in zip(wanted.items(), blobs, strict=True):
            if not isinstance(blob, bytes):
                continue
            try:
                content = unpack(blob, digest, self._block_size)
            except CorruptBlock as exc:
                log.warning("shared tier: %s; read from the origin instead", exc)
                self._events.block_corrupt(SHARED)
                continue
            found[index] = Block(digest, content, SHARED)
        return found

    def put(self, version: Version, index: int, digest: str, content: bytes | bytearray, use: Use) -> bool:
        self.put_many(version, {index: (digest, content)}, use)
        return False

    def put_many(self, version: Version, blocks: _Blocks, use: Use) -> None:
        """Queue ``blocks`` for the writers, or write them now: then a
        failure raises ``StoreError`` saying why."""
        if not blocks:
            return
        if not self._write_behind:
            if not self._store_now(version, blocks):
                raise StoreError(
                    f"could not write {version.key}'s blocks to the shared tier: {self.last_error}"
                )
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
        writer = zlib.crc32(f"{version.source}\0{version.key}".encode()) % WRITERS
        self._queues[writer].put((version, blocks))

    def served(self, version: Version, index: int, block: Block) -> bool:
        return False  # the bucket keeps no order of use: a lifecycle rule ages blocks out

    def residency(self, version: Version, index: int) -> str | None:
        """``shared`` for a block the tier maps (which a get would try):
        what ``cachefsd stage --shared-tier`` counts as staged."""
        return SHARED if index in self._mapping(version, "prefetch") else None

    def forget(self, version: Version) -> None:
        """Nothing: other nodes may still read the version, and the daemon
        never deletes there."""

    # -- requests ----------------------------------------------------------

    def _store_now(self, version: Version, blocks: _Blocks) -> bool:
        """Write blocks, then add them to their version's mapping, before
        returning: whether all of it was written (``last_error`` says why not)."""
        written = {}
        for index, (digest, content) in blocks.items():
            ok = self._put(self._block_path(digest), pack(content, digest, self._block_size))
            self._events.shared_written(ok)
            if not ok:
                break  # the bucket is failing: the rest would fail the same way
            written[index] = digest
        if not written or not self._write_mapping(version, written):
            return False
        return len(written) == len(blocks)

    def _block_path(self, digest: str) -> str:
        """A block's name. Under its block size: a small file is the same
        bytes at any block size, and a node at another size must not take
        this one's copy for damage."""
        return f"blocks/{self._block_size}/{digest}"

    def _mapping(self, version: Version, kind: FetchKind) -> dict[int, str]:
        """The version's mapping: remembered for ``MAPPING_SECONDS``, so a
        block that another node writes meanwhile is found soon after."""
        path = mapping_path(version.source, version.key, version.etag, self._block_size)
        with self._lock:
            known = self._mappings.get(path)
            if known is not None and known[0] == version.size and self._clock() - known[2] < MAPPING_SECONDS:
                self._mappings.move_to_end(path)
                return known[1]
        # No wait of its own: the leader's GET is bounded.
        return self._mapping_gets.do(path, lambda: self._look_up(path, version, kind), None)

    def _look_up(self, path: str, version: Version, kind: FetchKind) -> dict[int, str]:
        now = self._clock()
        blob = self._get_all([path], kind)[0]
        if blob is None:  # failed: nothing learnt, nothing remembered
            return {}
        mapping = self._parsed(blob, version)
        with self._lock:
            self._mappings[path] = (version.size, mapping, now)
            self._mappings.move_to_end(path)
            while len(self._mappings) > MAPPINGS_REMEMBERED:
                self._mappings.popitem(last=False)
        return mapping

    def _parsed(self, blob: bytes | _Missing, version: Version) -> dict[int, str]:
        """A stored mapping's blocks, if it is the one of this version: a
        stale or foreign one (another etag, size or block size) is none."""
        if not isinstance(blob, bytes):
            return {}
        try:
            data = json.loads(blob)
            expected = (version.source, version.key, version.etag, version.size, self._block_size)
            if (data["source"], data["key"], data["etag"], data["size"], data["block_size"]) != expected:
                return {}
            return {int(index): str(digest) for index, digest in data["blocks"].items()}
        except (ValueError, KeyError, TypeError, AttributeError):
            log.warning("shared tier: the mapping of %s is not one this daemon wrote; ignored", version.key)
            return {}

    def _get_all(self, paths: list[str], kind: FetchKind) -> list[bytes | _Missing | None]:
        """The objects at ``paths``, fetched at once: each its content,
        ``MISSING`` if there is none, or None if its request failed."""

        async def get_all() -> list[bytes | BaseException | None]:
            gets = (self._fetcher.get_object(path, kind) for path in paths)
            return list(await asyncio.gather(*gets, return_exceptions=True))

        try:
            results = self._io.run(get_all(), REQUEST_SECONDS + WAIT_MARGIN_SECONDS)
        except StoreError as exc:  # the wait's deadline, or the daemon stopping
            self._failed(f"GET of {len(paths)} objects: {exc}")
            return [None] * len(paths)
        answers: list[bytes | _Missing | None] = []
        for path, result in zip(paths, results, strict=True):
            if isinstance(result, StoreError):
                self._failed(f"GET {path}: {result}")
                answers.append(None)
            elif isinstance(result, BaseException):
                raise result  # a bug of ours, not a miss
            else:
                answers.append(MISSING if result is None else result)
        return answers

    def _put(self, path: str, data: bytes) -> bool:
        try:
            self._io.run(self._store.put_object(path, data), REQUEST_SECONDS)
        except StoreError as exc:  # a failed write only costs the fleet a later fetch
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
            version, blocks = item
            try:
                self._store_now(version, blocks)
            finally:
                with self._lock:
                    self._queued_bytes -= sum(len(content) for _, content in blocks.values())

    def _write_mapping(self, version: Version, written: dict[int, str]) -> bool:
        """Add ``written`` to the version's mapping. Within a node one writer
        at a time per mapping; two nodes that write one version at once may
        each lose the other's entries: fewer shared hits later, never a
        wrong one. A mapping that could not be read is not rewritten."""
        path = mapping_path(version.source, version.key, version.etag, self._block_size)
        with self._mapping_locks[zlib.crc32(path.encode()) % MAPPING_LOCKS]:
            stored = self._get_all([path], "prefetch")[0]
            if stored is None:
                return False
            blocks = self._parsed(stored, version)
            blocks.update(written)
            body = {
                "source": version.source,
                "key": version.key,
                "etag": version.etag,
                "size": version.size,
                "block_size": self._block_size,
                "blocks": {str(index): digest for index, digest in sorted(blocks.items())},
            }
            if not self._put(path, json.dumps(body, separators=(",", ":")).encode()):
                return False
        with self._lock:
            self._mappings.pop(path, None)  # read afresh with the new entries
        return True


def shared_credentials(prefix: str | None, environ: Mapping[str, str] = os.environ) -> Credentials | None:
    """The S3 credentials of ``<prefix>AWS_ACCESS_KEY_ID``,
    ``<prefix>AWS_SECRET_ACCESS_KEY`` (and ``<prefix>AWS_SESSION_TOKEN``),
    or None without a prefix (the environment's own chain then)."""
    if prefix is None:
        return None
    names = [f"{prefix}AWS_{name}" for name in ("ACCESS_KEY_ID", "SECRET_ACCESS_KEY")]
    missing = [name for name in names if not environ.get(name)]
    if missing:
        raise ConfigError(
            f"cache.shared.credentials_env_prefix: {', '.join(missing)} not set in the environment"
        )
    return Credentials(
        environ[names[0]], environ[names[1]], environ.get(f"{prefix}AWS_SESSION_TOKEN") or None
    )


def open_shared(
    url: str,
    endpoint_url: str | None,
    credentials_env_prefix: str | None = None,
    environ: Mapping[str, str] = os.environ,
) -> ObjectStore:
    """The store behind a shared tier URL (``s3://bucket/prefix``,
    ``gs://bucket/prefix``, ``az://container/prefix``), its requests cut at ``REQUEST_SECONDS``, with
    the environment's credentials for it (and ``AWS_REGION``, else the
    AWS config's region: it is never asked of S3, as a source's is at its
    mount, since a shared tier that is down must not stop a mount), or for
    S3 those of ``<credentials_env_prefix>AWS_*``: the origin's may differ."""
    credentials = shared_credentials(credentials_env_prefix, environ)
    try:
        settings = StoreSettings(
            endpoint_url=endpoint_url, region=environ.get("AWS_REGION"), connect_timeout=REQUEST_SECONDS
        )
    except ValidationError as exc:
        message = exc.errors()[0]["msg"]
        raise ConfigError(f"cache.shared.endpoint_url: {message}") from None
    try:
        return open_store(url, settings, SHARED_FETCH, credentials, writable=True)
    except ConfigError as exc:
        raise ConfigError(f"cache.shared.url: {exc}") from None
