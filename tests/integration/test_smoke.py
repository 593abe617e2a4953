"""The shortest path through a real mount of a local directory."""

from __future__ import annotations

from pathlib import Path

from tests.integration.conftest import MountFactory


def test_local_directory_reads_back_exact_bytes(tmp_path: Path, mounter: MountFactory) -> None:
    source = tmp_path / "src"
    (source / "a").mkdir(parents=True)
    (source / "a" / "x.bin").write_bytes(b"hello" * 1000)
    mount = mounter(str(source))
    assert sorted(p.name for p in mount.mountpoint.iterdir()) == ["a"]
    assert mount.path("a/x.bin").read_bytes() == b"hello" * 1000
