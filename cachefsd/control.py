"""The control API: a small HTTP/1.1 service on a Unix socket, and its client.

A running daemon serves it next to its state file in the runtime directory
(``<runtime dir>/<id>.sock``, recorded in ``MountState.control_socket``), so
the CLI (``cachefsd stage``, ``cachefsd hint``) and loaders
(``cachefsd.hints``) reach the daemon of a mount from the mount's path. The
socket is owner-only (0600, in a 0700 directory): the API can make the
daemon download a whole bucket, so only the mounting user may call it.

Endpoints (bodies are JSON; errors are ``{"error": message}`` with a 4xx/5xx):

- ``GET /stats``: whatever ``ControlHandlers.stats()`` returns.
- ``POST /hint`` ``{"order": [path, ...]}`` (mount-relative paths, in the
  order the loader will read them) -> ``{"accepted": N, "unknown": M}``.
- ``POST /stage`` ``{"path": "/", "include": glob|null, "tier": name|null,
  "check": bool}`` -> newline-delimited JSON events (chunked transfer), the
  last one ``{"event": "summary", ...}`` or ``{"event": "error", ...}``.

Only the standard library is used, so ``cachefsd.hints`` stays importable in
any training environment. One request per connection: connections are cheap
on a Unix socket, and it keeps every wait on both sides a single bounded
socket timeout. A bad request is answered with 400 and never reaches the
data path; a handler that fails is answered with 500 and logged; neither
stops the server.

Concurrency: the server runs each connection on its own thread
(``ThreadingUnixStreamServer``); the handlers object must be thread-safe.
``_active`` (the connections being served, so ``stop`` can wait for them) is
guarded by ``_lock``.
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import json
import logging
import os
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from cachefsd.errors import CachefsdError, StageCancelled
from cachefsd.runtime import MOUNT_TYPE, MountState, mount_types, pid_alive, read_state, state_path

log = logging.getLogger(__name__)

# The largest request body accepted. A hint carries one path per sample of
# an epoch: 10 million samples with ~25-byte paths is ~250 MB of JSON, and a
# body is read into memory once, so 256 MiB admits the largest datasets we
# know of while bounding what one request can make the daemon allocate.
MAX_BODY_BYTES = 256 << 20
# Requests other than a hint are a few fields; anything larger is a mistake.
SMALL_BODY_BYTES = 64 << 10
# Every blocking socket operation of the server (reading a request, writing
# a response) gives up after this long, so a stuck client holds one thread
# for a bounded time. Long enough to receive MAX_BODY_BYTES from a slow
# Python client in pieces: the timeout applies to each read, not the total.
SERVER_IO_TIMEOUT_SECONDS = 30.0
# Client: a connect to a live daemon is immediate; one that does not accept
# within this long is wedged.
CONNECT_TIMEOUT_SECONDS = 5.0
# Client: how long a call waits for an answer. A hint for millions of paths
# is checked against the namespace before the daemon answers, which may take
# a few listings when they are not cached yet.
CALL_TIMEOUT_SECONDS = 60.0
# Client: the longest silence accepted while a stage streams. The server
# sends a progress event at least every ``stage.PROGRESS_INTERVAL_SECONDS``,
# so this only trips on a daemon that stopped answering.
STREAM_IDLE_SECONDS = 60.0
# How often the accept loop checks for ``stop``: the most an unmount waits
# for it. Five wake-ups a second of an idle thread cost nothing measurable.
ACCEPT_POLL_SECONDS = 0.2
# How long ``ControlServer.stop`` waits for requests in progress (a stage
# is cancelled first, so this covers the fetches already running).
STOP_WAIT_SECONDS = 10.0

NDJSON = "application/x-ndjson"


class ControlError(CachefsdError):
    """The daemon could not be reached, or refused a request (the message
    says which, and why)."""


class _ClientGone(ConnectionError):
    """Writing to the client failed: it hung up, or stopped reading."""


class BadRequest(CachefsdError):
    """A request the server answers with 400; handlers raise it for
    arguments they cannot accept (an unknown tier, a missing path). In
    this process (an offline stage) it is a plain one-line error."""


@dataclass(frozen=True, slots=True)
class StageRequest:
    """What ``POST /stage`` asks for: the files under ``path`` (mount-relative)
    whose mount-relative path matches ``include``, fetched into ``tier``
    (None: the fastest with room), or only measured when ``check``."""

    path: str = "/"
    include: str | None = None
    tier: str | None = None
    check: bool = False

    @classmethod
    def from_json(cls, body: Any) -> StageRequest:
        if not isinstance(body, dict):
            raise BadRequest("expected a JSON object")
        unknown = set(body) - {"path", "include", "tier", "check"}
        if unknown:
            raise BadRequest(f"unknown fields: {', '.join(sorted(unknown))}")
        path = body.get("path", "/")
        include = body.get("include")
        tier = body.get("tier")
        check = body.get("check", False)
        if not isinstance(path, str) or "\0" in path:
            raise BadRequest("path: expected a string")
        if include is not None and not isinstance(include, str):
            raise BadRequest("include: expected a glob string or null")
        if tier is not None and not isinstance(tier, str):
            raise BadRequest("tier: expected a tier name or null")
        if not isinstance(check, bool):
            raise BadRequest("check: expected true or false")
        return cls(path, include, tier, check)


Report = Callable[[dict[str, Any]], None]


class ControlHandlers(Protocol):
    """What the server serves. Called on server threads, concurrently."""

    def stats(self) -> dict[str, Any]:
        """A JSON-serialisable snapshot for ``GET /stats``."""
        ...

    def hint(self, order: list[str], part: tuple[int, int] | None) -> tuple[int, int]:
        """Accept the read order of mount-relative paths; returns (accepted,
        unknown). Paths that do not exist are counted, not errors. ``part``
        is (rank, world size) when the order is one rank's share."""
        ...

    def stage(self, request: StageRequest, report: Report) -> dict[str, Any]:
        """Stage (or check) the selection, calling ``report`` with progress
        events as it goes (at least every few seconds: the client treats a
        long silence as a dead daemon); returns the summary. ``report``
        raises ``OSError`` when the client has gone: let it propagate to
        stop the work. Raise ``BadRequest`` before the first report for a
        request that cannot be served."""
        ...

    def close(self) -> None:
        """Cancel work in progress (a stage): the daemon is stopping."""
        ...


def control_path(mountpoint: Path) -> Path:
    """Where the daemon of ``mountpoint`` listens: next to its state file."""
    return state_path(mountpoint).with_suffix(".sock")


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
        if self.path != "/stats":
            self._error(404, f"no such endpoint: GET {self.path}")
            return
        self._call(lambda: self._json(200, self.server.owner.handlers.stats()))

    def do_POST(self) -> None:
        self.close_connection = True
        routes: dict[str, tuple[int, Callable[[Any], None]]] = {
            "/hint": (self.server.owner.max_body_bytes, self._hint),
            "/stage": (SMALL_BODY_BYTES, self._stage),
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
        if not isinstance(body, dict) or "order" not in body or not set(body) <= {"order", "part"}:
            raise BadRequest('expected {"order": [path, ...]} and optionally "part": [rank, world size]')
        order = body["order"]
        if not isinstance(order, list) or not all(isinstance(path, str) for path in order):
            raise BadRequest("order: expected a list of path strings")
        part = body.get("part")
        if part is not None:
            valid = isinstance(part, list) and len(part) == 2 and all(isinstance(n, int) for n in part)
            if not valid or not 0 <= part[0] < part[1]:
                raise BadRequest("part: expected [rank, world size] with 0 <= rank < world size")
            part = (part[0], part[1])
        accepted, unknown = self.server.owner.handlers.hint(order, part)
        self._json(200, {"accepted": accepted, "unknown": unknown})

    def _stage(self, body: Any) -> None:
        request = StageRequest.from_json(body)
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

    def __init__(self, path: Path, handlers: ControlHandlers, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.path = path
        self.handlers = handlers
        self.max_body_bytes = max_body_bytes
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
            target=server.serve_forever, args=(ACCEPT_POLL_SECONDS,), name="cachefsd-control", daemon=True
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


# -- client ----------------------------------------------------------------


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(min(self.timeout or CONNECT_TIMEOUT_SECONDS, CONNECT_TIMEOUT_SECONDS))
            sock.connect(self._path)
            sock.settimeout(self.timeout)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


class ControlClient:
    """Calls the control API of one daemon; every call is bounded in time
    and raises ``ControlError`` (never a raw socket error)."""

    def __init__(self, socket_path: str | Path, timeout: float = CALL_TIMEOUT_SECONDS) -> None:
        self.socket_path = str(socket_path)
        self._timeout = timeout

    def stats(self) -> dict[str, Any]:
        return self._call("GET", "/stats", None, self._timeout)

    def hint(self, order: list[str], part: tuple[int, int] | None = None) -> tuple[int, int]:
        body: dict[str, Any] = {"order": order}
        if part is not None:
            body["part"] = list(part)
        answer = self._call("POST", "/hint", body, self._timeout, MAX_BODY_BYTES)
        return int(answer["accepted"]), int(answer["unknown"])

    def stage(self, request: StageRequest) -> Iterator[dict[str, Any]]:
        """The events of a stage as they arrive, ending with its summary
        (``ControlError`` if it ends with an error or the stream breaks)."""
        connection = self._open("POST", "/stage", asdict(request), STREAM_IDLE_SECONDS, SMALL_BODY_BYTES)
        try:
            response = self._response(connection)
            if response.status != 200:
                raise ControlError(self._refusal(response))
            for line in response:
                event = json.loads(line)
                if event.get("event") == "error" and event.get("cancelled"):
                    raise ControlError(
                        f"the stage stopped part way ({event.get('message')}); what it staged is kept, "
                        "and a rerun on the next mount resumes"
                    )
                if event.get("event") == "error":
                    raise ControlError(f"the daemon failed to stage: {event.get('message')}")
                yield event
                if event.get("event") == "summary":
                    return
            raise ControlError("the daemon closed the stage stream without a summary")
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise ControlError(f"lost the daemon at {self.socket_path} while staging: {exc}") from exc
        finally:
            connection.close()

    def _call(self, method: str, path: str, body: Any, timeout: float, limit: int = SMALL_BODY_BYTES) -> Any:
        connection = self._open(method, path, body, timeout, limit)
        try:
            response = self._response(connection)
            payload = response.read()
            if response.status != 200:
                raise ControlError(self._refusal(response, payload))
            return json.loads(payload)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise ControlError(f"no answer from the daemon at {self.socket_path}: {exc}") from exc
        finally:
            connection.close()

    def _open(self, method: str, path: str, body: Any, timeout: float, limit: int) -> _UnixConnection:
        data = None if body is None else json.dumps(body, separators=(",", ":")).encode()
        if data is not None and len(data) > limit:
            raise ControlError(
                f"{method} {path}: the request is {len(data)} bytes, over the daemon's limit of {limit}"
            )
        connection = _UnixConnection(self.socket_path, timeout)
        headers = {"Content-Type": "application/json"} if data is not None else {}
        try:
            connection.request(method, path, body=data, headers=headers)
        except (BrokenPipeError, ConnectionResetError):
            # The daemon answered and closed before reading the whole body
            # (a refusal, e.g. 413): its answer is still there to be read.
            pass
        except OSError as exc:
            connection.close()
            raise ControlError(
                f"cannot reach the daemon at {self.socket_path}: {exc.strerror or exc}"
            ) from exc
        return connection

    def _response(self, connection: _UnixConnection) -> http.client.HTTPResponse:
        try:
            return connection.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            raise ControlError(f"no answer from the daemon at {self.socket_path}: {exc}") from exc

    @staticmethod
    def _refusal(response: http.client.HTTPResponse, payload: bytes | None = None) -> str:
        payload = response.read() if payload is None else payload
        try:
            message = json.loads(payload)["error"]
        except (ValueError, KeyError, TypeError):
            message = payload.decode(errors="replace").strip() or response.reason
        return f"the daemon refused the request ({response.status}): {message}"


# -- finding the daemon of a path -------------------------------------------


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


def client_for(mount: MountOf, timeout: float = CALL_TIMEOUT_SECONDS) -> ControlClient:
    """A client for the daemon of ``mount``; ``ControlError`` saying why
    there is none (not running, or too old to serve the API)."""
    if not mount.live:
        raise ControlError(f"the daemon of {mount.mountpoint} is not running (pid {mount.state.pid})")
    if mount.state.control_socket is None:
        raise ControlError(f"the daemon of {mount.mountpoint} serves no control API (restart the mount)")
    return ControlClient(mount.state.control_socket, timeout)
