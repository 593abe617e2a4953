"""Epochs: boundaries, the unread set and the working set of one workload."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from cachefsd.workload.epochs import Epochs, add_files
from cachefsd.workload.model import WorkloadModel
from tests.unit.traces import (
    KIB,
    SMALL,
    Trace,
    dataset,
    details,
    epoch_of_path,
    listed_dataset,
    paths_of,
    predicted_files,
    shuffled_epochs,
)

# -- boundaries -------------------------------------------------------------------


def test_sequential_epochs_end_at_the_first_reopen() -> None:
    model = WorkloadModel()
    files = listed_dataset(model, "seq", 20)
    trace = Trace(model)
    trace.pass_over(files)
    assert epoch_of_path(model, "seq") == 0
    assert predicted_files(model, "seq") == set()
    trace.open(files[0])
    assert epoch_of_path(model, "seq") == 1
    assert predicted_files(model, "seq") == set(files[1:])
    trace.pass_over(files[1:])
    trace.pass_over(files)
    assert model.current() == 2


def test_shuffled_epochs_are_detected() -> None:
    model = WorkloadModel()
    files = listed_dataset(model, "shuf", 100)
    trace = Trace(model)
    for number, order in enumerate(shuffled_epochs(files, 4, random.Random(7))):
        trace.open(order[0])
        assert epoch_of_path(model, "shuf") == number
        trace.pass_over(order[1:])
        assert predicted_files(model, "shuf") == set()


def test_epoch_zero_without_listing_ends_at_any_reopen() -> None:
    model = WorkloadModel()
    trace = Trace(model)
    files = dataset("nolist", 10)
    trace.pass_over(files)
    trace.open(files[3])
    assert epoch_of_path(model, "nolist") == 1


def test_early_reread_does_not_end_the_epoch() -> None:
    model = WorkloadModel()
    files = listed_dataset(model, "d", 20)
    trace = Trace(model)
    trace.pass_over(files[:5])
    trace.open(files[0])  # 5 of 20 read: a re-read, not a new pass
    assert epoch_of_path(model, "d") == 0
    assert details(model, "d")["unread_files"] == 15


def test_reopening_a_file_just_opened_is_a_peek_not_a_boundary() -> None:
    model = WorkloadModel()
    files = listed_dataset(model, "d", 64)
    trace = Trace(model)
    trace.pass_over(files[:40])
    trace.open(files[39])  # opened 1 open ago: a loader peeking twice
    assert epoch_of_path(model, "d") == 0
    trace.open(files[0])  # opened 40 opens ago, over half read: a new pass
    assert epoch_of_path(model, "d") == 1


def test_many_reads_after_one_open_count_once() -> None:
    model = WorkloadModel()
    files = listed_dataset(model, "d", 4)
    model.opened(files[0], 4 * KIB, 1.0)
    for offset in range(0, 4 * KIB, KIB):
        model.read(files[0], offset, KIB, 1.0)
    assert predicted_files(model, "d") == set(files[1:])
    assert model.stats()["read_this_epoch_files"] == 1


def test_distributed_share_ends_epochs_once_the_epoch_size_is_known() -> None:
    """A node reads a different quarter of the dataset each epoch."""
    model = WorkloadModel()
    files = listed_dataset(model, "ddp", 400)
    trace = Trace(model)
    rng = random.Random(3)
    shares = [rng.sample(files, 100) for _ in range(6)]
    for share in shares:
        trace.pass_over(share)
    # Epoch 0 needs half the listing before a re-open ends it; later epochs
    # are measured against the previous one, so each share is then an epoch.
    assert epoch_of_path(model, "ddp") >= 3


# -- unread and working set ----------------------------------------------------


def test_unread_shrinks_during_an_epoch_and_resets_at_the_next() -> None:
    model = WorkloadModel()
    files = listed_dataset(model, "u", 10)
    trace = Trace(model)
    assert details(model, "u")["unread_files"] == 10
    trace.pass_over(files[:3])
    assert predicted_files(model, "u") == set(files[3:])
    trace.pass_over(files[3:])
    assert predicted_files(model, "u") == set()
    trace.open(files[5])
    assert predicted_files(model, "u") == set(files) - {files[5]}


def test_a_file_opened_without_listing_joins_the_working_set() -> None:
    model = WorkloadModel()
    files = listed_dataset(model, "w", 3)
    trace = Trace(model)
    trace.open("w/late.jpg")
    assert details(model, "w")["working_set_files"] == 4
    trace.pass_over(files)
    trace.open(files[0])
    assert "w/late.jpg" in predicted_files(model, "w")


def test_listing_predicts_unread_files_from_the_first_open() -> None:
    model = WorkloadModel()
    model.listed("train", {}, 0.0)
    cats, dogs = listed_dataset(model, "train/cat", 5), listed_dataset(model, "train/dog", 5)
    assert model.predict(10) == []  # a listing alone may be a human's `ls`
    Trace(model).open(dogs[2])
    predicted = model.predict(100)
    assert paths_of(predicted) == [path for path in cats + dogs if path != dogs[2]]
    assert all(p.offset == 0 and p.length == SMALL for p in predicted)
    assert epoch_of_path(model, "train") == 0


def test_satisfied_files_stay_unread_but_are_not_predicted_until_the_next_epoch() -> None:
    model = WorkloadModel()
    files = listed_dataset(model, "s", 6)
    trace = Trace(model)
    trace.open(files[0])
    for path in (files[1], files[4]):
        assert model.satisfied(path, "s")
    assert not model.satisfied(files[1], "s")  # not news
    assert not model.satisfied(files[0], "s")  # opened: nothing to predict anyway
    assert not model.satisfied(files[2], "gone")  # a workload the model forgot
    predicted = paths_of(model.predict(100))
    assert predicted == [files[2], files[3], files[5]]
    assert details(model, "s")["unread_files"] == 5
    trace.pass_over(files[1:])
    trace.open(files[0])  # a new epoch: every file is a candidate again
    assert set(paths_of(model.predict(100))) == set(files) - {files[0]}


# -- invariants under random events -------------------------------------------------

FILES = [f"d/f{i}" for i in range(12)]
EPOCH_EVENTS = st.one_of(
    st.tuples(st.just("open"), st.sampled_from(FILES)),
    st.tuples(st.just("list"), st.lists(st.sampled_from(FILES), max_size=6)),
    st.tuples(st.just("hint"), st.lists(st.sampled_from([*FILES, "d/ghost"]), max_size=12)),
    st.tuples(st.just("satisfy"), st.sampled_from(FILES)),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(EPOCH_EVENTS, max_size=80), st.booleans())
def test_unread_and_opened_stay_disjoint_parts_of_the_working_set(
    events: list[tuple[object, ...]], shared: bool
) -> None:
    """Also for a workload that started on another job's working set."""
    twin, epochs = Epochs(), Epochs()
    if shared:
        epochs.share_working_set(twin)
    epoch = 0
    for event in events:
        kind, argument = event
        if kind == "open":
            epochs.opened(str(argument), SMALL)
        elif kind == "list":
            add_files([epochs, twin], dict.fromkeys([str(path) for path in argument], SMALL))  # type: ignore[attr-defined]
        elif kind == "hint":
            epochs.hinted([str(path) for path in argument])  # type: ignore[attr-defined]
        elif argument in epochs.working:  # the prefetcher satisfies what was predicted
            epochs.satisfy(str(argument))
        unread, satisfied, seen = set(epochs.unread), set(epochs.satisfied), set(epochs.seen)
        assert not (unread | satisfied) & seen
        assert not unread & satisfied
        assert unread | satisfied | seen <= set(epochs.working)
        assert seen == set(epochs.order)
        assert len(epochs.order) == len(seen)
        assert not seen & {path for path, _ in epochs.planned()}
        assert epochs.epoch >= epoch
        epoch = epochs.epoch
        if not epochs.unread_pending:
            # Every file of the working set is opened, unread, or found cached.
            assert unread | satisfied | seen == set(epochs.working)
