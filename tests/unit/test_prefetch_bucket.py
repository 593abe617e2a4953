"""The prefetch bandwidth cap: a token bucket one second deep, driven by
the times passed in."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from cachefsd.prefetch.bucket import TokenBucket

RATE = 100


def test_a_rate_of_zero_is_no_cap() -> None:
    bucket = TokenBucket(0, now=0.0)
    assert all(bucket.spend(1 << 30, now=0.0) for _ in range(10))


def test_a_full_bucket_gives_a_seconds_worth_then_refills_with_time() -> None:
    bucket = TokenBucket(RATE, now=0.0)
    assert bucket.spend(60, now=0.0)
    assert not bucket.spend(60, now=0.0)  # 40 left
    assert not bucket.spend(60, now=0.125)  # 52.5
    assert bucket.spend(60, now=0.25)  # 65


def test_the_bucket_is_one_second_deep() -> None:
    """After a long idle spell, a burst of a second's worth, not more."""
    bucket = TokenBucket(RATE, now=0.0)
    assert bucket.spend(RATE, now=1000.0)
    assert not bucket.spend(1, now=1000.0)


def test_a_block_larger_than_a_seconds_worth_goes_once_the_bucket_is_full() -> None:
    """Else a cap below the block size would stop prefetch for good; the
    debt then holds the next block back until it is paid."""
    bucket = TokenBucket(RATE, now=0.0)
    assert bucket.spend(250, now=0.0)
    assert not bucket.spend(10, now=1.0)  # -150 + 100
    assert not bucket.spend(10, now=1.5)  # still short of 10
    assert bucket.spend(10, now=1.7)  # 20


def test_a_refund_gives_the_tokens_back() -> None:
    bucket = TokenBucket(RATE, now=0.0)
    assert bucket.spend(RATE, now=0.0)
    assert not bucket.spend(50, now=0.0)
    bucket.refund(RATE)
    assert bucket.spend(50, now=0.0)


@given(st.lists(st.tuples(st.floats(min_value=0.0, max_value=3.0), st.integers(1, 2 * RATE)), max_size=100))
def test_spending_never_outruns_the_rate_by_more_than_a_burst(spends: list[tuple[float, int]]) -> None:
    """Over any run of spends, at most a second's worth plus the rate times
    the time passed, plus the debt one block larger than a second's worth
    may leave (here at most another second's worth)."""
    bucket, now, spent = TokenBucket(RATE, now=0.0), 0.0, 0
    for step, nbytes in spends:
        now += step
        if bucket.spend(nbytes, now):
            spent += nbytes
        assert spent <= RATE + RATE * now + RATE + 1e-6
