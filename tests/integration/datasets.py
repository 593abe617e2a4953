"""Seeding and inspecting buckets on the test S3 server, and small readers
that worker processes import (so they survive ``spawn``).

Buckets are named per test (``new_bucket``) so tests never see each other's
objects on the shared session server.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import random
import uuid
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

# Parallel PUTs when seeding through HTTP: moto's werkzeug server answers one
# request a thread, and a handful of them keep both cores busy.
SEED_THREADS = 8

KiB = 1 << 10
MiB = 1 << 20


def new_bucket(s3_client: Any, stem: str = "t") -> str:
    """A fresh, empty bucket with a unique name."""
    name = f"{stem}-{uuid.uuid4().hex[:16]}"
    s3_client.create_bucket(Bucket=name)
    return name


def put_objects(s3_client: Any, bucket: str, objects: Mapping[str, bytes]) -> None:
    """Upload ``objects`` (key -> bytes) over HTTP, a few at a time."""

    def put(item: tuple[str, bytes]) -> None:
        s3_client.put_object(Bucket=bucket, Key=item[0], Body=item[1])

    with ThreadPoolExecutor(SEED_THREADS) as pool:
        list(pool.map(put, objects.items()))


def put_objects_in_process(bucket: str, keys: Iterable[str], body: bytes = b"") -> None:
    """Create many objects straight in moto's in-process backend: the test
    server runs in this process, and 10,000 HTTP PUTs would take a minute."""
    # Imported here: worker processes import this module, and moto is slow to import.
    from moto.core import DEFAULT_ACCOUNT_ID  # noqa: PLC0415
    from moto.s3.models import s3_backends  # noqa: PLC0415

    backend = s3_backends[DEFAULT_ACCOUNT_ID]["global"]
    for key in keys:
        backend.put_object(bucket, key, body)


def bucket_state(s3_client: Any, bucket: str) -> dict[str, tuple[str, int]]:
    """Every key of ``bucket`` with its etag and size."""
    state: dict[str, tuple[str, int]] = {}
    for page in s3_client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for item in page.get("Contents", ()):
            state[item["Key"]] = (item["ETag"], int(item["Size"]))
    return state


def random_bytes(rng: random.Random, size: int) -> bytes:
    return rng.randbytes(size)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: str | os.PathLike[str]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(256 * KiB):
            digest.update(chunk)
    return digest.hexdigest()


def hash_files(paths: list[str]) -> dict[str, str]:
    """path -> sha256 of every file in ``paths``; run in worker processes."""
    return {path: file_sha256(path) for path in paths}


def mmap_slices(path: str, slices: list[tuple[int, int]]) -> tuple[int, list[bytes]]:
    """The mapped length of ``path`` and ``mapped[start:end]`` for each slice, in order.

    Run it in a worker process: a page fault holds the GIL while the kernel
    waits on the daemon, and the test S3 server runs on threads of the test
    process, so faulting from the test process itself would starve it."""
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        return len(mapped), [mapped[start:end] for start, end in slices]


def walk_files(root: Path) -> set[str]:
    """Every regular file under ``root``, as a ``/``-separated relative path."""
    found = set()
    for directory, _, files in os.walk(root):
        for name in files:
            found.add(str((Path(directory) / name).relative_to(root)))
    return found


class RawFileDataset:
    """A map-style dataset of the raw bytes of files (an ImageFolder without
    decoding): item ``i`` is ``(i, class index, bytes)``. Picklable, so
    DataLoader workers can receive it under any start method."""

    def __init__(self, root: Path) -> None:
        self.classes = sorted(entry.name for entry in root.iterdir() if entry.is_dir())
        self.samples: list[tuple[str, int]] = [
            (str(root / name / file), label)
            for label, name in enumerate(self.classes)
            for file in sorted(os.listdir(root / name))
        ]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[int, int, bytes]:
        path, label = self.samples[index]
        with open(path, "rb") as handle:
            return index, label, handle.read()


def collate_list(batch: list[Any]) -> list[Any]:
    """Keep a batch as a list: the samples are raw bytes, not tensors."""
    return batch
