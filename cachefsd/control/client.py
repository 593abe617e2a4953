"""The control API's client: what the CLI and loaders (``cachefsd.hints``)
use to reach the daemon of a mount over its Unix socket (see server.py for
the endpoints).

Only the standard library is used, so ``cachefsd.hints`` and the loader
meter stay importable in any training environment: ``stats`` and
``diagnose`` import pydantic, for their typed answers (``answers.py``),
when they are called. One
request per connection: connections are cheap on a Unix socket, and it
keeps every wait a single bounded socket timeout.
"""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from cachefsd.control.mounts import MountOf, MountState
from cachefsd.errors import ControlError

if TYPE_CHECKING:
    from pydantic import BaseModel

    from cachefsd.control.answers import DiagnosisAnswer, StatsAnswer
    from cachefsd.stage import StageRequest

Answer = TypeVar("Answer", bound="BaseModel")

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


NDJSON = "application/x-ndjson"
# The largest request body accepted. A hint carries one path per sample of
# an epoch: 10 million samples with ~25-byte paths is ~250 MB of JSON, and a
# body is read into memory once, so 256 MiB admits the largest datasets we
# know of while bounding what one request can make the daemon allocate.
MAX_BODY_BYTES = 256 << 20


# Requests other than a hint are a few fields; anything larger is a mistake.
SMALL_BODY_BYTES = 64 << 10


@dataclass(frozen=True, slots=True)
class MeterTotals:
    """What a loader meter (``cachefsd.diagnose``) has measured so far, as
    ``POST /meter`` carries it: batches after the first, and their data
    wait and step seconds."""

    batches: int = 0
    data_wait_seconds: float = 0.0
    step_seconds: float = 0.0

    @property
    def data_wait_fraction(self) -> float:
        return self.data_wait_seconds / self.step_seconds if self.step_seconds > 0 else 0.0


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float | None) -> None:
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

    def stats(self) -> StatsAnswer:
        from cachefsd.control.answers import StatsAnswer  # noqa: PLC0415 - see the module's docstring

        return self._answer("/stats", StatsAnswer)

    def hint(self, order: list[str], part: tuple[int, int] | None = None) -> tuple[int, int]:
        body: dict[str, Any] = {"order": order}
        if part is not None:
            body["part"] = list(part)
        answer = self._call("POST", "/hint", body, self._timeout, MAX_BODY_BYTES)
        return int(answer["accepted"]), int(answer["unknown"])

    def meter(self, meter_id: str, readers: int, totals: MeterTotals) -> None:
        """A loader meter's totals so far (``cachefsd.diagnose``), for the
        caller's job, with the number of processes that read for it."""
        body = {
            "meter": meter_id,
            "readers": readers,
            "batches": totals.batches,
            "data_wait_seconds": totals.data_wait_seconds,
            "step_seconds": totals.step_seconds,
        }
        self._call("POST", "/meter", body, self._timeout)

    def diagnose(self) -> DiagnosisAnswer:
        """What ``cachefsd doctor`` judges: every metered job, with its reads."""
        from cachefsd.control.answers import DiagnosisAnswer  # noqa: PLC0415 - see the module's docstring

        return self._answer("/diagnose", DiagnosisAnswer)

    def sync(self, timeout: float | None) -> dict[str, Any]:
        """Wait until what was closed on the mount is in the bucket (or
        failed, or ``timeout`` passed): ``{"uploaded": N, "failed": {key: why}}``."""
        wait = None if timeout is None else timeout + CALL_TIMEOUT_SECONDS
        answer: dict[str, Any] = self._call("POST", "/sync", {"timeout": timeout}, wait)
        return answer

    def attach(self, settings: dict[str, Any]) -> MountState:
        """Mount ``settings`` (the fields that were set) on this daemon's
        node; its state once ready, or ``ControlError`` saying why not."""
        answer = self._call("POST", "/mounts", {"settings": settings}, self._timeout)
        return MountState(**answer)

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

    def _answer(self, path: str, model: type[Answer]) -> Answer:
        """``GET path``'s answer as a ``model``; ``ControlError`` naming the
        fields that do not fit (a daemon of another version)."""
        from pydantic import ValidationError  # noqa: PLC0415 - see the module's docstring

        answer = self._call("GET", path, None, self._timeout)
        try:
            return model.model_validate(answer)
        except ValidationError as exc:
            wrong = "; ".join(f"{'.'.join(map(str, error['loc']))}: {error['msg']}" for error in exc.errors())
            raise ControlError(
                f"the daemon at {self.socket_path} answered {path} in a form this command does not know "
                f"(another version of cachefsd?): {wrong}"
            ) from exc

    def _call(
        self, method: str, path: str, body: Any, timeout: float | None, limit: int = SMALL_BODY_BYTES
    ) -> Any:
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

    def _open(self, method: str, path: str, body: Any, timeout: float | None, limit: int) -> _UnixConnection:
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
        if response.status == 409:  # the daemon's own account of what stands in the way
            return str(message)
        return f"the daemon refused the request ({response.status}): {message}"


def client_for(mount: MountOf, timeout: float = CALL_TIMEOUT_SECONDS) -> ControlClient:
    """A client for the daemon of ``mount``; ``ControlError`` saying why
    there is none (it is not running)."""
    if not mount.live:
        raise ControlError(f"the daemon of {mount.mountpoint} is not running (pid {mount.state.pid})")
    return ControlClient(mount.state.control_socket, timeout)
