"""The uploader: takes staged files due for upload to the bucket, in the
background, in the journal's order for each key.

A few threads (``UPLOAD_WORKERS``), each running one upload at a time on
the daemon's event loop (the store sends a large file as parts in flight
together). Two uploads to one key never run at once, and run in the
journal's order, so the bucket ends with what was written last. Each attempt is bounded (the fetch
deadline, plus the time the file takes at ``FLOOR_BYTES_PER_SECOND``); a
failed one is retried, backing off up to ``MAX_BACKOFF_SECONDS``, for as
long as the daemon runs: a staged file is never dropped for failing. Its
failures are counted and logged, and ``wait`` (``fsync``, ``cachefsd
sync``) names it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from cachefsd import turns
from cachefsd.aio import LoopThread
from cachefsd.errors import CachefsdError, DaemonStopping
from cachefsd.store.base import ObjectInfo, ObjectStore
from cachefsd.writes.staged import Staging

log = logging.getLogger(__name__)

# Uploads in flight at once: each sends its parts in parallel already, so
# a few files saturate a link, and more only split it; each holds up to
# 160 MiB of parts in memory (``store.s3.UploadTuning``), 640 MiB in all.
UPLOAD_WORKERS = 4
# The slowest an upload may go before its attempt counts as failed.
FLOOR_BYTES_PER_SECOND = 4 << 20
MAX_BACKOFF_SECONDS = 60.0
# The kernel sends a file's release after close(2) has returned, just after
# the flush of its last descriptor; a writer that closed a descriptor but
# holds another (a dup) keeps the file open, and is not waited for past this.
RELEASE_WAIT_SECONDS = 1.0


class UploadEvents(Protocol):
    """What the uploader tells the metrics."""

    def upload_started(self) -> None: ...
    def upload_ended(
        self, result: Literal["ok", "failed", "dropped"], seconds: float, nbytes: int
    ) -> None: ...


@dataclass(slots=True)
class _Pending:
    op: int  # its journal row
    key: str
    since: float  # when it became due
    running: concurrent.futures.Future[ObjectInfo] | None = None
    cancelled: bool = False
    retry_at: float = 0.0
    failures: int = 0
    last_error: str | None = None


class Uploads:
    """The due operations of one mount, and the threads that run them."""

    def __init__(
        self,
        store: ObjectStore,
        staging: Staging,
        io: LoopThread,
        events: UploadEvents,
        deadline: float,
        wrote: Callable[[ObjectInfo], None],
        removed: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``wrote(info)`` is told of each object uploaded, ``removed(key)``
        of each deleted (``_delete_if_unwanted``)."""
        self._store = store
        self._staging = staging
        self._io = io
        self._events = events
        self._deadline = deadline
        self._wrote = wrote
        self._removed = removed
        self._clock = clock
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._pending: dict[int, _Pending] = {}
        self._running_keys: set[str] = set()
        self._stopping = False
        self._threads = [
            threading.Thread(target=self._work, name="cachefsd-upload", daemon=True)
            for _ in range(UPLOAD_WORKERS)
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    # -- what staging tells -------------------------------------------------

    def due(self, op: int, key: str) -> None:
        with self._wake:
            pending = self._pending.get(op)
            if pending is None or pending.cancelled:
                self._pending[op] = _Pending(op, key, self._clock())
            else:
                pending.retry_at = 0.0
            self._wake.notify_all()

    def cancel(self, op: int) -> None:
        """``op`` is not to be uploaded (as it is). An attempt under way is
        cut short, and stays due until its worker has settled it
        (``_delete_if_unwanted``), so that ``wait`` waits for that too."""
        with self._wake:
            pending = self._pending.get(op)
            if pending is None:
                return
            pending.cancelled = True
            if pending.running is None:
                del self._pending[op]
            else:
                pending.running.cancel()
            self._wake.notify_all()

    # -- waiting --------------------------------------------------------------

    def wait(self, ops: list[int] | None, timeout: float | None) -> tuple[int, dict[str, str]]:
        """Run ``ops`` (every due one if None) now and wait until each is
        done or failed an attempt, or ``timeout`` passed: how many were
        due, and key -> why for those not in the bucket (none: all are)."""
        end = None if timeout is None else self._clock() + timeout
        turns.give_up()
        with self._wake:
            if ops is None:  # what was closed before: some releases may still be on their way
                settled = self._clock() + min(RELEASE_WAIT_SECONDS, timeout or RELEASE_WAIT_SECONDS)
                while self._staging.any_closing() and (until_settled := settled - self._clock()) > 0:
                    self._wake.wait(until_settled)
            ids = list(self._pending) if ops is None else [op for op in ops if op in self._pending]
            failures = {op: self._pending[op].failures for op in ids}
            for op in ids:
                self._pending[op].retry_at = 0.0
            self._wake.notify_all()
            while True:
                left = {op: self._pending[op] for op in ids if op in self._pending}
                failed = {op: each for op, each in left.items() if each.failures > failures[op]}
                if len(failed) == len(left):
                    return len(ids), {each.key: each.last_error or "failed" for each in failed.values()}
                remaining = None if end is None else end - self._clock()
                if remaining is not None and remaining <= 0:
                    return len(ids), {
                        each.key: each.last_error or f"not uploaded within {timeout:g}s"
                        for each in left.values()
                    }
                self._wake.wait(remaining)

    def oldest_due_seconds(self) -> float:
        """How long the oldest due operation has waited (0: none is)."""
        with self._lock:
            oldest = min((each.since for each in self._pending.values()), default=None)
        return 0.0 if oldest is None else self._clock() - oldest

    def due_count(self) -> int:
        """Operations due: waiting, running, or failed and to be retried."""
        with self._lock:
            return len(self._pending)

    def failing(self) -> int:
        """Operations whose last attempt failed."""
        with self._lock:
            return sum(1 for each in self._pending.values() if each.failures)

    def oldest_failing(self) -> tuple[str, str] | None:
        """(key, its last attempt's error) of the failing operation due longest."""
        with self._lock:
            failing = [each for each in self._pending.values() if each.failures]
            oldest = min(failing, key=lambda each: each.since, default=None)
            return None if oldest is None else (oldest.key, oldest.last_error or "failed")

    def stop(self, wait: float) -> list[str]:
        """Wait up to ``wait`` seconds for what is due and has not failed
        yet (``cachefsd unmount`` waited for the rest already), then stop;
        the keys left (still staged, uploaded by the next mount of this
        source)."""
        with self._lock:
            untried = [op for op, each in self._pending.items() if not each.failures]
        self.wait(untried, wait)
        with self._wake:
            self._stopping = True
            left = [each.key for each in self._pending.values()]
            for each in self._pending.values():
                if each.running is not None:
                    each.cancelled = True
                    each.running.cancel()
            self._wake.notify_all()
        for thread in self._threads:
            thread.join(self._deadline)
        return left

    # -- the workers ----------------------------------------------------------

    def _take(self) -> _Pending | None:
        with self._wake:
            while not self._stopping:
                now = self._clock()
                keys: set[str] = set()  # each key's oldest operation is its only candidate
                for op_id in sorted(self._pending):
                    each = self._pending[op_id]
                    if each.key in keys:
                        continue
                    keys.add(each.key)
                    if each.retry_at <= now and each.key not in self._running_keys:
                        self._running_keys.add(each.key)
                        return each
                waits = [each.retry_at - now for each in self._pending.values() if each.retry_at > now]
                self._wake.wait(min(waits, default=None))
        return None

    def _work(self) -> None:
        while (pending := self._take()) is not None:
            try:
                self._run(pending)
            finally:
                with self._wake:
                    self._running_keys.discard(pending.key)
                    pending.running = None
                    self._wake.notify_all()

    def _run(self, pending: _Pending) -> None:
        started = self._clock()
        self._events.upload_started()
        try:
            nbytes = self._upload(pending)
        except Exception as exc:
            if pending.cancelled or isinstance(exc, DaemonStopping):
                self._events.upload_ended("dropped", self._clock() - started, 0)
                if pending.running is not None:  # its request may have landed all the same
                    self._delete_if_unwanted(pending.key)
                self._finished(pending)
                return
            self._events.upload_ended("failed", self._clock() - started, 0)
            if not isinstance(exc, CachefsdError):
                log.exception("uploading %s failed unexpectedly", pending.key)
            self._failed(pending, exc)
            return
        if nbytes is None:
            self._events.upload_ended("dropped", self._clock() - started, 0)
        else:
            self._events.upload_ended("ok", self._clock() - started, nbytes)

    def _upload(self, pending: _Pending) -> int | None:
        """Upload the staged file of ``pending``; its bytes, or None if it
        changed meanwhile (a writer holds it, or it is due again)."""
        file = self._staging.for_op(pending.op)
        if file is None:  # unlinked, renamed (a new op) or replaced meanwhile
            self._finished(pending)
            return None
        version, size = file.version, file.size
        if file.durable == version and file.info is not None:
            info = file.info  # an fsync uploaded it as it is
        else:
            timeout = self._deadline + size / FLOOR_BYTES_PER_SECOND
            info = self._submit(pending, self._store.put_file(pending.key, file.path), timeout)
            # Listed before the staged file leaves the listing, so that
            # the name never disappears between the two.
            self._wrote(info)
        if not self._staging.uploaded(file, version, info):
            # Written to while it uploaded (due again once closed), or
            # renamed or unlinked.
            self._delete_if_unwanted(pending.key)
            if file.writers or pending.cancelled:  # its next close makes it due again
                self._finished(pending)
            return None
        self._finished(pending)
        return size

    def _submit(
        self, pending: _Pending, coroutine: Coroutine[Any, Any, ObjectInfo], timeout: float
    ) -> ObjectInfo:
        with self._wake:
            if pending.cancelled or self._stopping:
                coroutine.close()
                raise DaemonStopping("cancelled")
            future = self._io.submit(coroutine)
            pending.running = future
        return self._io.result(future, timeout)

    def _delete_if_unwanted(self, key: str) -> None:
        """An upload to ``key`` ended after its file was renamed, unlinked
        or written to. Unless a file is staged under ``key`` (written to,
        or another one there since), what it put there is no one's, and
        goes: a renamed file is not left under its old name too. Run while
        the worker holds ``key``, so a later upload to it comes after."""
        if self._stopping or self._staging.find(key) is not None:
            return
        try:
            self._io.run(self._store.delete(key), self._deadline)
        except CachefsdError as exc:
            log.warning("%s was renamed or unlinked as it uploaded and stays in the bucket: %s", key, exc)
            return
        self._removed(key)

    def _finished(self, pending: _Pending) -> None:
        with self._wake:
            if self._pending.get(pending.op) is pending:
                del self._pending[pending.op]
            self._wake.notify_all()

    def _failed(self, pending: _Pending, exc: Exception) -> None:
        with self._wake:
            pending.failures += 1
            pending.last_error = str(exc)
            pending.retry_at = self._clock() + min(MAX_BACKOFF_SECONDS, 2.0**pending.failures)
            self._wake.notify_all()
        log.warning(
            "uploading %s failed (attempt %d): %s; it stays staged and is retried",
            pending.key,
            pending.failures,
            exc,
        )
