"""Ranged GETs against the cold store: bounded concurrency, retries with
backoff and full jitter, and a total deadline after which the read fails.

Runs on the event loop thread (aio.py). A request never waits forever: each
attempt has its own timeout and all attempts share one deadline, so a dead
bucket turns into ``DeadlineExceeded`` (EIO at the FUSE edge) in bounded time
while the daemon keeps serving what it has cached.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import random
import time
from collections.abc import Awaitable, Callable
from typing import Literal, Protocol, TypeVar

from cachefsd.config import FetchSettings
from cachefsd.errors import DeadlineExceeded, StoreError
from cachefsd.store.base import ObjectStore

T = TypeVar("T")

# demand: a reader waits; prefetch: nobody waits yet; metadata: list/head.
FetchKind = Literal["demand", "prefetch", "metadata"]


class FetchEvents(Protocol):
    def fetch_done(self, kind: FetchKind, seconds: float, nbytes: int) -> None: ...
    def fetch_retry(self, kind: FetchKind) -> None: ...
    def fetch_failed(self, kind: FetchKind) -> None: ...


# Lower goes first: a reader is waiting on demand requests and listings,
# nobody yet on a prefetch.
_PRIORITY: dict[str, int] = {"demand": 0, "metadata": 0, "prefetch": 1}


class PrioritySlots:
    """A counting semaphore whose waiters are served by priority, then in
    arrival order: a demand read waits only for requests already running,
    never behind queued prefetches. Belongs to one event loop."""

    def __init__(self, slots: int) -> None:
        self._free = slots
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._arrivals = itertools.count()

    async def acquire(self, priority: int) -> None:
        if self._free > 0 and not self._waiters:
            self._free -= 1
            return
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (priority, next(self._arrivals), granted))
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                self.release()  # the slot arrived as we were cancelled: pass it on
            raise

    def release(self) -> None:
        while self._waiters:
            _, _, granted = heapq.heappop(self._waiters)
            if not granted.done():
                granted.set_result(None)
                return
        self._free += 1


class Fetcher:
    def __init__(
        self,
        store: ObjectStore,
        settings: FetchSettings,
        events: FetchEvents,
        rng: random.Random | None = None,
    ) -> None:
        self._store = store
        self._settings = settings
        self._events = events
        self._rng = rng or random.Random()
        self._slots: PrioritySlots | None = None

    @property
    def deadline(self) -> float:
        return self._settings.deadline

    async def get_range(
        self, key: str, start: int, end: int, etag: str, kind: FetchKind = "demand"
    ) -> bytes | bytearray:
        """Bytes ``[start, end)`` of version ``etag`` of ``key``, exactly
        ``end - start`` of them, or a ``StoreError``.

        An attempt is not cut at ``attempt_timeout`` while its bytes flow: a
        32 MiB run at 2 MB/s takes 16 s, and cutting it at 10 s made every
        attempt fail on any link slower than 3.2 MB/s a connection (a shared
        1 Gbit/s NIC), and a read that joined it fail with it. A stalled
        connection is still dropped after ``attempt_timeout`` by the store's
        own read timeout (S3, GCS), and the deadline bounds it all."""

        async def attempt() -> bytes | bytearray:
            data = await self._store.get_range(key, start, end, etag)
            if len(data) != end - start:
                raise StoreError(f"short read of {key}: {len(data)} of {end - start} bytes")
            return data

        return await self.call(key, attempt, kind, attempt_timeout=self._settings.deadline)

    async def call(
        self,
        what: str,
        attempt: Callable[[], Awaitable[T]],
        kind: FetchKind,
        attempt_timeout: float | None = None,
    ) -> T:
        """``attempt()``'s result, retried on retryable errors and timeouts
        until the deadline; each attempt cut at ``attempt_timeout`` (the
        setting's, by default). ``what`` names the request in errors."""
        if self._slots is None:  # created lazily: it must belong to the running loop
            self._slots = PrioritySlots(self._settings.concurrency)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._settings.deadline
        attempts = 0
        cause: Exception | None = None
        per_attempt = self._settings.attempt_timeout if attempt_timeout is None else attempt_timeout
        while True:
            remaining = deadline - loop.time()
            started = time.monotonic()
            try:
                limited = self._limited(attempt, _PRIORITY[kind])
                result = await asyncio.wait_for(limited, min(per_attempt, remaining))
                nbytes = len(result) if isinstance(result, bytes | bytearray) else 0
                self._events.fetch_done(kind, time.monotonic() - started, nbytes)
                return result
            except StoreError as exc:
                if not exc.retryable:
                    self._events.fetch_failed(kind)
                    raise
                cause = exc
            except TimeoutError as exc:
                # An error the store gave says more than a timeout, which may
                # only be the deadline cutting the last attempt short.
                cause = cause or exc
            attempts += 1
            # Full jitter (AWS architecture blog): spreads retries of many
            # readers that failed together, so they do not retry in lockstep.
            backoff = self._rng.uniform(
                0, min(self._settings.backoff_max, self._settings.backoff_initial * 2**attempts)
            )
            if loop.time() + backoff >= deadline:
                self._events.fetch_failed(kind)
                reason = str(cause) or type(cause).__name__
                raise DeadlineExceeded(
                    f"{what}: gave up after {attempts} attempts in {self._settings.deadline:g}s: {reason}"
                ) from cause
            self._events.fetch_retry(kind)
            await asyncio.sleep(backoff)

    async def _limited(self, attempt: Callable[[], Awaitable[T]], priority: int) -> T:
        assert self._slots is not None
        await self._slots.acquire(priority)
        try:
            return await attempt()
        finally:
            self._slots.release()
