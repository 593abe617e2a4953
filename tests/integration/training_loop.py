"""A tiny CPU training loop over a directory of files, for ``cachefsd doctor``'s
tests: a PyTorch DataLoader (2 workers, shuffled) whose ``__getitem__``
reads a file and spends ``--transform-ms`` on it, and a step of
``--step-ms`` per batch, with the loader wrapped in
``cachefsd.diagnose.watch``. The loop times its own ``next()`` calls too
(the first batch left out, as the meter does) and prints
``{"data_wait_fraction", "batches"}`` as JSON.

    python training_loop.py DIR MOUNTPOINT --transform-ms 0 --step-ms 0 [--epochs 1]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

import cachefsd.diagnose

BATCH_SIZE = 8
WORKERS = 2


class Files(Dataset[torch.Tensor]):
    def __init__(self, root: Path, transform_seconds: float) -> None:
        self.paths = sorted(root / name for name in os.listdir(root))
        self.transform_seconds = transform_seconds

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> torch.Tensor:
        data = self.paths[index].read_bytes()
        time.sleep(self.transform_seconds)  # decoding and augmentation
        return torch.tensor(len(data))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=Path)
    parser.add_argument("mountpoint")
    parser.add_argument("--transform-ms", type=float, default=0.0)
    parser.add_argument("--step-ms", type=float, default=0.0)
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()
    loader = DataLoader(
        Files(args.root, args.transform_ms / 1000), batch_size=BATCH_SIZE, shuffle=True, num_workers=WORKERS
    )
    waited = stepped = 0.0
    batches = 0
    for _ in range(args.epochs):
        batches_of_epoch = iter(cachefsd.diagnose.watch(loader, args.mountpoint))
        previous = None
        while True:
            asked = time.perf_counter()
            try:
                next(batches_of_epoch)
            except StopIteration:
                break
            arrived = time.perf_counter()
            if previous is not None:
                waited += arrived - asked
                stepped += arrived - previous
                batches += 1
            previous = arrived
            time.sleep(args.step_ms / 1000)  # the model's forward and backward pass
    print(json.dumps({"data_wait_fraction": waited / stepped, "batches": batches}))


if __name__ == "__main__":
    main()
