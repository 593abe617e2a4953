"""``cachefsd doctor MOUNTPOINT``: per job, whether it starves for data, why,
and what to change.

The daemon answers ``GET /diagnose`` with what the jobs' loader meters
reported and what it saw of their reads (``diagnose/service.py``); the
judging happens here, in the asking process: the verdict rules
(``diagnose/verdict.py``) and the what-if replay (``diagnose/whatif.py``),
whose CPU the daemon's readers should not pay for.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from cachefsd.config import human_bytes
from cachefsd.control.answers import CacheSetup, DiagnosisAnswer, MeteredJobAnswer
from cachefsd.control.client import MeterTotals
from cachefsd.diagnose.meter import REPORT_SECONDS
from cachefsd.diagnose.verdict import JobFacts, advice, severity, verdict
from cachefsd.diagnose.whatif import capacities_to_try, what_if
from cachefsd.workload.model import ObservedOrder

# A meter reports every couple of seconds while its loop runs: a job silent
# for much longer has finished or paused, and its numbers are history.
QUIET_SECONDS = 30 * REPORT_SECONDS


@dataclass(frozen=True, slots=True)
class WhatIfRow:
    capacity_bytes: int
    hit_ratio: float
    current: bool  # the cache's capacity now


@dataclass(frozen=True, slots=True)
class WhatIfTable:
    """The job's observed epoch replayed through ``policy`` at several capacities."""

    policy: str
    rows: list[WhatIfRow]


@dataclass(frozen=True, slots=True)
class JobReport:
    """The doctor's word on one job (``doc/diagnose.md`` documents its JSON)."""

    job: str
    batches: int
    data_wait_fraction: float
    read_fraction: float | None  # None while its reads are counted with other jobs'
    storage_stall_fraction: float | None
    verdict: str
    severity: str
    hit_ratio: float | None
    last_report_seconds_ago: float
    epoch: int | None
    order: str | None  # what the prefetcher follows, if its order was observed
    working_set_bytes: int | None
    capacity_bytes: int
    advice: list[str]
    what_if: WhatIfTable


@dataclass(frozen=True, slots=True)
class DoctorReport:
    """``cachefsd doctor``'s report; ``--json`` prints it as it is laid out here."""

    mountpoint: str
    jobs: list[JobReport]


def judge(diagnosis: DiagnosisAnswer) -> DoctorReport:
    """The doctor's report of a ``GET /diagnose`` answer."""
    return DoctorReport(
        diagnosis.mountpoint,
        [_judge_job(job, diagnosis.cache, diagnosis.mountpoint) for job in diagnosis.jobs],
    )


def _judge_job(job: MeteredJobAnswer, cache: CacheSetup, mountpoint: str) -> JobReport:
    data_wait = MeterTotals(job.batches, job.data_wait_seconds, job.step_seconds).data_wait_fraction
    reads = job.reads
    reading = stall = None
    if reads is not None:
        budget = job.reader_seconds
        reading = min(1.0, reads.read_seconds / budget) if budget > 0 else 0.0
        stall = min(reading, reads.stall_seconds / budget) if budget > 0 else 0.0
    read_bytes = 0.0 if reads is None else reads.cache_bytes + reads.cold_bytes
    hit_ratio = reads.cache_bytes / read_bytes if reads is not None and read_bytes > 0 else None
    observed = None if job.observed is None else ObservedOrder(**job.observed.model_dump())
    table = []
    if observed is not None:
        sizes = capacities_to_try(observed.working_set_bytes, cache.capacity_bytes)
        table = what_if(observed, cache.block_size, cache.policy, sizes)
    facts = JobFacts(
        mountpoint=mountpoint,
        batches=job.batches,
        data_wait_fraction=data_wait,
        read_fraction=reading,
        storage_stall_fraction=stall,
        epoch=None if observed is None else observed.epoch,
        order_source=None if observed is None else observed.source,
        repeats=observed is not None and observed.repeats,
        working_set_bytes=None if observed is None else observed.working_set_bytes,
        capacity_bytes=cache.capacity_bytes,
    )
    return JobReport(
        job=job.job,
        batches=job.batches,
        data_wait_fraction=data_wait,
        read_fraction=reading,
        storage_stall_fraction=stall,
        verdict=verdict(data_wait, reading),
        severity=severity(data_wait),
        hit_ratio=hit_ratio,
        last_report_seconds_ago=job.last_report_seconds_ago,
        epoch=facts.epoch,
        order=facts.order_source,
        working_set_bytes=facts.working_set_bytes,
        capacity_bytes=facts.capacity_bytes,
        advice=advice(facts, table),
        what_if=WhatIfTable(
            cache.policy,
            [
                WhatIfRow(row.capacity_bytes, row.hit_ratio, row.capacity_bytes == cache.capacity_bytes)
                for row in table
            ],
        ),
    )


def render(report: DoctorReport) -> str:
    """The report as text, one block per job."""
    mountpoint = report.mountpoint
    if not report.jobs:
        return (
            f"cachefsd doctor {mountpoint}: no job has reported to this daemon yet.\n"
            f"Wrap the training loop's loader: for batch in cachefsd.diagnose.watch(loader, {mountpoint!r})"
        )
    count = len(report.jobs)
    lines = [f"cachefsd doctor {mountpoint}: {count} job{'s' if count > 1 else ''} with a loader meter"]
    for job in report.jobs:
        lines += ["", f"{job.job}: {job.verdict} ({job.severity})"]
        epoch = "" if job.epoch is None else f" (epoch {job.epoch})"
        age = job.last_report_seconds_ago
        quiet = f"; its last report came {age:.0f} s ago: finished or paused" if age > QUIET_SECONDS else ""
        lines.append(f"  batches        {job.batches:,}{epoch}{quiet}")
        lines.append(f"  data wait      {job.data_wait_fraction:.1%} of the loop's time")
        if job.read_fraction is None or job.storage_stall_fraction is None:
            lines.append("  reads          unknown: the daemon counts them with other jobs'")
        else:
            hit = "" if job.hit_ratio is None else f"; {job.hit_ratio:.1%} of bytes from the cache"
            lines.append(f"  reads          {job.read_fraction:.1%} of its readers' time{hit}")
            lines.append(f"  store stalls   {job.storage_stall_fraction:.1%} of its readers' time")
        if job.order is not None:
            lines.append(f"  read order     {job.order}")
        lines.append("  what to do")
        lines += [f"    - {note}" for note in job.advice]
        rows = job.what_if.rows
        if rows:
            lines.append(
                f"  what-if: its observed epoch through {job.what_if.policy}, "
                "without prefetch, the cache to itself"
            )
            lines.append(f"    {'cache':>10}  hit ratio")
            for row in rows:
                mark = "  (now)" if row.current else ""
                lines.append(f"    {human_bytes(row.capacity_bytes):>10}  {row.hit_ratio:>8.1%}{mark}")
    return "\n".join(lines)


def run(diagnosis: DiagnosisAnswer, as_json: bool) -> int:
    report = judge(diagnosis)
    print(json.dumps(asdict(report), indent=2) if as_json else render(report))
    return 0
