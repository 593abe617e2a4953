"""Identity: which workload an event belongs to.

A job is the processes reading for one training run, named by the FUSE
edge (``cachefsd/jobs.py``: the readers' process group; ``UNKNOWN_JOB`` when
the daemon cannot see the caller). A workload is one job reading one
dataset: the job and the root directory of the dataset, named
``job:root`` (the root alone for the unknown job, ``workload_id``). Several
workloads may read one mount: different prefixes, or one prefix read by
several jobs (a sweep). Everything the model learns (epochs, streams,
plans) is kept per workload.

Roots. Of one job, a path belongs to the workload whose root is its DEEPEST
ancestor directory that already is a root. When no root is an ancestor, a
new root is made (the same for every job: which directories were listed is
known to all):

1. if an ancestor directory was listed, the deepest listed ancestor, moved
   up while its parent was listed too (a recursive scan such as ImageFolder's
   lists ``train`` and then every ``train/<class>``: the root is ``train``);
2. otherwise the first path component (``a/x/1.jpg`` -> ``a``);
3. a file directly at the mount root belongs to the root ``""``.

The mount root itself never joins a chain of listed directories: a human
``ls`` of the mount would otherwise merge every workload on it into one.
The price is that a dataset whose class folders sit directly at the mount
root is modelled as one workload per folder (each still gets its own
epochs, unread set and replayed order) until a hint says otherwise: one
hint is one loader's order, so a hint whose paths fall in several workloads
makes their common directory one root (``claim_root``; the mount root, for
those class folders), which then also holds every path no deeper workload
claims. A listing that makes a new root above existing listing-made roots
(a child listed before its parent) merges them into it (``merge``); the
merged workload's id stays an alias of the one it went into.

Roots, once made, are kept while their job reads: the first event of a new
job (every shell command is one) forgets the jobs idle for
``JOB_IDLE_SECONDS``, with their workloads.

Cost: every lookup is O(depth of the path), O(1) in practice.

Concurrency: none here. ``Workloads`` and everything it holds are guarded
by the lock of their owner (``model.WorkloadModel``); time comes in as ``now``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Final

from cachefsd.jobs import UNKNOWN_JOB
from cachefsd.workload.epochs import Epochs
from cachefsd.workload.streams import Streams

# A workload with no event for this long (finished, or evaluating elsewhere)
# predicts nothing, so the prefetcher stops fetching its leftovers, and a job
# all of whose workloads are this idle is forgotten when a new job comes.
# Training reads continuously; five minutes covers checkpointing and
# evaluation pauses.
JOB_IDLE_SECONDS: Final = 300.0


def workload_id(job: str, root: str) -> str:
    """How a workload is named to the prefetcher, ``stats`` and metrics:
    its root alone for reads of the unknown job, else ``job:root``."""
    return f"{job}:{root}" if job else root


@dataclass
class Workload:
    """One job reading the dataset under ``root``."""

    root: str
    made_by_listing: bool
    job: str = UNKNOWN_JOB
    epochs: Epochs = field(default_factory=Epochs)
    streams: Streams = field(default_factory=Streams)
    # Predictions start once the workload opened or read a file or had a
    # hint: a listing alone may be a human's ``ls``.
    engaged: bool = False
    last_event: float = float("-inf")

    @property
    def id(self) -> str:
        return workload_id(self.job, self.root)

    def active(self, now: float) -> bool:
        """Engaged, and with an event in the last ``JOB_IDLE_SECONDS``."""
        return self.engaged and now - self.last_event <= JOB_IDLE_SECONDS

    def absorb(self, child: Workload) -> None:
        """Fold in a workload made below this one's root (its child listed first)."""
        self.epochs.absorb(child.epochs)
        self.streams.absorb(child.streams)
        self.engaged = self.engaged or child.engaged
        self.last_event = max(self.last_event, child.last_event)


@dataclass
class JobWorkloads:
    """One job's workloads, by root."""

    job: str
    by_root: dict[str, Workload] = field(default_factory=dict)

    def idle(self, now: float) -> bool:
        return all(now - workload.last_event > JOB_IDLE_SECONDS for workload in self.by_root.values())

    def dataset_root(self) -> Workload | None:
        """The mount root's workload when it is a dataset root, made by a
        hint whose paths span several top-level directories (ImageFolder
        class folders right under the mount): it then holds every path no
        deeper workload claims. A root workload made by a plain listing
        (someone ran ``ls``) or by a file at the root does not."""
        workload = self.by_root.get("")
        return workload if workload is not None and workload.made_by_listing else None

    def existing(self, path: str) -> Workload | None:
        """The workload of ``path`` (a file, directory or root), without making one."""
        workload = self.by_root.get(path)
        if workload is not None:
            return workload
        for directory in reversed(ancestors(path)):
            workload = self.by_root.get(directory)
            if workload is not None:
                return workload
        if "/" not in path:
            return self.by_root.get("")
        return self.dataset_root()

    def holds(self, directory: str) -> Workload | None:
        """The workload whose dataset ``directory`` is part of, if any."""
        held = self.existing(directory)
        if held is not None and (
            held is self.dataset_root() or directory == held.root or directory.startswith(held.root + "/")
        ):
            return held
        return None


_NO_WORKLOADS: Final = JobWorkloads(UNKNOWN_JOB)  # what a query about a job never seen looks in


class Workloads:
    """Every job's workloads, the listed directories that make roots, and
    the workloads that began an epoch since ``take_turns``."""

    def __init__(self) -> None:
        # job -> its workloads: the same directory read by two jobs is two
        # workloads, each with its epochs, plans and streams.
        self._jobs: dict[str, JobWorkloads] = {}
        self._by_id: dict[str, Workload] = {}
        self._aliases: dict[str, str] = {}  # id of a workload merged away -> id of the one it went into
        self._listed: set[str] = set()
        self._turns: dict[str, int] = {}  # workload id -> epoch, begun since ``take_turns``

    # -- lookups ----------------------------------------------------------------

    def job_count(self) -> int:
        """How many jobs have workloads; a single ``len``, safe without the owner's lock."""
        return len(self._jobs)

    def jobs(self) -> dict[str, JobWorkloads]:
        """Job -> its workloads, the live mapping (not to be changed)."""
        return self._jobs

    def known(self, job: str) -> JobWorkloads:
        """``job``'s workloads, none if it is unknown (not remembered)."""
        return self._jobs.get(job, _NO_WORKLOADS)

    def all(self) -> list[Workload]:
        """Every workload, oldest first."""
        return list(self._by_id.values())

    def by_id(self, name: str) -> Workload | None:
        """The workload named ``name`` itself, None if there is none (merged away or gone)."""
        return self._by_id.get(name)

    def named(self, name: str) -> Workload | None:
        """The workload named ``name``, or the one it was merged into; None once gone."""
        return self._by_id.get(self._aliases.get(name, name))

    def root_of(self, workloads: JobWorkloads, path: str) -> str:
        """The root of the workload among ``workloads`` a FILE ``path`` belongs to or would get."""
        above = ancestors(path)
        for directory in reversed(above):
            if directory in workloads.by_root:
                return directory
        if workloads.dataset_root() is not None:
            return ""
        for directory in reversed(above):
            if directory in self._listed:
                return self._chain_top(directory)
        return above[0] if above else ""

    # -- making workloads ---------------------------------------------------------

    def of_job(self, job: str, now: float) -> JobWorkloads:
        """``job``'s workloads, made empty if it is new. A new job (every
        shell command is one) first sweeps away the jobs idle for
        ``JOB_IDLE_SECONDS``: a workload that stopped reading protects nothing."""
        workloads = self._jobs.get(job)
        if workloads is None:
            for idle in [each for each in self._jobs.values() if each.idle(now)]:
                self._drop(idle)
            workloads = self._jobs[job] = JobWorkloads(job)
        return workloads

    def of_file(self, workloads: JobWorkloads, path: str) -> Workload:
        """The workload a FILE ``path`` belongs to; may make one (and merge)."""
        root = self.root_of(workloads, path)
        workload = workloads.by_root.get(root)
        if workload is not None:
            return workload
        if root and root in self._listed:
            return self._of_directory(workloads, root)
        return self._make(workloads, root, made_by_listing=False)

    def listed(self, workloads: JobWorkloads, directory: str) -> Workload:
        """The workload a listing of ``directory`` (``""``: the mount root) belongs to; may make and merge."""
        if not directory:
            return self._make(workloads, "", made_by_listing=False)
        self._listed.add(directory)
        return self._of_directory(workloads, directory)

    def _of_directory(self, workloads: JobWorkloads, directory: str) -> Workload:
        """The workload of a listed ``directory`` (not the root); may make and merge."""
        for candidate in [directory, *reversed(ancestors(directory))]:
            workload = workloads.by_root.get(candidate)
            if workload is not None:
                return workload
        root_workload = workloads.dataset_root()
        if root_workload is not None:
            return root_workload
        root = self._chain_top(directory)
        workload = self._make(workloads, root, made_by_listing=True)
        prefix = root + "/"
        for other in [other for other in workloads.by_root.values() if other.made_by_listing]:
            if other.root.startswith(prefix):
                self._merge(workloads, workload, other)
        return workload

    def claim_root(self, workloads: JobWorkloads, root: str) -> None:
        """A hint spans the directory ``root``: make it one workload, folding
        in the workloads that guessed smaller roots below it (one per class folder)."""
        workload = self._make(workloads, root, made_by_listing=True)
        workload.made_by_listing = True  # a root workload made by ``ls`` becomes a dataset root too
        prefix = root + "/" if root else ""
        for other in [other for other in workloads.by_root.values() if other is not workload]:
            if other.root.startswith(prefix) and other.root != root:
                self._merge(workloads, workload, other)

    def _make(self, workloads: JobWorkloads, root: str, made_by_listing: bool) -> Workload:
        workload = workloads.by_root.get(root)
        if workload is None:
            workload = Workload(root, made_by_listing, workloads.job)
            # Another job's workload of the same root knows the working set
            # (it listed the dataset): this one starts its epoch with it unread.
            twin = next(
                (each.by_root[root] for each in self._jobs.values() if root in each.by_root),
                None,
            )
            if twin is not None:
                workload.epochs.share_working_set(twin.epochs)
            workloads.by_root[root] = workload
            self._by_id[workload.id] = workload
        return workload

    def _chain_top(self, directory: str) -> str:
        while True:
            above = parent(directory)
            if not above or above not in self._listed:
                return directory
            directory = above

    def _merge(self, workloads: JobWorkloads, into: Workload, child: Workload) -> None:
        """Fold ``child``, made below ``into``, into it; its id becomes an alias."""
        del workloads.by_root[child.root]
        del self._by_id[child.id]
        self._aliases = {old: into.id if new == child.id else new for old, new in self._aliases.items()}
        self._aliases[child.id] = into.id
        if self._turns.pop(child.id, None) is not None:
            self._turns[into.id] = max(into.epochs.epoch, child.epochs.epoch)
        into.absorb(child)

    def _drop(self, workloads: JobWorkloads) -> None:
        del self._jobs[workloads.job]
        gone = {workload.id for workload in workloads.by_root.values()}
        for name in gone:
            del self._by_id[name]
            self._turns.pop(name, None)
        self._aliases = {child: into for child, into in self._aliases.items() if into not in gone}

    # -- turns ----------------------------------------------------------------

    def turned(self, workload: Workload) -> None:
        """``workload`` began an epoch."""
        self._turns[workload.id] = workload.epochs.epoch

    def take_turns(self) -> dict[str, int]:
        """The workloads that began an epoch since the last call -> their epoch now."""
        turns, self._turns = self._turns, {}
        return turns


def clean(path: str) -> str:
    """A mount-relative path without leading or trailing slashes."""
    return path.strip("/")


def common_directory(roots: list[str]) -> str:
    """The deepest directory holding every one of several ``roots`` ("" for the mount root)."""
    return os.path.commonpath(roots) if all(roots) else ""


def ancestors(path: str) -> list[str]:
    """Proper ancestor directories of ``path``, shallowest first, without the root ``""``."""
    out = []
    cut = path.find("/")
    while cut != -1:
        out.append(path[:cut])
        cut = path.find("/", cut + 1)
    return out


def parent(path: str) -> str:
    cut = path.rfind("/")
    return "" if cut == -1 else path[:cut]
