"""``cachefsd stage SOURCE --shared-tier URL``: a dataset loaded into the
shared tier once for the whole fleet, in this process, with no mount and no
local cache.

It is ``stage.stage_files`` (selection, ``--include``, progress, ``--check``,
the summary and its exit code) over the normal reader, whose block cache
has one level, the shared tier, writing as it is given blocks: a block
counts as staged when the shared tier maps it, and a run of blocks is read
from the origin and written there (blocks, then the version's mapping)
before the stage moves on, or fails saying why. A rerun skips what is
already mapped, which is how a stage interrupted part way resumes. The
listings it needs live in a throwaway index.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from cachefsd.aio import LoopThread
from cachefsd.cache.index import Index
from cachefsd.cache.layered import LayeredCache
from cachefsd.cache.shared import SHARED, SharedCache, open_shared
from cachefsd.config import Settings
from cachefsd.engine import MOUNT_CHECK_SECONDS
from cachefsd.errors import CachefsdError, StoreError
from cachefsd.fetch import Fetcher
from cachefsd.metrics import Metrics, SharedFetches
from cachefsd.namespace.tree import Namespace
from cachefsd.reader import BlockReader
from cachefsd.stage import Report, StageRequest, stage_files
from cachefsd.store import open_store
from cachefsd.store.base import ObjectInfo


class SharedResidency:
    """``stage.Resident`` of a fleet stage: a block is staged when the
    shared tier maps it (``LayeredCache.residency`` of its one level)."""

    def __init__(self, reader: BlockReader, cache: LayeredCache) -> None:
        self._reader = reader
        self._cache = cache

    def residency(self, info: ObjectInfo, index: int) -> str | None:
        return self._cache.residency(self._reader.version(info), index)


def stage_fleet(settings: Settings, request: StageRequest, report: Report) -> dict[str, Any]:
    """Stage (or ``check``) ``settings.source`` into ``settings.cache.shared``."""
    shared_settings = settings.cache.shared
    assert shared_settings is not None
    io = LoopThread()
    with contextlib.ExitStack() as resources:
        resources.callback(io.stop)
        store = open_store(settings.source, settings.store, settings.fetch)
        resources.callback(lambda: io.run(store.close(), MOUNT_CHECK_SECONDS))
        io.run(store.check(), MOUNT_CHECK_SECONDS)
        metrics = Metrics(CollectorRegistry())
        fetcher = Fetcher(store, settings.fetch, metrics)
        work = Path(resources.enter_context(tempfile.TemporaryDirectory(prefix="cachefsd-fleet-")))
        index = Index(work / "index.sqlite")
        resources.callback(index.close)
        namespace = Namespace(store, fetcher, io, index, settings.namespace.metadata_ttl, lambda _: None)
        block_size = settings.cache.block_size
        shared = SharedCache(
            open_shared(
                shared_settings.url, shared_settings.endpoint_url, shared_settings.credentials_env_prefix
            ),
            io,
            block_size,
            metrics,
            SharedFetches(metrics),
            time.monotonic,
            write_behind=False,
        )
        resources.callback(shared.close)
        shared.check()
        # Blocks are the shared tier's by content hash alone: no dedup by etag to ask for.
        cache = LayeredCache([shared])
        reader = BlockReader(store.cache_key, block_size, cache, fetcher, io, metrics, dedup_by_etag=False)
        try:
            return stage_files(namespace, reader, SharedResidency(reader, cache), [SHARED], request, report)
        except StoreError as exc:
            raise CachefsdError(f"cannot stage {settings.source}: {exc}") from exc
