"""One node, several mounts: one cache and one epoch clock under every
mount's data path, without a FUSE mount (``engine.Node``)."""

from __future__ import annotations

from pathlib import Path

from cachefsd.config import FetchSettings, Settings, StoreSettings
from cachefsd.engine import Node, NodeEpochs, StoreFactory
from cachefsd.store.memory import MemoryStore
from cachefsd.workload.model import WorkloadModel
from tests.unit.conftest import read_path

BLOCK = 64 << 10


def _settings(tmp_path: Path, name: str, **cache: object) -> Settings:
    return Settings(
        source=f"/{name}",
        mountpoint=tmp_path / name,
        cache={"dir": tmp_path / "cache", "block_size": BLOCK, **cache},
        prefetch={"enabled": False},
    )


def _stores(**stores: MemoryStore) -> StoreFactory:
    def open_store(source: str, store: StoreSettings, fetch: FetchSettings) -> MemoryStore:
        return stores[source.strip("/")]

    return open_store


def test_two_mounts_share_one_capacity_and_count_their_own_reads(tmp_path: Path) -> None:
    a = {f"a{n}.bin": bytes([n]) * BLOCK for n in range(6)}
    b = {f"b{n}.bin": bytes([100 + n]) * BLOCK for n in range(6)}
    stores = _stores(a=MemoryStore(a, uri="memory://a"), b=MemoryStore(b, uri="memory://b"))
    first, second = _settings(tmp_path, "a", size=8 * BLOCK + BLOCK // 2), _settings(tmp_path, "b")
    node = Node()
    try:
        with (
            node.source(first, stores) as store_a,
            node.opened(first.cache),
            node.mount(first, store_a) as mount_a,
        ):
            with node.source(second, stores) as store_b, node.mount(second, store_b) as mount_b:
                assert mount_a.cache is mount_b.cache
                for name, data in a.items():
                    assert read_path(mount_a.fs, name, BLOCK) == data
                for name, data in b.items():
                    assert read_path(mount_b.fs, name, BLOCK) == data
                (tier,) = node.cache.tiers
                # Twelve blocks read, room for eight (and their headers): one
                # capacity over both mounts.
                assert tier.block_count == 8
                assert tier.used_bytes <= tier.capacity

                def mount_bytes(mount: Path, source: str) -> float | None:
                    labels = {"mount": str(mount), "source": source}
                    return node.metrics.registry.get_sample_value("cachefsd_mount_read_bytes_total", labels)

                assert mount_bytes(first.mountpoint, "cold") == 6 * BLOCK
                assert mount_bytes(second.mountpoint, "cold") == 6 * BLOCK
                node_cold = node.metrics.registry.get_sample_value(
                    "cachefsd_read_bytes_total", {"source": "cold"}
                )
                assert node_cold == 12 * BLOCK
            # Gone with its mount: the label is bounded by the mounts there are.
            assert mount_bytes(second.mountpoint, "cold") is None
            assert mount_bytes(first.mountpoint, "cold") == 6 * BLOCK
            assert read_path(mount_a.fs, "a5.bin", BLOCK) == a["a5.bin"]
    finally:
        node.close()


def test_the_node_clock_is_the_latest_epoch_of_any_mount() -> None:
    clock = NodeEpochs()
    assert (clock.current(), clock.job_epochs()) == (0, {})
    first, second = WorkloadModel(), WorkloadModel()
    clock.add(first)
    clock.add(second)
    files = {f"d/{n}": 10 for n in range(4)}
    for model in (first, second):
        model.listed("d", files, 0.0, job="sid:1")
    # Mount one: job sid:1 reads its dataset twice; mount two: once, by two jobs.
    for epoch in range(2):
        for path in files:
            first.opened(path, 10, 1.0 + epoch, job="sid:1")
    for job in ("sid:1", "sid:2"):
        for path in files:
            second.opened(path, 10, 5.0, job=job)
    assert clock.current() == max(first.current(), second.current()) == first.current()
    assert first.current() > second.current()
    assert clock.job_epochs()["sid:1"] == first.job_epochs()["sid:1"]
    assert clock.job_epochs()["sid:2"] == second.job_epochs()["sid:2"]
    clock.remove(first)
    assert clock.current() == second.current()
