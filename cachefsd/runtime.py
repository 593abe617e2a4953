"""How CLI commands find the daemon of a mount path, and how two daemons are
kept off one cache directory.

Each running daemon writes ``<runtime dir>/<id>.json`` (pid, mountpoint,
source, cache dir, metrics address, control socket), where the id is derived from the
mountpoint. The runtime dir is owner-only. A cache directory is held with an
exclusive ``flock`` for the daemon's lifetime: two daemons sharing one would
each evict the other's blocks and break the capacity bound.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import socket
import stat
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from cachefsd.errors import CachefsdError, ConfigError

# A daemon that was just unmounted needs a moment to flush its index; a new
# mount of the same cache waits this long for it before giving up.
LOCK_WAIT_SECONDS = 15.0
log = logging.getLogger(__name__)

_POLL_SECONDS = 0.05


FUSE_DEVICE = "/dev/fuse"
FUSE_CONF = Path("/etc/fuse.conf")
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
    pid: int
    mountpoint: str
    source: str
    cache_dir: str
    metrics_addr: str | None
    # The Unix socket of the control API (``cachefsd.control``); None in
    # state files written before it existed, or when it is not served.
    control_socket: str | None = None


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
    try:
        return MountState(**json.loads(state_path(mountpoint).read_text()))
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


class CacheDirLock:
    """An exclusive lock on a cache directory, held until ``release``. Its
    errors name the ``setting`` that gave the directory, and say what to do
    when another process holds it (``busy``)."""

    def __init__(
        self,
        cache_dir: Path,
        wait_seconds: float = LOCK_WAIT_SECONDS,
        setting: str = "cache.dir",
        busy: str = "give each mount its own --cache-dir",
    ) -> None:
        try:
            self._fd = os.open(cache_dir / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise ConfigError(f"{setting}: cannot lock {cache_dir}: {exc.strerror}") from exc
        content = os.pread(self._fd, 32, 0).strip(b"\0 \n")
        if content and not content.isdigit():
            # Ours holds a pid, or nothing (zeros, after a power loss on some
            # filesystems): this is someone's own file, in a directory given
            # as a cache (or named by a damaged record).
            os.close(self._fd)
            raise ConfigError(f"{setting}: {cache_dir / 'lock'} is not cachefsd's lock file; move it")
        deadline = time.monotonic() + wait_seconds
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = os.pread(self._fd, 32, 0).decode(errors="replace").strip() or "another process"
                    os.close(self._fd)
                    raise CachefsdError(f"{setting}: {cache_dir} is in use by pid {holder}; {busy}") from None
                time.sleep(_POLL_SECONDS)
        try:  # who holds it, for the message above: on a full disk, the lock holds all the same
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, str(os.getpid()).encode(), 0)
        except OSError as exc:
            log.warning("%s: cannot write this process's pid in %s: %s", setting, cache_dir / "lock", exc)

    def release(self) -> None:
        os.close(self._fd)


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


def check_fuse_device() -> None:
    """libfuse opens /dev/fuse itself and, on EACCES, neither falls back to
    fusermount3 nor says more than a bare error code."""
    if not os.access(FUSE_DEVICE, os.R_OK | os.W_OK):
        raise CachefsdError(
            f"cannot use {FUSE_DEVICE} as uid {os.getuid()}: FUSE needs it present (apt-get install "
            "fuse3) and readable and writable (mode 0666, Debian's default), or cachefsd run as root"
        )


def check_allow_other(allow_other: bool, uid: int | None = None, fuse_conf: Path = FUSE_CONF) -> None:
    """fusermount3 lets a user's mount allow other users only when
    ``fuse_conf`` has ``user_allow_other``; it says so on its stderr (the
    daemon's log), and libfuse then returns a bare code ("unexpected
    error: 4"). ``uid`` is the mounting user's (default: this process's)."""
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


def create_cache_directory(setting: str, directory: Path) -> None:
    """Create a cache directory, owner-only; ``ConfigError`` naming the
    ``setting`` that gave it when that fails."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        found = directory.stat()
    except OSError as exc:
        raise ConfigError(f"{setting}: cannot create {directory}: {exc.strerror}") from exc
    # Another user who can write here can replace the index (which says which
    # cached bytes are served for which object), or plant symlinks where the
    # daemon writes its log.
    uid, mode = os.geteuid(), stat.S_IMODE(found.st_mode)
    if found.st_uid != uid:
        raise ConfigError(
            f"{setting}: {directory} belongs to uid {found.st_uid}, not to this user (uid {uid}): "
            "give a directory of your own"
        )
    if mode & 0o022:
        if mode & stat.S_ISVTX:  # shared by design (/tmp): not ours to close
            raise ConfigError(
                f"{setting}: {directory} is writable by other users (mode {mode:o}): "
                "give a directory only you can write"
            )
        directory.chmod(mode & ~0o022)  # ours (a umask of 002 made it so): made ours alone
        log.warning(
            "%s: %s was writable by other users (mode %o), now %o", setting, directory, mode, mode & ~0o022
        )
