"""Plans: an order of files a workload is expected to open this epoch, and
whether to believe it.

A plan comes from one of two places: a hint (the loader's sampler sent the
exact order of its epoch) or a replay (the previous epoch's order, for a
loader that does not shuffle). Either can be wrong: a stale hint, a hint
meant for another job, a loader that shuffles after all. So a plan is
judged by the opens it sees: it is trusted while at least ``min_match`` of
them came at about the position it placed them (within ``slack`` places).
An untrusted plan is ignored and the next source of predictions is used,
so a wrong plan costs the bandwidth of a few predictions, nothing else.

Before ``PLAN_PROBATION_OPENS`` opens, a plan keeps the verdict it started
with: a hint is trusted (the loader said so), a replay only if the
previous epoch already replayed the one before it.

Units: positions and distances count FILES opened this epoch, 0-based.

Concurrency: none here. A plan belongs to one workload's epochs
(``epochs.py``), whose owner (``model.WorkloadModel``) guards it with its lock.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Final

# A plan is judged only after this many opens; before that a hint is trusted
# (the loader said so) and a replay is trusted only if the previous epoch
# already replayed the one before it. Eight opens is a batch or two: little
# bandwidth is wasted on a wrong plan, and a random order will not match by chance.
PLAN_PROBATION_OPENS: Final = 8
# "Mostly matches": a replay needs 90 % of the opens at their predicted
# place: loaders that do not shuffle repeat their order exactly (up to the
# slack below), and anything lower is better treated as unknown order.
REPLAY_MIN_MATCH: Final = 0.9
# A hint is kept while half of the opens follow it: the loader knows its order,
# so a lower rate means the hint is stale or for another job.
HINT_MIN_MATCH: Final = 0.5
# An open matches a plan when it is within plan length // PLAN_SLACK_DIVISOR
# places (at least 1) of its predicted position. DataLoader workers open the
# files of several batches at once, so an exact hint is read up to workers x
# prefetch_factor x batch size places out of order (8 x 2 x 256 = 4,096, more
# with several ranks on the node); a random order falls within n/8 of its
# place with probability about 1/4, far below the thresholds. The slack
# grows with the plan, never capped: at batch 256 an exact hint of a
# 100k-file dataset is read thousands of places out of order.
PLAN_SLACK_DIVISOR: Final = 8


class Plan:
    """An order of files for one epoch (a hint, or the previous epoch's to
    replay) and how well the workload has followed it."""

    def __init__(self, order: list[str], index: dict[str, int], min_match: float, trusted: bool) -> None:
        self.order = order
        # path -> its (first) position in order.
        self.index = index
        self.min_match = min_match
        # The verdict before PLAN_PROBATION_OPENS opens were seen.
        self.trusted_at_start = trusted
        self.slack = max(1, len(order) // PLAN_SLACK_DIVISOR)
        self.low = 0  # entries before this were all opened this epoch
        self.observed = 0
        self.matched = 0

    @classmethod
    def of(cls, order: list[str], min_match: float, trusted: bool) -> Plan:
        index: dict[str, int] = {}
        for position, path in enumerate(order):
            index.setdefault(path, position)
        return cls(order, index, min_match, trusted)

    def observe(self, position: int, path: str) -> None:
        """``path`` was the workload's ``position``-th open (0-based) of the epoch."""
        self.observed += 1
        planned = self.index.get(path)
        if planned is not None and abs(planned - position) <= self.slack:
            self.matched += 1

    def trusted(self) -> bool:
        if self.observed < PLAN_PROBATION_OPENS:
            return self.trusted_at_start
        return self.matched >= self.min_match * self.observed

    def judged_good(self) -> bool:
        """Seen long enough and followed: the epoch replayed this order."""
        return self.observed >= PLAN_PROBATION_OPENS and self.trusted()

    def placements(self, seen: Mapping[str, int], opens: int, stop: int) -> Iterator[tuple[str, float]]:
        """The files placed between the low mark and position ``stop`` that
        are not in ``seen`` (opened this epoch, ``opens`` files so far), each
        once, with its distance: the number of files to be opened before it."""
        placed: set[str] = set()
        for position in range(self.low, stop):
            path = self.order[position]
            if path not in seen and path not in placed:
                placed.add(path)
                yield path, float(max(0, position - opens))

    def advance(self, seen: Mapping[str, int]) -> None:
        """Move the low mark past the entries already in ``seen``."""
        order = self.order
        while self.low < len(order) and order[self.low] in seen:
            self.low += 1
