"""Staging: load a dataset, or part of it, into the cache before a job.

``cachefsd stage TARGET`` selects files by walking the namespace from a
path (listing directories in parallel), keeps those whose mount-relative
path matches ``--include``, and brings every block of them into the cache
with a pool of workers calling ``BlockReader.fetch_run_ahead`` (runs of
consecutive blocks, up to ``reader.RUN_BYTES``, a GET a block; kind
"prefetch": demand reads of a training job running meanwhile still go
first). A block already cached is counted and skipped before it reaches a
worker, so a rerun after an interruption only fetches what is missing.
``--check`` fetches nothing and reports how much of the selection is
resident, by tier. A selection larger than the cache is not an error to
hide: staging stops at the first block the cache refuses (fetching more
would only spend bandwidth), and the summary says how much of the selection
the cache does not hold at the end.

Where it runs: through the daemon of a mount (``POST /stage`` on its
control socket, progress streamed back) when TARGET is a path under a live
mount, since the daemon holds the cache directory's lock; in this process
over ``engine.open_engine`` when TARGET is a source (``s3://...``,
``gs://...``, ``az://...``, a local directory) and no daemon uses the
cache directory.

The same code stages in both places (``stage_files``) and speaks in the
same events (dicts, sent as JSON lines by the daemon):

- ``{"event": "progress", "phase": "select"|"fetch"|"check", ...counters}``
  at least every ``PROGRESS_INTERVAL_SECONDS`` (the client's liveness signal),
- ``{"event": "failure", "path": ..., "error": ...}`` once per failed file
  (or directory that could not be listed),
- and the summary the caller returns.

Include patterns are matched against the mount-relative path without its
leading slash (``train/shard-0001.tar``), with path-aware glob rules
(``globs``): ``*`` and ``?`` never cross a ``/``, ``**/`` matches any
number of directories (``train/**/*.jpg``) and ``**`` anything
(``train/**`` is everything under ``train``), ``[...]`` is a character
class. A pattern without a ``/`` is
matched against the file name alone, at any depth, as in ``.gitignore``
(``*.tar`` selects every tar file).

Concurrency: ``stage_files`` runs on the calling thread, which alone owns
the counters; workers only call ``fetch_run_ahead`` and return its result.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from cachefsd.errors import BadRequest, CachefsdError, NotADirectory, ObjectNotFound, StageCancelled
from cachefsd.globs import PathGlob
from cachefsd.store.base import ObjectInfo

if TYPE_CHECKING:
    from cachefsd.namespace.tree import Entry

# Parallel block fetches of one stage. Stage runs before a job, when the
# node's link is otherwise idle: 16 GETs of 4 MiB keep a 10 Gb/s link busy
# at S3's ~50 ms per request, and stay under the fetcher's own concurrency
# cap (32 by default), so demand reads of a running job keep their share.
STAGE_WORKERS = 16
# Blocks handed to the pool at once: enough queued that no worker waits for
# the coordinator, few enough that a million-block stage holds a bounded
# number of futures.
WINDOW_PER_WORKER = 4
# Directories listed at once while selecting (an ImageNet-style tree has
# 1000 directories; one at a time that is 1000 round trips in a row).
LIST_WORKERS = 8
# A progress event at least this often: the client's proof that the stage
# is alive (``control.client.STREAM_IDLE_SECONDS`` is far above it).
PROGRESS_INTERVAL_SECONDS = 1.0
# Failures kept for the final listing; a bucket gone entirely would
# otherwise print (and hold) a line per file. The count is always exact.
MAX_LISTED_FAILURES = 1000


class Tree(Protocol):
    """The namespace as staging sees it (``namespace.tree.Namespace``)."""

    def lookup(self, path: str) -> Entry:
        """The node at ``path``; ``ObjectNotFound`` / ``NotADirectory`` otherwise."""
        ...

    def listdir(self, path: str) -> dict[str, ObjectInfo | None]:
        """Name -> object, or None for a subdirectory."""
        ...


@dataclass(frozen=True, slots=True)
class StageRequest:
    """What ``POST /stage`` asks for: the files under ``path`` (mount-relative)
    whose mount-relative path matches ``include``, fetched into ``tier``
    (None: the fastest with room), or only measured when ``check``."""

    path: str = "/"
    include: str | None = None
    tier: str | None = None
    check: bool = False


class Blocks(Protocol):
    """How staging fetches blocks (``reader.BlockReader``)."""

    @property
    def block_size(self) -> int: ...

    @property
    def run_blocks(self) -> int:
        """Blocks one ``fetch_run_ahead`` brings at most."""
        ...

    def fetching(self, info: ObjectInfo, index: int) -> bool:
        """Whether a GET of block ``index`` of ``info`` is under way."""
        ...

    def fetch_run_ahead(self, info: ObjectInfo, indices: range, tier: str | None = None) -> set[int]:
        """Cache consecutive blocks ``indices`` (a GET each); those this
        call fetched. Raises on failure."""
        ...


class Resident(Protocol):
    """Where staging learns what the cache holds (``cache.view.CacheView``)."""

    def residency(self, info: ObjectInfo, index: int) -> str | None:
        """The tier holding block ``index`` of ``info``, or None."""
        ...


# -- selection ----------------------------------------------------------------


def compile_include(pattern: str | None) -> Callable[[str], bool]:
    """A predicate on mount-relative paths (``a/b.txt``) for ``--include``
    (rules in the module docstring and ``globs``)."""
    if pattern is None:
        return lambda _path: True
    pattern = pattern.lstrip("/")
    glob = PathGlob(pattern)
    if "/" not in pattern:
        return lambda path: glob.matches(path.rpartition("/")[2])
    return glob.matches


def normalise(path: str) -> str:
    """``a//b/`` -> ``/a/b``; ``..`` cannot climb above the mount root."""
    parts: list[str] = []
    for part in path.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if parts:
                parts.pop()
            continue
        parts.append(part)
    return "/" + "/".join(parts)


@dataclass(frozen=True, slots=True)
class Selected:
    path: str  # mount-relative, with a leading slash
    info: ObjectInfo


@dataclass
class _Counters:
    """Everything a progress event and the summary say; the coordinating
    thread is the only writer."""

    started: float = field(default_factory=time.monotonic)
    files_total: int = 0
    files_done: int = 0
    bytes_total: int = 0
    bytes_fetched: int = 0
    bytes_cached: int = 0
    bytes_failed: int = 0
    bytes_missing: int = 0  # check: not resident
    bytes_skipped: int = 0  # not fetched: the cache was found full
    failed: int = 0  # files and directories
    files_failed: int = 0
    resident: dict[str, int] = field(default_factory=dict)
    last_report: float = field(default_factory=time.monotonic)  # a quick stage reports no "select"

    @property
    def bytes_done(self) -> int:
        return (
            self.bytes_fetched
            + self.bytes_cached
            + self.bytes_failed
            + self.bytes_missing
            + self.bytes_skipped
        )

    def event(self, phase: str) -> dict[str, Any]:
        return {
            "event": "progress",
            "phase": phase,
            "files_total": self.files_total,
            "files_done": self.files_done,
            "bytes_total": self.bytes_total,
            "bytes_done": self.bytes_done,
            "bytes_fetched": self.bytes_fetched,
            "bytes_cached": self.bytes_cached,
            "failed": self.failed,
            "seconds": round(time.monotonic() - self.started, 3),
        }


class _Run:
    """One stage: the counters and the reporting rhythm."""

    def __init__(self, report: Report, cancelled: threading.Event | None) -> None:
        self.report = report
        self.cancelled = cancelled
        self.counters = _Counters()

    def fail(self, path: str, error: BaseException | str) -> None:
        self.counters.failed += 1
        message = error if isinstance(error, str) else _describe(error)
        self.report({"event": "failure", "path": path, "error": message})

    def tick(self, phase: str, force: bool = False) -> None:
        """Report progress if it is time; stop if the daemon is stopping."""
        if self.cancelled is not None and self.cancelled.is_set():
            raise StageCancelled("the daemon is stopping")
        now = time.monotonic()
        if force or now - self.counters.last_report >= PROGRESS_INTERVAL_SECONDS:
            self.counters.last_report = now
            self.report(self.counters.event(phase))

    def until_next_tick(self) -> float:
        elapsed = time.monotonic() - self.counters.last_report
        return max(0.0, PROGRESS_INTERVAL_SECONDS - elapsed)


def _describe(error: BaseException) -> str:
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _select(tree: Tree, request: StageRequest, run: _Run) -> list[Selected]:
    """The files to stage, sorted by path; directories that cannot be listed
    are reported as failures and skipped."""
    root = normalise(request.path)
    match = compile_include(request.include)
    try:
        node = tree.lookup(root)
    except (ObjectNotFound, NotADirectory) as exc:
        raise BadRequest(f"{root}: no such file or directory") from exc
    selected: list[Selected] = []

    def take(path: str, info: ObjectInfo) -> None:
        if match(path[1:]):
            selected.append(Selected(path, info))
            run.counters.files_total += 1
            run.counters.bytes_total += info.size

    if node.info is not None:
        take(root, node.info)
        return selected
    with ThreadPoolExecutor(LIST_WORKERS, thread_name_prefix="cachefsd-stage-list") as pool:
        listing: dict[Future[dict[str, ObjectInfo | None]], str] = {pool.submit(tree.listdir, root): root}
        try:
            while listing:
                done, _ = wait(listing, timeout=run.until_next_tick(), return_when=FIRST_COMPLETED)
                for future in done:
                    directory = listing.pop(future)
                    try:
                        entries = future.result()
                    except CachefsdError as exc:
                        run.fail(directory, exc)
                        continue
                    base = directory.rstrip("/")
                    for name, info in entries.items():
                        path = f"{base}/{name}"
                        if info is None:
                            listing[pool.submit(tree.listdir, path)] = path
                        else:
                            take(path, info)
                run.tick("select")
        finally:
            for future in listing:
                future.cancel()
    selected.sort(key=lambda item: item.path)
    return selected


# -- staging --------------------------------------------------------------------


def stage_files(
    tree: Tree,
    blocks: Blocks,
    resident: Resident,
    tiers: Sequence[str],
    request: StageRequest,
    report: Report,
    cancelled: threading.Event | None = None,
    workers: int = STAGE_WORKERS,
) -> dict[str, Any]:
    """Stage (or, with ``request.check``, measure) the selection; returns the
    summary. ``BadRequest`` before any work for an unknown tier or path;
    exceptions raised by ``report`` (the client hung up) stop the stage."""
    if request.tier is not None and request.tier not in tiers:
        raise BadRequest(f"tier {request.tier!r} is not configured (tiers: {', '.join(tiers)})")
    run = _Run(report, cancelled)
    files = _select(tree, request, run)
    phase = "check" if request.check else "fetch"
    run.tick(phase, force=True)
    if request.check:
        _check(resident, blocks.block_size, files, run)
    else:
        _BlockFetch(blocks, resident, request.tier, run).run(files, workers)
    run.tick(phase, force=True)
    counters = run.counters
    seconds = time.monotonic() - counters.started
    summary: dict[str, Any] = {
        "check": request.check,
        "files": counters.files_total,
        "bytes": counters.bytes_total,
        "fetched_bytes": counters.bytes_fetched,
        "cached_bytes": counters.bytes_cached,
        "failed": counters.failed,
        "failed_files": counters.files_failed,
        "seconds": round(seconds, 3),
    }
    if request.check:
        summary["tiers"] = list(tiers)
        summary["resident"] = counters.resident
        summary["missing_bytes"] = counters.bytes_missing
    else:
        # Counted at the end: a cache smaller than the selection refuses
        # blocks (epoch-aware, MinIO) or evicts earlier ones (LRU).
        kept = sum(
            length
            for selected in files
            for tier, length in _residency(resident, blocks.block_size, selected)
            if tier is not None
        )
        summary["unkept_bytes"] = max(0, counters.bytes_total - counters.bytes_failed - kept)
    return summary


def _blocks_of(info: ObjectInfo, block_size: int) -> Iterator[tuple[int, int]]:
    """(index, length) of every block of ``info``."""
    for index in range((info.size + block_size - 1) // block_size):
        yield index, min(block_size, info.size - index * block_size)


def _residency(resident: Resident, block_size: int, selected: Selected) -> Iterator[tuple[str | None, int]]:
    """(tier holding it or None, length) of every block of ``selected``."""
    for index, length in _blocks_of(selected.info, block_size):
        yield resident.residency(selected.info, index), length


def _check(resident: Resident, block_size: int, files: list[Selected], run: _Run) -> None:
    counters = run.counters
    for selected in files:
        for tier, length in _residency(resident, block_size, selected):
            if tier is not None:
                counters.resident[tier] = counters.resident.get(tier, 0) + length
                counters.bytes_cached += length
            else:
                counters.bytes_missing += length
        counters.files_done += 1
        run.tick("check")


@dataclass(slots=True)
class _FileProgress:
    selected: Selected
    blocks_left: int = 0
    failed: bool = False


@dataclass(slots=True)
class _BlockRun:
    """Consecutive blocks (index, bytes) of one file, fetched by one call."""

    state: _FileProgress
    blocks: list[tuple[int, int]]

    def takes(self, state: _FileProgress, index: int, most: int) -> bool:
        """Whether block ``index`` of ``state``'s file extends this run of at most ``most`` blocks."""
        return state is self.state and index == self.blocks[-1][0] + 1 and len(self.blocks) < most


class _BlockFetch:
    """The fetch phase: hands uncached blocks to a pool a window at a time
    and books what comes back. Used by the coordinating thread only."""

    def __init__(self, blocks: Blocks, resident: Resident, tier: str | None, run: _Run) -> None:
        self._blocks = blocks
        self._resident = resident
        self._tier = tier
        self._run = run
        self._counters = run.counters
        # A fetched block the cache refused: it is full of blocks its policy
        # keeps, so fetching the rest would only spend bandwidth.
        self._cache_full = False

    def run(self, files: list[Selected], workers: int) -> None:
        todo = self._pending([_FileProgress(item) for item in files])
        window = workers * WINDOW_PER_WORKER
        in_flight: dict[Future[set[int]], _BlockRun] = {}
        pool = ThreadPoolExecutor(workers, thread_name_prefix="cachefsd-stage")
        run: _BlockRun | None = None  # gathered until it cannot grow

        def submit(run: _BlockRun) -> None:
            indices = range(run.blocks[0][0], run.blocks[-1][0] + 1)
            future = pool.submit(self._blocks.fetch_run_ahead, run.state.selected.info, indices, self._tier)
            in_flight[future] = run
            self._run.tick("fetch")

        try:
            exhausted = False
            while True:
                while not exhausted and not self._cache_full and len(in_flight) < window:
                    task = next(todo, None)
                    if task is None:
                        exhausted = True
                        if run is not None:
                            submit(run)
                            run = None
                        break
                    state, index, length = task
                    if run is not None and run.takes(state, index, self._blocks.run_blocks):
                        run.blocks.append((index, length))
                        continue
                    if run is not None:
                        submit(run)
                    run = _BlockRun(state, [(index, length)])
                if not in_flight:
                    break
                done, _ = wait(in_flight, timeout=self._run.until_next_tick(), return_when=FIRST_COMPLETED)
                for future in done:
                    self._book(future, in_flight.pop(future))
                self._run.tick("fetch")
            left = [] if run is None else [(run.state, index, length) for index, length in run.blocks]
            for state, _, length in [*left, *todo]:  # left when the cache was found full
                self._counters.bytes_skipped += length
                self._block_done(state)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def _pending(self, files: list[_FileProgress]) -> Iterator[tuple[_FileProgress, int, int]]:
        """Blocks still to fetch, in file order; cached blocks (and those of
        files that already failed) are counted here and never queued."""
        block_size = self._blocks.block_size
        for state in files:
            info = state.selected.info
            state.blocks_left = len(range(0, info.size, block_size))
            if state.blocks_left == 0:
                self._counters.files_done += 1
            for index, length in _blocks_of(info, block_size):
                if state.failed:
                    self._counters.bytes_failed += length
                    self._block_done(state)
                elif self._resident.residency(info, index) is not None:
                    self._counters.bytes_cached += length
                    self._block_done(state)
                else:
                    yield state, index, length

    def _book(self, future: Future[set[int]], run: _BlockRun) -> None:
        try:
            fetched = future.result()
        except Exception as exc:
            self._counters.bytes_failed += sum(length for _, length in run.blocks)
            if not run.state.failed:
                run.state.failed = True  # its other blocks are skipped, it is reported once
                self._counters.files_failed += 1
                self._run.fail(run.state.selected.path, exc)
            for _ in run.blocks:
                self._block_done(run.state)
            return
        for index, length in run.blocks:
            if index in fetched:
                self._counters.bytes_fetched += length
            else:  # it was cached, or a read's GET (which this joined) fetched it
                self._counters.bytes_cached += length
            info = run.state.selected.info
            if self._resident.residency(info, index) is None and not self._blocks.fetching(info, index):
                self._cache_full = True  # fetched, by whoever, and refused (not still on its way)
            self._block_done(run.state)

    def _block_done(self, state: _FileProgress) -> None:
        state.blocks_left -= 1
        if state.blocks_left == 0:
            self._counters.files_done += 1


# What a stage reports its progress to: one event (a JSON object) a call.
Report = Callable[[dict[str, Any]], None]
