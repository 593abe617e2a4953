"""Share one execution of a slow call among every thread that asks for the
same key at once (the second reader of a block waits for the first's GET
instead of issuing its own)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Generic, TypeVar

from cachefsd.errors import DeadlineExceeded

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class SingleFlight(Generic[K, V]):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[K, Future[V]] = {}

    def busy(self, key: K) -> bool:
        """Whether some caller is computing ``key`` now."""
        with self._lock:
            return key in self._calls

    def do(self, key: K, call: Callable[[], V], timeout: float | None) -> V:
        """``call()``'s result, computed once for all concurrent callers of
        ``key``; a follower waits at most ``timeout`` seconds for the leader
        (None: as long as the leader takes, when ``call`` bounds itself)."""
        with self._lock:
            future = self._calls.get(key)
            leads = future is None
            if future is None:
                future = self._calls[key] = Future()
        if leads:
            return self._settle({key: future}, lambda: {key: call()})[key]
        try:
            return future.result(timeout)
        except FutureTimeout:
            raise DeadlineExceeded(f"waited {timeout:g}s for a shared fetch") from None

    def lead(self, keys: list[K], call: Callable[[list[K]], dict[K, V]]) -> list[K]:
        """Compute the ``keys`` no other caller is computing with one
        ``call(led)``, which returns a value for each; callers of ``do``
        for any of them meanwhile wait for it. Keys already in flight are
        left to their leader, not waited for. Returns the keys led."""
        futures: dict[K, Future[V]] = {}
        with self._lock:
            for key in keys:
                if key not in self._calls:
                    futures[key] = self._calls[key] = Future()
        led = list(futures)
        if led:
            self._settle(futures, lambda: call(led))
        return led

    def _settle(self, futures: dict[K, Future[V]], compute: Callable[[], dict[K, V]]) -> dict[K, V]:
        """Run the leader's ``compute`` for the keys of ``futures``, hand
        its values (or its exception) to their followers, free the keys."""
        try:
            values = compute()
        except BaseException as exc:
            for future in futures.values():
                future.set_exception(exc)
            raise
        else:
            for key, future in futures.items():
                future.set_result(values[key])
            return values
        finally:
            with self._lock:
                for key in futures:
                    del self._calls[key]
