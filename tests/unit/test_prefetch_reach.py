"""The prefetcher's reach (AIMD): grows by what is read, halves once per
burst of waste, stays between its floor and its limit."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from cachefsd.prefetch.reach import Reach


def test_the_reach_grows_by_what_is_used_up_to_its_limit() -> None:
    reach = Reach(initial=100, floor=10, limit=250)
    reach.used(60)
    assert reach.bytes == 160
    reach.used(200)
    assert reach.bytes == 250


def test_a_burst_of_waste_halves_the_reach_once() -> None:
    """As TCP halves its window once per window of data, not once per lost
    packet: until a reach's worth has left the ahead set after a cut, waste
    cuts nothing more and reads earn nothing."""
    reach = Reach(initial=400, floor=30, limit=1000)
    for _ in range(5):  # an epoch's start: block after block thrown away
        reach.wasted(10)
    assert reach.bytes == 200
    reach.used(100)  # with the 40 wasted, 140 of the 200 have left: recovering
    reach.wasted(10)
    assert reach.bytes == 200
    reach.used(100)  # recovered after 50 of these; the other 50 earn reach
    assert reach.bytes == 250
    reach.wasted(10)
    assert reach.bytes == 125


def test_persistent_waste_takes_the_reach_to_its_floor() -> None:
    """A cache too small for the reach: one block read for nine thrown away."""
    reach = Reach(initial=1 << 30, floor=8 << 20, limit=2 << 30)
    for _ in range(10_000):
        reach.used(1 << 20)
        for _ in range(9):
            reach.wasted(1 << 20)
    assert reach.bytes == 8 << 20
    reach.used(1 << 20)
    reach.wasted(0)
    assert reach.bytes == 8 << 20  # never below it


@given(st.lists(st.tuples(st.booleans(), st.integers(min_value=0, max_value=1 << 20)), max_size=200))
def test_the_reach_stays_between_its_floor_and_its_limit(events: list[tuple[bool, int]]) -> None:
    reach = Reach(initial=64 << 10, floor=8 << 10, limit=1 << 20)
    for used, nbytes in events:
        if used:
            reach.used(nbytes)
        else:
            reach.wasted(nbytes)
        assert 8 << 10 <= reach.bytes <= 1 << 20
