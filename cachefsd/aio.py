"""The event loop thread that owns all network I/O, and the bounded bridge
that FUSE threads use to wait on it.

FUSE requests arrive on the session's worker threads; they submit a coroutine and
block on its result. Every wait has a timeout: a FUSE thread that waited
forever would wedge the mount, and with it every process touching it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import uvloop

from cachefsd import turns
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
        """Run ``coroutine`` on the loop and wait at most ``timeout`` seconds
        (``submit``, then ``result``)."""
        return self.result(self.submit(coroutine), timeout)

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``coroutine`` on the loop, without waiting: its future, for
        ``result`` (cancelling it cancels the coroutine). Once the loop is
        stopping (the daemon is exiting), ``DaemonStopping`` at once, for a
        request already waiting as for a new one: a prefetch thread would
        otherwise wait out its timeout, and hold up the exit, on a loop
        that answers nothing."""
        with self._lock:
            if self._stopped:
                coroutine.close()
                raise DaemonStopping(_STOPPING)
            future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
            self._pending.add(future)
        future.add_done_callback(self._settled)
        return future

    def result(self, future: concurrent.futures.Future[T], timeout: float) -> T:
        """The result of a ``submit``, waited for at most ``timeout`` seconds:
        past it the coroutine is cancelled and ``DeadlineExceeded`` raised.
        A serving thread gives its turn up first (``turns``)."""
        turns.give_up()
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise DeadlineExceeded(f"no answer within {timeout:g}s") from None
        except concurrent.futures.CancelledError:
            raise DaemonStopping(_STOPPING) from None

    def _settled(self, future: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._pending.discard(future)

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
