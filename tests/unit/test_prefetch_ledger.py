"""The prefetcher's in-flight accounting: blocks ahead, blocks and GETs in
flight, reads that join a GET, and failed blocks held back from retries."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from cachefsd.cache.index import BlockRef
from cachefsd.prefetch.ledger import Ahead, Ledger
from cachefsd.store.base import ObjectInfo

INFO = ObjectInfo(key="train/a", size=300, etag="e1", mtime=0.0)


def ref(index: int) -> BlockRef:
    return BlockRef("mem://bucket", INFO.key, INFO.etag, index)


def ahead(index: int, nbytes: int = 100, job: str = "train") -> Ahead:
    return Ahead(INFO, index, f"digest-{index}", nbytes, job)


def test_a_block_in_flight_is_held_and_counted_until_it_lands() -> None:
    ledger = Ledger()
    ledger.start(ref(0), 100)
    assert ledger.holds(ref(0))
    assert not ledger.holds(ref(1))
    assert ledger.in_flight_bytes == 100
    assert not ledger.landed(ref(0))  # nobody read it meanwhile
    assert ledger.in_flight_bytes == 0
    assert not ledger.holds(ref(0))


def test_a_read_of_a_block_in_flight_joins_its_get_and_uses_nothing_yet() -> None:
    """The join counts when the block lands (used, late), not at the read."""
    ledger = Ledger()
    ledger.start(ref(0), 100)
    assert ledger.read(ref(0)) == 0
    assert ledger.landed(ref(0))
    ledger.start(ref(0), 100)  # fetched again later: the old join is forgotten
    assert not ledger.landed(ref(0))


def test_a_block_ahead_is_used_by_its_first_read_only() -> None:
    ledger = Ledger()
    ledger.put_ahead(ref(0), ahead(0, 100))
    assert ledger.holds(ref(0))
    assert ledger.ahead_bytes == 100
    assert ledger.read(ref(0)) == 100
    assert ledger.read(ref(0)) == 0
    assert ledger.ahead_bytes == 0
    assert not ledger.holds(ref(0))


def test_retiring_counts_only_the_blocks_still_ahead() -> None:
    """A block read between the look at the cache and the retirement is used, not wasted."""
    ledger = Ledger()
    for index in range(3):
        ledger.put_ahead(ref(index), ahead(index, 100))
    ledger.read(ref(1))
    assert ledger.retire([ref(0), ref(1)]) == 100
    assert ledger.retire([ref(0)]) == 0
    assert [each for each, _ in ledger.ahead()] == [ref(2)]
    assert ledger.ahead_bytes == 100


def test_a_failed_block_is_held_back_until_its_retry_time_then_forgotten() -> None:
    ledger = Ledger()
    ledger.failed([ref(0), ref(1)], retry_at=130.0)
    assert ledger.failed_lately(ref(0), now=129.9)
    assert not ledger.failed_lately(ref(0), now=130.0)
    assert not ledger.failed_lately(ref(0), now=0.0)  # forgotten, whatever the time
    assert ledger.failed_lately(ref(1), now=100.0)
    assert not ledger.failed_lately(ref(2), now=100.0)


def test_the_digests_of_a_jobs_blocks_ahead() -> None:
    ledger = Ledger()
    ledger.put_ahead(ref(0), ahead(0, job="train"))
    ledger.put_ahead(ref(1), ahead(1, job="val"))
    assert ledger.digests_of({"train"}) == ["digest-0"]
    assert ledger.digests_of(set()) == []


def test_gets_are_counted_apart_from_blocks() -> None:
    """The concurrency is in GETs: one run of many blocks is one."""
    ledger = Ledger()
    ledger.get_started()
    ledger.get_started()
    ledger.get_over()
    assert ledger.gets == 1


@given(st.lists(st.tuples(st.sampled_from(["start", "read", "land", "retire"]), st.integers(0, 4))))
def test_the_byte_counts_are_the_sums_of_their_blocks(steps: list[tuple[str, int]]) -> None:
    """Driven as the prefetcher drives it: a block is started only when not
    held, lands only when in flight, and goes ahead when it lands unread."""
    ledger = Ledger()
    in_flight: dict[int, int] = {}
    held_ahead: dict[int, int] = {}
    for step, index in steps:
        nbytes = 10 * (index + 1)
        if step == "start" and not ledger.holds(ref(index)):
            ledger.start(ref(index), nbytes)
            in_flight[index] = nbytes
        elif step == "read":
            ledger.read(ref(index))
            if index not in in_flight:  # else it joins the GET
                held_ahead.pop(index, None)
        elif step == "land" and index in in_flight:
            if not ledger.landed(ref(index)):
                ledger.put_ahead(ref(index), ahead(index, nbytes))
                held_ahead[index] = nbytes
            del in_flight[index]
        elif step == "retire":
            ledger.retire([ref(index)])
            held_ahead.pop(index, None)
        assert ledger.in_flight_bytes == sum(in_flight.values())
        assert ledger.ahead_bytes == sum(held_ahead.values())
