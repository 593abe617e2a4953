"""The ``kill -9`` torture loop shared by the fault and tier tests: readers
hammer a mount, the daemon is killed mid-churn, and every reader must have
seen right bytes until the mount died under it.

Each test brings its own mount, its own churn condition (when to kill) and its
own checks afterwards. Every wait is a bounded poll, never a sleep.
"""

from __future__ import annotations

import errno
import hashlib
import os
import random
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

from tests.integration.conftest import Mount, force_unmount, wait_dead
from tests.polling import wait_until

# Reads every file of the manifest in a shuffled loop, dropping each file's
# pages afterwards so every read reaches the daemon. Prints how many files it
# read and the errno that stopped it; exits 2 on a wrong byte.
_READER = r"""
import hashlib, os, random, sys

root, manifest, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
expected = dict(line.split() for line in open(manifest))
names = sorted(expected)
rng = random.Random(seed)
done = 0
while True:
    rng.shuffle(names)
    for name in names:
        try:
            with open(os.path.join(root, name), "rb") as handle:
                data = handle.read()
                os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError as exc:
            print(done, exc.errno, flush=True)
            sys.exit(0)
        if hashlib.sha256(data).hexdigest() != expected[name]:
            print(done, "mismatch", name, len(data), flush=True)
            sys.exit(2)
        done += 1
"""
READERS = 4
KILL_ROUNDS = 3
# Errors a reader may see once the daemon is gone: new requests on an aborted
# connection fail with ENOTCONN, requests in flight with ECONNABORTED.
DEAD_MOUNT_ERRNOS = {errno.ENOTCONN, errno.ECONNABORTED}
READER_EXIT_SECONDS = 30.0
# Upper bound of any polling loop here.
POLL_TIMEOUT_SECONDS = 60.0


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def metric(mount: Mount, name: str) -> float:
    """The sum of every sample of ``name`` (all label values)."""
    return sum(value for sample, value in mount.metrics().items() if sample.partition("{")[0] == name)


def write_manifest(manifest: Path, objects: Mapping[str, bytes]) -> None:
    """The readers' manifest: one ``name sha256`` line per object."""
    manifest.write_text("".join(f"{name} {sha256(body)}\n" for name, body in objects.items()))


def kill_round(
    mount: Callable[[], Mount],
    manifest: Path,
    round_number: int,
    churning: Callable[[Mount], bool],
    waiting_for: str = "churn under the readers",
) -> None:
    """Mount, start ``READERS`` readers of ``manifest``, SIGKILL the daemon
    once ``churning`` holds, and check that every reader saw only right bytes
    and was stopped by the dead mount. The mountpoint is unmounted after."""
    mounted = mount()
    readers = [
        subprocess.Popen(
            [sys.executable, "-c", _READER, str(mounted.mountpoint), str(manifest), str(seed)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in range(round_number * READERS, (round_number + 1) * READERS)
    ]

    def churning_or_stopped() -> bool:
        # A reader that stopped is reported below, not waited out.
        return any(reader.poll() is not None for reader in readers) or churning(mounted)

    try:
        # Kill in the middle of the churn: blocks are being fetched,
        # admitted and evicted, and every reader is still going.
        wait_until(churning_or_stopped, waiting_for, POLL_TIMEOUT_SECONDS)
        assert all(reader.poll() is None for reader in readers), "a reader stopped before the kill"
        os.kill(mounted.pid, signal.SIGKILL)
        wait_dead(mounted.pid)
        outcomes = []
        for reader in readers:
            out, err = reader.communicate(timeout=READER_EXIT_SECONDS)
            outcomes.append((reader.returncode, out.strip(), err.strip()))
    finally:
        for reader in readers:
            if reader.poll() is None:
                reader.kill()
                reader.wait()
        force_unmount(mounted.mountpoint)
    for returncode, out, err in outcomes:
        assert returncode == 0, f"reader saw wrong bytes: {out} {err}"
        assert int(out.split()[1]) in DEAD_MOUNT_ERRNOS, f"reader stopped by: {out}"


def kill_during_reads(
    mount: Callable[[], Mount],
    manifest: Path,
    rounds: int,
    churning: Callable[[Mount], bool],
    waiting_for: str = "churn under the readers",
) -> None:
    """``rounds`` kill rounds back to back (see ``kill_round``)."""
    for round_number in range(rounds):
        kill_round(mount, manifest, round_number, churning, waiting_for)


def assert_reads_right(mount: Mount, objects: Mapping[str, bytes], when: str) -> None:
    """Every object read whole through ``mount``, in a random order, has its bytes."""
    for name in sorted(objects, key=lambda _: random.random()):
        assert sha256(mount.path(name).read_bytes()) == sha256(objects[name]), f"{name} wrong {when}"
