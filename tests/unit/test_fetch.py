"""Retries, deadlines and errors of the fetcher, against a fault-injecting store."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from cachefsd.aio import LoopThread
from cachefsd.config import FetchSettings
from cachefsd.errors import AccessDenied, DaemonStopping, DeadlineExceeded, ObjectChanged, StoreError
from cachefsd.fetch import Fetcher, PrioritySlots
from cachefsd.store.faulty import Faults, FaultyStore
from cachefsd.store.memory import MemoryStore
from tests.unit.conftest import FAST_FETCH


class Events:
    def __init__(self) -> None:
        self.done = self.retries = self.failed = 0

    def fetch_done(self, kind: str, seconds: float, nbytes: int) -> None:
        self.done += 1

    def fetch_retry(self, kind: str) -> None:
        self.retries += 1

    def fetch_failed(self, kind: str) -> None:
        self.failed += 1


def setup(faults: Faults, settings: FetchSettings = FAST_FETCH) -> tuple[Fetcher, MemoryStore, Events]:
    store = MemoryStore({"k": b"0123456789"})
    events = Events()
    return Fetcher(FaultyStore(store, faults), settings, events), store, events


def etag(store: MemoryStore, io: LoopThread) -> str:
    return io.run(store.head("k"), 5).etag


def fetch(io: LoopThread, fetcher: Fetcher, start: int, end: int, version: str, timeout: float) -> bytes:
    """Bytes ``[start, end)`` of "k" through ``fetcher``."""
    return bytes(io.run(fetcher.get_range("k", start, end, version), timeout))


def test_transient_errors_are_retried(io: LoopThread) -> None:
    fetcher, store, events = setup(Faults(failures_left=3))
    assert fetch(io, fetcher, 2, 5, etag(store, io), 5) == b"234"
    assert events.retries == 3
    assert events.done == 1


def test_a_hanging_store_fails_within_the_deadline(io: LoopThread) -> None:
    fetcher, store, events = setup(Faults(hang=True))
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        fetch(io, fetcher, 0, 5, etag(store, io), 10)
    assert time.monotonic() - started < FAST_FETCH.deadline + 1
    assert events.failed == 1


def test_a_stopped_loop_refuses_requests_at_once() -> None:
    """What a prefetch thread still running meets while the daemon exits:
    an error now, not a wait for an answer that never comes."""
    io = LoopThread()
    io.stop()
    request = asyncio.sleep(0, "answer")
    with pytest.raises(DaemonStopping, match="stopping"):
        io.run(request, 60)
    assert request.cr_frame is None  # closed, not left never awaited


def test_a_request_waiting_when_the_loop_stops_fails_at_once() -> None:
    io = LoopThread()
    started = threading.Event()
    failures: list[Exception] = []

    async def unanswered() -> None:
        started.set()
        await asyncio.sleep(3600)

    def request() -> None:
        try:
            io.run(unanswered(), 60)
        except StoreError as exc:
            failures.append(exc)

    waiting = threading.Thread(target=request, daemon=True)
    waiting.start()
    assert started.wait(5)
    io.stop()
    waiting.join(10)  # not the request's 60 s
    assert not waiting.is_alive()
    assert [type(failure) for failure in failures] == [DaemonStopping]


@pytest.mark.parametrize("error", [AccessDenied, ObjectChanged])
def test_permanent_errors_are_not_retried(io: LoopThread, error: type[Exception]) -> None:
    fetcher, store, events = setup(Faults(failures_left=1, error=error))  # type: ignore[arg-type]
    with pytest.raises(error):
        fetch(io, fetcher, 0, 5, etag(store, io), 5)
    assert events.retries == 0


def test_a_changed_object_is_never_read(io: LoopThread) -> None:
    fetcher, store, _ = setup(Faults())
    old = etag(store, io)
    store.put("k", b"new content")
    with pytest.raises(ObjectChanged):
        fetch(io, fetcher, 0, 5, old, 5)


def test_a_short_read_is_retried_then_fails(io: LoopThread) -> None:
    fetcher, store, _ = setup(Faults())
    with pytest.raises(DeadlineExceeded, match="short read"):
        fetch(io, fetcher, 5, 20, etag(store, io), 10)


def test_giving_up_names_the_stores_last_error_not_a_timeout(io: LoopThread) -> None:
    """A bucket that failed, then stopped answering: the timeouts that follow
    (the last one perhaps only the deadline cutting it short) say less."""
    fetcher, _, _ = setup(Faults())
    calls = 0

    async def attempt() -> bytes:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise StoreError("connection reset by the bucket")
        await asyncio.Event().wait()
        return b""

    with pytest.raises(DeadlineExceeded, match="connection reset by the bucket"):
        io.run(fetcher.call("k", attempt, "demand"), 10)
    assert calls > 1


def test_waiting_demand_requests_go_before_waiting_prefetches(io: LoopThread) -> None:
    async def scenario() -> list[str]:
        slots = PrioritySlots(1)
        order: list[str] = []
        await slots.acquire(0)  # the one slot is busy

        async def request(name: str, priority: int) -> None:
            await slots.acquire(priority)
            order.append(name)
            slots.release()

        waiting = [asyncio.ensure_future(request(f"prefetch-{i}", 1)) for i in range(3)]
        waiting.append(asyncio.ensure_future(request("demand", 0)))
        while len(slots._waiters) < len(waiting):  # until every request has queued
            await asyncio.sleep(0)
        slots.release()
        await asyncio.gather(*waiting)
        return order

    assert io.run(scenario(), 5) == ["demand", "prefetch-0", "prefetch-1", "prefetch-2"]


def test_a_slow_get_is_not_cut_at_the_attempt_timeout(io: LoopThread) -> None:
    """A block must come within the deadline, not the attempt timeout: a
    4 MiB block at 0.2 MB/s takes 20 s. A listing or a HEAD, whose answer
    is small, is still cut at the attempt timeout."""
    store = MemoryStore({"k": b"0123456789"})
    slow = Faults(latency_seconds=FAST_FETCH.attempt_timeout * 2)
    assert slow.latency_seconds < FAST_FETCH.deadline
    faulty = FaultyStore(store, slow)
    events = Events()
    fetcher = Fetcher(faulty, FAST_FETCH, events)
    assert fetch(io, fetcher, 0, 10, etag(store, io), 10) == b"0123456789"
    assert events.retries == 0
    with pytest.raises(DeadlineExceeded):
        io.run(fetcher.call("head k", lambda: faulty.head("k"), "metadata"), 10)
    assert events.retries > 0


def test_a_stopped_loop_releases_its_descriptors() -> None:
    """A test suite (and stage's engines) starts and stops many loops: each
    kept its selector and pipes open, and select() failed past 1024."""
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        LoopThread().stop()
    assert len(os.listdir("/proc/self/fd")) - before < 20
