"""One daemon a node: a second mount on a cache directory joins the daemon
that serves it (one capacity, one copy of each block, one metrics
endpoint), an unmount detaches one mount, and the daemon ends with its
last; a config file's ``[[mounts]]`` start one daemon for all of them."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from pathlib import Path

from cachefsd.control.mounts import read_state
from tests.integration.conftest import MountFactory, force_unmount, run_cli, wait_dead
from tests.net import free_port

BLOCK = 64 << 10


def _source(root: Path, name: str, files: dict[str, bytes]) -> Path:
    source = root / name
    source.mkdir()
    for relative, data in files.items():
        (source / relative).write_bytes(data)
    return source


def test_a_second_mount_joins_the_daemon_of_its_cache_dir_and_shares_its_capacity(
    tmp_path: Path, mounter: MountFactory
) -> None:
    shared = os.urandom(BLOCK)
    a = {"same.bin": shared, **{f"a{n}.bin": os.urandom(BLOCK) for n in range(6)}}
    b = {
        "same.bin": shared,
        "late.bin": os.urandom(BLOCK),
        **{f"b{n}.bin": os.urandom(BLOCK) for n in range(6)},
    }
    capacity = 8 * BLOCK + BLOCK // 2  # eight blocks and their headers
    first = mounter(
        str(_source(tmp_path, "a", a)), "--block-size", "64K", "--cache-size", str(capacity), name="first"
    )
    # No cache flags: the daemon's apply (a default left alone is no conflict).
    second = mounter(str(_source(tmp_path, "b", b)), name="second", joining=first)
    assert second.pid == first.pid
    assert "joined the daemon of" not in second.warnings

    assert first.path("same.bin").read_bytes() == shared
    assert second.path("same.bin").read_bytes() == shared
    samples = first.metrics()
    # The second mount's copy of the block is the first's: nothing written twice.
    assert samples["cachefsd_dedup_saved_bytes_total{where=disk}"] == BLOCK
    for mount, files in ((first, a), (second, b)):
        for name, data in files.items():
            if name not in ("same.bin", "late.bin"):
                assert mount.path(name).read_bytes() == data

    samples = first.metrics()
    assert samples["cachefsd_tier_capacity_bytes{tier=hot}"] == capacity
    assert 0 < samples["cachefsd_tier_used_bytes{tier=hot}"] <= capacity
    assert samples["cachefsd_tier_blocks{tier=hot}"] == 8  # of 13 different blocks read
    for mount in (first, second):
        # Seven files each, all from the source (the shared one before its hash was known).
        assert (
            samples[f"cachefsd_mount_read_bytes_total{{mount={mount.mountpoint},source=cold}}"] == 7 * BLOCK
        )

    stats = run_cli("stats", str(second.mountpoint), "--json")
    assert stats.returncode == 0, stats.stderr
    shown = json.loads(stats.stdout)
    assert shown["mount"]["mountpoint"] == str(second.mountpoint)
    assert shown["mount"]["reads"]["bytes"]["cold"] == 7 * BLOCK
    assert [mount["mountpoint"] for mount in shown["node"]["mounts"]] == [
        str(first.mountpoint),
        str(second.mountpoint),
    ]
    assert shown["tiers"][0]["capacity_bytes"] == capacity
    assert shown["block_size"] == BLOCK  # the daemon's, though the joining mount gave none
    drawn = run_cli("stats", str(second.mountpoint)).stdout
    assert "this mount" in drawn
    assert str(first.mountpoint) in drawn  # the node's other mount, whose cache this is too

    # Unmounting one keeps the other, served by the same daemon.
    first.unmount()
    assert not os.path.ismount(first.mountpoint)
    assert second.alive
    assert read_state(second.mountpoint) is not None
    assert second.path("late.bin").read_bytes() == b["late.bin"]
    assert [name for name in second.metrics() if f"mount={first.mountpoint}" in name] == []
    second.unmount()
    wait_dead(second.pid)
    assert not os.path.ismount(second.mountpoint)


def test_a_joining_mount_that_sets_a_daemon_setting_otherwise_is_refused_by_name(
    tmp_path: Path, mounter: MountFactory
) -> None:
    first = mounter(str(_source(tmp_path, "a", {"x.bin": b"x"})), "--cache-size", "1G", name="first")
    other = tmp_path / "other"
    other.mkdir()
    try:
        source = _source(tmp_path, "b", {"y.bin": b"y"})
        result = run_cli(
            "mount", str(source), str(other), "--cache-dir", str(first.cache_dir), "--cache-size", "2G"
        )
    finally:
        force_unmount(other)
    assert result.returncode == 1
    message = result.stderr.strip()
    assert "\n" not in message, message
    assert message.startswith("cachefsd: error: cache.size: 2.0 GiB here, 1.0 GiB in the daemon"), message
    assert not os.path.ismount(other)
    assert first.alive
    assert first.path("x.bin").read_bytes() == b"x"


def test_a_config_file_mounts_all_its_mounts_in_one_daemon_that_sigterm_ends_and_a_crash_is_cleared(
    tmp_path: Path,
) -> None:
    mountpoints = [tmp_path / "m1", tmp_path / "m2"]
    for mountpoint in mountpoints:
        mountpoint.mkdir()
    one, two = _source(tmp_path, "one", {"1.txt": b"one"}), _source(tmp_path, "two", {"2.txt": b"two"})
    config = tmp_path / "node.toml"
    config.write_text(
        f'[cache]\ndir = "{tmp_path / "cache"}"\n[metrics]\naddr = "127.0.0.1:{free_port()}"\n'
        f'[[mounts]]\nsource = "{one}"\nmountpoint = "{mountpoints[0]}"\n'
        f'[[mounts]]\nsource = "{two}"\nmountpoint = "{mountpoints[1]}"\n[mounts.prefetch]\nenabled = false\n'
    )

    def mount_all() -> int:
        result = run_cli("mount", "--config", str(config))
        assert result.returncode == 0, result.stderr
        states = [read_state(mountpoint) for mountpoint in mountpoints]
        pids = {state.pid for state in states if state is not None}
        assert len(pids) == 1, states
        return pids.pop()

    try:
        # A crash leaves both mounts dead; the supervisor's clean-up detaches them.
        crashed = mount_all()
        os.kill(crashed, signal.SIGKILL)
        wait_dead(crashed)
        result = run_cli("unmount", "--config", str(config))
        assert result.returncode == 0, result.stderr
        assert not any(os.path.ismount(mountpoint) for mountpoint in mountpoints)
        assert run_cli("unmount", "--config", str(config)).returncode == 0  # nothing mounted: nothing to do

        pid = mount_all()
        assert (mountpoints[0] / "1.txt").read_bytes() == b"one"
        held = open(mountpoints[1] / "2.txt", "rb")  # noqa: SIM115 - a file open does not hold SIGTERM up
        try:
            assert held.read() == b"two"
            os.kill(pid, signal.SIGTERM)
            wait_dead(pid)
        finally:
            with contextlib.suppress(OSError):  # ENOTCONN: its FLUSH has no daemon to go to
                held.close()
        assert not any(os.path.ismount(mountpoint) for mountpoint in mountpoints)
        assert all(read_state(mountpoint) is None for mountpoint in mountpoints)
        log = (tmp_path / "cache" / "cachefsd.log").read_text()
        assert "Traceback" not in log, log
    finally:
        for mountpoint in mountpoints:
            force_unmount(mountpoint)
        subprocess.run(["pkill", "-9", "-f", str(config)], check=False)
