"""The prefetcher: turns the workload model's predictions into block fetches,
within one global budget. It composes one module per mechanism, and holds
the state they share.

Every open, read and directory listing of the mount is an event for the
workload model (``cachefsd/workload/``). A single thread wakes on those events, asks
the model what will be read next (a sequential stream's next window, a
hint's remaining order, a replayed order, or the unread files of the
epoch), and fetches the blocks that are not cached yet, nearest predicted
use first.

Budget, whatever the number of open files, counted by the accounts
(``accounts.py``: blocks ahead, blocks and GETs in flight, failed blocks):
- at most ``concurrency`` prefetch runs at once, each up to
  ``reader.RUN_GETS_IN_FLIGHT`` block GETs, which queue behind every demand
  read in the fetcher (``fetch.PrioritySlots``): with every request slot
  taken by prefetches, a demand read waits for the first GET to end;
- at most the reach (``reach.py``: AIMD between
  ``PrefetchTuning.min_reach_bytes`` and ``lookahead``) fetched ahead and
  not yet read;
- at most the cache's room (``CachedBlocks.room``: free space plus what the
  eviction policy would give up) in flight: a block the cache refuses on
  arrival was fetched for nothing;
- at most ``bandwidth`` bytes per second when set (``bucket.py``).
A demand read of a block being prefetched joins its GET (single-flight in
``reader.py``; the prefetch then counts as used, late), and a failed
prefetch only logs. One run starts with a read, on the reader's thread: a
large file's first read in its first block begins the file's first run,
whose GET brings that read's block first, at a demand read's priority
(``head.py``).

Blocks fetched ahead carry their predicted use, which the cache records
(``cache.policy.PlannedUse``) before admitting them; with a plan (a hint,
or a replay the model trusts), the cached blocks of the files it places are
planned too, when a hint arrives and whenever a workload starts an epoch. The
epoch-aware policy then ranks by Belady: a block needed sooner evicts one
planned for later, and blocks already read this epoch go first. A block
fetched ahead that leaves the cache unread counts as waste; one that is
read counts as used. With a plan, files already cached are also warmed
into the page cache as their turn nears (``warm.py``). A dataset larger
than RAM is read from the cache disk every epoch; without this, each small
file's read waits for it.

Time and tuning are passed in: ``clock`` (default ``time.monotonic``) is
the only time read here, and ``PrefetchTuning`` holds the numbers.

Concurrency. Immutable after construction: the collaborators, the
settings, the tuning, the clock and the pool. ``_lock`` guards the accounts,
the reach and the token bucket, which have no lock of their own (taking a
block reads and changes all three at once), and ``_opens``, ``_replan``,
``_resident_plans`` and the hint shares. The head runs have their own lock
(``HeadRuns``); the warm queue has none (only the prefetch thread uses
it). Lock order: the head runs' lock, then ``_lock`` (a read beginning a
first run takes its blocks' budget under both, so that no two reads begin
it), then the cache's (a block's digest and the cache's room are read
under ``_lock``) and, through its eviction policy, the model's. A first
run's GET waits for its verdict (``HeadRun.goes_on``) holding no lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from cachefsd.cache.index import BlockRef
from cachefsd.config import PrefetchSettings
from cachefsd.errors import CachefsdError
from cachefsd.fetch import FetchKind
from cachefsd.jobs import UNKNOWN_JOB
from cachefsd.namespace.tree import Namespace
from cachefsd.prefetch.accounts import Accounts, Ahead
from cachefsd.prefetch.bucket import TokenBucket
from cachefsd.prefetch.head import HeadRun, HeadRuns, free_blocks
from cachefsd.prefetch.reach import Reach
from cachefsd.prefetch.tuning import DEFAULT_TUNING, PrefetchTuning
from cachefsd.prefetch.warm import ToWarm, WarmQueue
from cachefsd.reader import RUN_BYTES, ClaimedRun, block_range
from cachefsd.store.base import ObjectInfo
from cachefsd.workload.model import Prediction, WorkloadModel

log = logging.getLogger(__name__)

# Consecutive blocks of one file fetched by one call: (index, ref, bytes) each.
Run = list[tuple[int, BlockRef, int]]


class Fetches(Protocol):
    """What the prefetcher asks of the read path (``reader.BlockReader``):
    how blocks are cut and named, whether one is being fetched, and runs of
    them brought in ahead of their reads, sharing GETs with demand reads."""

    @property
    def block_size(self) -> int: ...

    @property
    def run_blocks(self) -> int:
        """Blocks one run's GET brings at most."""
        ...

    def ref(self, info: ObjectInfo, index: int) -> BlockRef: ...

    def fetching(self, info: ObjectInfo, index: int) -> bool: ...

    def claim_run_ahead(
        self,
        info: ObjectInfo,
        indices: range,
        tier: str | None = None,
        next_use: float | None = None,
        proceed: Callable[[int], bool] | None = None,
        kind: FetchKind = "prefetch",
    ) -> ClaimedRun:
        """Claim the blocks now (a read of one then waits for this run);
        fetch them when the run's ``fetch`` is called."""
        ...

    def fetch_run_ahead(
        self, info: ObjectInfo, indices: range, tier: str | None = None, next_use: float | None = None
    ) -> set[int]:
        """Bring the blocks into the cache (a GET each, several at once); those this call fetched."""
        ...


class CachedBlocks(Protocol):
    """What the prefetcher asks of the block cache (``cache.view.CacheView``),
    by object version and block index."""

    def digest(self, info: ObjectInfo, index: int) -> str | None:
        """The content hash cached for block ``index`` of ``info``; None if it is not cached."""
        ...

    def plan(self, info: ObjectInfo, index: int, position: float) -> str | None:
        """Plan cached block ``index`` of ``info`` to be read next at
        ``position`` (on the count of opens); its hash, or None if it is not
        cached (then nothing is planned)."""
        ...

    def unplan(self, digest: str) -> None:
        """Block ``digest`` is no longer planned (read, or the plan changed)."""
        ...

    def warm(self, info: ObjectInfo, index: int) -> bool:
        """Start loading cached block ``index`` of ``info`` into RAM ahead
        of its read; False if it is not cached."""
        ...

    def room(self, next_use: float | None, wanted: int) -> int:
        """Bytes the cache would keep of blocks fetched ahead now, planned
        to be read at ``next_use`` (None: unknown), counted until ``wanted``
        bytes are found."""
        ...


class PrefetchEvents(Protocol):
    def prefetch_issued(self, nbytes: int) -> None: ...
    def prefetch_used(self, nbytes: int) -> None: ...
    def prefetch_wasted(self, nbytes: int) -> None: ...
    def prefetch_warmed(self, nbytes: int) -> None: ...


class Prefetcher:
    def __init__(
        self,
        model: WorkloadModel,
        namespace: Namespace,
        reader: Fetches,
        cache: CachedBlocks,
        settings: PrefetchSettings,
        events: PrefetchEvents,
        tuning: PrefetchTuning = DEFAULT_TUNING,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``clock`` is read wherever the prefetcher needs the time: the
        workload model's events, the token bucket, failed blocks' retries and
        the pace of waste retirement."""
        self._model = model
        self._namespace = namespace
        self._reader = reader
        self._cache = cache
        self._settings = settings
        self._events = events
        self._tuning = tuning
        self._clock = clock
        self._lock = threading.Lock()
        self._accounts = Accounts()
        self._reach = Reach(
            min(settings.lookahead, tuning.initial_reach_bytes), tuning.min_reach_bytes, settings.lookahead
        )
        self._bucket = TokenBucket(settings.bandwidth, clock())
        self._heads = HeadRuns(
            free_blocks(tuning.head_free_bytes, reader.block_size), tuning.head_verdict_seconds
        )
        self._warming = WarmQueue(tuning.warm_ahead_bytes)
        # Cached blocks a plan places, planned in the cache; replanned when a
        # hint arrives (``_replan``) or a workload starts an epoch. A read ends a
        # block's plan in the cache.
        self._resident_plans: set[str] = set()
        self._replan = False
        # job -> (world size, rank -> its share of the epoch's order)
        self._hint_parts: dict[str, tuple[int, dict[int, list[str]]]] = {}
        self._opens = 0
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._pool = ThreadPoolExecutor(settings.concurrency, thread_name_prefix="cachefsd-prefetch")
        self._thread = threading.Thread(target=self._run, name="cachefsd-prefetcher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Also for a prefetcher never started (``--no-prefetch``)."""
        self._stopped.set()
        self._wake.set()
        self._heads.stop()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- events from the filesystem -------------------------------------

    def opened(self, info: ObjectInfo, job: str = UNKNOWN_JOB) -> None:
        self._model.opened(info.key, info.size, self._clock(), job)
        with self._lock:
            self._opens += 1
        self._wake.set()

    def read(self, info: ObjectInfo, offset: int, size: int, job: str = UNKNOWN_JOB) -> None:
        self._model.read(info.key, offset, size, self._clock(), job)
        block_size = self._reader.block_size
        if offset >= block_size and self._heads.awaiting():  # a read in block 0 says nothing (``judge``)
            self._heads.judge(self._reader.ref(info, 0), offset, block_size)
        if offset < block_size < info.size:
            self._fetch_head(info, job)
        used = 0
        with self._lock:
            for index in block_range(offset, size, info.size, block_size):
                used += self._accounts.read(self._reader.ref(info, index))
            if used:
                self._reach.used(used)
        if used:
            self._events.prefetch_used(used)
        self._wake.set()

    def wanted_elsewhere(self, info: ObjectInfo, job: str = UNKNOWN_JOB) -> bool:
        return self._model.wanted_elsewhere(info.key, job)

    def read_by_one_of_many(self, info: ObjectInfo, offset: int, size: int, job: str = UNKNOWN_JOB) -> None:
        """``job`` read these bytes, which another job is still to read: the
        read consumed their blocks' plan, so the other job's plan, if it
        places them, plans them again (else the policy would see them due
        but unplanned, and never give them up for blocks needed sooner)."""
        distance = self._model.planned_elsewhere(info.key, job)
        if distance is None:
            return
        position = self._opens_now() + distance
        for index in block_range(offset, size, info.size, self._reader.block_size):
            self._cache.plan(info, index, position)

    def _fetch_head(self, info: ObjectInfo, job: str) -> None:
        """Fetch the first run of a large file (``head.py``) with the GET of
        this read in its first block (the kernel's first reads of a file
        come in any order), if that block is neither cached nor being
        fetched and the budget allows. The run's blocks are claimed before
        this returns, so that the read waits for its GET, which runs at a
        demand read's priority."""
        if not self._thread.is_alive() or self._stopped.is_set():  # --no-prefetch, or stopping
            return
        if self._cache.digest(info, 0) is not None or self._reader.fetching(info, 0):
            return
        prediction = Prediction(
            info.key, 0, RUN_BYTES, 0.0, workload=self._model.workload_of(info.key, job) or ""
        )

        def take() -> tuple[Run, float] | None:
            with self._lock:
                run = self._take_run_locked(info, prediction)
                if not run:
                    return None
                self._accounts.get_started()  # with the blocks, so that reads at once cannot overrun it
                return run, self._opens + prediction.distance

        begun = self._heads.begin(self._reader.ref(info, 0), take)
        if begun is None:
            return
        head, taken = begun
        if taken is None:
            head.claimed.wait(self._tuning.head_claim_seconds)  # another read of the file is starting it
            return
        run, position = taken
        claim = None
        try:
            indices = range(run[0][0], run[-1][0] + 1)
            claim = self._reader.claim_run_ahead(
                info, indices, next_use=position, proceed=head.goes_on, kind="demand"
            )
            head.claimed.set()
            self._pool.submit(self._fetch, info, run, position, prediction.workload, head, claim)
        except BaseException as exc:
            head.claimed.set()
            if claim is not None:
                claim.abandon()
            self._run_over(info, run, set(), prediction.workload, head)
            if not isinstance(exc, Exception):
                raise
            # Read-ahead that cannot start must not fail the read that
            # began it (a cache disk error, a pool shut down at unmount):
            # the read fetches its block itself.
            log.warning("first run of %s not started: %s", info.key, exc, exc_info=True)

    def _take_run_locked(self, info: ObjectInfo, prediction: Prediction) -> Run:
        """The blocks of a file's first run the budget allows, from block 0
        on; none if block 0 needs no fetch or the budget is spent."""
        run: Run = []
        for index in block_range(0, RUN_BYTES, info.size, self._reader.block_size):
            taken = self._take_locked(info, index, prediction)
            if not isinstance(taken, tuple):
                break
            run.append((index, *taken))
        return run

    def listed(self, entries: dict[str, ObjectInfo | None], directory: str, job: str = UNKNOWN_JOB) -> None:
        files = {info.key: info.size for info in entries.values() if info is not None}
        self._model.listed(directory, files, self._clock(), job)
        self._wake.set()

    def hint(
        self, order: list[str], part: tuple[int, int] | None = None, job: str = UNKNOWN_JOB
    ) -> tuple[int, int]:
        """Follow ``order`` (mount-relative paths) for the current epoch;
        returns (accepted, unknown). Unknown paths are dropped, not errors:
        a stale hint costs bandwidth, never correctness. ``part`` (rank,
        world size) marks one rank's share: the shares of the ranks on this
        node are interleaved into one order, as their readers run side by side."""
        accepted = [info.key for path in order if (info := self._file_info(path)) is not None]
        self._model.hint(self._merged(accepted, part, job), self._clock(), job)
        with self._lock:
            self._replan = True
        self._wake.set()
        return len(accepted), len(order) - len(accepted)

    def _merged(self, order: list[str], part: tuple[int, int] | None, job: str) -> list[str]:
        if part is None:
            return order
        rank, world = part
        reading = self._model.jobs()
        with self._lock:
            # The shares of jobs the model forgot (they stopped reading) go.
            self._hint_parts = {each: kept for each, kept in self._hint_parts.items() if each in reading}
            known_world, parts = self._hint_parts.get(job, (0, {}))
            if world != known_world:
                parts = {}
                self._hint_parts[job] = (world, parts)
            parts[rank] = order
            shares = [parts[rank] for rank in sorted(parts)]
        merged: list[str] = []
        for position in range(max(len(share) for share in shares)):
            merged.extend(share[position] for share in shares if position < len(share))
        return merged

    # -- the prefetch thread ----------------------------------------------

    def _run(self) -> None:
        retired_at = float("-inf")  # the first round retires
        while not self._stopped.is_set():
            self._wake.wait(self._tuning.idle_wake_seconds)
            self._wake.clear()
            try:
                turns = self._model.take_turns()
                if turns:
                    self._void_plans(turns)
                now = self._clock()
                if now - retired_at >= self._tuning.idle_wake_seconds:
                    retired_at = now
                    self._retire_waste()
                with self._lock:
                    replan, self._replan = self._replan, False
                if replan or turns:
                    self._plan_residents()
                if self._has_budget():
                    self._issue()
                self._warm()
            except Exception:
                log.exception("prefetch round failed")
            # Rounds are paced: a round asks the model for many predictions,
            # and completions would otherwise start one per finished GET.
            self._stopped.wait(self._tuning.min_round_seconds)

    def _has_budget(self) -> bool:
        with self._lock:
            return (
                self._accounts.gets < self._settings.concurrency
                and self._accounts.ahead_bytes < self._reach.bytes
            )

    def _void_plans(self, turns: dict[str, int]) -> None:
        """A workload's new epoch voids the plans of its last: a block planned and
        never read would otherwise stay protected by its old, early position.
        It ranks again as not yet read, and goes stale if it stays unread.
        Here the blocks those workloads fetched ahead are unplanned, and what was
        warmed for their last pass stops counting against the budget (files
        still queued to warm are dropped as they come up); the caller then
        replans every workload's cached blocks (``_plan_residents``), so
        other workloads' plans stand."""
        with self._lock:
            voided = self._accounts.digests_of(turns)
        for digest in voided:
            self._cache.unplan(digest)
        self._warming.void(self._stale)

    def _stale(self, workload: str, epoch: int) -> bool:
        """A prediction of ``workload`` made in ``epoch``, which it has since
        left (or the workload is gone: it stopped reading)."""
        current = self._model.epoch_of(workload)
        return current is None or epoch < current

    def _plan_residents(self) -> None:
        """Tell the cache when each cached block of a file a plan (hint,
        replay) places will be read, so that the eviction policy gives up
        the residents read last (Belady) to make room for blocks read sooner.
        Without this, every resident of a full cache counts as due this
        epoch, and nothing is fetched ahead until reads free room. Once per
        hint or new epoch: O(the plans' lengths)."""
        opens = self._opens_now()
        planned: set[str] = set()
        for path, distance in self._model.planned():
            info = self._file_info(path)
            if info is None:
                continue
            for index in block_range(0, info.size, info.size, self._reader.block_size):
                digest = self._cache.plan(info, index, opens + distance)
                if digest is not None:
                    planned.add(digest)
        with self._lock:
            stale, self._resident_plans = self._resident_plans - planned, planned
        for digest in stale:
            self._cache.unplan(digest)

    def _retire_waste(self) -> None:
        """Blocks fetched ahead that left the cache before anyone read them."""
        with self._lock:
            ahead = self._accounts.ahead()
        gone = [ref for ref, block in ahead if self._cache.digest(block.info, block.index) is None]
        with self._lock:
            wasted = self._accounts.retire(gone)
            if wasted:
                self._reach.wasted(wasted)
        if wasted:
            self._events.prefetch_wasted(wasted)

    def _issue(self) -> None:
        with self._lock:
            free = self._settings.concurrency - self._accounts.gets
            opens = self._opens
        wanted = min(self._tuning.predictions_per_round, self._tuning.predictions_per_slot * free)
        for prediction in self._model.predict(wanted):
            if self._stopped.is_set():
                return
            info = self._file_info(prediction.path)
            if info is None:
                continue
            # Up to the next multiple of a run: a stream's window slides a
            # block at a time, and would be claimed (and fetched) so. A
            # stream's (offset past 0) one run further, so that the next run
            # is in flight while the reader works through this one.
            end = -(-(prediction.offset + prediction.length) // RUN_BYTES) * RUN_BYTES
            if prediction.offset > 0:
                end += RUN_BYTES
            block_size = self._reader.block_size
            blocks = block_range(prediction.offset, end - prediction.offset, info.size, block_size)
            if all(self._cache.digest(info, index) is not None for index in blocks):
                if prediction.offset == 0 and prediction.length >= info.size:
                    news = self._model.satisfied(prediction.path, prediction.workload)
                    if news and prediction.planned:
                        position = opens + prediction.distance
                        self._warming.plan(
                            ToWarm(position, prediction.path, prediction.workload, prediction.epoch)
                        )
                continue
            run: Run = []
            for index in blocks:
                taken = self._take(info, index, prediction)
                if run and (not isinstance(taken, tuple) or len(run) == self._reader.run_blocks):
                    self._submit(info, run, prediction)
                    run = []
                if taken is False:
                    return
                if isinstance(taken, tuple):
                    run.append((index, *taken))
            if run:
                self._submit(info, run, prediction)

    def _warm(self) -> None:
        """Warm the planned cached files read next, nearest first, within
        the warming budget (``warm.py``)."""
        opens = self._opens_now()
        self._warming.turned(opens)
        while not self._stopped.is_set() and (file := self._warming.next(opens, self._stale)) is not None:
            info = self._file_info(file.path)
            if info is None:
                continue
            for index in block_range(0, info.size, info.size, self._reader.block_size):
                self._cache.warm(info, index)
            self._warming.warmed(file, info.size)
            self._events.prefetch_warmed(info.size)

    def _file_info(self, path: str) -> ObjectInfo | None:
        """The object at mount-relative ``path``; None for a directory or a
        path that is gone (a stale prediction or hint, not an error)."""
        try:
            return self._namespace.lookup("/" + path.lstrip("/")).info
        except CachefsdError:
            return None

    def _opens_now(self) -> int:
        with self._lock:
            return self._opens

    def _take(self, info: ObjectInfo, index: int, prediction: Prediction) -> tuple[BlockRef, int] | bool:
        """Claim block ``index`` of ``info`` for a fetch if it needs one and
        the budget allows: its ref and bytes; True when it needs no fetch;
        False when the budget is spent (stop this round)."""
        with self._lock:
            return self._take_locked(info, index, prediction)

    def _take_locked(
        self, info: ObjectInfo, index: int, prediction: Prediction
    ) -> tuple[BlockRef, int] | bool:
        ref = self._reader.ref(info, index)
        nbytes = min(self._reader.block_size, info.size - index * self._reader.block_size)
        if self._accounts.holds(ref):
            return True
        now = self._clock()
        if self._accounts.failed_lately(ref, now):
            return True
        position = self._opens + prediction.distance
        if not self._budget_allows_locked(nbytes, position, now):
            return False
        if self._cache.digest(info, index) is not None:
            self._bucket.refund(nbytes)
            return True
        self._accounts.start(ref, nbytes)
        return ref, nbytes

    def _submit(self, info: ObjectInfo, run: Run, prediction: Prediction) -> None:
        with self._lock:
            position = self._opens + prediction.distance
            self._accounts.get_started()
        self._pool.submit(self._fetch, info, run, position, prediction.workload)

    def _budget_allows_locked(self, nbytes: int, position: float, now: float) -> bool:
        """A free slot, room in the reach, room in the cache for it and for
        every block already in flight, counting residents planned for after
        ``position`` (a cache that refuses a block on arrival wastes its GET),
        and bandwidth tokens (spent here when everything else allows)."""
        needed = self._accounts.in_flight_bytes + nbytes
        return (
            self._accounts.gets < self._settings.concurrency
            and self._accounts.ahead_bytes + nbytes <= self._reach.bytes
            and needed <= self._cache.room(position, wanted=needed)
            and self._bucket.spend(nbytes, now)
        )

    def _fetch(
        self,
        info: ObjectInfo,
        run: Run,
        position: float,
        workload: str,
        head: HeadRun | None = None,
        claim: ClaimedRun | None = None,
    ) -> None:
        """Fetch a run of consecutive blocks (a GET each, several at once), then account for
        each block as it turned out. A file's first run (``head``) comes
        with its blocks already ``claim``ed."""
        first, last = run[0][0], run[-1][0]
        fetched: set[int] = set()
        try:
            if claim is None:
                fetched = self._reader.fetch_run_ahead(info, range(first, last + 1), next_use=position)
            else:
                fetched = claim.fetch()
        except Exception as exc:
            # A bug too (logged with its traceback), not only a failed GET:
            # either way the run's blocks and its slot must be given back,
            # or prefetch would stop for good once every slot leaked.
            failed = isinstance(exc, CachefsdError)
            level = logging.INFO if failed else logging.ERROR
            message = "prefetch of %s blocks %d-%d failed: %s"
            log.log(level, message, info.key, first, last, exc, exc_info=not failed)
            retry_at = self._clock() + self._tuning.failed_retry_seconds
            with self._lock:
                self._accounts.failed((ref for _, ref, _ in run), retry_at)
        finally:
            self._run_over(info, run, fetched, workload, head)

    def _run_over(
        self, info: ObjectInfo, run: Run, fetched: set[int], workload: str, head: HeadRun | None
    ) -> None:
        """Account for each block of a run as it turned out, and give its slot back."""
        for index, ref, nbytes in run:
            self._account(info, index, ref, nbytes, index in fetched, workload)
        if head is not None:
            self._heads.over(run[0][1], head)
        with self._lock:
            self._accounts.get_over()
        self._wake.set()

    def _account(
        self, info: ObjectInfo, index: int, ref: BlockRef, nbytes: int, fetched: bool, workload: str
    ) -> None:
        """Block ``index``'s prefetch is over: it was ``fetched`` by it, or
        not (cached meanwhile, fetched by a read's GET, or failed)."""
        digest = self._cache.digest(info, index) if fetched else None
        with self._lock:
            joined = self._accounts.landed(ref)
            if digest is None:
                self._bucket.refund(nbytes)
                if fetched:
                    # Fetched, but the cache had no room the policy would give
                    # up: the bytes crossed the network for nothing.
                    self._reach.wasted(nbytes)
            elif joined:
                self._reach.used(nbytes)
            else:
                self._accounts.put_ahead(ref, Ahead(info, index, digest, nbytes, workload))
        if fetched:  # issued counts every fetched block, so used + wasted <= issued
            self._events.prefetch_issued(nbytes)
            if digest is None:
                self._events.prefetch_wasted(nbytes)
            elif joined:
                self._events.prefetch_used(nbytes)
