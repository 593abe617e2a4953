"""A store wrapper that injects latency, errors and hangs, for tests and
benchmarks of everything that must survive a misbehaving bucket."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from pathlib import Path

from cachefsd.errors import StoreError
from cachefsd.store.base import ListingPage, ObjectInfo, ObjectStore

# How often a call held by a gate looks whether it was released.
GATE_POLL_SECONDS = 0.005


@dataclass
class Faults:
    """What to inject; mutable so a test can change it while the daemon runs."""

    latency_seconds: float = 0.0
    failures_left: int = 0  # the next N calls raise ``error``
    error: type[StoreError] = StoreError
    hang: bool = False  # every call waits forever (until cancelled)
    # Every call waits until the test sets it (or the call is cancelled): a
    # store that hangs exactly as long as the test needs, whatever the timeouts.
    gate: threading.Event | None = None
    # GETs of ranges that start before this offset pass the gate: a link
    # that sends an object's first blocks, then stalls.
    gate_from: int = 0


async def _passed(gate: threading.Event | None) -> None:
    """Once ``gate`` (read once, now) is set; at once if there is none."""
    while gate is not None and not gate.is_set():
        await asyncio.sleep(GATE_POLL_SECONDS)  # the event is set from another thread


class FaultyStore:
    """An ``ObjectStore`` that injects ``faults`` into every call of the store it wraps."""

    def __init__(self, inner: ObjectStore, faults: Faults | None = None) -> None:
        self._inner = inner
        self.faults = faults or Faults()
        self.calls = 0
        self.gets: list[tuple[str, int, int]] = []  # the key and range each ``get_range`` asked for
        self._gets_now = 0
        self.most_concurrent_gets = 0  # the most GETs that were in flight at once

    @property
    def uri(self) -> str:
        return self._inner.uri

    @property
    def cache_key(self) -> str:
        return self._inner.cache_key

    @property
    def content_etags(self) -> bool:
        return self._inner.content_etags

    async def _inject(self, gated: bool = True) -> None:
        self.calls += 1
        if self.faults.latency_seconds:
            await asyncio.sleep(self.faults.latency_seconds)
        if self.faults.hang:
            await asyncio.Event().wait()
        if gated:
            await _passed(self.faults.gate)
        if self.faults.failures_left > 0:
            self.faults.failures_left -= 1
            raise self.faults.error("injected fault")

    async def check(self) -> bool:
        await self._inject()
        return await self._inner.check()

    async def list_page(self, prefix: str, token: str | None) -> ListingPage:
        await self._inject()
        return await self._inner.list_page(prefix, token)

    async def head(self, key: str) -> ObjectInfo:
        await self._inject()
        return await self._inner.head(key)

    async def get_range(self, key: str, start: int, end: int, etag: str) -> bytes | bytearray:
        self._gets_now += 1  # the event loop's thread only: no lock
        self.most_concurrent_gets = max(self.most_concurrent_gets, self._gets_now)
        try:
            await self._inject(gated=start >= self.faults.gate_from)
            self.gets.append((key, start, end))
            return await self._inner.get_range(key, start, end, etag)
        finally:
            self._gets_now -= 1

    async def get_object(self, key: str) -> bytes:
        await self._inject()
        return await self._inner.get_object(key)

    async def put_object(self, key: str, data: bytes) -> None:
        await self._inject()
        await self._inner.put_object(key, data)

    async def put_file(self, key: str, path: Path) -> ObjectInfo:
        await self._inject()
        return await self._inner.put_file(key, path)

    async def delete(self, key: str) -> None:
        await self._inject()
        await self._inner.delete(key)

    async def copy(self, source: str, target: str) -> ObjectInfo:
        await self._inject()
        return await self._inner.copy(source, target)

    async def close(self) -> None:
        await self._inner.close()
