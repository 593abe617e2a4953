"""Synthetic traces for the workload model's tests (``test_workload_*.py``),
and what they read back through its API."""

from __future__ import annotations

import random

from cachefsd.jobs import UNKNOWN_JOB
from cachefsd.workload.model import Prediction, WorkloadModel

KIB = 1 << 10
MIB = 1 << 20
SMALL = 100 * KIB
# More predictions than any test's workloads have files: all of them.
ALL = 100_000


class Trace:
    """Feeds a model events with a clock that ticks 10 ms per event."""

    def __init__(self, model: WorkloadModel) -> None:
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


def listed(model: WorkloadModel, directory: str, paths: list[str], size: int = SMALL) -> None:
    model.listed(directory, dict.fromkeys(paths, size), 0.0)


def listed_dataset(model: WorkloadModel, root: str, count: int) -> list[str]:
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


def epoch_of_path(model: WorkloadModel, path: str, job: str = UNKNOWN_JOB) -> int:
    """The epoch of ``job``'s workload of ``path``, as the prefetcher asks it."""
    workload = model.workload_of(path, job)
    assert workload is not None, f"no workload of {job} holds {path}"
    epoch = model.epoch_of(workload)
    assert epoch is not None
    return epoch


def predicted_files(model: WorkloadModel, workload: str) -> set[str]:
    """The whole files predicted for ``workload``: what it still has to
    open this epoch but what the prefetcher found cached (its unread set,
    while it is active)."""
    return {p.path for p in model.predict(ALL) if p.workload == workload and p.offset == 0}


def details(model: WorkloadModel, workload: str) -> dict[str, object]:
    """``stats``' details of ``workload``."""
    per_workload = model.stats()["per_workload"]
    assert isinstance(per_workload, dict)
    found = per_workload[workload]
    assert isinstance(found, dict)
    return found


def workloads(model: WorkloadModel) -> set[str]:
    """The names of the model's workloads (all of them, as ``stats`` details up to 32)."""
    per_workload = model.stats()["per_workload"]
    assert isinstance(per_workload, dict)
    return set(per_workload)
