"""A whole ``GET /stats`` answer as JSON, and the node facts and access
model stats behind one, for tests of the control API and of how the
commands draw it."""

from __future__ import annotations

from typing import Any

from cachefsd.control.answers import NodeFacts, NodeMount
from cachefsd.stats import OTHER_PREFIX

ACCESS: dict[str, Any] = {
    "epoch": 2,
    "workloads": 1,
    "working_set_files": 1000,
    "unread_files": 400,
    "read_this_epoch_files": 600,
    "active_streams": 1,
    "hint_coverage": 0.0,
    "per_workload": {
        "python[4242]:train": {
            "epoch": 2,
            "working_set_files": 1000,
            "unread_files": 400,
            "read_this_epoch_files": 600,
            "order": "replay",
            "hint_files": 0,
            "hint_matched": 0,
            "active_streams": 1,
        }
    },
}


def node_facts() -> NodeFacts:
    """A daemon with the one mount of ``STATS``."""
    return NodeFacts(
        pid=4242,
        cache_dir="/var/cache/cachefsd",
        metrics_addr="127.0.0.1:9100",
        mounts=[NodeMount(mountpoint="/mnt/imagenet", source="s3://datasets/imagenet")],
    )


def _fetched(count: int, nbytes: int, p50: float | None, p99: float | None) -> dict[str, Any]:
    return {
        "count": count,
        "bytes": nbytes,
        "retries": 0,
        "errors": 0,
        "p50_seconds": p50,
        "p99_seconds": p99,
    }


STATS: dict[str, Any] = {
    "pid": 4242,
    "mountpoint": "/mnt/imagenet",
    "source": "s3://datasets/imagenet",
    "block_size": 4 << 20,
    "tiers": [
        {"name": "hot", "dir": "/nvme", "capacity_bytes": 100 << 30, "used_bytes": 25 << 30, "blocks": 6400},
        {"name": "warm", "dir": "/disk", "capacity_bytes": 1 << 40, "used_bytes": 0, "blocks": 0},
    ],
    "hints": {"received": 0, "paths": 0, "accepted": 0, "unknown": 0},
    "mount": {
        "mountpoint": "/mnt/imagenet",
        "reads": {
            "count": {"cache": 900, "cold": 100},
            "bytes": {"cache": 9 << 30, "cold": 1 << 30, "total": 10 << 30},
        },
        "hit_ratio": 0.9,
        "stall_seconds": 12.5,
        "passthrough": "on",
    },
    "node": node_facts().model_dump(mode="json"),
    "uptime_seconds": 3725.0,
    "reads": {
        "count": {"cache": 900, "cold": 100},
        "bytes": {"cache": 9 << 30, "cold": 1 << 30, "total": 10 << 30},
        "served_bytes": {"cold": 1 << 30, "hot": 9 << 30, "memory": 0},
    },
    "hit_ratio": {"since_mount": 0.9, "last_minute": 0.995, "last_minute_seconds": 58.0, "by_tier": {}},
    "stall_seconds": 12.5,
    "fetch": {
        "demand": {**_fetched(256, 1 << 30, 0.0125, 0.42), "retries": 1},
        "prefetch": _fetched(0, 0, None, None),
        "metadata": _fetched(3, 0, 0.01, 0.02),
        "shared": _fetched(0, 0, None, None),
    },
    "prefetch": {
        "issued_bytes": 2 << 30,
        "used_bytes": 3 << 29,
        "wasted_bytes": 1 << 29,
        "accuracy": 0.75,
        "waste": 0.25,
    },
    "dedup": {"disk_saved_bytes": 1 << 20, "wire_saved_bytes": 0},
    "cache": {
        "used_bytes": 25 << 30,
        "capacity_bytes": (100 << 30) + (1 << 40),
        "promotions": 0,
        "demotions": 0,
        "evictions": {"hot": 0, "warm": 0},
        "corrupt_blocks": {"hot": 0, "warm": 0},
        "errors": {"hot": 0, "warm": 0},
    },
    "epoch": {"current": 2, "workloads": {"train": 2, "val": 1}},
    "jobs": {
        "python[4242]": {
            "reads": {"cache": 900, "cold": 100},
            "bytes": {"cache": 9 << 20, "cold": 1 << 20},
            "hit_ratio": 0.9,
            "stall_seconds": 3.5,
            "batches": 120,
            "data_wait_fraction": 0.375,
        },
        "cat[77]": {
            "reads": {"cache": 0, "cold": 2},
            "bytes": {"cache": 0, "cold": 4096},
            "hit_ratio": 0.0,
            "stall_seconds": 0.04,
            "batches": 0,
            "data_wait_fraction": None,
        },
    },
    "access": ACCESS,
    "residency": {
        "source": "s3://datasets/imagenet",
        "tiers": ["hot", "warm"],
        "age_seconds": 12.0,
        "refresh_seconds": 30.0,
        "max_prefixes": 50,
        "error": None,
        "prefixes": [
            {"prefix": "train", "bytes": {"hot": 24 << 30, "warm": 0}, "total_bytes": 24 << 30},
            {"prefix": OTHER_PREFIX, "bytes": {"hot": 1 << 30}, "total_bytes": 1 << 30},
        ],
    },
    "writes": None,
}

# The ``writes`` of a writable mount checkpointing: one file uploading,
# one failing, one waiting.
WRITES: dict[str, Any] = {
    "staged_bytes": 3 << 30,
    "staged_files": 3,
    "uploads_due": 3,
    "uploads_in_flight": 1,
    "uploads_failing": 1,
    "oldest_due_seconds": 95.0,
    "uploaded_bytes": 40 << 30,
    "uploaded_files": 20,
    "failed_attempts": 4,
    "upload_bytes_per_second": float(250 << 20),
    "upload_rate_seconds": 55.0,
    "upload_p50_seconds": 8.0,
    "upload_p99_seconds": 24.0,
    "oldest_failure": {"key": "ckpt/step-9/[rank0].pt", "error": "AccessDenied: no PutObject"},
}
