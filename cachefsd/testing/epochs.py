"""A training job's reads, for tests and benchmarks, in a process of its own:
every file once an epoch in a seeded shuffle, each file's pages dropped once
read (a dataset larger than RAM: the next epoch's reads reach the daemon).

    python -m cachefsd.testing.epochs SEED EPOCHS [--metrics URL] [--compute-ms MS] [--hint] PATH...

With ``--metrics`` (a mount's metrics endpoint), it prints a JSON line an
epoch: the bytes of this job's reads (``reader_job`` of its process group)
that came from the cache and from the store in that epoch. ``--compute-ms``
sleeps that long after each file, as a GPU step would (no CPU used);
``--hint`` sends each epoch's order to the mount's daemon before the epoch,
as ``cachefsd.hints.HintingSampler`` does.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from cachefsd.control.client import client_for
from cachefsd.control.mounts import find_mount


def read_epoch(paths: list[str], compute_seconds: float = 0.0) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            while os.read(fd, 1 << 20):
                pass
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        if compute_seconds:
            time.sleep(compute_seconds)


def hint(paths: list[str]) -> None:
    """Send ``paths``, in the order they are about to be read, to their mount's daemon."""
    mount = find_mount(paths[0])
    if mount is None:
        raise SystemExit(f"{paths[0]} is not under a cachefsd mount")
    client_for(mount).hint(["/" + os.path.relpath(path, mount.mountpoint) for path in paths])


def my_read_bytes(metrics_url: str) -> dict[str, float]:
    """Bytes read by this process's job so far, by source (cache, cold)."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    mine = f"[{os.getpgid(0)}]"
    read = {"cache": 0.0, "cold": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "cachefsd_job_read_bytes_total" and sample.labels["reader_job"].endswith(mine):
                read[sample.labels["source"]] += sample.value
    return read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("seed", type=int)
    parser.add_argument("epochs", type=int)
    parser.add_argument("paths", nargs="+")
    parser.add_argument("--metrics", help="print each epoch's bytes by source from this endpoint")
    parser.add_argument("--compute-ms", type=float, default=0.0, help="a training step after each file")
    parser.add_argument("--hint", action="store_true", help="hint each epoch's order to the daemon")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    before = my_read_bytes(args.metrics) if args.metrics else {}
    for epoch in range(args.epochs):
        rng.shuffle(args.paths)
        if args.hint:
            hint(args.paths)
        read_epoch(args.paths, args.compute_ms / 1000)
        if args.metrics:
            after = my_read_bytes(args.metrics)
            print(
                json.dumps({"epoch": epoch, **{key: after[key] - before[key] for key in after}}), flush=True
            )
            before = after


if __name__ == "__main__":
    main()
