"""The workload model as a mount, the prefetcher and the eviction policy use
it: predictions over workloads, the epoch clock, what a job read, stats,
and consistency under concurrent and random events."""

from __future__ import annotations

import random
import threading

from hypothesis import given, settings
from hypothesis import strategies as st

from cachefsd.cache.policy import EpochAwarePolicy
from cachefsd.workload.identity import JOB_IDLE_SECONDS
from cachefsd.workload.model import WorkloadModel
from tests.unit.traces import (
    MIB,
    SMALL,
    Trace,
    dataset,
    details,
    listed_dataset,
    paths_of,
    workloads,
)


def test_predictions_interleave_workloads_round_robin() -> None:
    model = WorkloadModel()
    a_files, b_files = listed_dataset(model, "a", 10), listed_dataset(model, "b", 10)
    trace = Trace(model)
    trace.open(a_files[0])
    trace.open(b_files[0])
    predicted = paths_of(model.predict(6))
    assert predicted == [a_files[1], b_files[1], a_files[2], b_files[2], a_files[3], b_files[3]]
    assert len(model.predict(1000)) == 18


def test_an_idle_workload_predicts_nothing() -> None:
    model = WorkloadModel()
    listed_dataset(model, "old", 5)
    listed_dataset(model, "new", 5)
    model.opened("old/img0000.jpg", SMALL, 0.0)
    model.opened("new/img0000.jpg", SMALL, JOB_IDLE_SECONDS + 1.0)
    assert {prediction.workload for prediction in model.predict(100)} == {"new"}


def test_interleaved_workloads_keep_separate_epochs_and_unread_sets() -> None:
    model = WorkloadModel()
    a_files, b_files = listed_dataset(model, "a", 10), listed_dataset(model, "b", 30)
    trace = Trace(model)
    a_trace = a_files * 3
    for step in range(30):
        trace.open(a_trace[step])
        trace.open(b_files[step])
        if step == 14:
            # b has read half its files: a's re-reads must not touch b.
            assert (model.epoch_of("a"), model.epoch_of("b")) == (1, 0)
            predicted = model.predict(1000)
            assert {p.path for p in predicted if p.workload == "b"} == set(b_files[15:])
            assert {p.path for p in predicted if p.workload == "a"} == set(a_files[5:])
    assert (model.epoch_of("a"), model.epoch_of("b")) == (2, 0)
    assert model.current() == 2
    assert model.predict(1000) == []


def test_the_model_is_an_epoch_clock_for_the_eviction_policy() -> None:
    model = WorkloadModel()
    policy = EpochAwarePolicy(model)
    files = dataset("c", 4)
    trace = Trace(model)
    trace.pass_over(files)
    policy.admitted("block-a")
    trace.open(files[0])
    assert model.current() == 1
    assert policy.victim() is None  # block-a was read in epoch 0: still to come


def test_stats_report_epochs_sizes_streams_and_hints() -> None:
    model = WorkloadModel()
    files = listed_dataset(model, "s", 10)
    trace = Trace(model)
    trace.pass_over(files[:4])
    stats = model.stats()
    assert stats["epoch"] == 0
    assert stats["workloads"] == 1
    assert stats["working_set_files"] == 10
    assert stats["unread_files"] == 6
    assert stats["read_this_epoch_files"] == 4
    assert stats["active_streams"] == 0
    assert stats["hint_coverage"] == 0.0
    assert details(model, "s") == {
        "epoch": 0,
        "working_set_files": 10,
        "unread_files": 6,
        "read_this_epoch_files": 4,
        "order": "unknown",
        "hint_files": 0,
        "hint_matched": 0,
        "active_streams": 0,
    }
    assert model.predict(0) == []


def test_observed_is_a_jobs_largest_workload_in_the_order_it_read() -> None:
    model = WorkloadModel()
    files = listed_dataset(model, "big", 40)
    model.listed("small", {"small/a": SMALL}, 0.0, "p[1]")
    model.opened("small/a", SMALL, 1.0, "p[1]")
    for position, path in enumerate(files[::-1]):
        model.opened(path, SMALL, 2.0 + position, "p[1]")
    observed = model.observed("p[1]", max_files=1000)
    assert observed is not None
    assert (observed.workload, observed.order, observed.epoch) == ("p[1]:big", files[::-1], 0)
    assert (observed.working_set_files, observed.working_set_bytes) == (40, 40 * SMALL)
    assert (observed.sample_every, observed.source, observed.repeats) == (1, "unknown", False)
    thinned = model.observed("p[1]", max_files=10)
    assert thinned is not None
    assert thinned.sample_every == 4
    assert set(thinned.order) < set(files)
    assert model.observed("nobody[2]", max_files=1000) is None


def test_concurrent_events_from_many_threads_keep_the_model_consistent() -> None:
    model = WorkloadModel()
    files = listed_dataset(model, "t", 200)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for step in range(2000):
                path = rng.choice(files)
                model.opened(path, 8 * MIB, float(step))
                model.read(path, rng.randrange(0, 8 * MIB, MIB), MIB, float(step))
                if step % 50 == 0:
                    model.predict(64)
                    model.stats()
                    model.planned()
        except BaseException as exc:  # surfaced below, in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    found = details(model, "t")
    assert found["working_set_files"] == 200
    unread, opened = found["unread_files"], found["read_this_epoch_files"]
    assert isinstance(unread, int)
    assert isinstance(opened, int)
    assert unread + opened == 200


# -- invariants under random events -------------------------------------------------

PATHS = [f"{root}/{sub}/f{i}" for root in ("a", "b") for sub in ("x", "y") for i in range(4)]
JOBS = ["", "p[1]", "q[2]"]
EVENTS = st.one_of(
    st.tuples(st.just("open"), st.sampled_from(PATHS), st.sampled_from(JOBS)),
    st.tuples(
        st.just("read"),
        st.sampled_from(PATHS),
        st.sampled_from(JOBS),
        st.integers(0, 16 * MIB),
        st.integers(1, 2 * MIB),
    ),
    st.tuples(
        st.just("list"), st.sampled_from(["a", "b", "a/x", "a/y", "b/x", "b/y", ""]), st.sampled_from(JOBS)
    ),
    st.tuples(
        st.just("hint"), st.lists(st.sampled_from([*PATHS, "a/ghost"]), max_size=12), st.sampled_from(JOBS)
    ),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(EVENTS, max_size=80))
def test_random_events_keep_every_workloads_counts_and_the_clock_consistent(
    events: list[tuple[object, ...]],
) -> None:
    model = WorkloadModel()
    now = 0.0
    epoch = 0
    for event in events:
        now += 1.0
        kind, subject, job = event[0], event[1], str(event[2])
        if kind == "open":
            model.opened(str(subject), 64 * MIB, now, job)
        elif kind == "read":
            model.read(str(subject), int(event[3]), int(event[4]), now, job)  # type: ignore[call-overload]
        elif kind == "list":
            directory = str(subject)
            prefix = directory + "/" if directory else ""
            files = {p: 64 * MIB for p in PATHS if p.rsplit("/", 1)[0] + "/" == prefix}
            model.listed(directory, files, 1000.0, job)
        else:
            model.hint([str(path) for path in subject], now, job)  # type: ignore[attr-defined]
        stats = model.stats()
        per_workload = stats["per_workload"]
        assert isinstance(per_workload, dict)
        assert stats["workloads"] == len(per_workload)  # names are unique
        for found in per_workload.values():
            assert found["unread_files"] + found["read_this_epoch_files"] <= found["working_set_files"]
            assert found["epoch"] <= model.current()
        assert all(value <= model.current() for value in model.job_epochs().values())
        assert model.current() >= epoch
        epoch = model.current()
        predicted = model.predict(5)
        assert len(predicted) <= 5
        assert all(p.length > 0 and p.offset >= 0 and p.distance >= 0 for p in predicted)
        assert all(p.workload in workloads(model) for p in predicted)
