"""The loader meter on a fake clock, the daemon's ledger of meters, the
verdict rules, the what-if replay against the policy simulator, and the
doctor's report of a ``GET /diagnose`` answer."""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, fields
from pathlib import Path

import pytest
from pydantic import BaseModel

from benchmarks.policy_sim import DEFAULT_FRACTIONS, run
from cachefsd.cli.doctor import judge, render
from cachefsd.control.answers import CacheSetup, DiagnosisAnswer, MeteredReads, ObservedReads
from cachefsd.control.client import MeterTotals
from cachefsd.diagnose import meter
from cachefsd.diagnose.ledger import MAX_JOBS, MAX_METERS_PER_JOB, JobReads, MeterLedger
from cachefsd.diagnose.meter import watch
from cachefsd.diagnose.service import CacheFacts, Diagnosis
from cachefsd.diagnose.verdict import (
    INPUT_BOUND,
    NOT_INPUT_BOUND,
    PREPROCESSING,
    STORAGE,
    JobFacts,
    advice,
    severity,
    size_setting,
    verdict,
)
from cachefsd.diagnose.whatif import WhatIf, capacities_to_try, what_if
from cachefsd.errors import ControlError
from cachefsd.jobs import CallerJobs
from cachefsd.workload.model import ObservedOrder

KiB = 1 << 10


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Recorder:
    """A sink that keeps every report, or fails them all."""

    def __init__(self, fail: BaseException | None = None) -> None:
        self.reports: list[tuple[str, MeterTotals, int]] = []
        self.fail = fail

    def send(self, meter_id: str, totals: MeterTotals, readers: int) -> None:
        if self.fail is not None:
            raise self.fail
        self.reports.append((meter_id, totals, readers))


def slow_loader(clock: Clock, waits: list[float]) -> Iterator[float]:
    """Batches that each take ``waits[i]`` seconds to arrive."""
    for wait in waits:
        clock.now += wait
        yield wait


# -- the meter -----------------------------------------------------------------


def test_the_meter_yields_every_batch_and_measures_wait_and_step_after_the_first() -> None:
    clock, sink = Clock(), Recorder()
    waits = [5.0, 0.2, 0.4, 0.0, 0.1]  # the first is the loader starting its workers
    seen = []
    for batch in watch(slow_loader(clock, waits), "/nowhere", sink=sink, clock=clock):
        seen.append(batch)
        clock.now += 1.0  # the step's compute
    assert seen == waits
    _, final, readers = sink.reports[-1]
    assert readers == 0  # a generator: the loop reads itself
    assert final.batches == 4
    assert final.data_wait_seconds == pytest.approx(0.7)
    assert final.step_seconds == pytest.approx(4.7)
    assert final.data_wait_fraction == pytest.approx(0.7 / 4.7)
    assert len({meter_id for meter_id, _, _ in sink.reports}) == 1  # one meter, cumulative totals
    assert sink.reports[0][1] == MeterTotals()  # the window opens at the first batch


def test_a_loop_that_stops_early_still_reports_what_it_measured() -> None:
    clock, sink = Clock(), Recorder()
    for index, _ in enumerate(watch(slow_loader(clock, [1.0] * 10), "/nowhere", sink=sink, clock=clock)):
        if index == 3:
            break
    assert sink.reports[-1][1].batches == 3


def test_an_unreachable_daemon_costs_one_warning_and_the_batches_flow(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(meter, "_backoff", meter._Backoff())
    with caplog.at_level(logging.WARNING, logger="cachefsd.diagnose.meter"):
        assert list(watch(range(5), tmp_path)) == list(range(5))  # not a mount
        sink = Recorder(fail=ControlError("gone"))
        assert list(watch(range(5), tmp_path, sink=sink)) == list(range(5))
    warnings = [record for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "not a cachefsd mount" in warnings[0].getMessage()


def test_a_sink_that_breaks_or_hangs_never_reaches_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(meter, "_backoff", meter._Backoff())
    assert list(watch(range(3), "/nowhere", sink=Recorder(fail=OSError("broken pipe")))) == [0, 1, 2]
    release = threading.Event()

    class Hung:
        def send(self, meter_id: str, totals: MeterTotals, readers: int) -> None:
            release.wait(60)

    started = time.monotonic()
    try:
        assert list(watch(range(3), "/nowhere", sink=Hung())) == [0, 1, 2]
        # The end of a pass waits for its last report for a bounded time only.
        assert time.monotonic() - started < meter.CLOSE_WAIT_SECONDS + 5
    finally:
        release.set()


def test_a_dataloader_reports_its_workers_as_the_readers() -> None:
    class Loader(list[int]):
        num_workers = 3

    sink = Recorder()
    assert list(watch(Loader([1, 2]), "/nowhere", sink=sink)) == [1, 2]
    assert {readers for _, _, readers in sink.reports} == {3}


def test_an_empty_loader_reports_nothing() -> None:
    sink = Recorder()
    assert list(watch([], "/nowhere", sink=sink)) == []
    assert sink.reports == []


def test_importing_the_meter_loads_only_the_standard_library() -> None:
    code = (
        "import sys; import cachefsd.diagnose; "
        "heavy = {'torch', 'pydantic', 'prometheus_client', 'rich', 'aiobotocore', 'obstore'}; "
        "print(sorted(heavy & {name.split('.')[0] for name in sys.modules}))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


# -- the ledger ----------------------------------------------------------------


class Events:
    def __init__(self) -> None:
        self.deltas: list[tuple[str, int, float, float]] = []

    def meter_reported(self, job: str, batches: int, data_wait_seconds: float, step_seconds: float) -> None:
        self.deltas.append((job, batches, data_wait_seconds, step_seconds))


def test_a_jobs_meters_add_up_and_a_repeated_report_counts_once() -> None:
    reads = {"job": JobReads(1.0, 100.0, 50.0)}
    events = Events()
    ledger = MeterLedger(reads.__getitem__, events, Clock())
    ledger.report("job", "/m", "rank0", MeterTotals(10, 1.0, 10.0), readers=2)
    ledger.report("job", "/m", "rank1", MeterTotals(5, 2.0, 5.0), readers=0)
    ledger.report("job", "/m", "rank1", MeterTotals(5, 2.0, 5.0), readers=0)  # the same totals again
    ledger.report("job", "/m", "rank0", MeterTotals(8, 0.5, 8.0), readers=2)  # less than before: ignored
    reads["job"] = JobReads(4.0, 300.0, 60.0)
    (job,) = ledger.jobs("/m")
    assert ledger.jobs("/elsewhere") == []  # a mount's doctor shows the jobs metered through it
    assert job.totals == MeterTotals(15, 3.0, 15.0)
    # Two workers had the whole of rank0's steps; rank1's loop read itself, inside next().
    assert job.reader_seconds == pytest.approx(2 * 10.0 + 2.0)
    assert job.meters == 2
    assert job.reads == JobReads(3.0, 200.0, 10.0)  # since its first report
    assert sum(delta[1] for delta in events.deltas) == 15
    assert sum(delta[3] for delta in events.deltas) == pytest.approx(15.0)


def test_a_job_keeps_the_totals_of_meters_it_forgets() -> None:
    ledger = MeterLedger(lambda _: JobReads(), Events(), Clock())
    for index in range(MAX_METERS_PER_JOB + 10):
        ledger.report("job", "/m", f"epoch{index}", MeterTotals(1, 0.1, 1.0), readers=1)
    (job,) = ledger.jobs("/m")
    assert job.meters == MAX_METERS_PER_JOB
    assert job.totals.batches == MAX_METERS_PER_JOB + 10
    assert job.reader_seconds == pytest.approx(MAX_METERS_PER_JOB + 10)


def test_a_forgotten_job_that_reports_again_is_not_counted_twice_in_the_metrics() -> None:
    events = Events()
    ledger = MeterLedger(lambda _: JobReads(), events, Clock())
    ledger.report("old", "/m", "meter", MeterTotals(10, 1.0, 10.0), readers=1)
    for index in range(MAX_JOBS):  # the old job's entry goes
        ledger.report(f"job{index}", "/m", f"m{index}", MeterTotals(1, 0.1, 1.0), readers=1)
    assert "old" not in {job.job for job in ledger.jobs("/m")}
    ledger.report("old", "/m", "meter", MeterTotals(12, 1.2, 12.0), readers=1)
    assert sum(batches for job, batches, _, _ in events.deltas if job == "old") == 12


def test_reads_counted_with_other_jobs_are_unknown_until_the_job_has_its_own() -> None:
    reads: dict[str, JobReads | None] = {"job": None}
    ledger = MeterLedger(reads.__getitem__, Events(), Clock())
    ledger.report("job", "/m", "m", MeterTotals(1, 0.1, 1.0), readers=1)
    assert ledger.jobs("/m")[0].reads is None
    reads["job"] = JobReads(2.0, 10.0, 10.0)
    ledger.report("job", "/m", "m", MeterTotals(2, 0.2, 2.0), readers=1)  # the window starts now
    reads["job"] = JobReads(3.0, 30.0, 10.0)
    assert ledger.jobs("/m")[0].reads == JobReads(1.0, 20.0, 0.0)


# -- the verdict ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("data_wait", "reading", "expected"),
    [
        (0.049, 0.9, NOT_INPUT_BOUND),  # TensorFlow's 5 %
        (0.05, 0.5, STORAGE),  # the readers read half their time
        (0.90, 0.49, PREPROCESSING),  # and otherwise they mostly decode
        (0.06, 0.10, PREPROCESSING),  # eight workers each reading 10 %: decoding is the cause
        (0.60, None, INPUT_BOUND),  # the job's reads are counted with others': the cause is unknown
        (0.01, None, NOT_INPUT_BOUND),
    ],
)
def test_verdict_thresholds(data_wait: float, reading: float | None, expected: str) -> None:
    assert verdict(data_wait, reading) == expected


def test_severity_uses_tensorflows_bands() -> None:
    assert [severity(x) for x in (0.0, 0.05, 0.19, 0.2)] == [
        "not input-bound",
        "moderately input-bound",
        "moderately input-bound",
        "highly input-bound",
    ]


def facts(**changes: object) -> JobFacts:
    base = {
        "mountpoint": "/mnt/data",
        "batches": 500,
        "data_wait_fraction": 0.5,
        "read_fraction": 0.95,
        "storage_stall_fraction": 0.9,
        "epoch": 2,
        "order_source": "hint",
        "repeats": False,
        "working_set_bytes": 100 << 30,
        "capacity_bytes": 50 << 30,
    }
    return JobFacts(**{**base, **changes})  # type: ignore[arg-type]


def test_a_cache_smaller_than_the_data_asks_for_the_size_the_table_says_is_enough() -> None:
    table = [WhatIf(50 << 30, 0.5), WhatIf(100 << 30, 0.96), WhatIf(125 << 30, 1.0)]
    notes = advice(facts(), table)
    assert any("A cache of 100G keeps it (--cache-size 100G" in note for note in notes), notes


def test_a_size_is_advised_as_the_flag_takes_it() -> None:
    assert [size_setting(n) for n in (1, 5 << 20, (1 << 30) + 1, 100 << 30)] == ["1M", "5M", "2G", "100G"]


def test_a_cold_first_epoch_is_told_to_stage_and_an_unknown_order_to_hint() -> None:
    notes = advice(facts(epoch=0, working_set_bytes=10 << 30, order_source="unknown"), [])
    assert any("cachefsd stage /mnt/data" in note for note in notes)
    assert any("HintingSampler" in note for note in notes)


def test_preprocessing_and_compute_bound_jobs_get_their_own_advice() -> None:
    assert any(
        "num_workers" in note for note in advice(facts(read_fraction=0.1, storage_stall_fraction=0.0), [])
    )
    cached_but_slow = advice(facts(read_fraction=0.9, storage_stall_fraction=0.1), [])
    assert any("reading what is cached is what is slow" in note for note in cached_but_slow)
    assert any("nothing to change" in note for note in advice(facts(data_wait_fraction=0.01), []))
    assert any("let the job run longer" in note for note in advice(facts(batches=3), []))
    unknown = advice(facts(read_fraction=None, storage_stall_fraction=None), [])
    assert any("reads with other jobs'" in note for note in unknown)


# -- what-if -------------------------------------------------------------------


def observed(files: int, repeats: bool, every: int = 1) -> ObservedOrder:
    order = [f"f{index:05d}" for index in range(files)]
    random.Random(1).shuffle(order)
    return ObservedOrder(
        workload="j",
        order=order,
        sizes=dict.fromkeys(order, 100 * KiB),
        sample_every=every,
        working_set_files=files * every,
        working_set_bytes=files * every * 100 * KiB,
        repeats=repeats,
        source="unknown",
        epoch=3,
    )


def test_what_if_agrees_with_the_policy_simulator() -> None:
    simulated = run(files=1000, epochs=3, fractions=DEFAULT_FRACTIONS, seed=0)
    steady = {(row["fraction"], row["policy"]): row["steady"] for row in simulated["rows"]}
    job = observed(1000, repeats=False)
    for policy in ("epoch-aware", "lru", "minio"):
        capacities = [round(fraction * job.working_set_bytes) for fraction in DEFAULT_FRACTIONS]
        table = what_if(job, 4 << 20, policy, capacities)
        for fraction, row in zip(DEFAULT_FRACTIONS, table, strict=True):
            assert row.hit_ratio == pytest.approx(steady[fraction, policy], abs=0.04), (policy, fraction)


def test_what_if_replays_a_repeated_order_as_a_loop() -> None:
    # The same order every epoch through LRU with room for half: each block
    # is evicted just before its turn comes again.
    job = observed(400, repeats=True)
    (row,) = what_if(job, 4 << 20, "lru", [job.working_set_bytes // 2])
    assert row.hit_ratio == 0.0
    (row,) = what_if(job, 4 << 20, "epoch-aware", [job.working_set_bytes // 2])
    assert row.hit_ratio == pytest.approx(0.5, abs=0.03)


def test_a_sample_replays_at_its_share_of_the_capacity() -> None:
    whole, sample = observed(1000, repeats=False), observed(100, repeats=False, every=10)
    capacity = whole.working_set_bytes // 2
    (full,) = what_if(whole, 4 << 20, "epoch-aware", [capacity])
    (sampled,) = what_if(sample, 4 << 20, "epoch-aware", [capacity])
    assert sampled.hit_ratio == pytest.approx(full.hit_ratio, abs=0.05)


def test_files_larger_than_a_block_are_replayed_block_by_block() -> None:
    job = observed(200, repeats=False)
    capacities = capacities_to_try(job.working_set_bytes, job.working_set_bytes // 4)
    table = what_if(job, 64 * KiB, "epoch-aware", capacities)  # two blocks a file
    assert [row.capacity_bytes for row in table] == sorted(capacities)
    assert table[-1].hit_ratio == 1.0  # 125 % of the data: everything stays
    ratios = [row.hit_ratio for row in table]
    assert ratios == sorted(ratios)


# -- the doctor's report -------------------------------------------------------


def diagnosis(step: float, wait: float, stall: float, order: ObservedOrder | None) -> DiagnosisAnswer:
    answer = {
        "mountpoint": "/mnt/data",
        "cache": {"capacity_bytes": 50 * 100 * KiB, "policy": "epoch-aware", "block_size": 4 << 20},
        "jobs": [
            {
                "job": "python[42]",
                "batches": 100,
                "data_wait_seconds": wait,
                "step_seconds": step,
                "reader_seconds": 2 * step,
                "meters": 1,
                "last_report_seconds_ago": 1.0,
                "reads": {
                    "read_seconds": stall * 1.1,
                    "stall_seconds": stall,
                    "cache_bytes": 300.0,
                    "cold_bytes": 100.0,
                },
                "observed": None if order is None else asdict(order),
            }
        ],
    }
    return DiagnosisAnswer.model_validate(answer)


def test_the_daemons_diagnosis_round_trips_to_the_doctor() -> None:
    """What ``GET /diagnose`` sends is what ``cachefsd doctor`` parses back and judges."""
    ledger = MeterLedger(lambda _: JobReads(3.0, 2.0, 300.0, 100.0), Events(), Clock())
    order = observed(50, repeats=True)
    service = Diagnosis(
        ledger,
        CallerJobs(),
        lambda job, _files: order,
        "/mnt/data",
        CacheFacts(lambda: 1 << 20, "lru", 4 << 20),
    )
    service.meter(os.getpid(), "m", MeterTotals(10, 1.0, 10.0), readers=1)
    answer = service.snapshot()
    sent = json.loads(json.dumps(answer.model_dump(mode="json")))
    assert DiagnosisAnswer.model_validate(sent) == answer
    assert answer.jobs[0].observed is not None
    assert ObservedOrder(**answer.jobs[0].observed.model_dump()) == order
    (job,) = judge(answer).jobs
    assert job.epoch == order.epoch


def test_the_doctor_judges_each_job_and_tables_what_if() -> None:
    report = judge(diagnosis(step=100.0, wait=40.0, stall=160.0, order=observed(100, repeats=False)))
    (job,) = report.jobs
    assert job.verdict == STORAGE
    assert job.read_fraction == pytest.approx(0.88)
    assert job.data_wait_fraction == pytest.approx(0.4)
    assert job.storage_stall_fraction == pytest.approx(0.8)  # of its two readers' 200 s
    assert job.hit_ratio == pytest.approx(0.75)
    rows = job.what_if.rows
    assert [row.current for row in rows].count(True) == 1
    # ``doctor --json``'s keys, in the order doc/diagnose.md lists them.
    dumped = json.loads(json.dumps(asdict(report)))
    assert list(dumped["jobs"][0]) == [
        "job",
        "batches",
        "data_wait_fraction",
        "read_fraction",
        "storage_stall_fraction",
        "verdict",
        "severity",
        "hit_ratio",
        "last_report_seconds_ago",
        "epoch",
        "order",
        "working_set_bytes",
        "capacity_bytes",
        "advice",
        "what_if",
    ]
    assert list(dumped["jobs"][0]["what_if"]["rows"][0]) == ["capacity_bytes", "hit_ratio", "current"]
    text = render(report)
    assert "python[42]: storage (highly input-bound)" in text
    assert "(now)" in text


def test_the_doctor_without_meters_says_how_to_add_one() -> None:
    cache = CacheSetup(capacity_bytes=1 << 30, policy="epoch-aware", block_size=4 << 20)
    text = render(judge(DiagnosisAnswer(mountpoint="/m", cache=cache, jobs=[])))
    assert "cachefsd.diagnose.watch(loader, '/m')" in text


def test_a_job_with_no_steps_yet_is_not_input_bound_and_told_to_wait() -> None:
    (job,) = judge(diagnosis(step=0.0, wait=0.0, stall=0.0, order=None)).jobs
    assert job.verdict == NOT_INPUT_BOUND
    assert job.what_if.rows == []


@pytest.mark.parametrize(
    ("answer", "record"),
    [(MeteredReads, JobReads), (ObservedReads, ObservedOrder)],
    ids=["reads", "observed"],
)
def test_an_answer_copies_its_daemon_record_field_for_field(answer: type[BaseModel], record: type) -> None:
    """The answers module imports nothing of the daemon, so these two records
    are declared on each side of the socket: they must not drift apart."""
    assert list(answer.model_fields) == [each.name for each in fields(record)]
