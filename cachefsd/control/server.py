"""The control API's server: a small HTTP/1.1 service on a Unix socket,
and the handlers that serve it from a daemon's data path.

A running daemon serves it next to its state file in the runtime directory
(``<runtime dir>/<id>.sock``, recorded in ``MountState.control_socket``), so
the CLI (``cachefsd stage``, ``cachefsd hint``) and loaders
(``cachefsd.hints``, through client.py) reach the daemon of a mount from the
mount's path. The socket is owner-only (0600, in a 0700 directory): the API
can make the daemon download a whole bucket, so only the mounting user may
call it.

Endpoints (bodies are JSON; errors are ``{"error": message}`` with a 4xx/5xx):

- ``GET /stats``: a ``StatsAnswer`` (``answers.py``).
- ``POST /hint`` ``{"order": [path, ...], "part": [rank, world size]|null}``
  (mount-relative paths, in the order the loader will read them) ->
  ``{"accepted": N, "unknown": M}``.
- ``GET /diagnose``: a ``DiagnosisAnswer``, the loader meters' jobs
  (``diagnose/service.py``).
- ``POST /meter`` ``{"meter": id, "readers": N, "batches": N,
  "data_wait_seconds": s, "step_seconds": s}`` (a loader meter's totals so
  far) -> ``{}``.
- ``POST /stage`` ``{"path": "/", "include": glob|null, "tier": name|null,
  "check": bool}`` -> newline-delimited JSON events (chunked transfer), the
  last one ``{"event": "summary", ...}`` or ``{"event": "error", ...}``.
- ``POST /sync`` ``{"timeout": seconds|null}``: answers once every file
  closed on a writable mount is in the bucket, or failed an attempt, or
  ``timeout`` passed -> ``{"uploaded": N, "failed": {key: why}}``.
- ``POST /mounts`` ``{"settings": {...}}`` (``Settings.model_dump`` without
  the fields left unset) mounts another source on this daemon's node and
  answers once it is ready -> the new mount's ``MountState``; a mount it
  cannot make is refused with 409 and why (the setting at fault first).

Request bodies are pydantic models that forbid unknown fields. A bad request
is answered with 400 and never reaches the data path; a handler that fails
is answered with 500 and logged; neither stops the server.

Concurrency: the server runs each connection on its own thread
(``ThreadingUnixStreamServer``); the handlers object must be thread-safe.
``_active`` (the connections being served, so ``stop`` can wait for them) is
guarded by ``_lock``.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import logging
import os
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

from cachefsd.cache.tiered import TieredCache
from cachefsd.config import Settings, validated_settings
from cachefsd.control.answers import DiagnosisAnswer, HintCounts, NodeActivity, StatsAnswer, TierUsage
from cachefsd.control.client import MAX_BODY_BYTES, NDJSON, SMALL_BODY_BYTES, MeterTotals
from cachefsd.control.mounts import MountState
from cachefsd.errors import BadRequest, CachefsdError, StageCancelled
from cachefsd.namespace.tree import Namespace
from cachefsd.stage import Blocks, Report, Resident, StageRequest, normalise, stage_files
from cachefsd.writes.uploads import Uploads

log = logging.getLogger(__name__)

# Every blocking socket operation of the server (reading a request, writing
# a response) gives up after this long, so a stuck client holds one thread
# for a bounded time. Long enough to receive MAX_BODY_BYTES from a slow
# Python client in pieces: the timeout applies to each read, not the total.
SERVER_IO_TIMEOUT_SECONDS = 30.0
# How often the accept loop checks for ``stop``: the most an unmount waits
# for it. Five wake-ups a second of an idle thread cost nothing measurable.
ACCEPT_POLL_SECONDS = 0.2
# How long ``ControlServer.stop`` waits for requests in progress (a stage
# is cancelled first, so this covers the fetches already running).
STOP_WAIT_SECONDS = 10.0


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class HintBody(_Request):
    """``POST /hint``: the read order, and the rank's share it is, if one."""

    order: list[StrictStr]
    part: tuple[StrictInt, StrictInt] | None = None

    @model_validator(mode="after")
    def _rank_within_world(self) -> HintBody:
        if self.part is not None and not 0 <= self.part[0] < self.part[1]:
            raise ValueError("part: expected [rank, world size] with 0 <= rank < world size")
        return self


class MeterBody(_Request):
    """``POST /meter``: a loader meter's totals so far (``cachefsd.diagnose``).
    Bounded far above any run (2^53 batches, 30 years), so that sums stay exact and finite."""

    meter: StrictStr = Field(min_length=1, max_length=64)
    readers: StrictInt = Field(ge=0, le=1 << 16)
    batches: StrictInt = Field(ge=0, le=1 << 53)
    data_wait_seconds: float = Field(ge=0, le=1e9, allow_inf_nan=False)
    step_seconds: float = Field(ge=0, le=1e9, allow_inf_nan=False)

    @model_validator(mode="after")
    def _wait_within_step(self) -> MeterBody:
        if self.data_wait_seconds > self.step_seconds:
            raise ValueError(
                "data_wait_seconds: the wait for a batch is part of its step, so at most step_seconds"
            )
        return self


class MountBody(_Request):
    """``POST /mounts``: the settings of the mount to add."""

    settings: dict[StrictStr, Any]


class SyncBody(_Request):
    """``POST /sync``: how long to wait at most (None: each upload's own bound)."""

    timeout: StrictFloat | None = Field(default=None, ge=0)


class StageBody(_Request):
    """``POST /stage``: the fields of a ``StageRequest``."""

    path: StrictStr = "/"
    include: StrictStr | None = None
    tier: StrictStr | None = None
    check: StrictBool = False

    @field_validator("path")
    @classmethod
    def _no_nul(cls, path: str) -> str:
        if "\0" in path:
            raise ValueError("a path holds no NUL byte")
        return path


RequestBody = TypeVar("RequestBody", bound=_Request)


def _parsed(model: type[RequestBody], body: Any) -> RequestBody:
    """``body`` as a ``model``; ``BadRequest`` naming what is wrong."""
    if not isinstance(body, dict):
        raise BadRequest("expected a JSON object")
    unknown = set(body) - set(model.model_fields)
    if unknown:
        raise BadRequest(f"unknown fields: {', '.join(sorted(unknown))}")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        problems = [
            f"{'.'.join(str(part) for part in error['loc']) or 'body'}: {error['msg']}"
            for error in exc.errors()
        ]
        raise BadRequest("; ".join(problems)) from None


# struct ucred: pid, uid, gid.
_PEER_CREDENTIALS = struct.Struct("3i")


def _peer(connection: socket.socket) -> tuple[int, int]:
    """The pid and uid of the process at the other end of a Unix socket
    ((0, -1) if unknown)."""
    try:
        credentials = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEER_CREDENTIALS.size)
    except OSError:
        return 0, -1
    pid, uid, _ = _PEER_CREDENTIALS.unpack(credentials)
    return int(pid), int(uid)


class _ClientGone(ConnectionError):
    """Writing to the client failed: it hung up, or stopped reading."""


class ControlHandlers(Protocol):
    """What the server serves. Called on server threads, concurrently."""

    def stats(self) -> StatsAnswer:
        """What ``GET /stats`` answers."""
        ...

    def hint(self, order: list[str], part: tuple[int, int] | None, pid: int) -> tuple[int, int]:
        """Accept the read order of mount-relative paths from process
        ``pid`` (0 if unknown), for its job; returns (accepted, unknown).
        Paths that do not exist are counted, not errors. ``part`` is (rank,
        world size) when the order is one rank's share."""
        ...

    def meter(self, meter_id: str, totals: MeterTotals, readers: int, pid: int) -> None:
        """A loader meter's totals (its loop read by ``readers`` processes),
        from process ``pid`` (0 if unknown), for its job."""
        ...

    def diagnose(self) -> DiagnosisAnswer:
        """What ``GET /diagnose`` answers (``diagnose/service.py``)."""
        ...

    def stage(self, request: StageRequest, report: Report) -> dict[str, Any]:
        """Stage (or check) the selection, calling ``report`` with progress
        events as it goes (at least every few seconds: the client treats a
        long silence as a dead daemon); returns the summary. ``report``
        raises ``OSError`` when the client has gone: let it propagate to
        stop the work. Raise ``BadRequest`` before the first report for a
        request that cannot be served."""
        ...

    def attach(self, settings: dict[str, Any]) -> dict[str, Any]:
        """Mount ``settings`` on this daemon's node; its ``MountState`` once
        ready. Raise ``CachefsdError`` saying why it cannot be."""
        ...

    def sync(self, timeout: float | None) -> tuple[int, dict[str, str]]:
        """Upload now what is due and wait (``writes.uploads.Uploads.wait``):
        how many files were due, and those not in the bucket, with why."""
        ...

    def detach(self, mountpoint: str) -> None:
        """Unmount ``mountpoint``, attached for a client that has gone."""
        ...

    def close(self) -> None:
        """Cancel work in progress (a stage): the daemon is stopping."""
        ...


# -- server ----------------------------------------------------------------


class _UnixServer(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True  # a wedged client never keeps the daemon from exiting
    block_on_close = False  # ControlServer.stop waits itself, with a bound

    def __init__(self, path: str, owner: ControlServer) -> None:
        self.owner = owner
        super().__init__(path, _Handler)


class _ChunkedWriter:
    """The body of a chunked response, one JSON line a chunk."""

    def __init__(self, handler: _Handler) -> None:
        self._handler = handler
        self._started = False

    def event(self, event: dict[str, Any]) -> None:
        if not self._started:
            self._handler.send_response(200)
            self._handler.send_header("Content-Type", NDJSON)
            self._handler.send_header("Transfer-Encoding", "chunked")
            self._handler.send_header("Connection", "close")
            self._handler.end_headers()
            self._started = True
        line = json.dumps(event, separators=(",", ":")).encode() + b"\n"
        self._handler.send_bytes(b"%x\r\n%s\r\n" % (len(line), line))

    @property
    def started(self) -> bool:
        return self._started

    def end(self) -> None:
        self._handler.send_bytes(b"0\r\n\r\n")


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _UnixServer
    protocol_version = "HTTP/1.1"
    server_version = "cachefsd"
    timeout = SERVER_IO_TIMEOUT_SECONDS

    def address_string(self) -> str:
        """The base class indexes ``client_address``, which is an empty
        string for a Unix socket peer."""
        return "unix"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("control: " + format, *args)

    def handle(self) -> None:
        owner = self.server.owner
        owner._enter()
        try:
            super().handle()
        except (OSError, TimeoutError) as exc:  # the client went away or stalled
            log.debug("control: connection dropped: %s", exc)
        finally:
            owner._leave()

    # -- routes -----------------------------------------------------------

    def do_GET(self) -> None:
        self.close_connection = True
        handlers = self.server.owner.handlers
        routes: dict[str, Callable[[], BaseModel]] = {
            "/stats": handlers.stats,
            "/diagnose": handlers.diagnose,
        }
        if self.path not in routes:
            self._error(404, f"no such endpoint: GET {self.path}")
            return
        route = routes[self.path]
        self._call(lambda: self._json(200, route().model_dump(mode="json")))

    def do_POST(self) -> None:
        self.close_connection = True
        routes: dict[str, tuple[int, Callable[[Any], None]]] = {
            "/hint": (self.server.owner.max_body_bytes, self._hint),
            "/meter": (SMALL_BODY_BYTES, self._meter),
            "/stage": (SMALL_BODY_BYTES, self._stage),
            "/mounts": (SMALL_BODY_BYTES, self._attach),
            "/sync": (SMALL_BODY_BYTES, self._sync),
        }
        if self.path not in routes:
            self._error(404, f"no such endpoint: POST {self.path}")
            return
        limit, route = routes[self.path]
        body = self._body(limit)
        if body is not None:
            self._call(lambda: route(body))

    def _call(self, action: Callable[[], None]) -> None:
        try:
            action()
        except BadRequest as exc:
            self._error(400, str(exc))
        except _ClientGone:
            raise  # nobody to answer: ``handle`` drops the connection
        except Exception as exc:
            log.exception("control: %s %s failed", self.command, self.path)
            self._error(500, f"{type(exc).__name__}: {exc}")

    def _hint(self, body: Any) -> None:
        hint = _parsed(HintBody, body)
        accepted, unknown = self.server.owner.handlers.hint(hint.order, hint.part, _peer(self.request)[0])
        self._json(200, {"accepted": accepted, "unknown": unknown})

    def _meter(self, body: Any) -> None:
        meter = _parsed(MeterBody, body)
        totals = MeterTotals(meter.batches, meter.data_wait_seconds, meter.step_seconds)
        self.server.owner.handlers.meter(meter.meter, totals, meter.readers, _peer(self.request)[0])
        self._json(200, {})

    def _sync(self, body: Any) -> None:
        due, failed = self.server.owner.handlers.sync(_parsed(SyncBody, body).timeout)
        self._json(200, {"uploaded": due - len(failed), "failed": failed})

    def _attach(self, body: Any) -> None:
        handlers = self.server.owner.handlers
        if _peer(self.request)[1] != os.geteuid():
            # The socket is owner-only already; a mount is made with the
            # daemon's credentials, so its own user alone may ask for one.
            self._error(403, "only the daemon's own user may add a mount")
            return
        try:
            state = handlers.attach(_parsed(MountBody, body).settings)
        except CachefsdError as exc:
            self._error(409, str(exc))
            return
        try:
            self._json(200, state)
        except _ClientGone:
            # Nobody will be told it is mounted: no mount may appear behind its back.
            handlers.detach(state["mountpoint"])
            raise

    def _stage(self, body: Any) -> None:
        stage = _parsed(StageBody, body)
        request = StageRequest(**stage.model_dump())
        writer = _ChunkedWriter(self)
        try:
            summary = self.server.owner.handlers.stage(request, writer.event)
        except Exception as exc:
            if not writer.started or isinstance(exc, _ClientGone):
                raise  # answered with a status by ``_call``, or nobody to tell
            # Headers are out: the error travels as the last event.
            if isinstance(exc, StageCancelled):  # an unmount, not a failure
                log.info("control: stage stopped part way: %s", exc)
                writer.event({"event": "error", "message": str(exc), "cancelled": True})
            else:
                log.exception("control: stage failed")
                writer.event({"event": "error", "message": f"{type(exc).__name__}: {exc}"})
            writer.end()
            return
        writer.event({"event": "summary", **summary})
        writer.end()

    # -- plumbing ---------------------------------------------------------

    def _body(self, limit: int) -> Any | None:
        """The request's JSON body, or None after answering an error."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self._error(411, "send a Content-Length, not a chunked body")
            return None
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self._error(411, "a Content-Length header is required")
            return None
        if length < 0:
            self._error(400, "invalid Content-Length")
            return None
        if length > limit:
            # Refuse before reading: the point of the limit is to not allocate it.
            self._error(413, f"body of {length} bytes is over the {limit}-byte limit of {self.path}")
            return None
        raw = self.rfile.read(length)
        if len(raw) != length:
            raise ConnectionError("the client closed the connection mid-body")
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            self._error(400, f"body is not valid JSON: {exc}")
            return None

    def _json(self, status: int, payload: Any) -> None:
        body = json.dumps(payload, separators=(",", ":")).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.send_bytes(body)

    def end_headers(self) -> None:
        try:
            super().end_headers()
        except OSError as exc:
            raise _ClientGone(str(exc)) from exc

    def send_bytes(self, data: bytes) -> None:
        """Write to the client; ``_ClientGone`` if it has gone or stalled
        past the socket timeout."""
        try:
            self.wfile.write(data)
            self.wfile.flush()
        except OSError as exc:
            raise _ClientGone(str(exc)) from exc

    def _error(self, status: int, message: str) -> None:
        self._json(status, {"error": message})


class ControlServer:
    """Serves ``handlers`` on a Unix socket at ``path`` until ``stop``."""

    def __init__(
        self,
        path: Path,
        handlers: ControlHandlers,
        max_body_bytes: int = MAX_BODY_BYTES,
        accept_poll: float = ACCEPT_POLL_SECONDS,
    ) -> None:
        self.path = path
        self.handlers = handlers
        self.max_body_bytes = max_body_bytes
        self._accept_poll = accept_poll  # how long stop() may wait for the accept loop
        self._lock = threading.Lock()
        self._active = 0
        self._idle = threading.Condition(self._lock)
        self._server: _UnixServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Listen. The socket is bound under a temporary name, made
        owner-only, then renamed into place, so it is never reachable with
        wider permissions, and a stale socket of a crashed daemon is
        replaced atomically."""
        temp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        temp.unlink(missing_ok=True)
        server = _UnixServer(str(temp), self)
        try:
            os.chmod(temp, 0o600)
            temp.replace(self.path)
        except OSError:
            server.server_close()
            temp.unlink(missing_ok=True)
            raise
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, args=(self._accept_poll,), name="cachefsd-control", daemon=True
        )
        self._thread.start()
        log.info("control API on %s", self.path)

    def stop(self) -> None:
        """Stop accepting, cancel work in progress, and wait (bounded) for
        requests being served, so the data path is not torn down under them."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self.handlers.close()
        deadline = time.monotonic() + STOP_WAIT_SECONDS
        with self._idle:
            while self._active:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    log.warning("control: %d requests still running at shutdown", self._active)
                    break
                self._idle.wait(remaining)
        if self._thread is not None:
            self._thread.join(STOP_WAIT_SECONDS)

    def _enter(self) -> None:
        with self._lock:
            self._active += 1

    def _leave(self) -> None:
        with self._idle:
            self._active -= 1
            self._idle.notify_all()


class NodeMounts(Protocol):
    """The daemon a mount belongs to, which can take more mounts."""

    def attach(self, settings: Settings) -> MountState: ...
    def detach(self, mountpoint: str) -> None: ...


class Diagnoses(Protocol):
    """A mount's loader meters as ``POST /meter`` and ``GET /diagnose`` see
    them (``diagnose.service.Diagnosis``)."""

    def meter(self, pid: int, meter_id: str, totals: MeterTotals, readers: int) -> None:
        """A meter's report, for the job of the process ``pid`` that sent it."""
        ...

    def snapshot(self) -> DiagnosisAnswer: ...


class MountHandlers:
    """What a mounted daemon serves on its control socket
    (``ControlHandlers``): its stats, hints handed to the prefetcher, and
    stages run on its own data path. The server side only: the client
    (``control/client.py``, imported by loaders through ``cachefsd.hints``)
    stays free of the data path."""

    def __init__(
        self,
        namespace: Namespace,
        reader: Blocks,
        resident: Resident,
        cache: TieredCache,
        mount: MountState,
        activity: Callable[[], NodeActivity],
        hint: Callable[[list[str], tuple[int, int] | None, int], tuple[int, int]] | None = None,
        node: NodeMounts | None = None,
        diagnosis: Diagnoses | None = None,
        uploads: Uploads | None = None,
    ) -> None:
        """``mount``: what identifies the mount in ``/stats`` (pid, mountpoint,
        source); ``activity``: what its daemon measured
        (``stats.DaemonStats.snapshot``). ``hint``: the prefetcher's, when
        there is one; without it a hint is only checked against the
        namespace and counted. ``node``: the daemon that takes more mounts,
        if any. ``diagnosis``: the loader meters' ledger, without which
        reports are refused. ``uploads``: a writable mount's uploader."""
        self._namespace = namespace
        self._uploads = uploads
        self._reader = reader
        self._resident = resident
        self._cache = cache
        self._mount = mount
        self._activity = activity
        self._hint = hint
        self._node = node
        self._diagnosis = diagnosis
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._hints = {"received": 0, "paths": 0, "accepted": 0, "unknown": 0}

    def stats(self) -> StatsAnswer:
        with self._lock:
            hints = HintCounts(**self._hints)
        return StatsAnswer(
            pid=self._mount.pid,
            mountpoint=self._mount.mountpoint,
            source=self._mount.source,
            block_size=self._reader.block_size,
            tiers=[
                TierUsage(
                    name=tier.name,
                    dir=str(tier.root),
                    capacity_bytes=tier.capacity,
                    used_bytes=tier.used_bytes,
                    blocks=tier.block_count,
                )
                for tier in self._cache.tiers
            ],
            hints=hints,
            **dict(self._activity()),
        )

    def hint(self, order: list[str], part: tuple[int, int] | None = None, pid: int = 0) -> tuple[int, int]:
        if self._hint is not None:
            accepted, unknown = self._hint(order, part, pid)
        else:
            accepted = sum(1 for path in order if self._is_file(path))
            unknown = len(order) - accepted
        with self._lock:
            self._hints["received"] += 1
            self._hints["paths"] += len(order)
            self._hints["accepted"] += accepted
            self._hints["unknown"] += unknown
        return accepted, unknown

    def meter(self, meter_id: str, totals: MeterTotals, readers: int, pid: int) -> None:
        if self._diagnosis is None:
            raise BadRequest("this daemon keeps no loader meters")
        self._diagnosis.meter(pid, meter_id, totals, readers)

    def diagnose(self) -> DiagnosisAnswer:
        if self._diagnosis is None:
            raise BadRequest("this daemon keeps no loader meters")
        return self._diagnosis.snapshot()

    def _is_file(self, path: str) -> bool:
        try:
            return self._namespace.lookup(normalise(path)).info is not None
        except CachefsdError:
            return False

    def stage(self, request: StageRequest, report: Report) -> dict[str, Any]:
        tiers = [tier.name for tier in self._cache.tiers]
        return stage_files(
            self._namespace, self._reader, self._resident, tiers, request, report, self._closing
        )

    def attach(self, settings: dict[str, Any]) -> dict[str, Any]:
        if self._node is None:
            raise CachefsdError("this daemon takes no more mounts")
        return asdict(self._node.attach(validated_settings(settings)))

    def detach(self, mountpoint: str) -> None:
        if self._node is not None:
            self._node.detach(mountpoint)

    def sync(self, timeout: float | None) -> tuple[int, dict[str, str]]:
        if self._uploads is None:
            raise BadRequest("the mount is read-only: it has nothing to upload")
        return self._uploads.wait(None, timeout)

    def close(self) -> None:
        self._closing.set()
