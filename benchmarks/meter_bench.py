"""The loader meter's cost per batch: ``cachefsd.diagnose.watch`` over a loader
of empty batches against the bare loop, repeated, medians. The reports go
to a sink that keeps nothing (their sending runs on the meter's own thread,
every 2 seconds, and is not the loop's cost).

    .venv/bin/python benchmarks/meter_bench.py [--batches 1000000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

from cachefsd.control.client import MeterTotals
from cachefsd.diagnose.meter import watch


class Discard:
    def send(self, meter_id: str, totals: MeterTotals, readers: int) -> None:
        """Nothing: the loop's side of the meter is what is measured."""


def seconds_per_batch(batches: int, metered: bool) -> float:
    loader = range(batches)
    started = time.perf_counter()
    for _ in watch(loader, "/nowhere", sink=Discard()) if metered else loader:
        pass
    return (time.perf_counter() - started) / batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    bare = statistics.median(seconds_per_batch(args.batches, False) for _ in range(args.repeats))
    metered = statistics.median(seconds_per_batch(args.batches, True) for _ in range(args.repeats))
    overhead = metered - bare
    print(f"bare loop {bare * 1e9:.0f} ns/batch, metered {metered * 1e9:.0f} ns/batch")
    print(f"meter: {overhead * 1e9:.0f} ns a batch, {overhead / 1e-3:.3%} of a 1 ms step")


if __name__ == "__main__":
    main()
