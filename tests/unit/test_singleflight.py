"""One execution of a slow call shared by every concurrent caller of a key.

The leader is held on an event the test sets, never on a sleep; that a
follower is waiting is known from its key: ``Key`` notes each thread that
looks it up in the flight's table, which happens under the flight's lock,
so a thread that looked a key up while its leader is held has found that
leader's computation and will wait for it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future

import pytest

from cachefsd.errors import DeadlineExceeded
from cachefsd.singleflight import Abandoned, SingleFlight

# Only a failing test waits this long: a thread that should finish at once
# does so within it even on a loaded machine.
SETTLE_SECONDS = 10.0
# How long a follower waits for a leader that is held until the test says:
# any value times out, a short one keeps the test quick.
FOLLOWER_TIMEOUT_SECONDS = 0.05
FOLLOWERS = 4


class Key:
    """A hashable key that notes which threads have looked it up."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._seen = threading.Condition()
        self._looked_up_by: set[int] = set()

    def __hash__(self) -> int:
        with self._seen:
            self._looked_up_by.add(threading.get_ident())
            self._seen.notify_all()
        return hash(self.name)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Key) and other.name == self.name

    def __repr__(self) -> str:
        return f"Key({self.name!r})"

    def wait_looked_up_by(self, callers: list[Caller]) -> None:
        with self._seen:
            found = self._seen.wait_for(
                lambda: {caller.ident for caller in callers} <= self._looked_up_by, SETTLE_SECONDS
            )
        assert found, f"{self!r} was not looked up by every caller within {SETTLE_SECONDS:g}s"


class Caller(threading.Thread):
    """``run()`` on a thread of its own; its result or exception kept."""

    def __init__(self, run: Callable[[], object]) -> None:
        super().__init__(daemon=True)
        self._call = run
        self.result: object = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self._call()
        except BaseException as exc:  # handed to the test
            self.error = exc

    def finished(self) -> Caller:
        self.join(SETTLE_SECONDS)
        assert not self.is_alive(), f"still waiting after {SETTLE_SECONDS:g}s"
        return self


def started(*runs: Callable[[], object]) -> list[Caller]:
    callers = [Caller(run) for run in runs]
    for caller in callers:
        caller.start()
    return callers


class Held:
    """A leader's call that signals when it runs, then waits until released."""

    def __init__(self, value: object = "leader's", error: BaseException | None = None) -> None:
        self.value = value
        self.error = error
        self.running = threading.Event()
        self.release = threading.Event()
        self.calls = 0

    def __call__(self) -> object:
        self.calls += 1
        self.running.set()
        assert self.release.wait(SETTLE_SECONDS), "never released"
        if self.error is not None:
            raise self.error
        return self.value

    def wait_running(self) -> None:
        assert self.running.wait(SETTLE_SECONDS), "the leader's call did not start"


class Counted:
    """A call that returns its value at once, counting how often it ran."""

    def __init__(self, value: object) -> None:
        self.value = value
        self.calls = 0

    def __call__(self) -> object:
        self.calls += 1
        return self.value


def test_concurrent_callers_share_one_execution() -> None:
    flight: SingleFlight[Key, object] = SingleFlight()
    key = Key("k")
    held = Held()
    [leader] = started(lambda: flight.do(key, held, timeout=None))
    held.wait_running()
    own = Counted("follower's own")
    followers = started(*[lambda: flight.do(key, own, timeout=None)] * FOLLOWERS)
    key.wait_looked_up_by(followers)
    held.release.set()
    for caller in [leader, *followers]:
        caller.finished()
        assert caller.error is None
        assert caller.result == "leader's"
    assert held.calls == 1
    assert own.calls == 0


def test_different_keys_do_not_wait_for_each_other() -> None:
    flight: SingleFlight[str, object] = SingleFlight()
    held = Held()
    [leader] = started(lambda: flight.do("a", held, timeout=None))
    held.wait_running()
    other = Counted("b's")
    assert flight.do("b", other, timeout=FOLLOWER_TIMEOUT_SECONDS) == "b's"
    assert other.calls == 1
    held.release.set()
    assert leader.finished().result == "leader's"


def test_a_follower_gives_up_at_its_timeout() -> None:
    flight: SingleFlight[str, object] = SingleFlight()
    held = Held()
    [leader] = started(lambda: flight.do("k", held, timeout=None))
    held.wait_running()
    own = Counted("follower's own")
    try:
        with pytest.raises(DeadlineExceeded):
            flight.do("k", own, timeout=FOLLOWER_TIMEOUT_SECONDS)
        assert own.calls == 0  # it waited for the leader, did not lead
        assert flight.busy("k")  # the leader is not disturbed by a follower leaving
    finally:
        held.release.set()
    assert leader.finished().result == "leader's"


def test_the_leaders_exception_reaches_every_follower() -> None:
    flight: SingleFlight[Key, object] = SingleFlight()
    key = Key("k")
    boom = ValueError("the store failed")
    held = Held(error=boom)
    [leader] = started(lambda: flight.do(key, held, timeout=None))
    held.wait_running()
    own = Counted("follower's own")
    followers = started(*[lambda: flight.do(key, own, timeout=None)] * FOLLOWERS)
    key.wait_looked_up_by(followers)
    held.release.set()
    for caller in [leader, *followers]:
        assert caller.finished().error is boom
    assert own.calls == 0  # a failure is shared, not retried by each follower
    # The failed call is not kept: the next caller computes anew.
    assert not flight.busy(key)
    assert flight.do(key, Counted("again"), timeout=None) == "again"


def test_claimed_keys_settle_one_by_one() -> None:
    """A waiter of a run's first key has its value before the last key is
    computed (a reader of a run's first block does not wait for its last)."""
    flight: SingleFlight[Key, object] = SingleFlight()
    first, middle, last = Key("first"), Key("middle"), Key("last")
    claimed = flight.claim([first, middle, last])
    assert set(claimed) == {first, middle, last}
    assert all(flight.busy(key) for key in (first, middle, last))
    own = Counted("follower's own")
    [follower] = started(lambda: flight.do(first, own, timeout=None))
    first.wait_looked_up_by([follower])
    rest = threading.Event()

    def call(keys: list[Key], settle: Callable[[Key, object], None]) -> None:
        assert keys == [first, middle, last]
        settle(first, "first's")
        assert rest.wait(SETTLE_SECONDS), "never told to go on"
        settle(middle, "middle's")
        settle(last, "last's")

    [computing] = started(lambda: flight.compute(claimed, call))
    try:
        assert follower.finished().result == "first's"
        assert own.calls == 0
        assert not flight.busy(first)  # freed as soon as it settled
        assert flight.busy(middle)  # the run is still under way
        assert flight.busy(last)
    finally:
        rest.set()
    assert computing.finished().error is None
    assert not flight.busy(middle)
    assert not flight.busy(last)


def test_claim_leaves_keys_in_flight_to_their_leader() -> None:
    flight: SingleFlight[str, object] = SingleFlight()
    held = Held()
    [leader] = started(lambda: flight.do("taken", held, timeout=None))
    held.wait_running()
    try:
        claimed = flight.claim(["taken", "free"])
        assert set(claimed) == {"free"}  # not waited for, not taken over
        assert flight.current("taken") is not claimed.get("taken")
    finally:
        held.release.set()
    assert leader.finished().result == "leader's"
    flight.compute(claimed, lambda keys, settle: settle("free", "free's"))
    assert not flight.busy("free")


def test_keys_left_unsettled_are_computed_anew_by_their_waiters() -> None:
    """A run cut short on purpose: the waiters of the keys it did not reach
    compute them themselves, each once, rather than failing."""
    flight: SingleFlight[Key, object] = SingleFlight()
    reached, cut = Key("reached"), Key("cut")
    claimed = flight.claim([reached, cut])
    cut_future = flight.current(cut)
    assert cut_future is not None
    own = Counted("computed by its waiter")
    [waiter] = started(lambda: flight.do(cut, own, timeout=None))
    cut.wait_looked_up_by([waiter])
    flight.compute(claimed, lambda keys, settle: settle(reached, "reached's"))
    assert waiter.finished().error is None
    assert waiter.result == "computed by its waiter"
    assert own.calls == 1
    with pytest.raises(Abandoned):
        cut_future.result(0)
    assert not flight.busy(cut)


def test_a_failed_run_hands_its_exception_to_the_keys_it_did_not_settle() -> None:
    flight: SingleFlight[str, object] = SingleFlight()
    claimed = flight.claim(["done", "failed"])
    futures = {key: flight.current(key) for key in claimed}
    boom = OSError("the connection broke mid-body")

    def call(keys: list[str], settle: Callable[[str, object], None]) -> None:
        settle("done", "done's")
        raise boom

    with pytest.raises(OSError, match="mid-body") as raised:
        flight.compute(claimed, call)
    assert raised.value is boom  # the caller of compute learns of it too
    done, failed = futures["done"], futures["failed"]
    assert done is not None
    assert failed is not None
    assert done.result(0) == "done's"
    assert failed.exception(0) is boom
    assert not flight.busy("done")
    assert not flight.busy("failed")
    assert flight.do("failed", Counted("again"), timeout=None) == "again"


def test_busy_and_current_follow_the_computation() -> None:
    flight: SingleFlight[str, object] = SingleFlight()
    assert not flight.busy("k")
    assert flight.current("k") is None
    held = Held()
    [leader] = started(lambda: flight.do("k", held, timeout=None))
    held.wait_running()
    try:
        assert flight.busy("k")
        assert not flight.busy("other")
        under_way = flight.current("k")
        assert isinstance(under_way, Future)
        assert not under_way.done()
        assert flight.current("k") is under_way  # one computation, whoever asks
    finally:
        held.release.set()
    assert leader.finished().result == "leader's"
    assert under_way.result(0) == "leader's"  # its waiters keep it after the key is freed
    assert not flight.busy("k")
    assert flight.current("k") is None


def test_a_settled_key_is_free_and_the_next_call_computes_anew() -> None:
    """Results are not cached here: by the next call the block is in the
    block cache, and a value kept would outlive its version."""
    flight: SingleFlight[str, object] = SingleFlight()
    first, second = Counted(1), Counted(2)
    assert flight.do("k", first, timeout=None) == 1
    assert not flight.busy("k")
    assert flight.do("k", second, timeout=None) == 2
    assert (first.calls, second.calls) == (1, 1)
    claimed = flight.claim(["k"])
    assert set(claimed) == {"k"}  # free to claim too
    flight.compute(claimed, lambda keys, settle: settle("k", 3))
    assert flight.do("k", Counted(4), timeout=None) == 4


def test_a_key_is_free_before_its_waiters_learn_how_it_ended() -> None:
    """A waiter that calls again as soon as it has its answer (a retry after
    a failure) leads a new computation, never finds the one that ended. A
    future's callbacks run as it is set, so they see what a waiter woken
    then would."""
    flight: SingleFlight[str, object] = SingleFlight()
    busy_when_ended: dict[str, bool] = {}

    def watch(claimed: dict[str, Future[object]]) -> None:
        for key, future in claimed.items():
            future.add_done_callback(lambda _, key=key: busy_when_ended.__setitem__(key, flight.busy(key)))

    run = flight.claim(["settled", "failed"])
    watch(run)

    def fails_after_the_first(keys: list[str], settle: Callable[[str, object], None]) -> None:
        settle("settled", "settled's")
        raise ValueError("cut")

    with pytest.raises(ValueError, match="cut"):
        flight.compute(run, fails_after_the_first)
    cut_short = flight.claim(["abandoned"])
    watch(cut_short)
    flight.compute(cut_short, lambda keys, settle: None)
    assert busy_when_ended == {"settled": False, "failed": False, "abandoned": False}
