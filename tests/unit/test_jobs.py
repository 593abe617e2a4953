"""Job identity: which job a read's caller belongs to, and the bounded job labels of metrics."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry

from cachefsd.jobs import UNKNOWN_JOB, CallerJobs, ProcessStat, parse_stat
from cachefsd.metrics import JOB_IDLE_SECONDS, MAX_JOB_SERIES, OTHER_JOBS_LABEL, Metrics
from tests.unit.conftest import Clock


def _stat(pid: int, command: str, group: int, parent: int = 1, session: int = 1) -> str:
    return f"{pid} ({command}) S {parent} {group} {session} 0 -1 4194560 0 0 0 0"


def _proc(tmp_path: Path, processes: dict[int, tuple[str, int]]) -> Path:
    for pid, (command, group) in processes.items():
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(_stat(pid, command, group))
    return tmp_path


def test_a_command_with_spaces_and_parentheses_is_parsed() -> None:
    assert parse_stat(_stat(7, "my (odd) cmd)", 42, 3, 9)) == ProcessStat("my (odd) cmd)", 3, 42, 9)


def test_the_ranks_of_one_torchrun_are_one_job(tmp_path: Path) -> None:
    """torchrun starts each rank in a session of its own; the ranks and their
    workers are named by torchrun's group. A session leader without the
    variable is a job of its own."""
    processes = {
        10: _stat(10, "torchrun", 10, parent=5, session=5),
        20: _stat(20, "python", 20, parent=10, session=20),  # rank 0
        21: _stat(21, "pt_data_worker", 20, parent=20, session=20),  # its DataLoader worker
        30: _stat(30, "python", 30, parent=10, session=30),  # rank 1
        40: _stat(40, "python", 40, parent=10, session=40),  # setsid, no torchrun variable
    }
    for pid, stat in processes.items():
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(stat)
        (tmp_path / str(pid) / "environ").write_bytes(
            b"PATH=/bin\0TORCHELASTIC_RUN_ID=none\0" if pid in (20, 30) else b"PATH=/bin\0"
        )
    jobs = CallerJobs(tmp_path)
    assert jobs.of(20) == jobs.of(21) == jobs.of(30) == "torchrun[10]"
    assert jobs.of(40) == "python[40]"


def test_workers_of_one_group_are_one_job_named_by_its_leader(tmp_path: Path) -> None:
    proc = _proc(tmp_path, {10: ("python", 10), 11: ("pt_data_worker", 10), 20: ("python", 20)})
    jobs = CallerJobs(proc)
    assert jobs.of(10) == jobs.of(11) == "python[10]"
    assert jobs.of(20) == "python[20]"


def test_callers_it_cannot_see_are_the_unknown_job(tmp_path: Path) -> None:
    proc = _proc(tmp_path, {11: ("worker", 10)})  # the group's leader exited
    jobs = CallerJobs(proc)
    assert jobs.of(0) == UNKNOWN_JOB  # another pid namespace
    assert jobs.of(99) == UNKNOWN_JOB  # gone
    assert jobs.of(11) == "?[10]"


def test_a_pid_is_looked_up_again_once_its_job_is_old(tmp_path: Path) -> None:
    proc = _proc(tmp_path, {10: ("python", 10), 30: ("bash", 30)})
    clock = Clock()
    jobs = CallerJobs(proc, clock, remember_seconds=10)
    assert jobs.of(10) == "python[10]"
    (proc / "10" / "stat").write_text(_stat(10, "python", 30))  # the pid now in another group
    clock.now += 5
    assert jobs.of(10) == "python[10]"
    clock.now += 6
    assert jobs.of(10) == "bash[30]"


def test_real_processes_a_child_shares_its_job_a_new_session_does_not() -> None:
    jobs = CallerJobs()
    mine = jobs.of(os.getpid())
    assert mine.endswith(f"[{os.getpgid(0)}]")
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    other = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE, start_new_session=True
    )
    try:
        assert jobs.of(child.pid) == mine
        assert jobs.of(other.pid).endswith(f"[{other.pid}]")  # its own group, led by itself
    finally:
        for process in (child, other):
            process.communicate(b"", timeout=10)


def test_job_labels_are_bounded_and_go_to_the_jobs_reading_now() -> None:
    clock = Clock()
    registry = CollectorRegistry()
    metrics = Metrics(registry, clock)
    for index in range(MAX_JOB_SERIES):
        metrics.read_done({"cold": 100}, 0.5, f"job{index}", 0.0)
    metrics.read_done({"hot": 100}, 0.0, "late", 0.0)
    other = {"reader_job": OTHER_JOBS_LABEL, "source": "cache"}
    assert registry.get_sample_value("cachefsd_job_reads_total", other) == 1
    assert (
        registry.get_sample_value("cachefsd_job_reads_total", {"reader_job": "late", "source": "cache"})
        is None
    )
    clock.now += JOB_IDLE_SECONDS - 1
    for index in range(1, MAX_JOB_SERIES):
        metrics.read_done({"hot": 100}, 0.0, f"job{index}", 0.0)
    clock.now += 2  # job0 idle for longer than JOB_IDLE_SECONDS, the others not
    metrics.read_done({"cold": 100}, 0.25, "late", 0.0)
    assert (
        registry.get_sample_value("cachefsd_job_reads_total", {"reader_job": "late", "source": "cold"}) == 1
    )
    assert registry.get_sample_value("cachefsd_job_read_stall_seconds_total", {"reader_job": "late"}) == 0.25
    assert (
        registry.get_sample_value("cachefsd_job_reads_total", {"reader_job": "job0", "source": "cold"})
        is None
    )
    job1 = {"reader_job": "job1", "source": "cache"}
    assert registry.get_sample_value("cachefsd_job_read_bytes_total", job1) == 100
    metrics.read_done({"hot": 100}, 0.0, "another", 0.0)  # every other job read just now
    assert registry.get_sample_value("cachefsd_job_reads_total", other) == 2


def test_each_named_job_has_its_hit_ratio_and_epoch() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry, Clock())
    metrics.watch_epoch(lambda: 3, lambda: {"a[1]": 3, "b[2]": 1, "": 0, "never-read[3]": 9})
    metrics.read_done({"cold": 100, "hot": 300}, 0.1, "a[1]", 0.0)
    metrics.read_done({"memory": 50}, 0.0, "b[2]", 0.0)
    metrics.read_done({"cold": 10}, 0.1, UNKNOWN_JOB, 0.0)

    def gauge(name: str, job: str) -> float | None:
        return registry.get_sample_value(name, {"reader_job": job})

    assert gauge("cachefsd_job_hit_ratio", "a[1]") == 0.75
    assert gauge("cachefsd_job_hit_ratio", "b[2]") == 1.0
    assert gauge("cachefsd_job_hit_ratio", "unknown") == 0.0
    assert (gauge("cachefsd_job_epoch", "a[1]"), gauge("cachefsd_job_epoch", "b[2]")) == (3, 1)
    assert gauge("cachefsd_job_epoch", "unknown") == 0
    assert gauge("cachefsd_job_epoch", "never-read[3]") is None  # only jobs that read have series
