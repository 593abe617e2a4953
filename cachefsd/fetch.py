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
from cachefsd.errors import DeadlineExceeded, ObjectChanged, ObjectNotFound, StoreError
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
    """Every request to the cold store: slots by priority, retries with jittered backoff, one total
    deadline."""

    def __init__(
        self,
        store: ObjectStore,
        settings: FetchSettings,
        events: FetchEvents,
        rng: random.Random | None = None,
        retries: bool = True,
    ) -> None:
        """Without ``retries`` a failed request fails at once (the shared
        tier's: a miss there costs one origin fetch, a retry's backoff
        would cost every read more)."""
        self._store = store
        self._settings = settings
        self._events = events
        self._rng = rng or random.Random()
        self._retries = retries
        self._slots: PrioritySlots | None = None

    @property
    def deadline(self) -> float:
        return self._settings.deadline

    async def get_range(
        self, key: str, start: int, end: int, etag: str, kind: FetchKind = "demand"
    ) -> bytes | bytearray:
        """Bytes ``[start, end)`` of version ``etag`` of ``key``, exactly
        (a block at most), or a ``StoreError``.

        Attempts are not cut at ``attempt_timeout``: a block on a slow link
        may take longer (cutting a GET at a fixed time fails every attempt
        below the rate it implies). A stalled connection is dropped after
        ``attempt_timeout`` by the store's own read timeout (S3, GCS), and
        the GET is retried with backoff until the deadline, which bounds
        the whole request."""

        async def attempt() -> bytes | bytearray:
            data = await self._store.get_range(key, start, end, etag)
            if len(data) < end - start:
                raise StoreError(f"short read of {key}: {len(data)} of {end - start} bytes")
            return data

        try:
            return await self._request(key, attempt, kind, len, self._settings.deadline)
        except ObjectNotFound as exc:
            # The version the read is pinned to went with its object: to
            # a reader, the object changed (EIO, and the listing that
            # showed it is dropped), not "no such file" from read().
            raise ObjectChanged(f"{key} was deleted; the read was pinned to version {etag}") from exc

    async def call(
        self,
        what: str,
        attempt: Callable[[], Awaitable[T]],
        kind: FetchKind,
        measure: Callable[[T], int] = lambda _: 0,
    ) -> T:
        """``attempt()``'s result, retried on retryable errors and timeouts
        until the deadline; each attempt cut at ``attempt_timeout`` (a
        listing or a HEAD, whose answers are small). ``what`` names the
        request in errors; ``measure`` says how many bytes a result brought."""
        return await self._request(what, attempt, kind, measure, self._settings.attempt_timeout)

    async def _request(
        self,
        what: str,
        attempt: Callable[[], Awaitable[T]],
        kind: FetchKind,
        measure: Callable[[T], int],
        attempt_seconds: float,
    ) -> T:
        """``call``, with each attempt cut at ``attempt_seconds`` (or at the deadline, if sooner)."""
        self._slots = self._slots or PrioritySlots(self._settings.concurrency)  # of the running loop
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._settings.deadline
        attempts = 0
        cause: Exception | None = None
        while True:
            remaining = deadline - loop.time()
            started = time.monotonic()
            try:
                limited = self._limited(attempt, _PRIORITY[kind])
                result = await asyncio.wait_for(limited, min(attempt_seconds, remaining))
                self._events.fetch_done(kind, time.monotonic() - started, measure(result))
                return result
            except (StoreError, TimeoutError) as exc:
                cause = self._worth_retrying(exc, kind, cause)
            attempts += 1
            await self._back_off(what, kind, attempts, cause, deadline)

    async def get_object(self, key: str, kind: FetchKind) -> bytes | None:
        """Object ``key`` whole (a small one), or None if there is none; a
        request as ``call`` makes one."""

        async def attempt() -> bytes | None:
            try:
                return await self._store.get_object(key)
            except ObjectNotFound:
                return None

        return await self.call(f"GET {key}", attempt, kind, lambda data: 0 if data is None else len(data))

    def _worth_retrying(
        self, exc: StoreError | TimeoutError, kind: FetchKind, cause: Exception | None
    ) -> Exception:
        """What to report if the attempts run out, after ``exc`` failed one;
        ``exc`` again, at once, when retrying cannot help. An error the store
        gave says more than a timeout, which may only be the deadline
        cutting the last attempt short."""
        if isinstance(exc, TimeoutError):
            return cause or exc
        if not exc.retryable:
            self._events.fetch_failed(kind)
            raise exc
        return exc

    async def _back_off(
        self, what: str, kind: FetchKind, attempts: int, cause: Exception | None, deadline: float
    ) -> None:
        """Wait before the next attempt, or give up if it would come past
        ``deadline``. Full jitter (AWS architecture blog): spreads retries
        of many readers that failed together, so they do not retry in lockstep."""
        backoff = self._rng.uniform(
            0, min(self._settings.backoff_max, self._settings.backoff_initial * 2**attempts)
        )
        if not self._retries or asyncio.get_running_loop().time() + backoff >= deadline:
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
