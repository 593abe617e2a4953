"""Eviction policies: each policy's order and refusals, epoch detection, and bookkeeping invariants."""

from __future__ import annotations

import random
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachefsd.cache.policy import (
    DEFAULT_POLICY,
    POLICY_NAMES,
    EpochAwarePolicy,
    EvictionPolicy,
    LruPolicy,
    MinioPolicy,
    ReadMarks,
    TwoRandomPolicy,
    make_policy,
)
from cachefsd.workload.model import WorkloadModel


class FakeClock:
    """An ``EpochClock`` the test advances by hand."""

    def __init__(self) -> None:
        self.epoch = 0

    def current(self) -> int:
        return self.epoch


class OtherJobs:
    """A ``DueElsewhere``: the blocks another job is still to read, a set the test edits."""

    def __init__(self) -> None:
        self.due: set[str] = set()

    def due_elsewhere(self, block: str) -> bool:
        return block in self.due


class PlanOracle:
    """A ``NextUse`` backed by a dict the test edits; missing = unknown."""

    def __init__(self) -> None:
        self.plan: dict[str, float] = {}

    def next_use(self, block: str) -> float | None:
        return self.plan.get(block)


def fill(policy: EvictionPolicy, *blocks: str) -> None:
    for block in blocks:
        policy.admitted(block)


# --- LRU ---------------------------------------------------------------------------------------------


def test_lru_evicts_least_recently_read() -> None:
    policy = LruPolicy()
    fill(policy, "a", "b", "c")
    policy.accessed("a")
    assert policy.victim() == "b"
    policy.removed("b")
    assert policy.victim() == "c"
    policy.admitted("c")  # re-admission counts as a read
    assert policy.victim() == "a"


def test_lru_empty_and_unknown_blocks() -> None:
    policy = LruPolicy()
    assert policy.victim() is None
    policy.accessed("ghost")
    policy.removed("ghost")
    assert len(policy) == 0


# --- MinIO -------------------------------------------------------------------------------------------


def test_minio_refuses_once_full_and_tracks_residents() -> None:
    policy = MinioPolicy()
    fill(policy, "a", "b")
    policy.accessed("a")
    assert policy.victim("c") is None
    policy.removed("a")
    assert "a" not in policy
    assert len(policy) == 1


# --- 2-random ----------------------------------------------------------------------------------------


def test_two_random_with_two_blocks_evicts_the_older() -> None:
    policy = TwoRandomPolicy(random.Random(1))
    fill(policy, "a", "b")
    policy.accessed("a")
    assert all(policy.victim() == "b" for _ in range(20))


def test_two_random_evicts_one_of_its_sample_never_the_newest() -> None:
    policy = TwoRandomPolicy(random.Random(7))
    blocks = [f"b{index}" for index in range(10)]
    fill(policy, *blocks)
    policy.accessed("b3")  # now the most recently read
    victims = {policy.victim() for _ in range(500)}
    assert "b3" not in victims
    assert victims <= set(blocks)
    # The oldest block loses every sample it is in, so it is picked about 2/n of the time.
    assert "b0" in victims


def test_two_random_swap_remove_keeps_sampling_valid() -> None:
    policy = TwoRandomPolicy(random.Random(3))
    fill(policy, "a", "b", "c", "d")
    policy.removed("a")  # swaps "d" into the hole
    policy.removed("d")
    assert {policy.victim() for _ in range(100)} <= {"b", "c"}
    policy.removed("b")
    assert policy.victim() == "c"
    policy.removed("c")
    assert policy.victim() is None


# --- epoch-aware -------------------------------------------------------------------------------------


def test_epoch_aware_refuses_while_every_resident_is_unread_this_epoch() -> None:
    clock = FakeClock()
    policy = EpochAwarePolicy(clock)
    fill(policy, "a", "b")
    clock.epoch = 1
    assert policy.victim("c") is None


def test_epoch_aware_evicts_earliest_read_this_epoch_first() -> None:
    clock = FakeClock()
    policy = EpochAwarePolicy(clock)
    fill(policy, "a", "b", "c")
    clock.epoch = 1
    policy.accessed("c")
    policy.accessed("b")
    assert policy.victim() == "c"
    policy.removed("c")
    assert policy.victim() == "b"
    policy.admitted("d")  # admission is a read: a candidate, after "b"
    policy.removed("b")
    assert policy.victim() == "d"
    policy.removed("d")
    assert policy.victim() is None  # "a" is still to be read this epoch


def test_epoch_aware_keeps_what_one_job_read_while_another_is_still_to_read_it() -> None:
    """Two jobs on one dataset: a block one read this epoch and the other is
    still to read is due, as if unread; once the other reads it too, it is
    read this epoch and a victim as for one job."""
    clock, others = FakeClock(), OtherJobs()
    policy = EpochAwarePolicy(clock, elsewhere=others)
    fill(policy, "stale", "a", "b")
    clock.epoch = 2
    others.due = {"a", "b"}
    policy.accessed("a")
    policy.accessed("b")
    assert (policy.victim(), policy.spare()) == ("stale", 1)
    policy.removed("stale")
    assert (policy.victim(), policy.spare()) == (None, 0)
    others.due = set()
    policy.accessed("b")  # the second job's read: nobody is to read it again this epoch
    assert (policy.victim(), policy.spare()) == ("b", 1)


def test_epoch_aware_keeps_a_block_due_elsewhere_through_the_leading_jobs_next_epoch() -> None:
    """The clock is the leading job's epoch: a job one epoch behind still
    needs what it has not read, after the leader moved on; two epochs on, an
    unread due block is as stale as any."""
    clock, others = FakeClock(), OtherJobs()
    policy = EpochAwarePolicy(clock, elsewhere=others)
    clock.epoch = 2
    fill(policy, "done")
    others.due = {"due"}
    policy.admitted("due")
    policy.accessed("due")
    clock.epoch = 3  # the leader's next epoch
    assert (policy.victim(), policy.spare()) == (
        None,
        0,
    )  # "done" is now due for the leader, "due" for the other
    clock.epoch = 4
    assert policy.victim() == "done"
    policy.removed("done")
    assert (policy.victim(), policy.spare()) == ("due", 1)


def test_epoch_aware_keeps_a_block_admitted_for_a_read_another_job_is_still_to_make() -> None:
    """A block fetched (or promoted) for a read is admitted as read: the
    oracle is asked then too. The one another job still needs stays; the
    one nobody needs is the victim."""
    clock, others = FakeClock(), OtherJobs()
    policy = EpochAwarePolicy(clock, elsewhere=others)
    others.due = {"needed"}
    fill(policy, "needed", "done")
    assert (policy.victim("new"), policy.spare()) == ("done", 1)
    policy.removed("done")
    assert policy.victim("new") is None


def test_read_marks_mark_the_blocks_of_one_read_on_its_thread_only() -> None:
    marks = ReadMarks()
    assert not marks.due_elsewhere("a")  # no read marked
    seen_elsewhere: list[bool] = []
    with marks.reading({"a", "b"}.__contains__):
        assert marks.due_elsewhere("a")
        assert marks.due_elsewhere("b")
        assert not marks.due_elsewhere("c")  # not the read's: a block demoted meanwhile, say
        other = threading.Thread(target=lambda: seen_elsewhere.append(marks.due_elsewhere("a")))
        other.start()
        other.join()
    assert seen_elsewhere == [False]  # another thread's read is not marked
    assert not marks.due_elsewhere("a")  # the read is over


def test_a_read_mark_within_another_restores_the_outer_one() -> None:
    marks = ReadMarks()
    with marks.reading({"a"}.__contains__):
        with marks.reading({"b"}.__contains__):
            assert (marks.due_elsewhere("a"), marks.due_elsewhere("b")) == (False, True)
        assert (marks.due_elsewhere("a"), marks.due_elsewhere("b")) == (True, False)
    assert not marks.due_elsewhere("a")


def test_epoch_aware_keeps_a_block_fetched_ahead_until_it_is_read() -> None:
    clock = FakeClock()
    policy = EpochAwarePolicy(clock)
    fill(policy, "a")
    policy.admitted("ahead", ahead=True)
    assert (policy.victim("new"), policy.spare()) == ("a", 1)
    policy.removed("a")
    assert (policy.victim("new"), policy.spare()) == (None, 0)  # not read yet: protected
    policy.accessed("ahead")
    assert (policy.victim("new"), policy.spare()) == ("ahead", 1)


def test_epoch_aware_evicts_what_left_the_working_set_first() -> None:
    clock = FakeClock()
    policy = EpochAwarePolicy(clock)
    fill(policy, "old", "kept")
    clock.epoch = 1
    policy.accessed("kept")
    policy.admitted("ahead", ahead=True)
    fill(policy, "now")
    clock.epoch = 2  # "old" was read in neither epoch 1 nor 2, nor "ahead"
    policy.accessed("now")
    assert policy.spare() == 3
    assert policy.victim("new") == "old"
    policy.removed("old")
    assert policy.victim("new") == "ahead"
    policy.removed("ahead")
    assert policy.victim("new") == "now"  # then what this epoch has read; "kept" is due
    policy.removed("now")
    assert policy.victim("new") is None


def test_epoch_aware_rereads_move_a_block_to_the_back() -> None:
    clock = FakeClock()
    policy = EpochAwarePolicy(clock)
    fill(policy, "a", "b")
    policy.accessed("a")  # a block being read in several FUSE reads stays
    assert policy.victim() == "b"


def test_epoch_aware_unknown_next_use_read_this_epoch_goes_first() -> None:
    clock, oracle = FakeClock(), PlanOracle()
    policy = EpochAwarePolicy(clock, oracle)
    oracle.plan = {"far": 100.0, "near": 5.0}
    fill(policy, "far", "near", "done")
    assert policy.victim("new") == "done"


def test_epoch_aware_with_plan_evicts_farthest_only_for_a_sooner_newcomer() -> None:
    clock, oracle = FakeClock(), PlanOracle()
    policy = EpochAwarePolicy(clock, oracle)
    oracle.plan = {"far": 100.0, "near": 5.0, "mid": 50.0}
    fill(policy, "far", "near")
    assert policy.victim("mid") == "far"
    assert policy.victim("unplanned") is None  # unknown: just read, farther than any plan
    assert policy.victim() is None  # no newcomer to compare with
    oracle.plan["later"] = 200.0
    assert policy.victim("later") is None


def test_epoch_aware_spare_counts_residents_planned_after_the_newcomer() -> None:
    clock, oracle = FakeClock(), PlanOracle()
    policy = EpochAwarePolicy(clock, oracle)
    oracle.plan = {f"p{use}": float(use) for use in range(10)}
    fill(policy, *oracle.plan)
    clock.epoch = 1  # nothing read this epoch: only the plan can free room
    assert policy.spare() == 0
    assert policy.spare(incoming_use=6.5) == 3  # p7, p8, p9
    assert policy.spare(incoming_use=6.5, enough=2) == 2  # the walk stops once it has found enough
    assert policy.spare(incoming_use=20.0) == 0
    oracle.plan["p9"] = 1.0  # outdated heap entries are not counted
    policy.next_use_changed("p9")
    assert policy.spare(incoming_use=6.5) == 2


def test_epoch_aware_plan_changes_are_seen() -> None:
    clock, oracle = FakeClock(), PlanOracle()
    policy = EpochAwarePolicy(clock, oracle)
    oracle.plan = {"a": 10.0, "b": 20.0, "new": 15.0}
    fill(policy, "a", "b", "c")
    clock.epoch = 1  # "c": unread this epoch, unplanned: protected
    assert policy.victim("new") == "b"
    oracle.plan["b"] = 12.0  # re-ranked lazily on the next victim call
    assert policy.victim("new") is None
    oracle.plan["c"] = 30.0
    policy.next_use_changed("c")
    assert policy.victim("new") == "c"
    del oracle.plan["c"]  # dropped from the plan: back to unread-this-epoch
    assert policy.victim("new") is None
    policy.accessed("c")  # read in epoch 1, unplanned: first to go
    assert policy.victim("new") == "c"


def test_epoch_aware_heap_stays_bounded_under_rereads() -> None:
    clock, oracle = FakeClock(), PlanOracle()
    policy = EpochAwarePolicy(clock, oracle)
    fill(policy, "a", "b")
    for step in range(10_000):
        oracle.plan["a"] = float(step)
        policy.accessed("a")
    assert len(policy._heap) <= 8  # stale entries are compacted, not kept forever


# --- epoch detection ---------------------------------------------------------------------------------


class Reads:
    """The workload model (the policies' epoch clock in the daemon), told of
    each file's read as the mount tells it: an open, 1 ms after the last."""

    def __init__(self) -> None:
        self.model = WorkloadModel()
        self._now = 0.0

    def read(self, name: str) -> int:
        self._now += 0.001
        self.model.opened(name, 1000, self._now)
        return self.model.current()


def run_epochs(orders: list[list[str]]) -> list[tuple[int, int]]:
    """(true epoch, detected epoch) per read of the ``orders``."""
    reads = Reads()
    return [(epoch, reads.read(name)) for epoch, order in enumerate(orders) for name in order]


FILES = [f"f{index:04d}" for index in range(200)]


def test_epochs_of_shuffled_passes() -> None:
    rng = random.Random(5)
    orders = [rng.sample(FILES, len(FILES)) for _ in range(4)]
    assert all(true == seen for true, seen in run_epochs(orders))


def test_epochs_of_sequential_passes() -> None:
    assert all(true == seen for true, seen in run_epochs([FILES] * 4))


def test_an_early_reread_starts_no_epoch() -> None:
    reads = Reads()
    for name in FILES:
        reads.read(name)
    for name in FILES[:10]:
        reads.read(name)
    assert reads.model.current() == 1
    assert reads.read(FILES[3]) == 1  # 10 of 200 read this epoch: not a new epoch
    for name in FILES[10:]:
        reads.read(name)
    assert reads.read(FILES[0]) == 2


def test_epochs_of_a_different_shard_each_pass() -> None:
    """A distributed sampler: each epoch reads a fresh half of the files; the boundary lags a little."""
    rng = random.Random(11)
    reads = Reads()
    boundaries = []
    count = 0
    for _ in range(5):
        for name in rng.sample(FILES, len(FILES) // 2):
            before = reads.model.current()
            if reads.read(name) != before:
                boundaries.append(count)
            count += 1
    starts = range(len(FILES) // 2, count, len(FILES) // 2)
    assert len(boundaries) == len(starts)
    assert all(0 <= seen - start < 10 for seen, start in zip(boundaries, starts, strict=True))


# --- factory -----------------------------------------------------------------------------------------


def test_make_policy_knows_every_name() -> None:
    kinds = {name: type(make_policy(name, FakeClock(), random.Random(0))) for name in POLICY_NAMES}
    assert kinds == {
        "lru": LruPolicy,
        "2-random": TwoRandomPolicy,
        "minio": MinioPolicy,
        "epoch-aware": EpochAwarePolicy,
    }
    assert DEFAULT_POLICY == "epoch-aware"
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("arc", FakeClock(), random.Random(0))


# --- invariants under random operation sequences -----------------------------------------------------

BLOCKS = [f"h{index}" for index in range(6)]
OPERATIONS = st.lists(
    st.tuples(
        st.sampled_from(["admit", "ahead", "access", "remove", "victim", "evict", "tick", "plan", "unplan"]),
        st.sampled_from(BLOCKS),
        st.integers(0, 50),
    ),
    max_size=80,
)


def drive(
    policy: EvictionPolicy, clock: FakeClock, oracle: PlanOracle, operation: str, block: str, value: int
) -> None:
    """Apply one operation that needs no answer from the policy."""
    if operation == "admit":
        policy.admitted(block)
    elif operation == "ahead":
        policy.admitted(block, ahead=True)
    elif operation == "access":
        policy.accessed(block)  # a no-op for a block the policy does not hold
    elif operation == "remove":
        policy.removed(block)
    elif operation == "tick":
        clock.epoch += 1
    elif operation == "plan":
        oracle.plan[block] = float(value)
        if isinstance(policy, EpochAwarePolicy):
            policy.next_use_changed(block)
    elif operation == "unplan":
        oracle.plan.pop(block, None)  # unannounced: victim must cope


@pytest.mark.parametrize("name", [*POLICY_NAMES, "epoch-aware+plan"])
@settings(max_examples=150, deadline=None)
@given(operations=OPERATIONS, seed=st.integers(0, 2**16))
def test_policy_bookkeeping_matches_a_reference(
    name: str, operations: list[tuple[str, str, int]], seed: int
) -> None:
    clock, oracle = FakeClock(), PlanOracle()
    if name == "epoch-aware+plan":
        policy: EvictionPolicy = EpochAwarePolicy(clock, oracle)
    else:
        policy = make_policy(name, clock, random.Random(seed))
    resident: list[str] = []  # least recently read first
    read_in: dict[str, int] = {}
    for operation, block, value in operations:
        if operation == "ahead" and block in resident:
            continue  # the cache fetches ahead only what it does not hold
        drive(policy, clock, oracle, operation, block, value)
        if operation == "admit" or (operation == "access" and block in resident):
            if block in resident:
                resident.remove(block)
            resident.append(block)
            read_in[block] = clock.epoch
        elif operation == "ahead":
            resident.append(block)
            read_in[block] = clock.epoch - 1  # not read yet: due this epoch
        elif operation == "remove" and block in resident:
            resident.remove(block)
        elif operation in ("victim", "evict"):
            chosen = policy.victim(block)
            assert chosen is None or chosen in resident
            check_choice(name, chosen, resident, read_in, clock.epoch)
            if operation == "evict" and chosen is not None:
                policy.removed(chosen)
                resident.remove(chosen)
        check_spare(name, policy.spare(), resident, read_in, clock.epoch)
        assert len(policy) == len(resident)  # type: ignore[arg-type]  # every policy has __len__
        assert all((candidate in policy) == (candidate in resident) for candidate in BLOCKS)  # type: ignore[operator]


def check_choice(
    name: str, chosen: str | None, resident: list[str], read_in: dict[str, int], now: int
) -> None:
    """What each policy may answer, beyond "a resident or None"."""
    if name == "lru":
        assert chosen == (resident[0] if resident else None)
    elif name == "2-random":
        assert (chosen is None) == (not resident)
        if len(resident) > 1:
            assert chosen != resident[-1]
    elif name == "minio":
        assert chosen is None
    elif name == "epoch-aware":
        stale = [block for block in resident if read_in[block] < now - 1]
        oldest = min((read_in[block] for block in stale), default=None)
        candidates = [block for block in stale if read_in[block] == oldest] or [
            block for block in resident if read_in[block] == now
        ]
        assert chosen == (candidates[0] if candidates else None)


def check_spare(name: str, spare: int, resident: list[str], read_in: dict[str, int], now: int) -> None:
    """How many blocks each policy says it would give up for an unplanned newcomer."""
    evictable = sum(1 for block in resident if read_in[block] != now - 1)  # stale or read this epoch
    expected = {"lru": len(resident), "2-random": len(resident), "minio": 0, "epoch-aware": evictable}
    if name in expected:
        assert spare == expected[name]
    else:  # with a plan, an upper bound: blocks the plan has since placed are re-ranked lazily
        assert spare <= evictable
