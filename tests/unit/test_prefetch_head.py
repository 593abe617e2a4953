"""A large file's first run: the verdict a later read gives it, the wait of
its GET for that verdict, and the registry that lets one read begin it."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from cachefsd.cache.index import BlockRef
from cachefsd.prefetch.head import HeadRun, HeadRuns, free_blocks, verdict
from cachefsd.workload.streams import STREAM_FORWARD_SLACK

BLOCK = 64 << 10
FILE = BlockRef("mem://bucket", "shard.tar", "e1", 0)
# Long enough never to expire in a test that gives the verdict: the wait ends with it.
NEVER_SECONDS = 60.0


def test_a_first_run_reads_its_free_bytes_or_at_least_one_block() -> None:
    assert free_blocks(16 << 20, BLOCK) == 256
    assert free_blocks(BLOCK // 2, BLOCK) == 1


def test_a_read_in_the_first_block_says_nothing() -> None:
    """The header read again, or the kernel's read-ahead of the first read."""
    assert verdict(0, BLOCK, free=4) is None
    assert verdict(BLOCK - 1, BLOCK, free=4) is None


def test_a_read_inside_the_free_blocks_or_just_past_them_is_a_stream() -> None:
    assert verdict(BLOCK, BLOCK, free=4) is True
    assert verdict(4 * BLOCK + STREAM_FORWARD_SLACK - 1, BLOCK, free=4) is True


def test_a_read_further_on_is_a_jump() -> None:
    assert verdict(4 * BLOCK + STREAM_FORWARD_SLACK, BLOCK, free=4) is False
    assert verdict(60 * BLOCK, BLOCK, free=4) is False


def test_a_runs_get_reads_its_free_blocks_without_waiting() -> None:
    run = HeadRun(free_blocks=4, verdict_seconds=NEVER_SECONDS)
    assert all(run.goes_on(index) for index in range(4))  # returns at once: no verdict asked


def test_without_a_verdict_the_run_stops_after_its_free_blocks() -> None:
    run = HeadRun(free_blocks=4, verdict_seconds=0.0)
    assert not run.goes_on(4)


def test_the_get_waits_for_the_verdict_and_follows_it() -> None:
    for streaming in (True, False):
        run = HeadRun(free_blocks=4, verdict_seconds=NEVER_SECONDS)
        with ThreadPoolExecutor(1) as pool:
            goes_on = pool.submit(run.goes_on, 4)  # waits, whenever it starts, until the verdict
            run.decide(streaming)
            assert goes_on.result() is streaming


def test_one_read_begins_a_files_first_run_and_others_find_it() -> None:
    runs = HeadRuns(free_blocks=4, verdict_seconds=NEVER_SECONDS)
    takes: list[str] = []

    def take() -> str:
        takes.append("taken")
        return "blocks 0-3"

    begun = runs.begin(FILE, take)
    assert begun is not None
    run, taken = begun
    assert taken == "blocks 0-3"
    assert runs.begin(FILE, take) == (run, None)  # another read: the run it began
    assert takes == ["taken"]
    assert runs.awaiting()
    runs.over(FILE, run)
    assert not runs.awaiting()


def test_a_run_the_budget_does_not_allow_is_not_begun() -> None:
    runs = HeadRuns(free_blocks=4, verdict_seconds=NEVER_SECONDS)
    assert runs.begin(FILE, lambda: None) is None
    assert runs.begin(FILE, list) is None  # no blocks taken
    assert not runs.awaiting()


def test_the_end_of_an_older_run_leaves_a_newer_one() -> None:
    runs = HeadRuns(free_blocks=4, verdict_seconds=NEVER_SECONDS)
    old = runs.begin(FILE, lambda: 1)
    assert old is not None
    runs.over(FILE, old[0])
    new = runs.begin(FILE, lambda: 2)
    assert new is not None
    runs.over(FILE, old[0])
    assert runs.begin(FILE, lambda: 3) == (new[0], None)


def test_the_next_read_past_the_first_block_gives_the_verdict_and_it_stands() -> None:
    runs = HeadRuns(free_blocks=4, verdict_seconds=NEVER_SECONDS)
    begun = runs.begin(FILE, lambda: 1)
    assert begun is not None
    run = begun[0]
    runs.judge(FILE, 512, BLOCK)
    assert not run.verdict.is_set()
    runs.judge(FILE, 60 * BLOCK, BLOCK)
    assert run.verdict.is_set()
    assert not run.streaming
    runs.judge(FILE, BLOCK, BLOCK)  # a later read changes nothing
    assert not run.streaming


def test_a_read_of_a_file_with_no_run_judges_nothing() -> None:
    runs = HeadRuns(free_blocks=4, verdict_seconds=NEVER_SECONDS)
    runs.judge(FILE, BLOCK, BLOCK)
    assert not runs.awaiting()


def test_stopping_stops_every_run_at_its_free_blocks() -> None:
    runs = HeadRuns(free_blocks=4, verdict_seconds=NEVER_SECONDS)
    begun = runs.begin(FILE, lambda: 1)
    assert begun is not None
    runs.stop()
    assert not begun[0].goes_on(4)  # at once: stopping gave the verdict
