"""The access model on synthetic traces: jobs, epochs, unread sets, streams,
replayed orders, hints, next use, and invariants under random events."""

from __future__ import annotations

import random
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachefsd.cache.policy import EpochAwarePolicy
from cachefsd.prefetch.access import (
    FILE_PREDICTION_BYTES,
    JOB_IDLE_SECONDS,
    PLAN_PROBATION_OPENS,
    PLAN_RECHECK_FILES,
    SEED_UNREAD_OPENS,
    STREAM_CONFIRM_BYTES,
    STREAM_IDLE_SECONDS,
    STREAM_INITIAL_WINDOW,
    STREAM_MAX_WINDOW,
    AccessModel,
    Prediction,
)

KIB = 1 << 10
MIB = 1 << 20
SMALL = 100 * KIB


class Trace:
    """Feeds a model events with a clock that ticks 10 ms per event."""

    def __init__(self, model: AccessModel) -> None:
        self.model = model
        self.now = 1000.0

    def tick(self) -> float:
        self.now += 0.01
        return self.now

    def open(self, path: str, size: int = SMALL) -> None:
        self.model.opened(path, size, self.tick())
        self.model.read(path, 0, size, self.tick())

    def pass_over(self, paths: list[str], size: int = SMALL) -> None:
        for path in paths:
            self.open(path, size)


def dataset(root: str, count: int) -> list[str]:
    return [f"{root}/img{i:04d}.jpg" for i in range(count)]


def listed(model: AccessModel, directory: str, paths: list[str], size: int = SMALL) -> None:
    model.listed(directory, dict.fromkeys(paths, size), 0.0)


def listed_dataset(model: AccessModel, root: str, count: int) -> list[str]:
    """``count`` files in ``root``, listed to the model as a loader's scan would."""
    files = dataset(root, count)
    listed(model, root, files)
    return files


def shuffled_epochs(paths: list[str], count: int, rng: random.Random) -> list[list[str]]:
    """``count`` shuffled orders; each epoch starts with a file read early in
    the one before, so its first open is unambiguously a new pass."""
    epochs: list[list[str]] = []
    for _ in range(count):
        order = paths[:]
        rng.shuffle(order)
        if epochs:
            early = epochs[-1][: len(paths) // 2]
            first = next(i for i, path in enumerate(order) if path in early)
            order[0], order[first] = order[first], order[0]
        epochs.append(order)
    return epochs


def paths_of(predictions: list[Prediction]) -> list[str]:
    return [prediction.path for prediction in predictions]


# -- jobs ---------------------------------------------------------------------


def test_recursive_scan_makes_one_job_at_the_top_listed_directory() -> None:
    model = AccessModel()
    model.listed("", {}, 0.0)
    model.listed("data/train", {}, 0.0)
    for label in ("cat", "dog"):
        listed_dataset(model, f"data/train/{label}", 3)
    assert model.jobs() == ["", "data/train"]
    assert model.job_of("data/train/cat/img0001.jpg") == "data/train"
    assert len(model.working_set("data/train")) == 6


def test_without_listing_a_path_belongs_to_its_first_component() -> None:
    model = AccessModel()
    model.opened("a/x/1.bin", SMALL, 1.0)
    model.opened("b/y/2.bin", SMALL, 1.0)
    model.opened("root.bin", SMALL, 1.0)
    assert model.job_of("a/x/1.bin") == "a"
    assert model.job_of("b/y/2.bin") == "b"
    assert model.job_of("root.bin") == ""
    assert model.job_of("c/unseen.bin") is None


def test_a_parent_listed_after_its_child_absorbs_the_child_job() -> None:
    model = AccessModel()
    listed_dataset(model, "ds/c1", 2)
    assert model.jobs() == ["ds/c1"]
    listed(model, "ds", [])
    listed_dataset(model, "ds/c2", 2)
    assert model.jobs() == ["ds"]
    assert len(model.unread("ds")) == 4


def test_a_deeper_listing_under_a_fallback_job_joins_it() -> None:
    model = AccessModel()
    model.opened("a/train/0.jpg", SMALL, 1.0)
    listed_dataset(model, "a/train", 3)
    assert model.jobs() == ["a"]


# -- epochs -------------------------------------------------------------------


def test_sequential_epochs_end_at_the_first_reopen() -> None:
    model = AccessModel()
    files = listed_dataset(model, "seq", 20)
    trace = Trace(model)
    trace.pass_over(files)
    assert model.current_epoch("seq") == 0
    assert model.unread("seq") == set()
    trace.open(files[0])
    assert model.current_epoch("seq") == 1
    assert model.unread("seq") == set(files[1:])
    trace.pass_over(files[1:])
    trace.pass_over(files)
    assert model.current() == 2
    assert model.current_epoch() == 2


def test_shuffled_epochs_are_detected() -> None:
    model = AccessModel()
    files = listed_dataset(model, "shuf", 100)
    trace = Trace(model)
    for number, order in enumerate(shuffled_epochs(files, 4, random.Random(7))):
        trace.open(order[0])
        assert model.current_epoch("shuf") == number
        trace.pass_over(order[1:])
        assert model.unread("shuf") == set()


def test_epoch_zero_without_listing_ends_at_any_reopen() -> None:
    model = AccessModel()
    trace = Trace(model)
    files = dataset("nolist", 10)
    trace.pass_over(files)
    trace.open(files[3])
    assert model.current_epoch("nolist") == 1


def test_turns_name_the_jobs_that_started_an_epoch_once() -> None:
    """What the prefetcher asks each round: which jobs began a new pass."""
    model = AccessModel()
    first, second = listed_dataset(model, "a/b", 10), listed_dataset(model, "c", 10)
    trace = Trace(model)
    trace.pass_over(first)
    trace.pass_over(second)
    assert model.take_turns() == {}
    trace.open(second[0])
    assert model.take_turns() == {"c": 1}
    assert model.take_turns() == {}
    trace.open(first[0])
    listed(model, "a", [])  # before the turn is taken, a parent's job absorbs a/b's
    assert model.take_turns() == {"a": 1}


def test_early_reread_does_not_end_the_epoch() -> None:
    model = AccessModel()
    files = listed_dataset(model, "d", 20)
    trace = Trace(model)
    trace.pass_over(files[:5])
    trace.open(files[0])  # 5 of 20 read: a re-read, not a new pass
    assert model.current_epoch("d") == 0
    assert len(model.unread("d")) == 15


def test_reopening_a_file_just_opened_is_a_peek_not_a_boundary() -> None:
    model = AccessModel()
    files = listed_dataset(model, "d", 64)
    trace = Trace(model)
    trace.pass_over(files[:40])
    trace.open(files[39])  # opened 1 open ago: a loader peeking twice
    assert model.current_epoch("d") == 0
    trace.open(files[0])  # opened 40 opens ago, over half read: a new pass
    assert model.current_epoch("d") == 1


def test_many_reads_after_one_open_count_once() -> None:
    model = AccessModel()
    files = listed_dataset(model, "d", 4)
    model.opened(files[0], 4 * KIB, 1.0)
    for offset in range(0, 4 * KIB, KIB):
        model.read(files[0], offset, KIB, 1.0)
    assert model.read_this_epoch("d") == {files[0]}
    assert model.stats()["read_this_epoch_files"] == 1


def test_distributed_share_ends_epochs_once_the_epoch_size_is_known() -> None:
    """A node reads a different quarter of the dataset each epoch."""
    model = AccessModel()
    files = listed_dataset(model, "ddp", 400)
    trace = Trace(model)
    rng = random.Random(3)
    shares = [rng.sample(files, 100) for _ in range(6)]
    for share in shares:
        trace.pass_over(share)
    # Epoch 0 needs half the listing before a re-open ends it; later epochs
    # are measured against the previous one, so each share is then an epoch.
    assert model.current_epoch("ddp") >= 3


# -- unread and working set ----------------------------------------------------


def test_unread_shrinks_during_an_epoch_and_resets_at_the_next() -> None:
    model = AccessModel()
    files = listed_dataset(model, "u", 10)
    trace = Trace(model)
    assert model.unread("u") == set(files)
    trace.pass_over(files[:3])
    assert model.unread("u") == set(files[3:])
    trace.pass_over(files[3:])
    assert model.unread("u") == set()
    trace.open(files[5])
    assert model.unread("u") == set(files) - {files[5]}


def test_a_file_opened_without_listing_joins_the_working_set() -> None:
    model = AccessModel()
    files = listed_dataset(model, "w", 3)
    trace = Trace(model)
    trace.open("w/late.jpg")
    assert "w/late.jpg" in model.working_set("w")
    trace.pass_over(files)
    trace.open(files[0])
    assert "w/late.jpg" in model.unread("w")


def test_listing_predicts_unread_files_from_the_first_open() -> None:
    model = AccessModel()
    model.listed("train", {}, 0.0)
    cats, dogs = listed_dataset(model, "train/cat", 5), listed_dataset(model, "train/dog", 5)
    assert model.predict(10) == []  # a listing alone may be a human's `ls`
    Trace(model).open(dogs[2])
    predicted = model.predict(100)
    assert paths_of(predicted) == [path for path in cats + dogs if path != dogs[2]]
    assert all(p.offset == 0 and p.length == SMALL for p in predicted)
    assert model.current_epoch("train") == 0


def test_satisfied_files_stay_unread_but_are_not_predicted_until_the_next_epoch() -> None:
    model = AccessModel()
    files = listed_dataset(model, "s", 6)
    trace = Trace(model)
    trace.open(files[0])
    for path in (files[1], files[4]):
        assert model.satisfied(path, "s")
    assert not model.satisfied(files[1], "s")  # not news
    predicted = paths_of(model.predict(100))
    assert predicted == [files[2], files[3], files[5]]
    assert model.unread("s") == set(files[1:])
    assert model.stats()["per_job"]["s"]["unread_files"] == 5  # type: ignore[index]
    trace.pass_over(files[1:])
    trace.open(files[0])  # a new epoch: every file is a candidate again
    assert set(paths_of(model.predict(100))) == set(files) - {files[0]}


def test_a_satisfied_planned_file_is_predicted_again_as_its_turn_nears() -> None:
    # It may have been evicted since it was found cached: a plan's sooner
    # files take the room of its later ones.
    model = AccessModel()
    files = listed_dataset(model, "s", PLAN_RECHECK_FILES + 8)
    order = files[::-1]
    model.hint(order, 0.0)
    near, far = order[1], order[PLAN_RECHECK_FILES + 4]
    for path in (near, far):
        model.satisfied(path, "s")
    predicted = paths_of(model.predict(1000))
    assert near in predicted
    assert far not in predicted
    Trace(model).pass_over(order[:8])  # the far one's turn is near now
    assert far in paths_of(model.predict(1000))


def test_an_idle_job_predicts_nothing() -> None:
    model = AccessModel()
    listed_dataset(model, "old", 5)
    listed_dataset(model, "new", 5)
    model.opened("old/img0000.jpg", SMALL, 0.0)
    model.opened("new/img0000.jpg", SMALL, JOB_IDLE_SECONDS + 1.0)
    assert {model.job_of(path) for path in paths_of(model.predict(100))} == {"new"}


# -- streams ------------------------------------------------------------------


def stream_predictions(model: AccessModel) -> list[Prediction]:
    return [p for p in model.predict(100) if p.offset > 0]


def test_a_sequential_reader_gets_a_growing_window_after_its_last_read() -> None:
    model = AccessModel()
    shard = "shards/shard-000.tar"
    size = 1 << 30
    model.opened(shard, size, 0.0)
    chunk = 256 * KIB
    offset = 0
    while offset + chunk < STREAM_CONFIRM_BYTES:
        model.read(shard, offset, chunk, 0.0)
        offset += chunk
        # A random reader's read-around (several contiguous READs) is not a stream.
        assert stream_predictions(model) == []
    windows = []
    while offset < 200 * MIB:
        model.read(shard, offset, chunk, 0.0)
        offset += chunk
        windows.append(stream_predictions(model)[0].length)
    # The window doubled each time a whole window was consumed, before the
    # stream was confirmed too (1 + 2 + 4 MiB), up to the maximum.
    assert windows[0] == 8 * STREAM_INITIAL_WINDOW
    assert sorted(set(windows)) == [8 * STREAM_INITIAL_WINDOW << k for k in range(4)]
    assert windows[-1] == STREAM_MAX_WINDOW
    assert windows == sorted(windows)


def test_a_seek_resets_the_stream_window() -> None:
    model = AccessModel()
    shard = "shards/shard-000.tar"
    model.opened(shard, 1 << 30, 0.0)
    for offset in range(0, 8 * MIB, MIB):
        model.read(shard, offset, MIB, 0.0)
    grown = stream_predictions(model)[0].length
    assert grown > 2 * STREAM_INITIAL_WINDOW
    model.read(shard, 500 * MIB, 256 * KIB, 0.0)
    assert stream_predictions(model) == []
    model.read(shard, 500 * MIB + 256 * KIB, STREAM_CONFIRM_BYTES, 0.0)
    (again,) = stream_predictions(model)
    # Started over from the initial window (doubled once by that long read).
    assert again.offset == 500 * MIB + 256 * KIB + STREAM_CONFIRM_BYTES
    assert again.length == 2 * STREAM_INITIAL_WINDOW


def test_small_gaps_and_reordered_reads_continue_a_stream() -> None:
    model = AccessModel()
    shard = "s/big.bin"
    model.opened(shard, 1 << 30, 0.0)
    model.read(shard, 0, STREAM_CONFIRM_BYTES, 0.0)
    end = STREAM_CONFIRM_BYTES + 256 * KIB
    model.read(shard, end - 128 * KIB, 128 * KIB, 0.0)  # page cache served the gap
    model.read(shard, end - 256 * KIB, 128 * KIB, 0.0)  # a late FUSE thread
    (prediction,) = stream_predictions(model)
    assert prediction.offset == end
    # The same stream: its window grew (a doubling a read that consumed it),
    # where one started over would predict nothing before 8 MiB.
    assert prediction.length == 2 * STREAM_INITIAL_WINDOW


def test_stream_window_is_clipped_to_the_file_and_stops_at_its_end() -> None:
    model = AccessModel()
    shard = "s/big.bin"
    size = 10 * MIB
    model.opened(shard, size, 0.0)
    model.read(shard, 0, MIB, 0.0)
    model.read(shard, MIB, size - MIB - 100, 0.0)
    assert stream_predictions(model) == [Prediction(shard, size - 100, 100, 0.0)]
    model.read(shard, size - 100, 100, 0.0)
    assert stream_predictions(model) == []


def test_small_files_and_idle_streams_are_not_streamed() -> None:
    model = AccessModel()
    model.opened("s/small.bin", MIB, 0.0)
    model.read("s/small.bin", 0, 256 * KIB, 0.0)
    model.read("s/small.bin", 256 * KIB, 256 * KIB, 0.0)
    assert stream_predictions(model) == []
    model.opened("s/big.bin", 1 << 30, 0.0)
    model.read("s/big.bin", 0, MIB, 0.0)
    model.read("s/big.bin", MIB, STREAM_CONFIRM_BYTES, 0.0)
    assert len(stream_predictions(model)) == 1
    model.opened("s/other.bin", SMALL, STREAM_IDLE_SECONDS + 1.0)
    assert stream_predictions(model) == []
    assert model.stats()["active_streams"] == 0


# -- replayed order -----------------------------------------------------------


def test_an_unshuffled_loader_order_is_replayed_from_the_current_position() -> None:
    model = AccessModel()
    files = listed_dataset(model, "fixed", 50)
    order = files[:]
    random.Random(1).shuffle(order)  # fixed, but not the listing order
    trace = Trace(model)
    trace.pass_over(order)
    trace.pass_over(order[:10])
    assert model.current_epoch("fixed") == 1
    predicted = model.predict(5)
    assert paths_of(predicted) == order[10:15]
    assert [p.distance for p in predicted] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert model.stats()["per_job"]["fixed"]["order"] == "replay"  # type: ignore[index]
    # The next epoch repeated the previous one: replay from its first open.
    trace.pass_over(order[10:])
    trace.open(order[0])
    assert model.current_epoch("fixed") == 2
    assert paths_of(model.predict(3)) == order[1:4]


def test_replay_needs_some_evidence_in_the_first_repeated_epoch() -> None:
    model = AccessModel()
    files = listed_dataset(model, "fixed", 50)
    order = list(reversed(files))
    trace = Trace(model)
    trace.pass_over(order)
    trace.pass_over(order[: PLAN_PROBATION_OPENS - 1])
    # Not yet judged: unread files in listing order.
    assert paths_of(model.predict(2)) == files[:2]
    trace.open(order[PLAN_PROBATION_OPENS - 1])
    assert paths_of(model.predict(2)) == order[PLAN_PROBATION_OPENS : PLAN_PROBATION_OPENS + 2]


def test_a_shuffled_loader_is_not_replayed() -> None:
    model = AccessModel()
    files = listed_dataset(model, "shuf", 200)
    trace = Trace(model)
    first, second = shuffled_epochs(files, 2, random.Random(11))
    trace.pass_over(first)
    trace.pass_over(second[:50])
    assert model.stats()["per_job"]["shuf"]["order"] == "unknown"  # type: ignore[index]
    assert second[60] not in dict(model.planned())
    unread_in_listing_order = [path for path in files if path not in set(second[:50])]
    assert paths_of(model.predict(5)) == unread_in_listing_order[:5]


# -- hints ----------------------------------------------------------------------


def test_a_hint_is_followed_exactly_from_the_reader_position() -> None:
    model = AccessModel()
    files = listed_dataset(model, "h", 40)
    order = files[:]
    random.Random(5).shuffle(order)
    model.hint(order, 0.0)
    assert paths_of(model.predict(3)) == order[:3]
    trace = Trace(model)
    trace.pass_over(order[:5])
    predicted = model.predict(3)
    assert paths_of(predicted) == order[5:8]
    assert [p.distance for p in predicted] == [0.0, 1.0, 2.0]
    # Out-of-order workers: the files read ahead of the position are skipped.
    trace.open(order[6])
    assert paths_of(model.predict(3)) == [order[5], order[7], order[8]]
    stats = model.stats()
    assert stats["hint_coverage"] == 1.0
    assert stats["per_job"]["h"]["order"] == "hint"  # type: ignore[index]


def test_a_new_hint_starts_a_new_epoch() -> None:
    model = AccessModel()
    files = listed_dataset(model, "h", 40)
    trace = Trace(model)
    trace.pass_over(files)
    second = list(reversed(files))
    model.hint(second, trace.tick())
    assert model.current_epoch("h") == 1
    assert model.unread("h") == set(files)
    assert paths_of(model.predict(2)) == second[:2]
    trace.open(second[0])  # read last epoch, but this epoch began with the hint
    assert model.current_epoch("h") == 1


def test_a_hint_arriving_just_after_the_pass_began_joins_the_epoch() -> None:
    model = AccessModel()
    files = listed_dataset(model, "h", 64)
    trace = Trace(model)
    trace.pass_over(files)
    order = files[1:] + files[:1]
    random.Random(4).shuffle(order)
    order.remove(files[0])
    order.insert(0, files[0])
    trace.open(order[0])  # the re-open already started epoch 1
    model.hint(order, trace.tick())
    assert model.current_epoch("h") == 1
    assert paths_of(model.predict(2)) == order[1:3]


def test_a_hint_of_unknown_paths_costs_bandwidth_then_falls_back() -> None:
    model = AccessModel()
    files = listed_dataset(model, "h", 40)
    ghosts = [f"h/ghost{i}.jpg" for i in range(40)]
    model.hint(ghosts, 0.0)
    assert paths_of(model.predict(2)) == ghosts[:2]
    assert model.predict(1)[0].length == FILE_PREDICTION_BYTES  # size unknown
    trace = Trace(model)
    trace.pass_over(files[:PLAN_PROBATION_OPENS])
    assert paths_of(model.predict(2)) == files[PLAN_PROBATION_OPENS : PLAN_PROBATION_OPENS + 2]
    assert files[20] not in dict(model.planned())


def test_a_hint_with_a_different_order_falls_back() -> None:
    model = AccessModel()
    files = listed_dataset(model, "h", 40)
    model.hint(list(reversed(files)), 0.0)
    trace = Trace(model)
    trace.pass_over(files[:20])
    assert model.stats()["per_job"]["h"]["order"] == "unknown"  # type: ignore[index]
    assert paths_of(model.predict(2)) == files[20:22]


def dataloader_opens(order: list[str], workers: int, batch: int) -> list[str]:
    """The order in which a DataLoader's workers open an epoch's files: each
    worker reads its own batch (batches go round-robin) while the others
    read theirs, so an exact order arrives up to workers x batch places off."""
    batches = [order[start : start + batch] for start in range(0, len(order), batch)]
    opens = []
    for first in range(0, len(batches), workers):
        side_by_side = batches[first : first + workers]
        for step in range(batch):
            opens.extend(each[step] for each in side_by_side if step < len(each))
    return opens


@pytest.mark.parametrize("hinted", [True, False])
def test_a_hint_read_by_many_workers_with_large_batches_is_followed(hinted: bool) -> None:
    model = AccessModel()
    files = listed_dataset(model, "h", 20_000)
    order = files[:]
    random.Random(3).shuffle(order)
    model.hint(order if hinted else sorted(order, key=lambda path: path[::-1]), 0.0)
    Trace(model).pass_over(dataloader_opens(order, workers=8, batch=256)[:10_000])
    # Followed: 8 workers x 256 puts an open up to 1,785 places off its place.
    # The control, a hint of another order, is not.
    assert model.stats()["per_job"]["h"]["order"] == ("hint" if hinted else "unknown")  # type: ignore[index]


def test_one_hint_over_several_guessed_jobs_makes_them_one() -> None:
    """A hint is one loader's exact order: class folders right under the
    mount, first guessed as jobs of their own, are one dataset."""
    model = AccessModel()
    listed_dataset(model, "a", 4)
    listed_dataset(model, "b", 4)
    model.hint([], 0.0)
    model.hint(["a/img0003.jpg", "b/img0000.jpg", "a/img0001.jpg"], 0.0)
    assert paths_of(model.predict(3)) == ["a/img0003.jpg", "b/img0000.jpg", "a/img0001.jpg"]
    assert model.job_of("b/img0002.jpg") == model.job_of("a/img0000.jpg") == ""


def test_hints_of_two_jobs_stay_apart() -> None:
    model = AccessModel()
    listed_dataset(model, "a", 4)
    listed_dataset(model, "b", 4)
    model.hint(["a/img0003.jpg", "a/img0001.jpg"], 0.0)
    model.hint(["b/img0002.jpg", "b/img0000.jpg"], 0.0)
    assert model.jobs() == ["a", "b"]
    assert set(paths_of(model.predict(2))) == {"a/img0003.jpg", "b/img0002.jpg"}


# -- several jobs ----------------------------------------------------------------


def test_interleaved_jobs_keep_separate_epochs_and_unread_sets() -> None:
    model = AccessModel()
    a_files, b_files = listed_dataset(model, "a", 10), listed_dataset(model, "b", 30)
    trace = Trace(model)
    a_trace = a_files * 3
    for step in range(30):
        trace.open(a_trace[step])
        trace.open(b_files[step])
        if step == 14:
            # b has read half its files: a's re-reads must not touch b.
            assert model.current_epoch("a") == 1
            assert model.current_epoch("b") == 0
            assert model.unread("b") == set(b_files[15:])
            assert model.unread("a") == set(a_files[5:])
    assert model.current_epoch("a") == 2
    assert model.current_epoch("b") == 0
    assert model.current() == 2
    assert model.unread("a") == set()
    assert model.unread("b") == set()


def test_predictions_interleave_jobs_round_robin() -> None:
    model = AccessModel()
    a_files, b_files = listed_dataset(model, "a", 10), listed_dataset(model, "b", 10)
    trace = Trace(model)
    trace.open(a_files[0])
    trace.open(b_files[0])
    predicted = paths_of(model.predict(6))
    assert predicted == [a_files[1], b_files[1], a_files[2], b_files[2], a_files[3], b_files[3]]
    assert len(model.predict(1000)) == 18


def test_listing_the_mount_root_does_not_merge_jobs() -> None:
    model = AccessModel()
    model.listed("", {"README": 10}, 0.0)
    listed_dataset(model, "a", 2)
    listed_dataset(model, "b", 2)
    assert model.jobs() == ["", "a", "b"]


# -- next use and the epoch clock -------------------------------------------------


def test_planned_orders_files_by_the_plan_and_drops_them_once_read() -> None:
    model = AccessModel()
    files = listed_dataset(model, "n", 30)
    order = files[:]
    random.Random(2).shuffle(order)
    assert model.planned() == []  # nothing known yet
    model.hint(order, 0.0)
    planned = model.planned()
    assert [path for path, _ in planned] == order
    assert [distance for _, distance in planned] == sorted(distance for _, distance in planned)
    trace = Trace(model)
    trace.pass_over(order[:5])
    distances = dict(model.planned())
    assert order[2] not in distances
    # Distance + opens stays put as the reader advances (the prefetcher's positions are stable).
    assert distances[order[20]] == dict(planned)[order[20]] - 5
    assert "n/unknown.jpg" not in distances


def test_the_model_is_an_epoch_clock_for_the_eviction_policy() -> None:
    model = AccessModel()
    policy = EpochAwarePolicy(model)
    files = dataset("c", 4)
    trace = Trace(model)
    trace.pass_over(files)
    policy.admitted("block-a")
    trace.open(files[0])
    assert model.current() == 1
    assert policy.victim() is None  # block-a was read in epoch 0: still to come


def test_stats_report_epochs_sizes_streams_and_hints() -> None:
    model = AccessModel()
    files = listed_dataset(model, "s", 10)
    trace = Trace(model)
    trace.pass_over(files[:4])
    stats = model.stats()
    assert stats["epoch"] == 0
    assert stats["jobs"] == 1
    assert stats["working_set_files"] == 10
    assert stats["unread_files"] == 6
    assert stats["read_this_epoch_files"] == 4
    assert stats["active_streams"] == 0
    assert stats["hint_coverage"] == 0.0
    assert model.predict(0) == []


def test_concurrent_events_from_many_threads_keep_the_model_consistent() -> None:
    model = AccessModel()
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
    assert not model.unread("t") & model.read_this_epoch("t")
    assert model.unread("t") | model.read_this_epoch("t") == set(files)


# -- invariants under random events -------------------------------------------------

PATHS = [f"{root}/{sub}/f{i}" for root in ("a", "b") for sub in ("x", "y") for i in range(4)]
EVENTS = st.one_of(
    st.tuples(st.just("open"), st.sampled_from(PATHS)),
    st.tuples(st.just("read"), st.sampled_from(PATHS), st.integers(0, 16 * MIB), st.integers(1, 2 * MIB)),
    st.tuples(st.just("list"), st.sampled_from(["a", "b", "a/x", "a/y", "b/x", "b/y", ""])),
    st.tuples(st.just("hint"), st.lists(st.sampled_from([*PATHS, "a/ghost"]), max_size=12)),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(EVENTS, max_size=80))
def test_unread_and_read_this_epoch_stay_disjoint_parts_of_the_working_set(
    events: list[tuple[object, ...]],
) -> None:
    model = AccessModel()
    now = 0.0
    epoch = 0
    for event in events:
        now += 1.0
        kind = event[0]
        if kind == "open":
            model.opened(str(event[1]), 64 * MIB, now)
        elif kind == "read":
            model.read(str(event[1]), int(event[2]), int(event[3]), now)  # type: ignore[call-overload]
        elif kind == "list":
            directory = str(event[1])
            prefix = directory + "/" if directory else ""
            model.listed(
                directory, {p: 64 * MIB for p in PATHS if p.rsplit("/", 1)[0] + "/" == prefix}, 1000.0
            )
        else:
            model.hint([str(path) for path in event[1]], now)  # type: ignore[union-attr]
        for root in model.jobs():
            unread = model.unread(root)
            seen = model.read_this_epoch(root)
            working = model.working_set(root)
            assert not unread & seen
            assert unread <= working
            assert seen <= working
            assert not seen & {path for path, _ in model.planned()}
        assert model.current() >= epoch
        epoch = model.current()
        predicted = model.predict(5)
        assert len(predicted) <= 5
        assert all(p.length > 0 and p.offset >= 0 and p.distance >= 0 for p in predicted)
    assert len(set(model.jobs())) == len(model.jobs())


# -- jobs told apart by their callers -----------------------------------------


def _interleaved(orders: dict[str, list[str]], rng: random.Random) -> list[tuple[str, str]]:
    """(caller, path) events of several callers' passes, each in its own
    order, taking turns at random."""
    positions = dict.fromkeys(orders, 0)
    events: list[tuple[str, str]] = []
    while positions:
        caller = rng.choice(sorted(positions))
        events.append((caller, orders[caller][positions[caller]]))
        positions[caller] += 1
        if positions[caller] == len(orders[caller]):
            del positions[caller]
    return events


def test_two_callers_reading_one_dataset_keep_their_own_epochs() -> None:
    """Two jobs (a sweep) shuffling the same files: each epoch boundary is a
    job's own, not every re-read of a file the other job read."""
    model = AccessModel()
    files = listed_dataset(model, "d", 200)
    rng = random.Random(7)
    passes = {caller: shuffled_epochs(files, 3, rng) for caller in ("a[1]", "b[2]")}
    now = 0.0
    for epoch in range(3):
        events = _interleaved({caller: orders[epoch] for caller, orders in passes.items()}, rng)
        for caller, path in events:
            now += 0.01
            model.opened(path, SMALL, now, caller)
    assert model.current_epoch("d", "a[1]") == model.current_epoch("d", "b[2]") == 2
    assert model.current() == 2
    assert set(model.jobs()) == {"d", "a[1]:d", "b[2]:d"}  # "d": the listing's (no caller)


def test_a_job_that_never_listed_shares_the_datasets_working_set() -> None:
    """A second job on a listed dataset knows its files: its unread set
    once it has opened a few (a shell's ``cat`` of one file copies nothing),
    and what a later listing adds."""
    model = AccessModel()
    files = listed_dataset(model, "d", 40)
    model.opened(files[0], SMALL, 1.0, "cat[5]")
    assert model.unread("d", "cat[5]") == set()
    assert model.working_set("d", "cat[5]") == set(files)
    for index, path in enumerate(files[:SEED_UNREAD_OPENS]):
        model.opened(path, SMALL, 1.0 + index, "w[6]")
    assert model.unread("d", "w[6]") == set(files[SEED_UNREAD_OPENS:])
    model.listed("d", {"d/new.jpg": SMALL}, 100.0, "other[9]")  # a later listing reaches every job of d
    assert "d/new.jpg" in model.unread("d", "w[6]")
    assert "d/new.jpg" in model.working_set("d", "cat[5]")


def test_a_caller_idle_for_long_is_forgotten_when_a_new_one_comes() -> None:
    model = AccessModel()
    files = listed_dataset(model, "d", 4)
    model.opened(files[0], SMALL, 1000.0, "a[1]")
    model.opened(files[1], SMALL, 1000.0 + JOB_IDLE_SECONDS / 2, "b[2]")
    assert {"a[1]:d", "b[2]:d"} <= set(model.jobs())
    model.opened(files[2], SMALL, 1001.0 + JOB_IDLE_SECONDS, "c[3]")
    assert "a[1]:d" not in model.jobs()
    assert "b[2]:d" in model.jobs()
    assert model.epoch_of("a[1]:d") is None  # its predictions are stale for the prefetcher


def test_a_hint_replaces_only_its_own_jobs_plan() -> None:
    model = AccessModel()
    files = listed_dataset(model, "d", 8)
    model.hint(files, 1000.0, "a[1]")
    model.hint(files[::-1], 1000.0, "b[2]")
    model.hint(files[2:] + files[:2], 1001.0, "a[1]")
    first = {
        caller: next(p.path for p in model.predict(100) if p.job == f"{caller}:d")
        for caller in ("a[1]", "b[2]")
    }
    assert first == {"a[1]": files[2], "b[2]": files[-1]}


def test_a_file_is_planned_elsewhere_by_another_callers_plan_until_it_reads_it() -> None:
    model = AccessModel()
    files = listed_dataset(model, "d", 6)
    model.hint(files, 1000.0, "a[1]")
    model.hint(files[::-1], 1000.0, "b[2]")
    assert model.planned_elsewhere(files[1], "a[1]") == 4  # b[2] opens four files before it
    assert model.planned_elsewhere(files[1], "b[2]") == 1  # and a[1] one
    model.opened(files[5], SMALL, 1001.0, "b[2]")
    assert model.planned_elsewhere(files[1], "a[1]") == 3  # b[2] is one file nearer
    assert model.planned_elsewhere(files[5], "a[1]") is None  # b[2] has read it
    model.opened(files[0], SMALL, 1001.0, "c[3]")  # a caller with no plan plans nothing
    assert model.planned_elsewhere(files[2], "b[2]") == 2


def test_a_file_is_wanted_elsewhere_while_another_active_job_is_still_to_read_it() -> None:
    model = AccessModel()
    files = listed_dataset(model, "d", 4)
    assert not model.wanted_elsewhere(files[0], "a[1]")  # a listing alone is nobody's reading
    model.opened(files[0], SMALL, 1000.0, "a[1]")
    model.opened(files[1], SMALL, 1001.0, "b[2]")
    assert model.wanted_elsewhere(files[0], "a[1]")  # b[2] has yet to read it
    assert model.wanted_elsewhere(files[1], "b[2]")  # and a[1] this one
    assert not model.wanted_elsewhere(files[0], "b[2]")  # the caller's own job does not count
    model.opened(files[0], SMALL, 1002.0, "b[2]")
    assert not model.wanted_elsewhere(files[0], "a[1]")  # both read it this epoch
    model.opened(files[2], SMALL, 1002.0 + JOB_IDLE_SECONDS + 1, "b[2]")
    assert not model.wanted_elsewhere(files[2], "b[2]")  # a[1] stopped reading: it protects nothing any more


def test_a_listing_reaches_only_the_jobs_that_hold_its_directory() -> None:
    model = AccessModel()
    model.listed("", {"README": 10}, 0.0, "ls[1]")
    model.opened("README", 10, 1.0, "cat[2]")  # cat[2]'s job is the mount root's, not a dataset
    files = listed_dataset(model, "train", 5)
    model.listed("train", dict.fromkeys(files, SMALL), 2.0, "loader[3]")
    assert model.working_set("README", "cat[2]") == {"README"}


def test_a_file_of_one_callers_other_dataset_is_not_wanted_elsewhere() -> None:
    model = AccessModel()
    model.opened("train/a.jpg", SMALL, 1.0, "python[1]")
    model.opened("val/b.jpg", SMALL, 2.0, "python[1]")
    assert not model.wanted_elsewhere("val/b.jpg", "python[1]")
    model.opened("train/a.jpg", SMALL, 3.0, "python[2]")
    assert not model.wanted_elsewhere("train/a.jpg", "python[2]")  # python[1] read it this epoch


def test_a_job_merged_into_its_parent_answers_for_its_predictions() -> None:
    model = AccessModel()
    model.listed("ds/a", {"ds/a/1.jpg": SMALL}, 0.0, "p[1]")
    model.opened("ds/a/1.jpg", SMALL, 1.0, "p[1]")
    assert model.job_of("ds/a/1.jpg", "p[1]") == "p[1]:ds/a"
    model.listed("ds", {}, 2.0, "p[1]")  # the parent, listed after its child: one job
    assert model.job_of("ds/a/1.jpg", "p[1]") == "p[1]:ds"
    assert model.epoch_of("p[1]:ds/a") == model.epoch_of("p[1]:ds") == 0
