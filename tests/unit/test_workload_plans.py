"""Plans: a hint or a replayed order, followed while the opens bear it out."""

from __future__ import annotations

import random

import pytest

from cachefsd.workload.epochs import PLAN_RECHECK_FILES
from cachefsd.workload.model import FILE_PREDICTION_BYTES, WorkloadModel
from cachefsd.workload.plans import HINT_MIN_MATCH, PLAN_PROBATION_OPENS, REPLAY_MIN_MATCH, Plan
from tests.unit.traces import (
    Trace,
    details,
    epoch_of_path,
    listed_dataset,
    paths_of,
    predicted_files,
    shuffled_epochs,
)

# -- the plan alone -------------------------------------------------------------


def test_a_plan_keeps_its_first_verdict_until_probation_ends() -> None:
    order = [f"f{i}" for i in range(64)]
    hint, replay = (
        Plan.of(order, HINT_MIN_MATCH, trusted=True),
        Plan.of(order, REPLAY_MIN_MATCH, trusted=False),
    )
    for position in range(PLAN_PROBATION_OPENS - 1):
        for plan in (hint, replay):
            plan.observe(position, order[position])
    assert (hint.trusted(), replay.trusted()) == (True, False)
    for plan in (hint, replay):
        plan.observe(PLAN_PROBATION_OPENS - 1, order[PLAN_PROBATION_OPENS - 1])
    assert (hint.trusted(), replay.trusted(), replay.judged_good()) == (True, True, True)


def test_an_open_matches_within_the_slack_and_too_few_matches_lose_the_trust() -> None:
    order = [f"f{i}" for i in range(64)]  # slack: 64 // 8 = 8 places
    plan = Plan.of(order, HINT_MIN_MATCH, trusted=True)
    for position in range(PLAN_PROBATION_OPENS):
        plan.observe(position, order[position + 8])  # 8 places off: a match
    assert (plan.matched, plan.trusted()) == (PLAN_PROBATION_OPENS, True)
    for position in range(PLAN_PROBATION_OPENS, 3 * PLAN_PROBATION_OPENS):
        plan.observe(position, order[63 - position])  # far off, or not in the plan
    assert not plan.trusted()


def test_placements_skip_what_was_opened_and_count_the_files_before() -> None:
    plan = Plan.of(["a", "b", "a", "c", "d"], REPLAY_MIN_MATCH, trusted=True)
    seen = {"b": 0}
    assert list(plan.placements(seen, len(seen), 5)) == [("a", 0.0), ("c", 2.0), ("d", 3.0)]
    plan.advance({"a": 0, "b": 1})
    assert plan.low == 3


# -- replayed orders ------------------------------------------------------------


def test_an_unshuffled_loader_order_is_replayed_from_the_current_position() -> None:
    model = WorkloadModel()
    files = listed_dataset(model, "fixed", 50)
    order = files[:]
    random.Random(1).shuffle(order)  # fixed, but not the listing order
    trace = Trace(model)
    trace.pass_over(order)
    trace.pass_over(order[:10])
    assert epoch_of_path(model, "fixed") == 1
    predicted = model.predict(5)
    assert paths_of(predicted) == order[10:15]
    assert [p.distance for p in predicted] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert details(model, "fixed")["order"] == "replay"
    # The next epoch repeated the previous one: replay from its first open.
    trace.pass_over(order[10:])
    trace.open(order[0])
    assert epoch_of_path(model, "fixed") == 2
    assert paths_of(model.predict(3)) == order[1:4]


def test_replay_needs_some_evidence_in_the_first_repeated_epoch() -> None:
    model = WorkloadModel()
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
    model = WorkloadModel()
    files = listed_dataset(model, "shuf", 200)
    trace = Trace(model)
    first, second = shuffled_epochs(files, 2, random.Random(11))
    trace.pass_over(first)
    trace.pass_over(second[:50])
    assert details(model, "shuf")["order"] == "unknown"
    assert second[60] not in dict(model.planned())
    unread_in_listing_order = [path for path in files if path not in set(second[:50])]
    assert paths_of(model.predict(5)) == unread_in_listing_order[:5]


# -- hints ----------------------------------------------------------------------


def test_a_hint_is_followed_exactly_from_the_reader_position() -> None:
    model = WorkloadModel()
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
    assert model.stats()["hint_coverage"] == 1.0
    assert details(model, "h")["order"] == "hint"


def test_a_new_hint_starts_a_new_epoch() -> None:
    model = WorkloadModel()
    files = listed_dataset(model, "h", 40)
    trace = Trace(model)
    trace.pass_over(files)
    second = list(reversed(files))
    model.hint(second, trace.tick())
    assert epoch_of_path(model, "h") == 1
    assert predicted_files(model, "h") == set(files)
    assert paths_of(model.predict(2)) == second[:2]
    trace.open(second[0])  # read last epoch, but this epoch began with the hint
    assert epoch_of_path(model, "h") == 1


def test_a_hint_arriving_just_after_the_pass_began_joins_the_epoch() -> None:
    model = WorkloadModel()
    files = listed_dataset(model, "h", 64)
    trace = Trace(model)
    trace.pass_over(files)
    order = files[1:] + files[:1]
    random.Random(4).shuffle(order)
    order.remove(files[0])
    order.insert(0, files[0])
    trace.open(order[0])  # the re-open already started epoch 1
    model.hint(order, trace.tick())
    assert epoch_of_path(model, "h") == 1
    assert paths_of(model.predict(2)) == order[1:3]


def test_a_hint_of_unknown_paths_costs_bandwidth_then_falls_back() -> None:
    model = WorkloadModel()
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
    model = WorkloadModel()
    files = listed_dataset(model, "h", 40)
    model.hint(list(reversed(files)), 0.0)
    trace = Trace(model)
    trace.pass_over(files[:20])
    assert details(model, "h")["order"] == "unknown"
    assert paths_of(model.predict(2)) == files[20:22]


def dataloader_opens(order: list[str], workers: int, batch: int) -> list[str]:
    """The order in which a DataLoader's workers open an epoch's files: each
    worker reads its own batch (batches go round-robin) while the others
    read theirs, so an exact order arrives up to workers x batch places off."""
    batches = [order[start : start + batch] for start in range(0, len(order), batch)]
    opens: list[str] = []
    for first in range(0, len(batches), workers):
        side_by_side = batches[first : first + workers]
        for step in range(batch):
            opens.extend(each[step] for each in side_by_side if step < len(each))
    return opens


@pytest.mark.parametrize("hinted", [True, False])
def test_a_hint_read_by_many_workers_with_large_batches_is_followed(hinted: bool) -> None:
    model = WorkloadModel()
    files = listed_dataset(model, "h", 20_000)
    order = files[:]
    random.Random(3).shuffle(order)
    model.hint(order if hinted else sorted(order, key=lambda path: path[::-1]), 0.0)
    Trace(model).pass_over(dataloader_opens(order, workers=8, batch=256)[:10_000])
    # Followed: 8 workers x 256 puts an open up to 1,785 places off its place.
    # The control, a hint of another order, is not.
    assert details(model, "h")["order"] == ("hint" if hinted else "unknown")


def test_a_satisfied_planned_file_is_predicted_again_as_its_turn_nears() -> None:
    # It may have been evicted since it was found cached: a plan's sooner
    # files take the room of its later ones.
    model = WorkloadModel()
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


def test_planned_orders_files_by_the_plan_and_drops_them_once_read() -> None:
    model = WorkloadModel()
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
