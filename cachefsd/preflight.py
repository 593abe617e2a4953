"""Checks before a mount, each failing with a message that says what to do:
the FUSE device, ``allow_other``, the mountpoint; and the systemd
notification of a service that is ready.
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from cachefsd.control.mounts import pid_alive, read_state
from cachefsd.errors import CachefsdError, ConfigError

if TYPE_CHECKING:
    from cachefsd.config import Settings

FUSE_DEVICE = "/dev/fuse"
FUSE_CONF = Path("/etc/fuse.conf")


def notify_systemd(state: str) -> None:
    """Tell systemd about the service (``READY=1`` once the mount works,
    ``STOPPING=1``) when it runs us as ``Type=notify``; a no-op otherwise.
    The protocol is one datagram to $NOTIFY_SOCKET (sd_notify(3)); an
    address starting with ``@`` is in the abstract namespace."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as notify:
        notify.sendto(state.encode(), address)


def check_fuse_device(device: str = FUSE_DEVICE) -> None:
    """Said before anything is created, in words a user acts on: without
    the device, fusermount3 fails with a bare "No such file or directory"."""
    if not os.access(device, os.R_OK | os.W_OK):
        raise CachefsdError(
            f"cannot use {device} as uid {os.getuid()}: FUSE needs it present (apt-get install "
            "fuse3) and readable and writable (mode 0666, Debian's default), or cachefsd run as root"
        )


def check_allow_other(allow_other: bool, uid: int | None = None, fuse_conf: Path = FUSE_CONF) -> None:
    """fusermount3 lets a user's mount allow other users only when
    ``fuse_conf`` has ``user_allow_other``; it says so in its own words,
    which this check puts in cachefsd's: the setting to change. ``uid`` is
    the mounting user's (default: this process's)."""
    if not allow_other or (os.geteuid() if uid is None else uid) == 0:
        return
    try:
        lines = fuse_conf.read_text().splitlines()
    except OSError:
        lines = []
    if not any(line.split("#", 1)[0].strip() == "user_allow_other" for line in lines):
        raise ConfigError(
            f"fuse.allow_other: a user's mount may allow other users only when {fuse_conf} "
            "has the line user_allow_other (or mount as root)"
        )


def check_mounts(mounts: list[Settings]) -> None:
    """What makes every one of ``mounts`` (one daemon's: the first one's
    cache is theirs) impossible, refused before anything is opened or created."""
    check_fuse_device()
    for settings in mounts:
        check_allow_other(settings.fuse.allow_other)
        check_mountpoint(settings.mountpoint, mounts[0].cache.directories())


def check_mountpoint(mountpoint: Path, cache_directories: list[tuple[str, Path]]) -> None:
    """Checked by the mounting command before it creates anything (the
    cache directory, its log), and by the daemon. ``cache_directories``
    (setting, directory) must be outside it: the mount would hide them,
    and creating them would have made the mountpoint "not empty"."""
    for setting, directory in cache_directories:
        if directory.is_relative_to(mountpoint):
            raise ConfigError(f"{setting}: {directory} is inside the mountpoint {mountpoint}")
    try:
        os.statvfs(mountpoint)  # always asks the filesystem, never a cached attribute
    except OSError as exc:
        if exc.errno == errno.ENOTCONN:  # a FUSE mount whose daemon was killed
            raise ConfigError(
                f"mountpoint: {mountpoint} is still mounted by a daemon that died; "
                f"`cachefsd unmount {mountpoint}` clears it"
            ) from exc
    if not mountpoint.is_dir():
        raise ConfigError(f"mountpoint: {mountpoint} is not a directory")
    if os.path.ismount(mountpoint):
        state = read_state(mountpoint)
        if state is not None and pid_alive(state.pid):
            raise ConfigError(f"mountpoint: {mountpoint} is already mounted by cachefsd (pid {state.pid})")
        raise ConfigError(f"mountpoint: {mountpoint} is already a mount point")
    if any(mountpoint.iterdir()):
        raise ConfigError(f"mountpoint: {mountpoint} is not empty")
