"""Which job a read comes from: the caller of a FUSE request, named.

A job is the processes that read for one training run. It is named by the
caller's process group, which ``fork`` keeps: a DataLoader's workers and a
``torchrun`` job's ranks share their launcher's group, and slurmstepd puts
the tasks of a Slurm step in one group. Two command lines of an interactive
shell are two groups (job control), and so are two containers or two
scheduler steps. The session would merge every job started from one
terminal, and the cgroup every job of one container or login. Jobs
started in the background by one non-interactive script share its group:
start each with ``setsid`` to tell them apart.

The name is the group leader's command and the group's id,
``python[4242]``: readable in ``stats``, ``top`` and metric labels, and
unique while the group lives. A caller the daemon cannot see (pid 0: a
process in another pid namespace; or gone before it was looked at) is
``UNKNOWN_JOB``.

Reading ``/proc`` costs two small reads; a pid's job is remembered for
``remember_seconds`` (a pid is not reused that soon), and the table is
emptied when it holds ``MAX_REMEMBERED`` pids.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

UNKNOWN_JOB = ""
REMEMBER_SECONDS = 10.0
MAX_REMEMBERED = 4096


def parse_stat(text: str) -> tuple[str, int]:
    """(command, process group) from the text of ``/proc/PID/stat``. The
    command is in parentheses and may itself hold spaces and parentheses,
    so the fields are counted from the last ``)``."""
    head, _, rest = text.rpartition(")")
    command = head.partition("(")[2]
    fields = rest.split()
    return command, int(fields[2])  # state, ppid, pgrp


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
        try:
            _, group = parse_stat(self._read_stat(pid))
        except (OSError, ValueError, IndexError):
            return UNKNOWN_JOB
        try:
            leader, _ = parse_stat(self._read_stat(group))
        except (OSError, ValueError, IndexError):
            leader = "?"  # the group's leader exited; its group lives on
        return f"{leader}[{group}]"

    def _read_stat(self, pid: int) -> str:
        return (self._proc / str(pid) / "stat").read_text(errors="replace")
