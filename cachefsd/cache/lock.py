"""The cache directory's lock and its creation.

A cache directory is held with an exclusive ``flock`` for the daemon's
lifetime: two daemons sharing one would each evict the other's blocks and
break the capacity bound.
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
import time
from pathlib import Path

from cachefsd.errors import CachefsdError, ConfigError

log = logging.getLogger(__name__)

# A daemon that was just unmounted needs a moment to flush its index; a new
# mount of the same cache waits this long for it before giving up.
LOCK_WAIT_SECONDS = 15.0


_POLL_SECONDS = 0.05


class CacheDirLock:
    """An exclusive lock on a cache directory, held until ``release``. Its
    errors name the ``setting`` that gave the directory, and say what to do
    when another process holds it (``busy``)."""

    def __init__(
        self,
        cache_dir: Path,
        wait_seconds: float = LOCK_WAIT_SECONDS,
        setting: str = "cache.dir",
        busy: str = "wait for it to finish, or give another --cache-dir",
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
