"""The event loop thread that owns all network I/O, and the bounded bridge
that FUSE threads use to wait on it.

FUSE requests arrive on the session's worker threads; they submit a coroutine and
block on its result. Every wait has a timeout: a FUSE thread that waited
forever would wedge the mount, and with it every process touching it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import AsyncGenerator, Coroutine, Generator
from typing import Any, TypeVar

import uvloop

from cachefsd.errors import DaemonStopping, DeadlineExceeded

T = TypeVar("T")

_STOPPING = "the daemon is stopping: no more requests to the store"


class LoopThread:
    """A uvloop event loop running in a daemon thread until ``stop``."""

    def __init__(self, name: str = "cachefsd-io") -> None:
        self._loop = uvloop.new_event_loop()
        self._lock = threading.Lock()
        # Guarded by _lock: once stopped, no request waits on the loop.
        self._stopped = False
        self._pending: set[concurrent.futures.Future[Any]] = set()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coroutine`` on the loop and wait at most ``timeout`` seconds.

        On timeout the coroutine is cancelled and ``DeadlineExceeded`` raised.
        Once the loop is stopping (the daemon is exiting), ``DaemonStopping`` at
        once, for a request already waiting as for a new one: a prefetch
        thread would otherwise wait out its timeout, and hold up the exit,
        on a loop that answers nothing."""
        with self._lock:
            if self._stopped:
                coroutine.close()
                raise DaemonStopping(_STOPPING)
            future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
            self._pending.add(future)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise DeadlineExceeded(f"no answer within {timeout:g}s") from None
        except concurrent.futures.CancelledError:
            raise DaemonStopping(_STOPPING) from None
        finally:
            with self._lock:
                self._pending.discard(future)

    def iterate(self, stream: AsyncGenerator[T, None], timeout: float) -> Generator[T, None, None]:
        """The items of ``stream`` (an async generator run on the loop), for
        a thread that is not the loop's; each waits at most ``timeout``
        seconds, as ``run``. The stream is closed when the caller stops
        early, so that its request and connection are released."""

        async def next_item() -> tuple[bool, T | None]:
            try:
                return True, await anext(stream)
            except StopAsyncIteration:
                return False, None

        try:
            while True:
                more, item = self.run(next_item(), timeout)
                if not more:
                    return
                yield item  # type: ignore[misc]  # not None: the stream gave it
        finally:
            with contextlib.suppress(DaemonStopping):  # the loop is stopping: nothing to release
                self.run(stream.aclose(), timeout)

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            pending = list(self._pending)
        for future in pending:
            future.cancel()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():  # its selector and pipes, else left open for good
            self._loop.close()
