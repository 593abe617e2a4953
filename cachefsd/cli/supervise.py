"""Mount supervision: the mounting command starts the daemon in the
background and returns once the mount is ready (or says in one line why it
is not), through a pipe the daemon writes to; ``unmount`` waits for the
daemon to exit, so its cache is released."""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from cachefsd.cache.lock import create_cache_directory
from cachefsd.cli.logs import WARNING_PREFIX, _configure_logging
from cachefsd.config import Settings
from cachefsd.control.mounts import (
    MOUNT_TYPE,
    MountState,
    daemon_states,
    daemon_using,
    mount_types,
    pid_alive,
    read_state,
)
from cachefsd.errors import CachefsdError, ConfigError, ControlError
from cachefsd.preflight import check_mounts, notify_systemd

log = logging.getLogger("cachefsd")


# A mount must be ready (source checked, cache reconciled, kernel INIT done)
# within this time or the command fails. The source check has its own short
# bound; reconciling the cache is the slowest part, a stat of every block
# file: about 6 s for 200,000 blocks, so a minute for an ImageNet-sized
# cache on a slow disk. This only bounds a daemon that is stuck.
MOUNT_READY_SECONDS = 300.0


UNMOUNT_SECONDS = 30.0
# How long ``unmount`` waits for a writable mount's uploads due: what is
# not in the bucket by then stays staged, and the next mount uploads it.
UNMOUNT_UPLOAD_SECONDS = 60.0


# Ignored while a mount command stops the daemon it started (``_stop``).
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


_POLL_SECONDS = 0.05


class _ReadyPipe(logging.Handler):
    """The pipe to the mounting command: a "warning: ..." line for each
    warning logged while the daemon starts (a user who typed ``mount``
    should see them, not only the log), then one last line: "ready", or
    the error that prevented it. After that the mounting command has gone,
    so the pipe is closed and later messages are only logged (writing would
    raise BrokenPipeError). Errors are not relayed as warnings: the last
    line carries the one that ends the start."""

    def __init__(self, fd: int | None) -> None:
        super().__init__(logging.WARNING)
        self.addFilter(lambda record: record.levelno == logging.WARNING)
        self._fd = fd

    def emit(self, record: logging.LogRecord) -> None:
        self._write(f"{WARNING_PREFIX}{record.getMessage()}", last=False)

    def finish(self, line: str) -> bool:
        """Send the last line; False when nobody read it (the mounting
        command was killed)."""
        assert self.lock is not None  # made by Handler.__init__
        with self.lock:  # the lock ``handle`` holds around ``emit``
            return self._write(line, last=True)

    def _write(self, line: str, last: bool) -> bool:
        fd = self._fd
        if fd is None:
            return True
        try:
            os.write(fd, line.replace("\n", " ").encode() + b"\n")
            delivered = True
        except OSError:  # EPIPE: the reading end is closed
            delivered = False
        if last:
            self._fd = None
            os.close(fd)
        return delivered


def _mount_foreground(mounts: list[Settings], ready_fd: int | None) -> int:
    from cachefsd import daemon  # noqa: PLC0415 - keep `cachefsd --help` free of FUSE and SDK imports

    _configure_logging(mounts[0].log_level)
    pipe = _ReadyPipe(ready_fd)
    log.addHandler(pipe)

    def ready() -> None:
        log.info("mount ready")
        notify_systemd("READY=1")
        if not pipe.finish("ready"):
            # Whoever ran `cachefsd mount` was killed before the mount was
            # ready, and was told nothing or a failure: no mount may appear
            # behind its back. SIGTERM unmounts cleanly.
            log.warning("the mounting command is gone: unmounting")
            os.kill(os.getpid(), signal.SIGTERM)

    try:
        daemon.run(mounts, ready)
    except CachefsdError as exc:
        pipe.finish(str(exc))
        log.error("%s", exc)
        return 1
    except Exception as exc:
        pipe.finish(f"unexpected error: {exc}")
        log.exception("unexpected error")
        return 1
    finally:
        log.removeHandler(pipe)
    return 0


def _mount_background(argv: list[str], mounts: list[Settings]) -> int:
    """Start the daemon detached and return once its mounts are ready; a
    single mount on a cache directory a daemon serves joins that daemon."""
    # What the daemon would refuse, refused before the cache directory and
    # its log are created for a mount that cannot happen.
    settings = mounts[0]
    check_mounts(mounts)
    running = daemon_using(settings.cache.dir)
    if running is not None and len(mounts) == 1:
        return _join(settings, running)
    log_path = settings.cache.dir / "cachefsd.log"
    create_cache_directory("cache.dir", settings.cache.dir)
    try:
        open(log_path, "ab").close()
    except OSError as exc:
        raise ConfigError(f"cache.dir: cannot write the log {log_path}: {exc.strerror}") from exc
    read_end, write_end = os.pipe()
    # The daemon outlives this command only once it is mounted: Ctrl-C (a
    # KeyboardInterrupt already), or the SIGTERM of a ``timeout`` or a
    # supervisor, stops it, or the mount would appear behind the back of a
    # command that reported failure. (If this command is killed, the
    # daemon finds nobody reading its "ready" and unmounts.)
    mountpoints = [each.mountpoint for each in mounts]
    child = None
    try:
        with _signals_set((signal.SIGTERM, signal.SIGHUP), _interrupt):
            with open(log_path, "ab") as log_file:
                child = subprocess.Popen(
                    [sys.executable, "-m", "cachefsd", *argv, "--foreground", "--ready-fd", str(write_end)],
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=log_file,
                    pass_fds=(write_end,),
                    start_new_session=True,
                )
            os.close(write_end)
            line = _ready_line(read_end)
    except KeyboardInterrupt:
        if child is not None:
            _stop(child, mountpoints)
        raise
    if line == "ready":
        for each in mounts:
            print(f"cachefsd: mounted {each.source} on {each.mountpoint} (pid {child.pid})")
        return 0
    if line is None:
        _stop(child, mountpoints)
        line = f"the mount was not ready within {MOUNT_READY_SECONDS:g}s; see {log_path}"
    elif not line:
        # The daemon closed the pipe without a word: it is exiting (a crash
        # at start), and is reaped here, not taken for a slow mount.
        try:
            line = f"the daemon exited with status {child.wait(timeout=UNMOUNT_SECONDS)}; see {log_path}"
        except subprocess.TimeoutExpired:
            _stop(child, mountpoints)
            line = f"the daemon closed its ready pipe and did not exit; see {log_path}"
    print(f"cachefsd: error: {line}", file=sys.stderr)
    return 1


def _join(settings: Settings, running: MountState) -> int:
    """Mount ``settings`` on the daemon that serves its cache directory:
    one cache, one capacity, for all the node's mounts."""
    from cachefsd.control.client import ControlClient  # noqa: PLC0415 - only this path needs it

    tree = settings.model_dump(mode="json", exclude_unset=True)
    state = ControlClient(running.control_socket, MOUNT_READY_SECONDS).attach(tree)
    print(
        f"cachefsd: mounted {settings.source} on {state.mountpoint} "
        f"(pid {state.pid}, joined the daemon of {settings.cache.dir})"
    )
    return 0


def _ready_line(read_end: int) -> str | None:
    """The daemon's last line on the ready pipe: "" if it closed the pipe
    without one, None if it stayed silent for ``MOUNT_READY_SECONDS``; its
    warnings before that line go to stderr."""
    line = ""
    pending = b""
    deadline = time.monotonic() + MOUNT_READY_SECONDS
    with os.fdopen(read_end, "rb") as ready_pipe:
        while not line:
            remaining = deadline - time.monotonic()
            readable, _, _ = select.select([ready_pipe], [], [], max(0.0, remaining))
            if not readable:
                return None
            chunk = os.read(ready_pipe.fileno(), 4096)
            if not chunk:
                break
            pending += chunk
            while b"\n" in pending and not line:
                raw, pending = pending.split(b"\n", 1)
                text = raw.decode(errors="replace").strip()
                if text.startswith(WARNING_PREFIX):
                    print(f"cachefsd: {text}", file=sys.stderr)
                else:
                    line = text
    return line


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _stop(child: subprocess.Popen[bytes], mountpoints: list[Path]) -> None:
    """Stop a daemon that is not (or not yet) mounted: SIGTERM, which
    unmounts cleanly if it just got there; SIGKILL if it does not exit;
    then a lazy unmount of what it may have left, where the mount there is
    its own (another daemon may have mounted that path meanwhile). A second
    Ctrl-C must not cut this short."""
    with _signals_set(_STOP_SIGNALS, signal.SIG_IGN):
        child.terminate()
        try:
            child.wait(timeout=UNMOUNT_SECONDS)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        for mountpoint in mountpoints:
            state = read_state(mountpoint)
            ours = state is not None and state.pid == child.pid
            if ours and mount_types().get(str(mountpoint)) == MOUNT_TYPE:
                subprocess.run(
                    ["fusermount3", "-uz", str(mountpoint)], capture_output=True, timeout=10, check=False
                )


@contextlib.contextmanager
def _signals_set(signums: tuple[signal.Signals, ...], handler: Any) -> Iterator[None]:
    """``handler`` for ``signums`` within the block, the previous ones after."""
    previous = {signum: signal.signal(signum, handler) for signum in signums}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def _upload_before_unmount(state: MountState) -> None:
    """Give a writable mount's uploads due a while to reach the bucket, and
    say which stay staged (a read-only mount has none to wait for)."""
    from cachefsd.control.client import ControlClient  # noqa: PLC0415 - only when unmounting

    try:
        answer = ControlClient(state.control_socket).sync(UNMOUNT_UPLOAD_SECONDS)
    except ControlError:
        return  # read-only, or the daemon does not answer: nothing to wait for
    for key, why in sorted(answer["failed"].items()):
        print(
            f"cachefsd: {WARNING_PREFIX}{key} is not in the bucket ({why}); it stays staged in the cache, "
            f"and the next mount of {state.source} on it uploads it",
            file=sys.stderr,
        )


def unmount(mountpoint: Path, timeout: float = UNMOUNT_SECONDS) -> None:
    """Unmount, and wait until the mount's data path is closed, and its
    daemon has exited when it was its last mount (so its cache is released)."""
    mountpoint = mountpoint.resolve()
    state = read_state(mountpoint)
    kind = mount_types().get(str(mountpoint))
    if kind is None:
        raise CachefsdError(f"{mountpoint} is not mounted")
    if kind != MOUNT_TYPE:
        # As root, fusermount3 -u unmounts any filesystem.
        raise CachefsdError(f"{mountpoint} is a {kind} mount, not cachefsd's: left mounted")

    def fusermount(flag: str) -> subprocess.CompletedProcess[str]:
        command = ["fusermount3", flag, str(mountpoint)]
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)

    if state is not None and pid_alive(state.pid):
        _upload_before_unmount(state)
    result = fusermount("-u")
    if result.returncode != 0 and state is not None and not pid_alive(state.pid):
        # Its daemon died (kill -9, OOM) and a process still holds a file
        # open under it, so the plain unmount is "busy". Nothing can serve
        # that file again: detach the mount now, and let the kernel drop it
        # when the last holder lets go.
        result = fusermount("-uz")
    if result.returncode != 0:
        raise CachefsdError(result.stderr.strip() or f"fusermount3 -u {mountpoint} failed")
    if state is None:
        return
    # Done once this mount's state file is gone (its data path is closed)
    # while the daemon serves other mounts; else once it has exited (its
    # cache is released).
    deadline = time.monotonic() + timeout
    while pid_alive(state.pid):
        if read_state(mountpoint) is None and any(other.pid == state.pid for other in daemon_states()):
            return
        if time.monotonic() > deadline:
            raise CachefsdError(f"unmounted, but daemon pid {state.pid} did not finish within {timeout:g}s")
        time.sleep(_POLL_SECONDS)
