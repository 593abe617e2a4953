"""The prefetcher over an in-memory bucket: it fetches what the workload model
predicts, within its budget, and counts what was used."""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import pytest

from cachefsd.cache.codec import content_hash
from cachefsd.cache.policy import EpochAwarePolicy, MinioPolicy, PlannedUse
from cachefsd.cache.tier import disk_bytes
from cachefsd.config import PrefetchSettings
from cachefsd.errors import CachefsdError
from cachefsd.prefetch.prefetcher import Prefetcher
from cachefsd.prefetch.tuning import DEFAULT_TUNING, PrefetchTuning
from cachefsd.store.base import ObjectInfo
from cachefsd.workload.identity import JOB_IDLE_SECONDS
from cachefsd.workload.model import WorkloadModel
from tests.metrics import sample
from tests.polling import wait_until
from tests.unit.conftest import BLOCK_SIZE, Clock, Rig, RigFactory, joined, read_path

POLL_SECONDS = 10.0


def wait_for(condition: Callable[[], bool], what: str) -> None:
    wait_until(condition, what, POLL_SECONDS)


@pytest.fixture(name="dataset")
def fixture_dataset() -> dict[str, bytes]:
    return {f"train/c{i % 2}/s{i:02d}": os.urandom(BLOCK_SIZE // 2) for i in range(20)}


# A file's first run reads 4 blocks before it waits for a verdict.
FOUR_FREE_BLOCKS = PrefetchTuning(head_free_bytes=4 * BLOCK_SIZE)


@contextmanager
def start(
    rig: Rig,
    settings: PrefetchSettings,
    tuning: PrefetchTuning = DEFAULT_TUNING,
    clock: Callable[[], float] = time.monotonic,
) -> Iterator[Prefetcher]:
    model = WorkloadModel()
    prefetcher = Prefetcher(model, rig.namespace, rig.reader, rig.view, settings, rig.metrics, tuning, clock)
    prefetcher.start()
    try:
        yield prefetcher
    finally:
        prefetcher.stop()


@contextmanager
def store_held(rig: Rig) -> Iterator[threading.Event]:
    """Every call to the store waits until the test sets the event it is
    given (set at the latest on leaving): a GET stays in flight exactly as
    long as the test needs, however loaded the machine."""
    gate = threading.Event()
    rig.faulty.faults.gate = gate
    try:
        yield gate
    finally:
        gate.set()


def walk_and_open(rig: Rig, prefetcher: Prefetcher, path: str) -> None:
    for directory in ("train", "train/c0", "train/c1"):
        prefetcher.listed(rig.namespace.listdir("/" + directory), directory)
    info = rig.namespace.lookup("/" + path).info
    assert info is not None
    prefetcher.opened(info)
    prefetcher.read(info, 0, info.size)


def test_unread_files_of_a_listed_dataset_are_fetched_ahead(
    make_rig: RigFactory, dataset: dict[str, bytes]
) -> None:
    rig = make_rig(dataset)
    with start(rig, PrefetchSettings()) as prefetcher:
        walk_and_open(rig, prefetcher, "train/c0/s00")
        # Every file but the one being read (its read is the events' fiction here).
        wait_for(lambda: rig.store.get_count >= len(dataset) - 1, "every unread file to be fetched ahead")
    gets = rig.store.get_count
    for key, data in dataset.items():
        assert read_path(rig.fs, "/" + key, len(data)) == data
    assert rig.store.get_count == gets + 1  # every read was a hit but that of s00
    assert sample(rig.metrics.registry, "cachefsd_prefetch_issued_bytes_total") > 0


def test_a_hint_is_followed_in_order_within_the_lookahead(
    make_rig: RigFactory, dataset: dict[str, bytes]
) -> None:
    rig = make_rig(dataset)
    order = sorted(dataset, reverse=True)
    budget = 3 * (BLOCK_SIZE // 2)
    with start(rig, PrefetchSettings(lookahead=budget, concurrency=1)) as prefetcher:
        accepted, unknown = prefetcher.hint([*order, "train/no-such-file"])
        assert (accepted, unknown) == (len(order), 1)
        infos = [rig.namespace.lookup("/" + key).info for key in order]
        wait_for(lambda: all(rig.view.residency(info, 0) for info in infos[:3]), "the first hinted files")
        # The lookahead holds three files: nothing more is fetched until one is read.
        assert rig.store.get_count == 3
        info = rig.namespace.lookup("/" + order[0]).info
        assert info is not None
        prefetcher.opened(info)
        prefetcher.read(info, 0, info.size)
        wait_for(lambda: rig.store.get_count >= 4, "the next hinted file")
        assert sample(rig.metrics.registry, "cachefsd_prefetch_used_bytes_total") == BLOCK_SIZE // 2


def test_the_shares_of_distributed_ranks_are_merged_into_one_order(
    make_rig: RigFactory, dataset: dict[str, bytes]
) -> None:
    rig = make_rig(dataset)
    model = WorkloadModel()
    prefetcher = Prefetcher(model, rig.namespace, rig.reader, rig.view, PrefetchSettings(), rig.metrics)
    keys = sorted(dataset)
    prefetcher.hint(keys[0:4], part=(0, 2))
    prefetcher.hint(keys[4:8], part=(1, 2))
    predicted = [prediction.path for prediction in model.predict(8)]
    assert predicted == [keys[0], keys[4], keys[1], keys[5], keys[2], keys[6], keys[3], keys[7]]


def test_the_shares_of_a_job_that_stopped_reading_are_not_kept(
    make_rig: RigFactory, dataset: dict[str, bytes]
) -> None:
    """A sweep's trials each hint their ranks' shares: a trial that stopped
    reading (the model forgot it) must not keep its order, nor merge it
    into a later hint of a job of the same name."""
    rig = make_rig(dataset)
    model, clock = WorkloadModel(), Clock()
    prefetcher = Prefetcher(
        model, rig.namespace, rig.reader, rig.view, PrefetchSettings(), rig.metrics, DEFAULT_TUNING, clock
    )
    keys = sorted(dataset)
    prefetcher.hint(keys[0:4], part=(0, 2), job="trial[1]")
    prefetcher.hint(keys[4:8], part=(1, 2), job="trial[1]")
    assert model.stats()["per_workload"]["trial[1]:train"]["hint_files"] == 8  # type: ignore[index]
    clock.now += JOB_IDLE_SECONDS + 1
    info = rig.namespace.lookup("/" + keys[0]).info
    assert info is not None
    prefetcher.opened(info, "trial[2]")  # a new caller: trial[1], idle, is forgotten
    prefetcher.hint(keys[4:8], part=(1, 2), job="trial[1]")
    assert model.stats()["per_workload"]["trial[1]:train"]["hint_files"] == 4  # type: ignore[index]


def test_a_read_that_joins_a_prefetch_in_flight_counts_it_used_not_wasted(
    make_rig: RigFactory, dataset: dict[str, bytes]
) -> None:
    planned = PlannedUse()
    rig = make_rig(dataset, planned=planned)
    key = sorted(dataset)[0]
    info = rig.namespace.lookup("/" + key).info
    assert info is not None
    settings = PrefetchSettings(concurrency=1)
    prefetcher = Prefetcher(WorkloadModel(), rig.namespace, rig.reader, rig.view, settings, rig.metrics)
    calls = rig.faulty.calls
    prefetcher.start()
    try:
        with store_held(rig) as gate:
            prefetcher.hint([key])
            wait_for(lambda: rig.faulty.calls > calls, "the prefetch GET to start")
            prefetcher.opened(info)
            prefetcher.read(info, 0, info.size)  # before the block lands, as the FUSE read does
            assert rig.store.get_count == 0  # the prefetch's GET is still in flight: this read joins it
            gate.set()
        assert joined(rig.reader.read(info, 0, info.size)) == dataset[key]
        wait_for(
            lambda: sample(rig.metrics.registry, "cachefsd_prefetch_used_bytes_total") == info.size,
            "the join to count",
        )
    finally:
        prefetcher.stop()
    assert rig.store.get_count == 1
    assert sample(rig.metrics.registry, "cachefsd_prefetch_wasted_bytes_total") == 0
    digest = rig.view.digest(info, 0)
    assert digest is not None
    assert planned.next_use(digest) is None  # read: nothing left planned


def test_no_more_is_fetched_ahead_than_the_cache_would_keep(
    make_rig: RigFactory, dataset: dict[str, bytes]
) -> None:
    """Two blocks of room, a policy that gives up nothing, eight slots: two GETs, none wasted."""
    block_file = disk_bytes(BLOCK_SIZE // 2)
    rig = make_rig(dataset, capacity=2 * block_file, policy=MinioPolicy())
    with start(rig, PrefetchSettings(concurrency=8)) as prefetcher:
        prefetcher.hint(sorted(dataset))
        wait_for(lambda: rig.cache.used_bytes == 2 * block_file, "the cache to fill")
    assert rig.store.get_count == 2
    assert sample(rig.metrics.registry, "cachefsd_prefetch_wasted_bytes_total") == 0


def test_a_prefetched_block_the_cache_refuses_counts_issued_and_wasted(
    make_rig: RigFactory, dataset: dict[str, bytes]
) -> None:
    """Room for one block, taken by another while the prefetch's GET is in
    flight, and a policy that gives up nothing: the fetched block is refused.
    Its bytes crossed the network, so they count as issued and as wasted,
    and the dashboard's accuracy (used / issued) stays a fraction."""
    block_file = disk_bytes(BLOCK_SIZE // 2)
    rig = make_rig(dataset, capacity=block_file, policy=MinioPolicy())
    first, second = sorted(dataset)[:2]
    info = rig.namespace.lookup("/" + second).info
    assert info is not None
    calls = rig.faulty.calls
    with start(rig, PrefetchSettings(concurrency=1)) as prefetcher:
        with store_held(rig):
            prefetcher.hint([first])
            wait_for(lambda: rig.faulty.calls > calls, "the prefetch GET to start")
            data = dataset[second]
            rig.cache.admit(rig.reader.ref(info, 0), content_hash(data), data)
        wait_for(
            lambda: sample(rig.metrics.registry, "cachefsd_prefetch_issued_bytes_total") > 0,
            "the prefetch to land",
        )
    assert rig.view.residency(info, 0) is not None  # the resident stayed
    first_info = rig.namespace.lookup("/" + first).info
    assert first_info is not None
    assert rig.view.residency(first_info, 0) is None  # refused on arrival
    assert sample(rig.metrics.registry, "cachefsd_prefetch_issued_bytes_total") == BLOCK_SIZE // 2
    assert sample(rig.metrics.registry, "cachefsd_prefetch_wasted_bytes_total") == BLOCK_SIZE // 2


def test_with_a_hint_a_full_cache_gives_up_what_is_read_last_for_what_is_read_first(
    make_rig: RigFactory, dataset: dict[str, bytes]
) -> None:
    """Belady: the cache holds the last four files of the hinted order, all
    still to be read; the first four evict them, latest first. One fetch at
    a time, so that each eviction can be seen."""
    model, planned = WorkloadModel(), PlannedUse()
    block_file = disk_bytes(BLOCK_SIZE // 2)
    policy = EpochAwarePolicy(model, planned)
    rig = make_rig(dataset, capacity=4 * block_file, policy=policy, planned=planned)
    order = sorted(dataset)[:8]
    infos = [rig.namespace.lookup("/" + key).info for key in order]
    assert all(info is not None for info in infos)
    for info in infos[4:]:
        assert rig.reader.fetch_run_ahead(info, range(1)) == {0}  # cached, not read yet: due this epoch
    prefetcher = Prefetcher(
        model, rig.namespace, rig.reader, rig.view, PrefetchSettings(concurrency=1), rig.metrics
    )
    prefetcher.start()
    try:
        prefetcher.hint(order)
        for turn, info in enumerate(infos[:4]):
            wait_for(lambda info=info: rig.view.residency(info, 0) is not None, f"hinted file {turn}")
            kept = [rig.view.residency(each, 0) is not None for each in infos[4:]]
            assert kept == sorted(kept, reverse=True)  # only ever the latest went
            assert kept.count(False) > turn
    finally:
        prefetcher.stop()
    assert [rig.view.residency(info, 0) is not None for info in infos] == [True] * 4 + [False] * 4
    assert sample(rig.metrics.registry, "cachefsd_prefetch_wasted_bytes_total") == 0


def test_a_new_epoch_voids_the_plans_of_blocks_never_read(
    make_rig: RigFactory, dataset: dict[str, bytes]
) -> None:
    planned = PlannedUse()
    rig = make_rig(dataset, planned=planned)
    model = WorkloadModel()
    prefetcher = Prefetcher(model, rig.namespace, rig.reader, rig.view, PrefetchSettings(), rig.metrics)
    keys = sorted(dataset)
    ahead = rig.namespace.lookup("/" + keys[0]).info
    other = rig.namespace.lookup("/" + keys[5]).info
    assert ahead is not None
    assert other is not None
    prefetcher.start()
    try:
        prefetcher.hint([keys[0]])
        wait_for(lambda: rig.view.residency(ahead, 0) is not None, "the hinted file")
        digest = rig.view.digest(ahead, 0)
        assert digest is not None
        wait_for(lambda: planned.next_use(digest) is not None, "its plan")
        for _ in range(2):  # a re-read ends the first epoch
            prefetcher.opened(other)
            prefetcher.read(other, 0, other.size)
        wait_for(lambda: planned.next_use(digest) is None, "the plan to be voided")
    finally:
        prefetcher.stop()
    assert model.current() == 1


def test_one_jobs_new_epoch_keeps_the_plans_of_another(
    make_rig: RigFactory, dataset: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two jobs on one mount, c0 hinted and c1 not (each folder listed on
    its own): c1 starting its next epoch says nothing about c0's, whose
    cached blocks stay planned."""
    planned = PlannedUse()
    rig = make_rig(dataset, planned=planned)
    model = WorkloadModel()
    prefetcher = Prefetcher(model, rig.namespace, rig.reader, rig.view, PrefetchSettings(), rig.metrics)
    hinted = [key for key in sorted(dataset) if key.startswith("train/c0/")]
    first = rig.namespace.lookup("/" + hinted[0]).info
    unhinted = [key for key in sorted(dataset) if key.startswith("train/c1/")]
    others = [rig.namespace.lookup("/" + key).info for key in unhinted]
    assert first is not None
    unplan, void_plans = rig.view.unplan, prefetcher._void_plans
    unplanned: list[str] = []
    voided: list[dict[str, int]] = []

    def recorded_unplan(digest: str) -> None:
        unplanned.append(digest)
        unplan(digest)

    def recorded_void_plans(turns: dict[str, int]) -> None:
        void_plans(turns)
        voided.append(turns)

    monkeypatch.setattr(rig.view, "unplan", recorded_unplan)
    monkeypatch.setattr(prefetcher, "_void_plans", recorded_void_plans)
    for directory in ("train/c0", "train/c1"):
        prefetcher.listed(rig.namespace.listdir("/" + directory), directory)
    prefetcher.start()
    try:
        prefetcher.hint(hinted)
        wait_for(lambda: rig.view.residency(first, 0) is not None, "the first hinted file")
        digest = rig.view.digest(first, 0)
        assert digest is not None
        wait_for(lambda: planned.next_use(digest) is not None, "its plan")
        for info in [*others, others[0]]:  # c1 read through, then again: its next epoch
            assert info is not None
            prefetcher.opened(info)
            prefetcher.read(info, 0, info.size)
        wait_for(lambda: bool(voided), "the prefetcher to see c1's new epoch")
        assert list(voided[0]) == ["train/c1"]
        assert model.epoch_of("train/c0") == 0
        assert planned.next_use(digest) is not None
        assert digest not in unplanned  # kept, not voided and planned again
    finally:
        prefetcher.stop()


def test_with_a_hint_cached_files_are_warmed_nearest_first_within_the_budget(
    make_rig: RigFactory, dataset: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hinted files already cached are read into the page cache as their
    turn nears: three files' worth ahead of the reader, one more per file opened."""
    file_bytes = BLOCK_SIZE // 2
    tuning = PrefetchTuning(warm_ahead_bytes=3 * file_bytes)
    rig = make_rig(dataset)
    order = sorted(dataset, reverse=True)
    infos = [rig.namespace.lookup("/" + key).info for key in order]
    for info in infos:
        assert info is not None
        rig.reader.fetch_run_ahead(info, range(1))
    warmed = functools.partial(sample, rig.metrics.registry, "cachefsd_prefetch_warmed_bytes_total")
    warm = rig.view.warm
    warmed_keys: list[str] = []

    def recorded_warm(info: ObjectInfo, index: int) -> bool:
        warmed_keys.append(info.key)
        return warm(info, index)

    monkeypatch.setattr(rig.view, "warm", recorded_warm)
    with start(rig, PrefetchSettings(), tuning) as prefetcher:
        prefetcher.hint(order)
        wait_for(lambda: warmed() == 3 * file_bytes, "the first three hinted files to be warmed")
        assert warmed_keys == order[:3]
        assert infos[0] is not None
        prefetcher.opened(infos[0])
        prefetcher.read(infos[0], 0, file_bytes)
        wait_for(lambda: warmed() == 4 * file_bytes, "one more file to be warmed")
        assert warmed_keys == order[:4]
    assert rig.store.get_count == len(dataset)  # warming fetches nothing


def test_without_a_plan_nothing_is_warmed(make_rig: RigFactory, dataset: dict[str, bytes]) -> None:
    """The unread set has no order: a cached file's turn is anyone's guess."""
    rig = make_rig(dataset)
    for key in dataset:
        info = rig.namespace.lookup("/" + key).info
        assert info is not None
        rig.reader.fetch_run_ahead(info, range(1))
    model = WorkloadModel()
    prefetcher = Prefetcher(model, rig.namespace, rig.reader, rig.view, PrefetchSettings(), rig.metrics)
    prefetcher.start()
    try:
        walk_and_open(rig, prefetcher, "train/c0/s00")
        # Once the prefetcher has found every unread file cached, the model predicts none.
        wait_for(lambda: model.predict(100) == [], "the prefetcher to go over the unread files")
    finally:
        prefetcher.stop()
    assert sample(rig.metrics.registry, "cachefsd_prefetch_warmed_bytes_total") == 0


def test_the_blocks_of_a_hinted_file_are_each_fetched_once(make_rig: RigFactory) -> None:
    """A run's blocks are a ranged GET each (several at once), none twice."""
    data = os.urandom(6 * BLOCK_SIZE + 100)
    rig = make_rig({"big.bin": data})
    info = rig.namespace.lookup("/big.bin").info
    assert info is not None
    with start(rig, PrefetchSettings()) as prefetcher:
        prefetcher.hint(["big.bin"])
        wait_for(lambda: all(rig.view.residency(info, i) for i in range(7)), "the whole file cached")
        # Counted once the run is over, after its blocks are cached.
        issued = functools.partial(sample, rig.metrics.registry, "cachefsd_prefetch_issued_bytes_total")
        wait_for(lambda: issued() == len(data), "the run to be accounted for")
    assert rig.store.get_count == 7
    assert joined(rig.reader.read(info, 0, len(data))) == data


def test_a_stream_through_a_large_file_is_fetched_in_runs_ahead_of_the_reader(
    make_rig: RigFactory,
) -> None:
    """Read front to back, an 80-block file costs a GET a block, none
    twice: its first read begins the file's first run, which is the whole
    file, smaller than a run, and every later read joins its GET."""
    data = os.urandom(80 * BLOCK_SIZE)
    rig = make_rig({"shard.tar": data})
    info = rig.namespace.lookup("/shard.tar").info
    assert info is not None
    with start(rig, PrefetchSettings()) as prefetcher:
        prefetcher.opened(info)
        pieces = []
        for offset in range(0, len(data), BLOCK_SIZE):
            prefetcher.read(info, offset, BLOCK_SIZE)
            pieces.append(joined(rig.reader.read(info, offset, BLOCK_SIZE)))
    assert b"".join(pieces) == data
    assert rig.store.get_count == 80


def fetches_failing_twice(rig: Rig, monkeypatch: pytest.MonkeyPatch, error: Exception) -> list[str]:
    """The reader's first two run fetches raise ``error``; the keys they were for, as they come."""
    fetch_run_ahead = rig.reader.fetch_run_ahead
    raised: list[str] = []

    def breaks_twice(info: ObjectInfo, indices: range, **kwargs: Any) -> set[int]:
        if len(raised) < 2:
            raised.append(info.key)
            raise error
        return fetch_run_ahead(info, indices, **kwargs)

    monkeypatch.setattr(rig.reader, "fetch_run_ahead", breaks_twice)
    return raised


def test_a_prefetch_that_raises_gives_its_slot_back(
    make_rig: RigFactory, dataset: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug in a fetch (not a failed GET, which is a CachefsdError) must
    not keep its slot: two of them took a concurrency of 2 for good."""
    rig = make_rig(dataset)
    raised = fetches_failing_twice(rig, monkeypatch, RuntimeError("a bug"))
    with start(rig, PrefetchSettings(concurrency=2)) as prefetcher:
        walk_and_open(rig, prefetcher, "train/c0/s00")
        # All but the file being read and the two whose fetch broke (not retried for a while).
        wait_for(lambda: rig.store.get_count >= len(dataset) - 3, "the other unread files to be fetched")
    assert len(raised) == 2


def test_a_block_whose_prefetch_failed_is_tried_again_once_its_time_is_up_on_the_clock(
    make_rig: RigFactory, dataset: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failing bucket must not turn the prefetcher into a busy loop, nor
    keep a block from being prefetched for good: ``failed_retry_seconds``
    on the prefetcher's own clock, which here only the test moves."""
    rig = make_rig(dataset)
    raised = fetches_failing_twice(rig, monkeypatch, CachefsdError("a failed GET"))
    clock = Clock()
    with start(rig, PrefetchSettings(concurrency=2), clock=clock) as prefetcher:
        walk_and_open(rig, prefetcher, "train/c0/s00")
        wait_for(lambda: rig.store.get_count >= len(dataset) - 3, "the other unread files to be fetched")
        assert len(raised) == 2
        failed = [rig.namespace.lookup("/" + key).info for key in raised]
        assert all(info is not None and rig.view.residency(info, 0) is None for info in failed)
        clock.now += DEFAULT_TUNING.failed_retry_seconds
        wait_for(lambda: rig.store.get_count >= len(dataset) - 1, "the failed files to be fetched")
    assert len(raised) == 2


def test_the_bandwidth_cap_refills_on_the_prefetchers_clock(
    make_rig: RigFactory, dataset: dict[str, bytes]
) -> None:
    """1 KiB a second and files of 32 KiB: the first file leaves the bucket
    31 KiB in debt, so the next may go 32 seconds later by the prefetcher's
    clock, which here only the test moves (the bucket's own tests check
    that it is not sooner)."""
    rig = make_rig(dataset)
    file_bytes = BLOCK_SIZE // 2
    rate = 1 << 10
    issued = functools.partial(sample, rig.metrics.registry, "cachefsd_prefetch_issued_bytes_total")
    clock = Clock()
    with start(rig, PrefetchSettings(bandwidth=rate), clock=clock) as prefetcher:
        walk_and_open(rig, prefetcher, "train/c0/s00")
        wait_for(lambda: issued() >= file_bytes, "the first file to be fetched")
        clock.now += file_bytes / rate  # what the real clock would take 32 s for
        wait_for(lambda: issued() >= 2 * file_bytes, "the next file to be fetched")
    assert issued() == 2 * file_bytes
    assert rig.store.get_count == 2


def shard_rig(make_rig: RigFactory) -> tuple[Rig, ObjectInfo, bytes]:
    """An rig over one object of 80 blocks, ``shard.tar``."""
    data = os.urandom(80 * BLOCK_SIZE)
    rig = make_rig({"shard.tar": data})
    info = rig.namespace.lookup("/shard.tar").info
    assert info is not None
    return rig, info, data


def test_a_first_read_at_a_large_files_start_brings_its_block_with_the_first_run(
    make_rig: RigFactory,
) -> None:
    """The read's block is the first run's first GET, not one of its own
    before the run."""
    rig, info, data = shard_rig(make_rig)
    with start(rig, PrefetchSettings()) as prefetcher:
        prefetcher.opened(info)
        prefetcher.read(info, 0, 512)
        assert joined(rig.reader.read(info, 0, 512)) == data[:512]
        wait_for(lambda: all(rig.view.residency(info, i) for i in range(80)), "the whole file cached")
    assert rig.store.get_count == 80
    assert joined(rig.reader.read(info, 0, len(data))) == data


def peeked_run(
    rig: Rig, info: ObjectInfo, then_read_at: int | None, tuning: PrefetchTuning = FOUR_FREE_BLOCKS
) -> float:
    """Bytes issued by a file's first run (4 free blocks unless ``tuning``
    says otherwise), after a 512-byte read at its start and maybe one more
    read, which comes before the run's GET has brought any block."""
    issued = functools.partial(sample, rig.metrics.registry, "cachefsd_prefetch_issued_bytes_total")
    with start(rig, PrefetchSettings(), tuning) as prefetcher:
        with store_held(rig):
            prefetcher.opened(info)
            prefetcher.read(info, 0, 512)
            if then_read_at is not None:
                prefetcher.read(info, then_read_at, 512)
        # A run is accounted for at once, when it is over.
        wait_for(lambda: issued() > 0, "the first run to be over")
    return issued()


def test_a_jump_away_from_a_files_start_stops_its_first_run_after_its_free_blocks(
    make_rig: RigFactory,
) -> None:
    """A reader that only peeked at a header costs the free blocks, not a run."""
    rig, info, _ = shard_rig(make_rig)
    assert peeked_run(rig, info, then_read_at=60 * BLOCK_SIZE) == 4 * BLOCK_SIZE


def test_a_first_run_with_no_second_read_stops_after_its_free_blocks(make_rig: RigFactory) -> None:
    rig, info, _ = shard_rig(make_rig)
    tuning = replace(FOUR_FREE_BLOCKS, head_verdict_seconds=0.0)  # no read comes: why wait
    assert peeked_run(rig, info, then_read_at=None, tuning=tuning) == 4 * BLOCK_SIZE


def test_a_second_read_past_the_first_block_lets_the_first_run_go_on(make_rig: RigFactory) -> None:
    rig, info, _ = shard_rig(make_rig)
    assert peeked_run(rig, info, then_read_at=BLOCK_SIZE) == 80 * BLOCK_SIZE
    assert rig.store.get_count == 80


def test_a_header_read_again_does_not_let_the_first_run_go_on(make_rig: RigFactory) -> None:
    """A second read in the first block (the header again, or the kernel's
    read-ahead of the first read) is no sign of a stream."""
    rig, info, _ = shard_rig(make_rig)
    # The read again came before the GET began: a verdict from it would be in by now.
    tuning = replace(FOUR_FREE_BLOCKS, head_verdict_seconds=0.0)
    assert peeked_run(rig, info, then_read_at=512, tuning=tuning) == 4 * BLOCK_SIZE


def test_a_read_waiting_on_a_block_of_a_stopped_run_fetches_it_itself(make_rig: RigFactory) -> None:
    rig, info, data = shard_rig(make_rig)
    with start(rig, PrefetchSettings(), FOUR_FREE_BLOCKS) as prefetcher:
        with store_held(rig):  # the far read comes before the run's GET has brought a block
            prefetcher.opened(info)
            prefetcher.read(info, 0, 512)
            # Block 10 is the run's until a far read stops it; this reader then leads its own GET.
            reader = ThreadPoolExecutor(1).submit(rig.reader.read, info, 10 * BLOCK_SIZE, 100)
            prefetcher.read(info, 60 * BLOCK_SIZE, 512)
        assert joined(reader.result(POLL_SECONDS)) == data[10 * BLOCK_SIZE : 10 * BLOCK_SIZE + 100]
    # The run stopped after its free blocks; block 10 came with the reader's own GET.
    assert sorted(start // BLOCK_SIZE for _, start, _ in rig.faulty.gets) == [0, 1, 2, 3, 10]


def test_first_reads_of_many_large_files_at_once_start_no_more_runs_than_the_concurrency(
    make_rig: RigFactory,
) -> None:
    """Each read claimed budget before any counted its GET: eight first
    reads at once started eight runs at a concurrency of 2."""
    tuning = replace(FOUR_FREE_BLOCKS, head_verdict_seconds=0.0)  # no second read comes
    files = {f"shard-{i}.tar": os.urandom(80 * BLOCK_SIZE) for i in range(8)}
    rig = make_rig(files)
    infos = [rig.namespace.lookup("/" + key).info for key in files]
    together = threading.Barrier(len(infos))

    def first_read(info: ObjectInfo) -> None:
        together.wait(POLL_SECONDS)
        prefetcher.read(info, 0, 512)

    def read(info: ObjectInfo) -> bytes:
        return joined(rig.reader.read(info, 0, 512))

    with (
        start(rig, PrefetchSettings(concurrency=2), tuning) as prefetcher,
        ThreadPoolExecutor(len(infos)) as pool,
    ):
        # Every run begun stays in flight until all eight reads have come.
        with store_held(rig):
            list(pool.map(first_read, infos))
        firsts = list(pool.map(read, infos))
    assert firsts == [data[:512] for data in files.values()]
    runs = {key for key, start, _ in rig.faulty.gets if start == BLOCK_SIZE}  # only a run reads block 1
    assert len(runs) == 2


def test_a_first_run_that_cannot_start_does_not_fail_the_read(
    make_rig: RigFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Read-ahead is the prefetcher's business: an error starting it (here
    the claim; a cache disk error, a pool shut down) failed the read too."""
    rig, info, data = shard_rig(make_rig)

    def breaks(*args: Any, **kwargs: Any) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(rig.reader, "claim_run_ahead", breaks)
    with start(rig, PrefetchSettings()) as prefetcher:
        prefetcher.opened(info)
        prefetcher.read(info, 0, 512)
        assert joined(rig.reader.read(info, 0, 512)) == data[:512]
    assert rig.store.get_count == 1  # the read's own GET
