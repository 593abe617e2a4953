"""A store outage under a running mount, as a user meets it: the default
fetch deadline, an outage that outlasts the metadata TTL, and a store that
fails both ways, hung (SIGSTOP: connections accepted, never answered) or
gone (killed: connections refused).

The promises under test (SEMANTICS.md, "Errors"): a cached file opens
and reads at once through an outage of any length, whatever the deadline;
``ls`` of what was listed answers at once; an uncached read fails with EIO
within one deadline; once the store is back the mount recovers by itself,
changes are seen again, and ``unmount`` never waits on the store.

The S3 server runs in its own process here, so that it can be stopped and
killed as a real one would be; moto keeps its objects in memory, so a
killed server comes back empty and the test uploads the same objects again
(same bytes, same etags).
"""

from __future__ import annotations

import errno
import os
import signal
import time
from pathlib import Path

import pytest

from cachefsd.config import FetchSettings
from tests.integration.conftest import MountFactory, ServerProcess, drop_page_cache, run_cli, wait_dead
from tests.polling import timed, wait_until

KiB = 1 << 10
BUCKET = "outage"
TTL_SECONDS = 1.0  # the shortest --metadata-ttl: every listing has expired when the reads come
# The default deadline, on purpose: the waits this test guards against
# chained one deadline per directory.
DEADLINE_SECONDS = FetchSettings().deadline
# A cached read never touches the store; even on a loaded machine it is far
# below one deadline (the fault this guards against took a deadline or more).
CACHED_SECONDS = 2.0
# Slack on top of one deadline for an uncached read's EIO: the retries' last
# backoff, the FUSE bridge margin and a loaded CI machine.
EIO_MARGIN_SECONDS = 7.0
# How long the daemon may take to exit after an unmount during an outage.
EXIT_SECONDS = 5.0


def _upload(server: ServerProcess, objects: dict[str, bytes]) -> None:
    client = server.client()
    client.create_bucket(Bucket=BUCKET)
    for key, body in objects.items():
        client.put_object(Bucket=BUCKET, Key=key, Body=body)


def _dataset() -> dict[str, bytes]:
    """Four directories three levels deep, and a file at the top: a
    lookup resolves every directory on the way."""
    objects = {f"train/c{d}/{i}.bin": os.urandom((40 + 13 * i) * KiB) for d in range(4) for i in range(6)}
    objects["top.bin"] = os.urandom(10 * KiB)
    return objects


def _walk(root: Path) -> set[str]:
    return {
        str(Path(directory, name).relative_to(root))
        for directory, _, names in os.walk(root)
        for name in names
    }


def _past_the_ttl() -> None:
    """Let the listings expire: the outage must outlast the metadata TTL.
    Time passing is the behaviour under test here, not a synchronisation."""
    time.sleep(TTL_SECONDS + 0.5)


@pytest.mark.parametrize("fault", ["hung", "refused"])
def test_an_outage_serves_cached_files_at_once_fails_the_rest_in_one_deadline_and_recovers(
    fault: str, server: ServerProcess, mounter: MountFactory
) -> None:
    objects = _dataset()
    _upload(server, objects)
    mount = mounter(
        f"s3://{BUCKET}",
        "--endpoint-url",
        server.endpoint_url,
        "--metadata-ttl",
        f"{TTL_SECONDS:g}s",
        "--no-prefetch",  # a file the test does not read stays uncached
    )
    keys = sorted(objects)
    cached, uncached = keys[::2], keys[1::2]
    assert _walk(mount.mountpoint) == set(keys)
    for key in cached:
        assert mount.path(key).read_bytes() == objects[key]

    if fault == "hung":
        server.signal(signal.SIGSTOP)
    else:
        server.kill()
    _past_the_ttl()
    drop_page_cache()

    for key in cached:
        data, seconds = timed(mount.path(key).read_bytes)
        assert data == objects[key], f"{key}: wrong bytes through the outage"
        assert seconds < CACHED_SECONDS, f"{key}: a cached read took {seconds:.1f}s through the outage"
    listed, seconds = timed(lambda: _walk(mount.mountpoint))
    assert listed == set(keys)
    assert seconds < CACHED_SECONDS, f"ls -R took {seconds:.1f}s through the outage"

    started = time.monotonic()
    with pytest.raises(OSError, match=r"Input/output error") as raised:
        mount.path(uncached[-1]).read_bytes()  # three directories deep
    seconds = time.monotonic() - started
    assert raised.value.errno == errno.EIO
    assert seconds < DEADLINE_SECONDS + EIO_MARGIN_SECONDS, f"EIO only after {seconds:.1f}s"
    assert mount.alive

    if fault == "hung":
        server.signal(signal.SIGCONT)
    else:
        server.start()
        _upload(server, objects)
    client = server.client()
    client.put_object(Bucket=BUCKET, Key="train/c0/new.bin", Body=b"new")
    client.delete_object(Bucket=BUCKET, Key=cached[0])
    # No remount: the daemon finds the store back by itself, within a
    # deadline (a refresh under way retries until then).
    wait_until(
        lambda: mount.path("train/c0/new.bin").exists() and not mount.path(cached[0]).exists(),
        "the listings to show the store's changes",
        DEADLINE_SECONDS,
    )
    assert mount.path("train/c0/new.bin").read_bytes() == b"new"
    for key in keys[1:]:
        assert mount.path(key).read_bytes() == objects[key], f"{key}: wrong bytes after the outage"

    _, seconds = timed(mount.unmount)  # it returns once the daemon has exited
    assert seconds < EXIT_SECONDS, f"unmount took {seconds:.1f}s"
    result = run_cli("verify", "--cache-dir", str(mount.cache_dir))
    assert result.returncode == 0, result.stdout + result.stderr
    assert ": 0 corrupt, 0 missing" in result.stdout, result.stdout


def test_unmount_during_an_outage_is_not_held_up_by_the_store(
    server: ServerProcess, mounter: MountFactory
) -> None:
    """Listings are being refreshed, with retries, from a hung store when
    the mount goes: the daemon still exits within seconds."""
    objects = _dataset()
    _upload(server, objects)
    mount = mounter(
        f"s3://{BUCKET}", "--endpoint-url", server.endpoint_url, "--metadata-ttl", f"{TTL_SECONDS:g}s"
    )
    keys = sorted(objects)
    assert _walk(mount.mountpoint) == set(keys)
    assert mount.path(keys[0]).read_bytes() == objects[keys[0]]
    server.signal(signal.SIGSTOP)
    _past_the_ttl()
    drop_page_cache()
    assert _walk(mount.mountpoint) == set(keys)  # and a refresh starts, which hangs
    wait_until(
        lambda: mount.metrics().get("cachefsd_fetch_retries_total{kind=metadata}", 0.0) >= 1,
        "the refresh to retry",
        DEADLINE_SECONDS,
    )
    _, seconds = timed(mount.unmount)
    assert seconds < EXIT_SECONDS, f"unmount took {seconds:.1f}s"
    wait_dead(mount.pid, EXIT_SECONDS)
