"""Which job a read comes from: the caller of a FUSE request, named.

A job is the processes that read for one training run (the workload model,
``cachefsd/workload/``, keeps one workload for each dataset a job reads). It
is named by the caller's process group, which ``fork`` keeps: a DataLoader's workers share
their main process's. Two command lines of an interactive shell are two
groups (job control), and so are two containers. The session would merge
every job started from one terminal, and the cgroup every job of one
container or login. Jobs started in the background by one non-interactive
script share its group: start each with ``setsid`` to tell them apart.

``torchrun`` starts each rank in a session of its own (torch elastic's
``start_new_session``), so a group that leads its session and whose leader
has ``TORCHELASTIC_RUN_ID`` in its environment is named by its parent's
group instead: the ranks of one ``torchrun`` (and their workers) are one job.

The name is the group leader's command and the group's id,
``python[4242]``: readable in ``stats``, ``top`` and metric labels, and
unique while the group lives. A caller the daemon cannot see (pid 0: a
process in another pid namespace; or gone before it was looked at) is
``UNKNOWN_JOB``.

Reading ``/proc`` costs a few small reads; a pid's job is remembered for
``remember_seconds`` (a pid is not reused that soon), and the table is
emptied when it holds ``MAX_REMEMBERED`` pids.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

UNKNOWN_JOB = ""
_RUN_ID = b"TORCHELASTIC_RUN_ID="
REMEMBER_SECONDS = 10.0
MAX_REMEMBERED = 4096


@dataclass(frozen=True, slots=True)
class ProcessStat:
    command: str
    parent: int
    group: int
    session: int


def parse_stat(text: str) -> ProcessStat:
    """The fields of the text of ``/proc/PID/stat`` that name a job. The
    command is in parentheses and may itself hold spaces and parentheses,
    so the fields are counted from the last ``)``."""
    head, _, rest = text.rpartition(")")
    fields = rest.split()  # state, ppid, pgrp, session, ...
    return ProcessStat(head.partition("(")[2], int(fields[1]), int(fields[2]), int(fields[3]))


class CallerJobs:
    """pid -> job name, from ``proc`` (``/proc``; tests give a directory of
    their own). Thread-safe."""

    def __init__(
        self,
        proc: Path = Path("/proc"),
        clock: Callable[[], float] = time.monotonic,
        remember_seconds: float = REMEMBER_SECONDS,
    ) -> None:
        self._proc = proc
        self._clock = clock
        self._remember_seconds = remember_seconds
        self._lock = threading.Lock()
        self._known: dict[int, tuple[str, float]] = {}  # pid -> (job, looked up at)

    def of(self, pid: int) -> str:
        if pid <= 0:
            return UNKNOWN_JOB
        now = self._clock()
        with self._lock:
            known = self._known.get(pid)
        if known is not None and now - known[1] < self._remember_seconds:
            return known[0]
        job = self._look_up(pid)
        with self._lock:
            if len(self._known) >= MAX_REMEMBERED:
                self._known.clear()
            self._known[pid] = (job, now)
        return job

    def _look_up(self, pid: int) -> str:
        caller = self._stat(pid)
        if caller is None:
            return UNKNOWN_JOB
        group = caller.group
        leader = self._stat(group)  # None: the leader exited, its group lives on
        if leader is not None and leader.session == group and self._torchrun_rank(group):
            launcher = self._stat(leader.parent)
            if launcher is not None:
                group, leader = launcher.group, self._stat(launcher.group)
        return f"{'?' if leader is None else leader.command}[{group}]"

    def _stat(self, pid: int) -> ProcessStat | None:
        try:
            return parse_stat((self._proc / str(pid) / "stat").read_text(errors="replace"))
        except (OSError, ValueError, IndexError):
            return None

    def _torchrun_rank(self, pid: int) -> bool:
        try:
            environment = (self._proc / str(pid) / "environ").read_bytes()
        except OSError:
            return False
        return environment.startswith(_RUN_ID) or b"\0" + _RUN_ID in environment
