"""The FUSE device: mounting through ``fusermount3``, and unmounting (the
native plane registers passthrough's backing files, ``native/src/device.rs``).

``fusermount3`` mounts for root and for users alike: it opens /dev/fuse,
mounts it with the options it is given (and adds the descriptor, root mode
and owner), and passes the descriptor back over a socket named by
``_FUSE_COMMFD``, as libfuse does for users.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess

from cachefsd.errors import CachefsdError

log = logging.getLogger(__name__)

FUSERMOUNT = "fusermount3"
# fusermount3 mounts in milliseconds; past this it is stuck (a hung mountpoint).
FUSERMOUNT_SECONDS = 30.0


def _fusermount() -> str:
    path = shutil.which(FUSERMOUNT)
    if path is None:
        raise CachefsdError(
            f"{FUSERMOUNT} is not installed: install the fuse3 package (apt-get install fuse3)"
        )
    return path


def mount(mountpoint: str, options: str) -> int:
    """Mount FUSE on ``mountpoint`` with ``options``: the new connection's
    descriptor, non-blocking and close-on-exec."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours, theirs:
        try:
            result = subprocess.run(
                [_fusermount(), "-o", options, "--", mountpoint],
                env={**os.environ, "_FUSE_COMMFD": str(theirs.fileno())},
                pass_fds=(theirs.fileno(),),
                capture_output=True,
                text=True,
                timeout=FUSERMOUNT_SECONDS,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise CachefsdError(
                f"the mount of {mountpoint} did not finish within {FUSERMOUNT_SECONDS:g}s"
            ) from exc
        if result.returncode != 0:
            why = result.stderr.strip() or f"{FUSERMOUNT} exited with code {result.returncode}"
            raise CachefsdError(f"the mount of {mountpoint} was refused: {why}")
        theirs.close()
        _, fds, _, _ = socket.recv_fds(ours, 1, 1)
    if not fds:
        raise CachefsdError(f"{FUSERMOUNT} mounted {mountpoint} but passed no descriptor back")
    fd = fds[0]
    os.set_inheritable(fd, False)
    os.set_blocking(fd, False)
    return fd


def unmount(mountpoint: str) -> None:
    """Detach ``mountpoint`` lazily: processes that hold files under it keep
    them (reads then fail, the connection being closed)."""
    try:
        result = subprocess.run(
            [_fusermount(), "-u", "-z", "--", mountpoint],
            capture_output=True,
            text=True,
            timeout=FUSERMOUNT_SECONDS,
            check=False,
        )
    except (subprocess.TimeoutExpired, CachefsdError) as exc:
        log.warning("could not unmount %s: %s", mountpoint, exc)
        return
    if result.returncode != 0:  # most often: unmounted already, by the user
        log.info("%s -u %s: %s", FUSERMOUNT, mountpoint, result.stderr.strip())
