"""Finding the daemon of a path: state files and control sockets.

Each running daemon writes ``<runtime dir>/<id>.json`` (pid, mountpoint,
source, cache dir, metrics address, control socket), where the id is derived
from the mountpoint, and listens on ``<id>.sock`` beside it. The runtime dir
is owner-only. The CLI, loaders and an offline ``stage`` find a mount's
daemon (or a cache directory's) here; only the standard library is used.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import stat
from dataclasses import asdict, dataclass
from pathlib import Path

from cachefsd.errors import CachefsdError, ControlError


def control_path(mountpoint: Path) -> Path:
    """Where the daemon of ``mountpoint`` listens: next to its state file."""
    return state_path(mountpoint).with_suffix(".sock")


@dataclass(frozen=True, slots=True)
class MountOf:
    """The cachefsd mount a path is in, and the path relative to it (``/a/b``)."""

    mountpoint: Path
    state: MountState
    relative: str

    @property
    def live(self) -> bool:
        return pid_alive(self.state.pid) and os.path.ismount(self.mountpoint)


def find_mount(path: str | os.PathLike[str]) -> MountOf | None:
    """The innermost mountpoint at or above ``path`` that has a daemon state
    file (live or not), or None when ``path`` is not under a cachefsd mount.
    Symlinks are followed: ``/data -> /mnt/imagenet/train`` is in a mount."""
    absolute = Path(os.path.abspath(path))
    found = _mount_above(absolute)
    if found is None and (real := Path(os.path.realpath(absolute))) != absolute:
        found = _mount_above(real)
    return found


def _mount_above(absolute: Path) -> MountOf | None:
    for candidate in (absolute, *absolute.parents):
        state = read_state(candidate)
        if state is not None and Path(state.mountpoint) == candidate.resolve():
            relative = absolute.relative_to(candidate).as_posix()
            # The mountpoint itself, not a symlink to it (``/data`` ->
            # ``/mnt/imagenet``), which is no mount point to ``ismount``.
            return MountOf(Path(state.mountpoint), state, "/" if relative == "." else "/" + relative)
    return None


def foreign_mount(path: str | os.PathLike[str]) -> Path | None:
    """The cachefsd mount at or above ``path`` by the kernel's mount table,
    for a path ``find_mount`` finds no state of: one served by another
    user's daemon (root's, under the systemd unit or the DaemonSet), whose
    state and control socket are owner-only."""
    absolute = Path(os.path.abspath(path))
    mounted = {mountpoint for mountpoint, kind in mount_types().items() if kind == MOUNT_TYPE}
    return next((candidate for candidate in (absolute, *absolute.parents) if str(candidate) in mounted), None)


def not_a_mount(path: str | os.PathLike[str], foreign: Path | None = None) -> ControlError:
    """Why ``path`` has no daemon this user can reach; ``foreign`` when the
    caller already asked ``foreign_mount``."""
    foreign = foreign or foreign_mount(path)
    if foreign is None:
        return ControlError(f"{path} is not a cachefsd mount")
    return ControlError(
        f"{foreign} is served by another user's cachefsd daemon, whose control socket is owner-only: "
        "run this as that user (root for the systemd unit and the DaemonSet)"
    )


# The type the kernel's mount table gives a cachefsd mount (``fuse.<subtype>``).
MOUNT_TYPE = "fuse.cachefsd"


def mount_types() -> dict[str, str]:
    """Every mountpoint in the kernel's mount table -> its filesystem type
    (the last mount at a path wins, as it is the one seen there)."""
    try:
        with open("/proc/self/mounts", encoding="utf-8") as table:
            rows = [line.split() for line in table]
    except OSError:
        return {}
    # Spaces and the like in a mountpoint are escaped as octal (\040).
    return {
        re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), fields[1]): fields[2]
        for fields in rows
        if len(fields) > 2
    }


def runtime_dir() -> Path:
    """Where state files and control sockets live, owner-only. Without
    ``XDG_RUNTIME_DIR`` (containers, ``sudo -u``, cron) that is a name in
    /tmp anyone can predict, and create first: a directory there that is
    not this user's own, private one is refused, or its owner could plant
    symlinks where state files are written and answer for the control socket."""
    uid = os.geteuid()
    if uid == 0:
        base = Path("/run/cachefsd")
    elif os.environ.get("XDG_RUNTIME_DIR"):
        base = Path(os.environ["XDG_RUNTIME_DIR"]) / "cachefsd"
    else:
        base = Path(f"/tmp/cachefsd-{uid}")
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    found = base.lstat()
    if not stat.S_ISDIR(found.st_mode) or found.st_uid != uid:
        raise CachefsdError(
            f"runtime directory {base} is not a directory of this user's (uid {uid}): "
            "remove it, or set XDG_RUNTIME_DIR to a private directory"
        )
    if found.st_mode & 0o077:
        base.chmod(0o700)  # this user's own: made private, whatever made it
    return base


@dataclass(frozen=True)
class MountState:
    """What a running daemon records of itself in its state file."""

    pid: int
    mountpoint: str
    source: str
    cache_dir: str
    metrics_addr: str | None
    control_socket: str  # the Unix socket of the control API


def state_path(mountpoint: Path) -> Path:
    digest = hashlib.sha256(str(mountpoint.resolve()).encode()).hexdigest()[:16]
    return runtime_dir() / f"{digest}.json"


def write_state(state: MountState) -> Path:
    path = state_path(Path(state.mountpoint))
    _remove_dead_states(keep=path)
    temp = path.with_suffix(".tmp")
    temp.unlink(missing_ok=True)  # a crashed writer's
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(json.dumps(asdict(state)))
    temp.replace(path)
    return path


def remove_state(state: MountState) -> None:
    """Remove the state file of ``state``'s mount, unless it is another's
    by now: a new mount on the same mountpoint may have written its own."""
    path = state_path(Path(state.mountpoint))
    if _load_state(path) == state:
        path.unlink(missing_ok=True)


def _remove_dead_states(keep: Path) -> None:
    """Remove the state files and control sockets of daemons that died
    without cleaning up (kill -9, OOM): each would otherwise stay in the
    runtime directory for good. Not while the dead daemon's mount is still
    in the mount table: its state is what tells ``stats`` and ``unmount``
    that this user's daemon died there (without it, the mount looks like
    another user's), and the next ``unmount`` or mount there replaces it."""
    mounted = {path for path, kind in mount_types().items() if kind == MOUNT_TYPE}
    for path in runtime_dir().glob("*.json"):
        if path == keep:
            continue
        try:
            saved = json.loads(path.read_text())
            pid, mountpoint = saved["pid"], saved["mountpoint"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if isinstance(pid, int) and not pid_alive(pid) and mountpoint not in mounted:
            path.unlink(missing_ok=True)
            _remove_dead_socket(path.with_suffix(".sock"))


def _remove_dead_socket(path: Path) -> None:
    """Unless a daemon listens on it: one restarting on the same mountpoint
    binds its socket before it replaces the dead daemon's state file."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except ConnectionRefusedError:
            path.unlink(missing_ok=True)
        except OSError:  # gone already, or not ours to judge
            pass


def read_state(mountpoint: Path) -> MountState | None:
    return _load_state(state_path(mountpoint))


def _load_state(path: Path) -> MountState | None:
    """The state file at ``path``; None if it is missing or not one of ours."""
    try:
        return MountState(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` still runs. A zombie does not: a daemon started by a
    ``mount`` that has exited may never be reaped in a container without an
    init, and its dead socket must not be taken for a live daemon."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):  # gone, or exiting as it was read
        return False
    except PermissionError:
        return True
    return stat.rpartition(")")[2].split()[0] != "Z"


def daemon_states() -> list[MountState]:
    """The state of every mount this user's running daemons serve (a
    daemon serving several mounts has a state for each)."""
    states = (_load_state(state_file) for state_file in runtime_dir().glob("*.json"))
    return [state for state in states if state is not None and pid_alive(state.pid)]


def daemon_using(cache_dir: Path) -> MountState | None:
    """A mount of the running daemon (of this user) that holds ``cache_dir``, if any."""
    wanted = cache_dir.resolve()
    return next((state for state in daemon_states() if Path(state.cache_dir).resolve() == wanted), None)
