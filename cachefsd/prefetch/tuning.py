"""The prefetcher's tuning: the numbers its mechanisms run on, each with the
reason for its default. They are not settings (no deployment has needed to
change them); tests pass their own, a smaller head or warming budget, rather
than patching module constants."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefetchTuning:
    # Predictions asked for per round, at most. Most of the head of an
    # epoch's unread list may already be cached (a cache that holds half the
    # dataset holds about half of any list), so ask for far more than one
    # round can fetch.
    predictions_per_round: int = 4096
    # Predictions asked for per free prefetch slot: enough to find uncached
    # blocks among the cached ones of a cache that holds most of the dataset.
    predictions_per_slot: int = 64
    # The prefetch thread also wakes this often without events, to retire
    # waste and to spend bandwidth tokens that have accumulated.
    idle_wake_seconds: float = 0.5
    # At most one round per this many seconds: a round asks the model for
    # predictions (milliseconds under its lock), and readers that open
    # hundreds of files a second do not need a new plan for each.
    min_round_seconds: float = 0.02
    # How far ahead the prefetcher may reach to begin with, and at least: the
    # reach then adapts (AIMD, ``reach.Reach``) between this and the
    # configured lookahead, shrinking when fetched blocks are thrown away
    # unread (a cache too small for the lookahead) and growing as they are read.
    initial_reach_bytes: int = 64 << 20
    min_reach_bytes: int = 8 << 20
    # A block whose prefetch failed is not tried again for this long: a
    # deleted object or a failing bucket must not turn the prefetcher into a
    # busy loop. A demand read of the block is not affected.
    failed_retry_seconds: float = 30.0
    # Bytes of planned cached files warmed into the page cache and not
    # opened yet: enough for the readers not to catch up between two rounds
    # (a round's pause at 2,500 small files a second is 50 files, 7 MiB),
    # little enough to leave the page cache to others.
    warm_ahead_bytes: int = 32 << 20
    # A first read at a large file's start begins the file's first run at
    # once, with its own block first (``head.py``): most readers that start
    # there read on (a tar shard, a video, cp), and starting the run with the
    # read's block saves a request's round trip over a demand GET followed
    # by a run once a second read has shown the stream. Until a read past the first block comes, the run
    # reads no further than this (or one block, if larger): a reader that
    # only peeked at a header costs that much.
    head_free_bytes: int = 16 << 20
    # How long the run then waits for a read past the first block before it
    # stops; 0 stops it at once unless the verdict has already come.
    head_verdict_seconds: float = 2.0
    # How long a read waits for another read of the same file to claim its
    # first run's blocks (a few dictionary updates: this only bounds a surprise).
    head_claim_seconds: float = 1.0


# The production values.
DEFAULT_TUNING = PrefetchTuning()
