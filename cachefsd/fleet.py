"""``cachefsd stage SOURCE --shared-tier URL``: a dataset loaded into the
shared tier once for the whole fleet, in this process, with no mount and no
local cache.

It is ``stage.stage_files`` (selection, ``--include``, progress, ``--check``,
the summary and its exit code) over ``FleetBlocks``, whose one tier is the
shared one: a block counts as staged when the shared tier maps it, and a
run of blocks is read from the origin and written there (blocks, then the
version's mapping) before the stage moves on. A rerun skips what is
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
from cachefsd.cache.codec import content_hash
from cachefsd.cache.index import Index
from cachefsd.cache.shared import SharedTier, open_shared
from cachefsd.config import Settings
from cachefsd.engine import MOUNT_CHECK_SECONDS
from cachefsd.errors import CachefsdError, StoreError
from cachefsd.fetch import Fetcher
from cachefsd.metrics import Metrics
from cachefsd.namespace.tree import Namespace
from cachefsd.reader import BRIDGE_MARGIN_SECONDS, block_bounds, blocks_per_run
from cachefsd.stage import Report, StageRequest, stage_files
from cachefsd.store import open_store
from cachefsd.store.base import ObjectInfo

SHARED = "shared"


class FleetBlocks:
    """``stage.Blocks`` and ``stage.Resident`` whose one tier is the shared tier."""

    def __init__(
        self, source: str, shared: SharedTier, fetcher: Fetcher, io: LoopThread, block_size: int
    ) -> None:
        self._source = source
        self._shared = shared
        self._fetcher = fetcher
        self._io = io
        self._block_size = block_size

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def run_blocks(self) -> int:
        return blocks_per_run(self._block_size)

    def residency(self, info: ObjectInfo, index: int) -> str | None:
        mapped = self._shared.mapped(self._source, info.key, info.etag, info.size)
        return SHARED if index in mapped else None

    def fetching(self, info: ObjectInfo, index: int) -> bool:
        return False

    def fetch_run_ahead(self, info: ObjectInfo, indices: range, tier: str | None = None) -> set[int]:
        start = block_bounds(indices.start, info.size, self._block_size)[0]
        end = block_bounds(indices[-1], info.size, self._block_size)[1]
        stream = self._fetcher.stream_range(info.key, start, end, info.etag, self._block_size, "prefetch")
        blocks: dict[int, tuple[str, bytes | bytearray]] = {
            index: (content_hash(content), content)
            for index, content in enumerate(
                self._io.iterate(stream, self._fetcher.deadline + BRIDGE_MARGIN_SECONDS), indices.start
            )
        }
        if not self._shared.store_now(self._source, info.key, info.etag, info.size, blocks):
            raise StoreError(
                f"could not write {info.key}'s blocks to the shared tier: {self._shared.last_error}"
            )
        return set(blocks)


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
        shared = SharedTier(
            open_shared(
                shared_settings.url, shared_settings.endpoint_url, shared_settings.credentials_env_prefix
            ),
            io,
            block_size,
            metrics,
            time.monotonic,
        )
        resources.callback(shared.close)
        shared.check()
        blocks = FleetBlocks(store.cache_key, shared, fetcher, io, block_size)
        try:
            return stage_files(namespace, blocks, blocks, [SHARED], request, report)
        except StoreError as exc:
            raise CachefsdError(f"cannot stage {settings.source}: {exc}") from exc
