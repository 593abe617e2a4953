"""Identity: which workload (a job reading one dataset) each event belongs to."""

from __future__ import annotations

import random

from cachefsd.workload.epochs import SEED_UNREAD_OPENS
from cachefsd.workload.identity import JOB_IDLE_SECONDS, workload_id
from cachefsd.workload.model import WorkloadModel
from tests.unit.traces import (
    SMALL,
    Trace,
    details,
    epoch_of_path,
    listed,
    listed_dataset,
    paths_of,
    predicted_files,
    shuffled_epochs,
    workloads,
)

# -- roots ----------------------------------------------------------------------


def test_a_workload_is_named_by_its_job_and_root() -> None:
    assert workload_id("python[42]", "train") == "python[42]:train"
    assert workload_id("", "train") == "train"  # the unknown job's


def test_recursive_scan_makes_one_workload_at_the_top_listed_directory() -> None:
    model = WorkloadModel()
    model.listed("", {}, 0.0)
    model.listed("data/train", {}, 0.0)
    for label in ("cat", "dog"):
        listed_dataset(model, f"data/train/{label}", 3)
    assert workloads(model) == {"", "data/train"}
    assert model.workload_of("data/train/cat/img0001.jpg") == "data/train"
    assert details(model, "data/train")["working_set_files"] == 6


def test_without_listing_a_path_belongs_to_its_first_component() -> None:
    model = WorkloadModel()
    model.opened("a/x/1.bin", SMALL, 1.0)
    model.opened("b/y/2.bin", SMALL, 1.0)
    model.opened("root.bin", SMALL, 1.0)
    assert model.workload_of("a/x/1.bin") == "a"
    assert model.workload_of("b/y/2.bin") == "b"
    assert model.workload_of("root.bin") == ""
    assert model.workload_of("c/unseen.bin") is None


def test_a_parent_listed_after_its_child_absorbs_the_child_workload() -> None:
    model = WorkloadModel()
    listed_dataset(model, "ds/c1", 2)
    assert workloads(model) == {"ds/c1"}
    listed(model, "ds", [])
    listed_dataset(model, "ds/c2", 2)
    assert workloads(model) == {"ds"}
    assert details(model, "ds")["unread_files"] == 4


def test_a_deeper_listing_under_a_fallback_workload_joins_it() -> None:
    model = WorkloadModel()
    model.opened("a/train/0.jpg", SMALL, 1.0)
    listed_dataset(model, "a/train", 3)
    assert workloads(model) == {"a"}


def test_listing_the_mount_root_does_not_merge_workloads() -> None:
    model = WorkloadModel()
    model.listed("", {"README": 10}, 0.0)
    listed_dataset(model, "a", 2)
    listed_dataset(model, "b", 2)
    assert workloads(model) == {"", "a", "b"}


def test_one_hint_over_several_guessed_workloads_makes_them_one() -> None:
    """A hint is one loader's exact order: class folders right under the
    mount, first guessed as workloads of their own, are one dataset."""
    model = WorkloadModel()
    listed_dataset(model, "a", 4)
    listed_dataset(model, "b", 4)
    model.hint([], 0.0)
    model.hint(["a/img0003.jpg", "b/img0000.jpg", "a/img0001.jpg"], 0.0)
    assert paths_of(model.predict(3)) == ["a/img0003.jpg", "b/img0000.jpg", "a/img0001.jpg"]
    assert model.workload_of("b/img0002.jpg") == model.workload_of("a/img0000.jpg") == ""


def test_hints_of_two_workloads_stay_apart() -> None:
    model = WorkloadModel()
    listed_dataset(model, "a", 4)
    listed_dataset(model, "b", 4)
    model.hint(["a/img0003.jpg", "a/img0001.jpg"], 0.0)
    model.hint(["b/img0002.jpg", "b/img0000.jpg"], 0.0)
    assert workloads(model) == {"a", "b"}
    assert set(paths_of(model.predict(2))) == {"a/img0003.jpg", "b/img0002.jpg"}


def test_a_workload_merged_into_its_parent_answers_for_its_predictions() -> None:
    model = WorkloadModel()
    model.listed("ds/a", {"ds/a/1.jpg": SMALL}, 0.0, "p[1]")
    model.opened("ds/a/1.jpg", SMALL, 1.0, "p[1]")
    assert model.workload_of("ds/a/1.jpg", "p[1]") == "p[1]:ds/a"
    model.listed("ds", {}, 2.0, "p[1]")  # the parent, listed after its child: one workload
    assert model.workload_of("ds/a/1.jpg", "p[1]") == "p[1]:ds"
    assert model.epoch_of("p[1]:ds/a") == model.epoch_of("p[1]:ds") == 0


def test_turns_name_the_workloads_that_started_an_epoch_once() -> None:
    """What the prefetcher asks each round: which workloads began a new pass."""
    model = WorkloadModel()
    first, second = listed_dataset(model, "a/b", 10), listed_dataset(model, "c", 10)
    trace = Trace(model)
    trace.pass_over(first)
    trace.pass_over(second)
    assert model.take_turns() == {}
    trace.open(second[0])
    assert model.take_turns() == {"c": 1}
    assert model.take_turns() == {}
    trace.open(first[0])
    listed(model, "a", [])  # before the turn is taken, a parent's workload absorbs a/b's
    assert model.take_turns() == {"a": 1}


# -- several jobs -----------------------------------------------------------------


def _interleaved(orders: dict[str, list[str]], rng: random.Random) -> list[tuple[str, str]]:
    """(job, path) events of several jobs' passes, each in its own order,
    taking turns at random."""
    positions = dict.fromkeys(orders, 0)
    events: list[tuple[str, str]] = []
    while positions:
        job = rng.choice(sorted(positions))
        events.append((job, orders[job][positions[job]]))
        positions[job] += 1
        if positions[job] == len(orders[job]):
            del positions[job]
    return events


def test_two_jobs_reading_one_dataset_keep_their_own_epochs() -> None:
    """Two jobs (a sweep) shuffling the same files: each epoch boundary is a
    job's own, not every re-read of a file the other job read."""
    model = WorkloadModel()
    files = listed_dataset(model, "d", 200)
    rng = random.Random(7)
    passes = {job: shuffled_epochs(files, 3, rng) for job in ("a[1]", "b[2]")}
    now = 0.0
    for epoch in range(3):
        events = _interleaved({job: orders[epoch] for job, orders in passes.items()}, rng)
        for job, path in events:
            now += 0.01
            model.opened(path, SMALL, now, job)
    assert epoch_of_path(model, "d", "a[1]") == epoch_of_path(model, "d", "b[2]") == 2
    assert model.current() == 2
    assert model.job_epochs() == {"": 0, "a[1]": 2, "b[2]": 2}
    assert workloads(model) == {"d", "a[1]:d", "b[2]:d"}  # "d": the listing's (the unknown job)


def test_a_workload_that_never_listed_shares_the_datasets_working_set() -> None:
    """A second job on a listed dataset knows its files: its unread set
    once it has opened a few (a shell's ``cat`` of one file copies nothing),
    and what a later listing adds."""
    model = WorkloadModel()
    files = listed_dataset(model, "d", 40)
    model.opened(files[0], SMALL, 1.0, "cat[5]")
    assert details(model, "cat[5]:d")["unread_files"] == 0
    assert details(model, "cat[5]:d")["working_set_files"] == 40
    for index, path in enumerate(files[:SEED_UNREAD_OPENS]):
        model.opened(path, SMALL, 1.0 + index, "w[6]")
    assert predicted_files(model, "w[6]:d") == set(files[SEED_UNREAD_OPENS:])
    model.listed(
        "d", {"d/new.jpg": SMALL}, 100.0, "other[9]"
    )  # a later listing reaches every job's workload of d
    assert "d/new.jpg" in predicted_files(model, "w[6]:d")
    assert details(model, "cat[5]:d")["working_set_files"] == 41


def test_a_job_idle_for_long_is_forgotten_when_a_new_one_comes() -> None:
    model = WorkloadModel()
    files = listed_dataset(model, "d", 4)
    model.opened(files[0], SMALL, 1000.0, "a[1]")
    model.opened(files[1], SMALL, 1000.0 + JOB_IDLE_SECONDS / 2, "b[2]")
    assert {"a[1]:d", "b[2]:d"} <= workloads(model)
    assert {"a[1]", "b[2]"} <= model.jobs()
    model.opened(files[2], SMALL, 1001.0 + JOB_IDLE_SECONDS, "c[3]")
    assert "a[1]:d" not in workloads(model)
    assert model.jobs() == {"b[2]", "c[3]"}
    assert model.epoch_of("a[1]:d") is None  # its predictions are stale for the prefetcher


def test_a_hint_replaces_only_its_own_jobs_plan() -> None:
    model = WorkloadModel()
    files = listed_dataset(model, "d", 8)
    model.hint(files, 1000.0, "a[1]")
    model.hint(files[::-1], 1000.0, "b[2]")
    model.hint(files[2:] + files[:2], 1001.0, "a[1]")
    first = {
        job: next(p.path for p in model.predict(100) if p.workload == f"{job}:d") for job in ("a[1]", "b[2]")
    }
    assert first == {"a[1]": files[2], "b[2]": files[-1]}


def test_a_file_is_planned_elsewhere_by_another_jobs_plan_until_it_reads_it() -> None:
    model = WorkloadModel()
    files = listed_dataset(model, "d", 6)
    model.hint(files, 1000.0, "a[1]")
    model.hint(files[::-1], 1000.0, "b[2]")
    assert model.planned_elsewhere(files[1], "a[1]") == 4  # b[2] opens four files before it
    assert model.planned_elsewhere(files[1], "b[2]") == 1  # and a[1] one
    model.opened(files[5], SMALL, 1001.0, "b[2]")
    assert model.planned_elsewhere(files[1], "a[1]") == 3  # b[2] is one file nearer
    assert model.planned_elsewhere(files[5], "a[1]") is None  # b[2] has read it
    model.opened(files[0], SMALL, 1001.0, "c[3]")  # a job with no plan plans nothing
    assert model.planned_elsewhere(files[2], "b[2]") == 2


def test_a_file_is_wanted_elsewhere_while_another_active_job_is_still_to_read_it() -> None:
    model = WorkloadModel()
    files = listed_dataset(model, "d", 4)
    assert not model.wanted_elsewhere(files[0], "a[1]")  # a listing alone is nobody's reading
    model.opened(files[0], SMALL, 1000.0, "a[1]")
    model.opened(files[1], SMALL, 1001.0, "b[2]")
    assert model.wanted_elsewhere(files[0], "a[1]")  # b[2] has yet to read it
    assert model.wanted_elsewhere(files[1], "b[2]")  # and a[1] this one
    assert not model.wanted_elsewhere(files[0], "b[2]")  # the job's own workload does not count
    model.opened(files[0], SMALL, 1002.0, "b[2]")
    assert not model.wanted_elsewhere(files[0], "a[1]")  # both read it this epoch
    model.opened(files[2], SMALL, 1002.0 + JOB_IDLE_SECONDS + 1, "b[2]")
    assert not model.wanted_elsewhere(files[2], "b[2]")  # a[1] stopped reading: it protects nothing any more


def test_a_listing_reaches_only_the_workloads_that_hold_its_directory() -> None:
    model = WorkloadModel()
    model.listed("", {"README": 10}, 0.0, "ls[1]")
    model.opened("README", 10, 1.0, "cat[2]")  # cat[2]'s workload is the mount root's, not a dataset
    files = listed_dataset(model, "train", 5)
    model.listed("train", dict.fromkeys(files, SMALL), 2.0, "loader[3]")
    assert details(model, "cat[2]:")["working_set_files"] == 1


def test_a_file_of_one_jobs_other_dataset_is_not_wanted_elsewhere() -> None:
    model = WorkloadModel()
    model.opened("train/a.jpg", SMALL, 1.0, "python[1]")
    model.opened("val/b.jpg", SMALL, 2.0, "python[1]")
    assert not model.wanted_elsewhere("val/b.jpg", "python[1]")
    model.opened("train/a.jpg", SMALL, 3.0, "python[2]")
    assert not model.wanted_elsewhere("train/a.jpg", "python[2]")  # python[1] read it this epoch
