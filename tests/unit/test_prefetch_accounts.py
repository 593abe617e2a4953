"""The prefetcher's in-flight accounting: blocks ahead, blocks and GETs in
flight, reads that join a GET, and failed blocks held back from retries."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from cachefsd.cache.index import BlockRef
from cachefsd.prefetch.accounts import Accounts, Ahead
from cachefsd.store.base import ObjectInfo

INFO = ObjectInfo(key="train/a", size=300, etag="e1", mtime=0.0)


def ref(index: int) -> BlockRef:
    return BlockRef("mem://bucket", INFO.key, INFO.etag, index)


def ahead(index: int, nbytes: int = 100, workload: str = "train") -> Ahead:
    return Ahead(INFO, index, f"digest-{index}", nbytes, workload)


def test_a_block_in_flight_is_held_and_counted_until_it_lands() -> None:
    accounts = Accounts()
    accounts.start(ref(0), 100)
    assert accounts.holds(ref(0))
    assert not accounts.holds(ref(1))
    assert accounts.in_flight_bytes == 100
    assert not accounts.landed(ref(0))  # nobody read it meanwhile
    assert accounts.in_flight_bytes == 0
    assert not accounts.holds(ref(0))


def test_a_read_of_a_block_in_flight_joins_its_get_and_uses_nothing_yet() -> None:
    """The join counts when the block lands (used, late), not at the read."""
    accounts = Accounts()
    accounts.start(ref(0), 100)
    assert accounts.read(ref(0)) == 0
    assert accounts.landed(ref(0))
    accounts.start(ref(0), 100)  # fetched again later: the old join is forgotten
    assert not accounts.landed(ref(0))


def test_a_block_ahead_is_used_by_its_first_read_only() -> None:
    accounts = Accounts()
    accounts.put_ahead(ref(0), ahead(0, 100))
    assert accounts.holds(ref(0))
    assert accounts.ahead_bytes == 100
    assert accounts.read(ref(0)) == 100
    assert accounts.read(ref(0)) == 0
    assert accounts.ahead_bytes == 0
    assert not accounts.holds(ref(0))


def test_retiring_counts_only_the_blocks_still_ahead() -> None:
    """A block read between the look at the cache and the retirement is used, not wasted."""
    accounts = Accounts()
    for index in range(3):
        accounts.put_ahead(ref(index), ahead(index, 100))
    accounts.read(ref(1))
    assert accounts.retire([ref(0), ref(1)]) == 100
    assert accounts.retire([ref(0)]) == 0
    assert [each for each, _ in accounts.ahead()] == [ref(2)]
    assert accounts.ahead_bytes == 100


def test_a_failed_block_is_held_back_until_its_retry_time_then_forgotten() -> None:
    accounts = Accounts()
    accounts.failed([ref(0), ref(1)], retry_at=130.0)
    assert accounts.failed_lately(ref(0), now=129.9)
    assert not accounts.failed_lately(ref(0), now=130.0)
    assert not accounts.failed_lately(ref(0), now=0.0)  # forgotten, whatever the time
    assert accounts.failed_lately(ref(1), now=100.0)
    assert not accounts.failed_lately(ref(2), now=100.0)


def test_the_digests_of_a_workloads_blocks_ahead() -> None:
    accounts = Accounts()
    accounts.put_ahead(ref(0), ahead(0, workload="train"))
    accounts.put_ahead(ref(1), ahead(1, workload="val"))
    assert accounts.digests_of({"train"}) == ["digest-0"]
    assert accounts.digests_of(set()) == []


def test_gets_are_counted_apart_from_blocks() -> None:
    """The concurrency is in GETs: one run of many blocks is one."""
    accounts = Accounts()
    accounts.get_started()
    accounts.get_started()
    accounts.get_over()
    assert accounts.gets == 1


@given(st.lists(st.tuples(st.sampled_from(["start", "read", "land", "retire"]), st.integers(0, 4))))
def test_the_byte_counts_are_the_sums_of_their_blocks(steps: list[tuple[str, int]]) -> None:
    """Driven as the prefetcher drives it: a block is started only when not
    held, lands only when in flight, and goes ahead when it lands unread."""
    accounts = Accounts()
    in_flight: dict[int, int] = {}
    held_ahead: dict[int, int] = {}
    for step, index in steps:
        nbytes = 10 * (index + 1)
        if step == "start" and not accounts.holds(ref(index)):
            accounts.start(ref(index), nbytes)
            in_flight[index] = nbytes
        elif step == "read":
            accounts.read(ref(index))
            if index not in in_flight:  # else it joins the GET
                held_ahead.pop(index, None)
        elif step == "land" and index in in_flight:
            if not accounts.landed(ref(index)):
                accounts.put_ahead(ref(index), ahead(index, nbytes))
                held_ahead[index] = nbytes
            del in_flight[index]
        elif step == "retire":
            accounts.retire([ref(index)])
            held_ahead.pop(index, None)
        assert accounts.in_flight_bytes == sum(in_flight.values())
        assert accounts.ahead_bytes == sum(held_ahead.values())
