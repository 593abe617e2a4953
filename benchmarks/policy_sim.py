"""Eviction policies replayed over shuffled training epochs, against Belady's optimum.

N files of one block each are read once per epoch in a fresh random order
(seeded). A simulated cache of ``f * N`` blocks (``cachefsd.cache.replay``,
which ``cachefsd doctor``'s what-if table replays a job's order through)
admits on every miss; when full it asks the policy for a victim, and a
refusal (None) means the block is not admitted. Every policy is the real class from
``cachefsd.cache.policy``, with the daemon's own workload model
(``cachefsd.workload.model.WorkloadModel``) as its epoch clock, told of
each read as the mount tells it (an open, then a read of the block). Rows:

- lru, 2-random, minio, epoch-aware: the shipped policies;
- epoch-aware+plan: the epoch-aware policy given the exact next use of every
  block (the ``NextUse`` hook the prefetch issue will feed), which should
  reach the optimum;
- belady: the offline optimum, computed here from the full future trace:
  evict the block whose next use is farthest, and do not admit a block whose
  next use is farther than every resident's;
- lru (analytic): f + (1-f)ln(1-f), LRU's expected hit ratio under
  independent per-epoch shuffles (CoorDL, VLDB 2021).

Then the prefetching replays, where a block may enter before it is read,
with unbounded bandwidth (what the mount reaches when the store keeps up):

- epoch-aware+prefetch: the mount's prefetcher (``SimPrefetcher``: the
  workload model's predictions, planned on the count of opens as the mount
  plans them) filling the cache after every read, no hint;
- order-blind bound: the best any cache can do that knows which blocks
  each job is still to read this epoch but not their order (what the mount
  knows without a hint); for one reader, f(1 - ln f): every read hits once
  the rest of the epoch fits, and f / (rest) of them before
  (``analytic_order_blind``);
- +prefetch+hint: the mount's prefetcher with each job hinting its pass
  order as it starts it; every read can hit.

The first epoch is all compulsory misses; "steady" is the mean of the later
epochs. On this workload the optimum is exactly f: a block is admitted only
when read and read once per epoch, so every hit of epoch e is a block that
was resident when epoch e began, and at most f * N blocks were. A policy
that reaches f is therefore optimal here, and what separates MinIO from the
epoch-aware policy (following a changing working set, short-range reuse of
a block being read) is outside this trace. Prints a table and writes ``benchmarks/results/policy_sim.json``.

``--readers 2`` is two jobs reading the same dataset side by side (a sweep),
each its own shuffled passes, interleaved at random; an "epoch" is then one
pass of each. Each read tells the policy, as the mount does, whether the
other job is still to read the block this epoch (``ReadMarks``).

    .venv/bin/python benchmarks/policy_sim.py [--files 1000] [--epochs 5] [--seed 0] [--readers 1]
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cachefsd.cache.policy import (
    EPOCH_AWARE,
    POLICY_NAMES,
    EpochAwarePolicy,
    PlannedUse,
    ReadMarks,
    make_policy,
)
from cachefsd.cache.replay import ReplayCache, replay
from cachefsd.workload.model import WorkloadModel

RESULTS = Path(__file__).parent / "results"
# Large enough that a per-epoch hit ratio has a standard error of about 1 %,
# small enough that the whole run takes a couple of seconds.
DEFAULT_FILES = 1000
DEFAULT_EPOCHS = 5
DEFAULT_SEED = 0
# The three regimes: a small, a half and a large cache.
DEFAULT_FRACTIONS = (0.25, 0.5, 0.75)
# Each file is one block, read whole 1 ms after the one before (time only
# orders the model's events here).
READ_SECONDS = 0.001
PLANNED = "epoch-aware+plan"
BELADY = "belady"
PREFETCHED = "epoch-aware+prefetch"
HINTED = "+prefetch+hint"
BOUND = "order-blind bound"
# Replays without prefetching, where Belady is the optimum; then with it.
SIMULATED = (*POLICY_NAMES, PLANNED, BELADY)
PREFETCHING = (PREFETCHED, BOUND, HINTED)


def shuffled_trace(files: int, epochs: int, seed: int, readers: int = 1) -> tuple[list[str], list[str]]:
    """Every file once per epoch, a fresh shuffle each epoch; files are named
    by index. With several ``readers`` (jobs sharing a dataset, each at its
    own pace), each reads its own passes, interleaved at random. The reads,
    and the job (``jobs.py`` name) of each."""
    rng = random.Random(seed)
    names = [f"{index:08x}" for index in range(files)]
    passes: list[list[str]] = []
    for _ in range(readers):
        trace: list[str] = []
        for _ in range(epochs):
            order = names[:]
            rng.shuffle(order)
            trace.extend(order)
        passes.append(trace)
    if readers == 1:
        return passes[0], [_job(0)] * len(passes[0])
    interleaved: list[str] = []
    jobs: list[str] = []
    positions = [0] * readers
    while len(interleaved) < readers * files * epochs:
        reader = rng.randrange(readers)
        if positions[reader] < len(passes[reader]):
            interleaved.append(passes[reader][positions[reader]])
            jobs.append(_job(reader))
            positions[reader] += 1
    return interleaved, jobs


def _job(reader: int) -> str:
    return f"reader[{reader + 1}]"


def next_uses(trace: Sequence[str]) -> list[float]:
    """For each position, the position of the same block's next read (inf if none)."""
    upcoming: list[float] = [math.inf] * len(trace)
    seen: dict[str, int] = {}
    for position in range(len(trace) - 1, -1, -1):
        block = trace[position]
        if block in seen:
            upcoming[position] = seen[block]
        seen[block] = position
    return upcoming


class TraceOracle:
    """A ``NextUse`` that knows the whole trace: the exact plan a sampler hint would give."""

    def __init__(self, trace: Sequence[str]) -> None:
        self._upcoming = next_uses(trace)
        self._trace = trace
        self._next: dict[str, float] = {}
        for position in range(len(trace) - 1, -1, -1):
            self._next[trace[position]] = position

    def before(self, position: int, now: float) -> None:
        """The read at ``position`` is happening: its block's next use moves on."""
        self._next[self._trace[position]] = self._upcoming[position]

    def after(self, opens: int) -> None:
        """Nothing changes after a read."""

    def next_use(self, block: str) -> float | None:
        when = self._next.get(block, math.inf)
        return None if when == math.inf else when


class SimPrefetcher:
    """The mount's prefetcher (``cachefsd.prefetch.prefetcher``) with unbounded
    bandwidth and reach: after every read it fetches the workload model's
    predictions, jobs round-robin and nearest first, planning each at its
    predicted position on the count of opens, until the cache refuses one.
    With ``hints`` (the reader's pass order by the trace position that
    starts the pass), each job hints its pass as it begins it, and the
    cached blocks the hint places are planned, as ``_plan_residents`` does;
    a block read by one job that another's plan places is planned again
    for it, as ``read_by_one_of_many`` does."""

    def __init__(
        self,
        cache: ReplayCache,
        clock: WorkloadModel,
        trace: Sequence[str],
        jobs: Sequence[str],
        hints: dict[int, tuple[str, list[str]]] | None = None,
    ) -> None:
        assert cache.planned is not None
        self._cache = cache
        self._planned = cache.planned
        self._clock = clock
        self._trace = trace
        self._jobs = jobs
        self._hints = hints or {}

    def before(self, position: int, now: float) -> None:
        """The read at ``position`` is next: a job starting a pass hints it."""
        hint = self._hints.get(position)
        if hint is None:
            return
        job, order = hint
        self._clock.hint(order, now, job)
        for path, distance in self._clock.planned():
            if path in self._cache.resident:
                self._planned.plan(path, position + distance)
                self._cache.policy.next_use_changed(path)

    def after(self, opens: int) -> None:
        """Fill the cache ahead of the reads, ``opens`` reads in."""
        read, job = self._trace[opens - 1], self._jobs[opens - 1]
        distance = self._clock.planned_elsewhere(read, job)
        if distance is not None and read in self._cache.resident:
            self._planned.plan(read, opens + distance)
            self._cache.policy.next_use_changed(read)
        for prediction in self._clock.predict(self._cache.capacity):
            if prediction.path in self._cache.resident:
                self._clock.satisfied(prediction.path, prediction.workload)
                continue
            self._planned.plan(prediction.path, opens + prediction.distance)
            if not self._cache.admit(prediction.path, ahead=True):
                self._planned.consumed(prediction.path)
                return


def simulate_policy(
    name: str, trace: Sequence[str], jobs: Sequence[str], capacity: int, seed: int, files: int
) -> list[bool]:
    """One of ``SIMULATED`` over ``trace``: hit per read."""
    if name == BELADY:
        return simulate_belady(trace, capacity)
    if name == BOUND:
        return simulate_order_blind_bound(trace, jobs, capacity, files)
    clock = WorkloadModel()
    marks = ReadMarks()
    if name == PLANNED:
        oracle = TraceOracle(trace)
        cache = ReplayCache(EpochAwarePolicy(clock, oracle, marks), capacity)
        return replay(cache, trace, clock, jobs, hooks=[oracle], read_seconds=READ_SECONDS, read_marks=marks)
    if name in (PREFETCHED, HINTED):
        planned = PlannedUse()
        cache = ReplayCache(EpochAwarePolicy(clock, planned, marks), capacity, planned=planned)
        hints = pass_orders(trace, jobs, files) if name == HINTED else None
        prefetcher = SimPrefetcher(cache, clock, trace, jobs, hints)
        return replay(
            cache, trace, clock, jobs, hooks=[prefetcher], read_seconds=READ_SECONDS, read_marks=marks
        )
    cache = ReplayCache(make_policy(name, clock, random.Random(seed), elsewhere=marks), capacity)
    return replay(cache, trace, clock, jobs, read_seconds=READ_SECONDS, read_marks=marks)


def pass_orders(trace: Sequence[str], jobs: Sequence[str], files: int) -> dict[int, tuple[str, list[str]]]:
    """Each reader's passes: the trace position that starts one, its job and its order."""
    reads: dict[str, list[int]] = {}
    for position, job in enumerate(jobs):
        reads.setdefault(job, []).append(position)
    passes: dict[int, tuple[str, list[str]]] = {}
    for job, positions in reads.items():
        for start in range(0, len(positions), files):
            chunk = positions[start : start + files]
            passes[chunk[0]] = (job, [trace[position] for position in chunk])
    return passes


def simulate_order_blind_bound(
    trace: Sequence[str], jobs: Sequence[str], capacity: int, files: int
) -> list[bool]:
    """The best any cache can do that knows what each job is still to read
    this pass but not in which order, with a free, instant prefetcher:
    before every read it holds the blocks most likely to be read next. A
    block still to be read by the jobs S is read next with a chance in
    proportion to the sum over S of 1 / (blocks that job is still to read),
    so that sum ranks it; since fetching costs nothing, the best contents at
    each read are the best for that read alone. Blocks are kept in buckets
    by S (at most 2^jobs of them)."""
    names = sorted(set(trace))
    readers = list(dict.fromkeys(jobs))
    unread = {job: 0 for job in readers}
    reads = dict.fromkeys(readers, 0)
    needed_by: dict[str, frozenset[str]] = dict.fromkeys(names, frozenset())
    inside: dict[frozenset[str], set[str]] = {}
    outside: dict[frozenset[str], set[str]] = {frozenset(): set(names)}
    resident: set[str] = set()

    def move(block: str, needers: frozenset[str]) -> None:
        buckets = inside if block in resident else outside
        buckets[needed_by[block]].discard(block)
        buckets.setdefault(needers, set()).add(block)
        needed_by[block] = needers

    def worth(needers: frozenset[str]) -> float:
        return sum(1.0 / unread[job] for job in needers if unread[job])

    hits: list[bool] = []
    for block, job in zip(trace, jobs, strict=True):
        if reads[job] % files == 0:  # a new pass: every block is to be read again
            unread[job] = files
            for name in names:
                move(name, needed_by[name] | {job})
        # Fill before the read: the best outside blocks replace the worst inside.
        while True:
            best = max((s for s, group in outside.items() if group), key=worth, default=None)
            if best is None or not best:
                break
            if len(resident) < capacity:
                incoming = outside[best].pop()
            else:
                worst = min((s for s, group in inside.items() if group), key=worth, default=None)
                if worst is None or worth(worst) >= worth(best):
                    break
                leaving = inside[worst].pop()
                resident.discard(leaving)
                outside.setdefault(worst, set()).add(leaving)
                incoming = outside[best].pop()
            resident.add(incoming)
            inside.setdefault(best, set()).add(incoming)
        hits.append(block in resident)
        reads[job] += 1
        unread[job] -= 1
        move(block, needed_by[block] - {job})
    return hits


def simulate_belady(trace: Sequence[str], capacity: int) -> list[bool]:
    """Belady's optimum with bypass: evict the farthest next use, never admit a farther one."""
    upcoming = next_uses(trace)
    resident: dict[str, float] = {}
    farthest: list[tuple[float, str]] = []  # (-next use, block), stale entries skipped
    hits: list[bool] = []
    for position, block in enumerate(trace):
        when = upcoming[position]
        hit = block in resident
        hits.append(hit)
        if not hit:
            if when == math.inf or capacity == 0:
                continue
            if len(resident) >= capacity:
                while resident.get(farthest[0][1]) != -farthest[0][0]:
                    heapq.heappop(farthest)
                victim_when, victim = -farthest[0][0], farthest[0][1]
                if victim_when <= when:
                    continue
                heapq.heappop(farthest)
                del resident[victim]
        resident[block] = when
        heapq.heappush(farthest, (-when, block))
    return hits


def epoch_hit_ratios(hits: Sequence[bool], files: int) -> list[float]:
    """Hit ratio of each epoch of ``files`` reads."""
    return [sum(hits[start : start + files]) / files for start in range(0, len(hits), files)]


def steady(ratios: Sequence[float]) -> float:
    """Mean hit ratio after the first epoch, which is compulsory misses only."""
    return statistics.fmean(ratios[1:])


def analytic_lru(fraction: float) -> float:
    """LRU's expected hit ratio under independent per-epoch shuffles, f + (1-f)ln(1-f)."""
    if fraction >= 1.0:
        return 1.0
    return fraction + (1.0 - fraction) * math.log(1.0 - fraction)


def analytic_order_blind(fraction: float) -> float:
    """One reader's order-blind bound with free prefetch, f(1 - ln f): with a
    share p of the epoch read, a read hits with chance min(1, f / (1 - p))."""
    if fraction <= 0.0:
        return 0.0
    return min(1.0, fraction * (1.0 - math.log(fraction)))


def run(files: int, epochs: int, fractions: Sequence[float], seed: int, readers: int = 1) -> dict[str, Any]:
    """Every policy at every cache fraction over one seeded trace; a JSON-ready result."""
    trace, jobs = shuffled_trace(files, epochs, seed, readers)
    rows: list[dict[str, Any]] = []
    for fraction in fractions:
        capacity = round(fraction * files)
        for name in (*SIMULATED, *PREFETCHING):
            hits = simulate_policy(name, trace, jobs, capacity, seed, files)
            ratios = epoch_hit_ratios(hits, files * readers)
            rows.append({"fraction": fraction, "policy": name, "epochs": ratios, "steady": steady(ratios)})
        if readers == 1:  # the formulas are for one reader's passes
            rows.append({"fraction": fraction, "policy": "lru (analytic)", "steady": analytic_lru(fraction)})
            rows.append(
                {"fraction": fraction, "policy": "bound (analytic)", "steady": analytic_order_blind(fraction)}
            )
    return {
        "files": files,
        "epochs": epochs,
        "readers": readers,
        "seed": seed,
        "block_per_file": 1,
        "default_policy": EPOCH_AWARE,
        "rows": rows,
    }


def render(result: dict[str, Any]) -> str:
    """The result as a plain-text table: one row per (cache fraction, policy)."""
    epochs = result["epochs"]
    header = f"{'cache':>5}  {'policy':<20}" + "".join(f"{'ep' + str(e + 1):>7}" for e in range(epochs))
    lines = [header + f"{'steady':>8}", "-" * (len(header) + 8)]
    previous = None
    for row in result["rows"]:
        fraction = f"{row['fraction']:.0%}" if row["fraction"] != previous else ""
        if previous is not None and row["fraction"] != previous:
            lines.append("")
        previous = row["fraction"]
        cells = "".join(f"{ratio:>7.3f}" for ratio in row["epochs"]) if "epochs" in row else " " * 7 * epochs
        lines.append(f"{fraction:>5}  {row['policy']:<20}{cells}{row['steady']:>8.3f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=DEFAULT_FILES)
    parser.add_argument("--epochs", type=int, default=DEFAULT_EPOCHS)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--readers", type=int, default=1, help="jobs reading the dataset side by side")
    args = parser.parse_args()
    result = run(args.files, args.epochs, DEFAULT_FRACTIONS, args.seed, args.readers)
    print(
        f"hit ratio per epoch: {args.files} files, one block each, fresh shuffle per epoch, "
        f"{args.readers} reader(s), seed {args.seed}"
    )
    print(render(result))
    RESULTS.mkdir(exist_ok=True)
    name = "policy_sim.json" if args.readers == 1 else f"policy_sim_{args.readers}_readers.json"
    (RESULTS / name).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
