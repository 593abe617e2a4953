"""Page-cache warming: planned cached files, nearest first, within a
budget of bytes warmed and not opened yet."""

from __future__ import annotations

from cachefsd.prefetch.warm import ToWarm, WarmQueue

FILE_BYTES = 10


def never_stale(workload: str, epoch: int) -> bool:
    return False


def planned(queue: WarmQueue, *positions: float, workload: str = "train", epoch: int = 0) -> None:
    for position in positions:
        queue.plan(ToWarm(position, f"{workload}/f{position:g}", workload, epoch))


def warm_all(queue: WarmQueue, opens: int) -> list[str]:
    """Warm what the queue gives, as the prefetch thread does; the paths."""
    queue.turned(opens)
    paths = []
    while (file := queue.next(opens, never_stale)) is not None:
        queue.warmed(file, FILE_BYTES)
        paths.append(file.path)
    return paths


def test_files_are_warmed_nearest_first_within_the_budget() -> None:
    queue = WarmQueue(budget_bytes=3 * FILE_BYTES)
    planned(queue, 5, 1, 3, 2, 4)
    assert warm_all(queue, opens=0) == ["train/f1", "train/f2", "train/f3"]
    assert queue.warmed_bytes == 3 * FILE_BYTES
    assert warm_all(queue, opens=0) == []  # the budget is spent until a file's turn comes


def test_a_file_whose_turn_came_frees_its_bytes_for_the_next() -> None:
    queue = WarmQueue(budget_bytes=3 * FILE_BYTES)
    planned(queue, 1, 2, 3, 4, 5)
    warm_all(queue, opens=0)
    assert warm_all(queue, opens=2) == ["train/f4"]  # the file at 1 is due: it no longer counts


def test_a_file_whose_turn_has_come_is_not_warmed() -> None:
    """Warming it now would only race its read."""
    queue = WarmQueue(budget_bytes=3 * FILE_BYTES)
    planned(queue, 1, 7)
    assert warm_all(queue, opens=5) == ["train/f7"]


def test_a_file_planned_for_a_pass_that_is_over_is_dropped() -> None:
    queue = WarmQueue(budget_bytes=3 * FILE_BYTES)
    planned(queue, 1, workload="train", epoch=0)
    planned(queue, 2, workload="val", epoch=3)
    file = queue.next(0, lambda workload, epoch: workload == "train")
    assert file is not None
    assert file.path == "val/f2"
    assert queue.next(0, never_stale) is None  # train's was dropped, not kept for later


def test_what_was_warmed_for_a_pass_that_is_over_stops_counting() -> None:
    queue = WarmQueue(budget_bytes=2 * FILE_BYTES)
    planned(queue, 1, 2, workload="train")
    warm_all(queue, opens=0)
    planned(queue, 3, workload="val")
    assert warm_all(queue, opens=0) == []
    queue.void(lambda workload, epoch: workload == "train")
    assert queue.warmed_bytes == 0
    assert warm_all(queue, opens=0) == ["val/f3"]


def test_the_budget_is_checked_before_each_file() -> None:
    """A file is warmed whole, so the last one may take the warmed bytes
    past the budget; none follows it."""
    queue = WarmQueue(budget_bytes=FILE_BYTES + 1)
    planned(queue, 1, 2, 3)
    assert warm_all(queue, opens=0) == ["train/f1", "train/f2"]
