"""The policy simulator: its results match theory, and Belady bounds every policy."""

from __future__ import annotations

import pytest

from benchmarks.policy_sim import (
    BELADY,
    BOUND,
    DEFAULT_FRACTIONS,
    HINTED,
    PLANNED,
    PREFETCHED,
    SIMULATED,
    analytic_lru,
    analytic_order_blind,
    next_uses,
    run,
    shuffled_trace,
    simulate_belady,
)

INF = float("inf")


@pytest.fixture(name="steady", scope="module")
def fixture_steady() -> dict[tuple[float, str], float]:
    """Steady hit ratio per (fraction, policy) on the benchmark's default workload."""
    result = run(files=1000, epochs=5, fractions=DEFAULT_FRACTIONS, seed=0)
    return {(row["fraction"], row["policy"]): row["steady"] for row in result["rows"]}


def test_trace_reads_every_file_once_per_epoch() -> None:
    trace, _ = shuffled_trace(files=50, epochs=3, seed=1)
    epochs = [trace[start : start + 50] for start in range(0, 150, 50)]
    assert all(sorted(epoch) == sorted(epochs[0]) and len(set(epoch)) == 50 for epoch in epochs)
    assert epochs[0] != epochs[1]  # a fresh shuffle


def test_next_uses() -> None:
    assert next_uses(["a", "b", "a", "c", "b"]) == [2, 4, INF, INF, INF]


def test_belady_on_a_loop_larger_than_the_cache() -> None:
    # a b c a b c with room for two: c is never admitted, a and b hit.
    assert simulate_belady(["a", "b", "c", "a", "b", "c"], capacity=2) == [False] * 3 + [True, True, False]


@pytest.mark.parametrize("fraction", DEFAULT_FRACTIONS)
def test_minio_hits_the_cached_fraction(steady: dict[tuple[float, str], float], fraction: float) -> None:
    assert steady[fraction, "minio"] == pytest.approx(fraction, abs=0.03)


@pytest.mark.parametrize("fraction", DEFAULT_FRACTIONS)
def test_lru_matches_the_analytic_value(steady: dict[tuple[float, str], float], fraction: float) -> None:
    assert steady[fraction, "lru"] == pytest.approx(analytic_lru(fraction), abs=0.05)


@pytest.mark.parametrize("fraction", DEFAULT_FRACTIONS)
def test_belady_bounds_every_policy(steady: dict[tuple[float, str], float], fraction: float) -> None:
    for name in SIMULATED:
        assert steady[fraction, name] <= steady[fraction, BELADY] + 1e-9, name


@pytest.mark.parametrize("fraction", DEFAULT_FRACTIONS)
def test_epoch_aware_is_at_least_minio(steady: dict[tuple[float, str], float], fraction: float) -> None:
    assert steady[fraction, "epoch-aware"] >= steady[fraction, "minio"] - 0.02


@pytest.mark.parametrize("fraction", DEFAULT_FRACTIONS)
def test_epoch_aware_with_a_plan_reaches_belady(
    steady: dict[tuple[float, str], float], fraction: float
) -> None:
    assert steady[fraction, PLANNED] == pytest.approx(steady[fraction, BELADY], abs=0.01)


@pytest.mark.parametrize("fraction", DEFAULT_FRACTIONS)
def test_the_order_blind_bound_matches_theory(
    steady: dict[tuple[float, str], float], fraction: float
) -> None:
    assert steady[fraction, BOUND] == pytest.approx(analytic_order_blind(fraction), abs=0.02)


@pytest.mark.parametrize("fraction", DEFAULT_FRACTIONS)
def test_the_mounts_prefetcher_reaches_the_order_blind_bound(
    steady: dict[tuple[float, str], float], fraction: float
) -> None:
    assert steady[fraction, PREFETCHED] == pytest.approx(steady[fraction, BOUND], abs=0.02)
    assert steady[fraction, PREFETCHED] > steady[fraction, BELADY] + 0.1  # prefetch beats any eviction


@pytest.mark.parametrize("fraction", DEFAULT_FRACTIONS)
def test_a_hinted_prefetcher_hits_every_read(steady: dict[tuple[float, str], float], fraction: float) -> None:
    assert steady[fraction, HINTED] >= 0.99


def test_analytic_order_blind_at_half() -> None:
    assert analytic_order_blind(0.5) == pytest.approx(0.8466, abs=1e-4)


def test_analytic_lru_at_half() -> None:
    assert analytic_lru(0.5) == pytest.approx(0.1534, abs=1e-4)


def test_two_readers_each_read_every_file_once_per_epoch() -> None:
    trace, jobs = shuffled_trace(files=50, epochs=3, seed=1, readers=2)
    assert len(trace) == len(jobs) == 300
    assert all(trace.count(name) == 6 for name in set(trace))
    assert trace[:50] != shuffled_trace(files=50, epochs=3, seed=1)[0][:50]  # interleaved
    for job in set(jobs):  # each reader's own reads are its passes
        reads = [block for block, reader in zip(trace, jobs, strict=True) if reader == job]
        assert all(sorted(reads[start : start + 50]) == sorted(set(trace)) for start in (0, 50, 100))


@pytest.fixture(name="two_readers", scope="module")
def fixture_two_readers() -> dict[str, float]:
    """Steady hit ratio per policy of two readers at a 50 % cache."""
    result = run(files=400, epochs=4, fractions=(0.5,), seed=0, readers=2)
    return {row["policy"]: row["steady"] for row in result["rows"]}


def test_belady_bounds_every_policy_with_two_readers(two_readers: dict[str, float]) -> None:
    for name in SIMULATED:
        assert two_readers[name] <= two_readers[BELADY] + 1e-9, name


def test_epoch_aware_beats_minio_with_two_readers(two_readers: dict[str, float]) -> None:
    assert two_readers["epoch-aware"] >= two_readers["minio"] + 0.05


def test_prefetch_with_two_readers_stays_under_the_order_blind_bound(two_readers: dict[str, float]) -> None:
    assert two_readers["epoch-aware"] < two_readers[PREFETCHED] <= two_readers[BOUND] + 0.01


def test_two_hinted_readers_hit_nearly_every_read(two_readers: dict[str, float]) -> None:
    assert two_readers[HINTED] >= 0.98


def test_two_hinted_readers_hit_nearly_every_read_of_a_small_cache() -> None:
    # A block one job read stays planned for the other (``read_by_one_of_many``):
    # else it ranks as due but unplanned, and fills a small cache for good.
    result = run(files=400, epochs=4, fractions=(0.25,), seed=0, readers=2)
    steady = {row["policy"]: row["steady"] for row in result["rows"]}
    assert steady[HINTED] >= 0.98
