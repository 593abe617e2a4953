"""Share one execution of a slow call among every thread that asks for the
same key at once (the second reader of a block waits for the first's GET
instead of issuing its own)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Generic, TypeVar

from cachefsd import turns
from cachefsd.errors import DeadlineExceeded

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Abandoned(Exception):
    """The leader stopped without computing the key (a run cut short on
    purpose): whoever waited for it computes it anew."""


class SingleFlight(Generic[K, V]):
    """The calls in flight by key, so that concurrent callers of one key share one execution."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[K, Future[V]] = {}

    def busy(self, key: K) -> bool:
        """Whether some caller is computing ``key`` now."""
        return self.current(key) is not None

    def current(self, key: K) -> Future[V] | None:
        """The computation of ``key`` under way, to wait on for as long as
        the caller chooses; None if nobody computes it now."""
        with self._lock:
            return self._calls.get(key)

    def do(self, key: K, call: Callable[[], V], timeout: float | None) -> V:
        """``call()``'s result, computed once for all concurrent callers of
        ``key``; a follower waits at most ``timeout`` seconds for the leader
        (None: as long as the leader takes, when ``call`` bounds itself),
        and takes the lead itself if the leader abandons the key (a wait
        per leader)."""
        while True:
            with self._lock:
                future = self._calls.get(key)
                leads = future is None
                if future is None:
                    future = self._calls[key] = Future()
            if leads:
                self._settle({key: future}, lambda settle: settle(key, call()))
                return future.result()
            turns.give_up()  # the leader may be waiting on the network
            try:
                return future.result(timeout)
            except FutureTimeout:
                raise DeadlineExceeded(f"waited {timeout:g}s for a shared fetch") from None
            except Abandoned:
                continue

    def claim(self, keys: list[K]) -> dict[K, Future[V]]:
        """Take the lead of the ``keys`` no other caller is computing (those
        are left to their leader, not waited for): from now on callers of
        ``do`` for any of them wait for ``compute``, which the caller must
        then run, on any thread."""
        claimed: dict[K, Future[V]] = {}
        with self._lock:
            for key in keys:
                if key not in self._calls:
                    claimed[key] = self._calls[key] = Future()
        return claimed

    def compute(
        self, claimed: dict[K, Future[V]], call: Callable[[list[K], Callable[[K, V], None]], None]
    ) -> None:
        """Compute the ``claimed`` keys with one ``call(keys, settle)``,
        which hands each key's value to ``settle`` as soon as it has it (a
        run's first block is read before its last arrives). ``call`` may
        return without settling some keys (it stopped early): their callers
        compute them themselves. Its exception goes to the callers of the
        keys it did not settle."""
        keys = list(claimed)
        self._settle(claimed, lambda settle: call(keys, settle))

    def _settle(self, futures: dict[K, Future[V]], compute: Callable[[Callable[[K, V], None]], None]) -> None:
        """Run the leader's ``compute``, which settles the keys of
        ``futures`` one by one; hand its exception to those it did not
        settle. A key is freed as soon as it is settled: its value is then
        held only by the callers waiting for it (a run's blocks are not all
        in RAM until its last one comes), and the next caller computes anew
        (a fetched block is in the cache by then). Keys left unsettled are
        freed before their callers learn of it, so that one retrying leads
        anew rather than finding the same failed call."""
        pending = futures  # emptied as keys settle: the caller's dict must not keep their values

        def settle(key: K, value: V) -> None:
            future = pending.pop(key)
            with self._lock:
                del self._calls[key]
            future.set_result(value)

        try:
            compute(settle)
        except BaseException as exc:
            self._free(pending)
            for future in pending.values():
                future.set_exception(exc)
            raise
        self._free(pending)
        for key, future in pending.items():
            future.set_exception(Abandoned(f"the leader stopped before {key!r}"))

    def _free(self, pending: dict[K, Future[V]]) -> None:
        with self._lock:
            for key in pending:
                del self._calls[key]
