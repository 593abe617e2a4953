"""The control API over a real Unix socket: the real server and client, with
a fake handlers object standing in for the daemon's data path."""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cachefsd.control.answers import DiagnosisAnswer, StatsAnswer
from cachefsd.control.client import ControlClient, MeterTotals
from cachefsd.control.mounts import MountOf, MountState
from cachefsd.control.server import ControlServer
from cachefsd.errors import BadRequest, ControlError, StageCancelled
from cachefsd.hints import HintingSampler, MountPaths
from cachefsd.stage import Report, StageRequest
from tests.answers import STATS

METERED: dict[str, Any] = {
    "job": "python[1]",
    "batches": 0,
    "data_wait_seconds": 0.5,
    "step_seconds": 3.0,
    "reader_seconds": 6.0,
    "meters": 1,
    "last_report_seconds_ago": 1.0,
    "reads": None,
    "observed": None,
}
DIAGNOSIS: dict[str, Any] = {
    "mountpoint": "/mnt",
    "cache": {"capacity_bytes": 1 << 30, "policy": "epoch-aware", "block_size": 4 << 20},
    "jobs": [METERED],
}

# Every wait in these tests; the server answers in milliseconds.
WAIT_SECONDS = 10.0
# A small body limit, so the oversize test does not allocate 256 MiB.
TEST_BODY_LIMIT = 1024
# Servers here stop within 10 ms instead of the daemon's 0.2 s.
QUICK_ACCEPT_POLL = 0.01


class FakeHandlers:
    """Records what the server hands it; ``stage`` behaves as the test sets."""

    def __init__(self) -> None:
        self.orders: list[list[str]] = []
        self.parts: list[tuple[int, int] | None] = []
        self.pids: list[int] = []
        self.meters: list[tuple[str, MeterTotals, int]] = []
        self.stage_requests: list[StageRequest] = []
        self.closed = threading.Event()
        self.stage_release = threading.Event()  # set by a test to let a stage finish
        self.stage_error: BaseException | None = None  # what a report raised
        self.stage_mode = "normal"
        self.answer: Any = StatsAnswer.model_validate(STATS)  # what ``stats`` returns

    def stats(self) -> StatsAnswer:
        if self.stage_mode == "stats-crash":
            raise RuntimeError("stats broke")
        answer: StatsAnswer = self.answer
        return answer

    def hint(self, order: list[str], part: tuple[int, int] | None, pid: int) -> tuple[int, int]:
        self.pids.append(pid)
        self.orders.append(order)
        self.parts.append(part)
        known = sum(1 for path in order if not path.startswith("/missing"))
        return known, len(order) - known

    def meter(self, meter_id: str, totals: MeterTotals, readers: int, pid: int) -> None:
        self.pids.append(pid)
        self.meters.append((meter_id, totals, readers))

    def diagnose(self) -> DiagnosisAnswer:
        return DiagnosisAnswer.model_validate(
            {**DIAGNOSIS, "jobs": [{**METERED, "batches": len(self.meters)}]}
        )

    def stage(self, request: StageRequest, report: Report) -> dict[str, Any]:
        self.stage_requests.append(request)
        if self.stage_mode == "bad":
            raise BadRequest("tier 'warm' is not configured")
        report({"event": "progress", "phase": "fetch", "files_done": 0})
        if self.stage_mode == "fail-midway":
            raise RuntimeError("disk on fire")
        if self.stage_mode == "unmounted-midway":
            raise StageCancelled("the daemon is stopping")
        if self.stage_mode == "wait":
            # Only the client, having seen the first event, lets the stage end:
            # proof that events are streamed, not buffered to the end.
            assert self.stage_release.wait(WAIT_SECONDS)
        if self.stage_mode == "until-gone":
            try:
                for _ in range(1000):
                    report({"event": "progress", "phase": "fetch", "padding": "x" * 4096})
                    self.stage_release.wait(0.01)
            except OSError as exc:
                self.stage_error = exc
                raise
        report({"event": "failure", "path": "/a", "error": "gone"})
        return {"files": 2, "failed": 1}

    def close(self) -> None:
        self.closed.set()


@pytest.fixture(name="handlers")
def fixture_handlers() -> FakeHandlers:
    return FakeHandlers()


@pytest.fixture(name="server")
def fixture_server(tmp_path: Path, handlers: FakeHandlers) -> Iterator[ControlServer]:
    server = ControlServer(tmp_path / "control.sock", handlers, TEST_BODY_LIMIT, QUICK_ACCEPT_POLL)
    server.start()
    yield server
    server.stop()


@pytest.fixture(name="client")
def fixture_client(server: ControlServer) -> ControlClient:
    return ControlClient(server.path, timeout=WAIT_SECONDS)


def raw_request(path: Path, request: bytes) -> tuple[int, dict[str, Any]]:
    """Send ``request`` as is and parse the status and JSON body of the answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(WAIT_SECONDS)
        sock.connect(str(path))
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def post(path: str, body: bytes, length: int | None = None) -> bytes:
    length = len(body) if length is None else length
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n".encode() + body


def test_socket_is_owner_only(server: ControlServer) -> None:
    mode = os.stat(server.path).st_mode
    assert stat.S_ISSOCK(mode)
    assert stat.S_IMODE(mode) == 0o600


def test_stats_are_what_the_handler_returns(client: ControlClient) -> None:
    assert client.stats() == StatsAnswer.model_validate(STATS)


class OtherVersion:
    """A daemon's answer in a form this client does not know."""

    def __init__(self, stats: dict[str, Any]) -> None:
        self._stats = stats

    def model_dump(self, mode: str) -> dict[str, Any]:
        return self._stats


def test_stats_in_another_form_fail_naming_the_field(client: ControlClient, handlers: FakeHandlers) -> None:
    handlers.answer = OtherVersion({**STATS, "hit_ratio": {"since_mount": 0.5}})
    with pytest.raises(ControlError, match=r"does not know .*hit_ratio\.last_minute: Field required"):
        client.stats()


METER = {"meter": "m", "readers": 2, "batches": 1, "data_wait_seconds": 0.5, "step_seconds": 1.0}


def test_a_meter_report_reaches_the_handler_with_the_senders_pid(
    client: ControlClient, handlers: FakeHandlers
) -> None:
    client.meter("m1", 2, MeterTotals(12, 0.5, 3.0))
    assert handlers.meters == [("m1", MeterTotals(12, 0.5, 3.0), 2)]
    assert handlers.pids == [os.getpid()]
    assert client.diagnose().jobs[0].batches == 1


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({**METER, "batches": -1}, "batches"),
        ({**METER, "batches": 10**4000}, "batches"),
        ({**METER, "data_wait_seconds": -0.5}, "data_wait_seconds"),
        ({**METER, "step_seconds": 1e308}, "step_seconds"),
        ({**METER, "data_wait_seconds": 5.0, "step_seconds": 4.0}, "data_wait_seconds"),
        ({**METER, "meter": ""}, "meter"),
        ({**METER, "readers": -1}, "readers"),
        ({key: value for key, value in METER.items() if key != "step_seconds"}, "step_seconds"),
    ],
)
def test_a_bad_meter_report_is_refused_naming_the_field(
    server: ControlServer, handlers: FakeHandlers, body: dict[str, Any], named: str
) -> None:
    status, answer = raw_request(server.path, post("/meter", json.dumps(body).encode()))
    assert status == 400
    assert named in answer["error"]
    assert handlers.meters == []


def test_hint_returns_counts_and_passes_the_order_unchanged(
    client: ControlClient, handlers: FakeHandlers
) -> None:
    order = ["/b", "/a", "/missing/x", "/c"]
    assert client.hint(order) == (3, 1)
    assert handlers.orders == [order]


def test_stage_streams_events_before_it_ends(client: ControlClient, handlers: FakeHandlers) -> None:
    handlers.stage_mode = "wait"
    request = StageRequest(path="/train", include="*.tar", tier="warm", check=False)
    events = client.stage(request)
    first = next(events)
    assert first == {"event": "progress", "phase": "fetch", "files_done": 0}
    handlers.stage_release.set()
    rest = list(events)
    assert rest == [
        {"event": "failure", "path": "/a", "error": "gone"},
        {"event": "summary", "files": 2, "failed": 1},
    ]
    assert handlers.stage_requests == [request]


def test_stage_refused_before_streaming_is_a_400(client: ControlClient, handlers: FakeHandlers) -> None:
    handlers.stage_mode = "bad"
    with pytest.raises(ControlError, match=r"\(400\).*tier 'warm' is not configured"):
        list(client.stage(StageRequest()))


def test_stage_failing_midway_ends_the_stream_with_its_error(
    client: ControlClient, handlers: FakeHandlers
) -> None:
    handlers.stage_mode = "fail-midway"
    seen = []
    with pytest.raises(ControlError, match="disk on fire"):
        seen.extend(client.stage(StageRequest()))
    assert seen == [{"event": "progress", "phase": "fetch", "files_done": 0}]


def test_a_stage_stopped_by_an_unmount_says_so_not_that_it_failed(
    client: ControlClient, handlers: FakeHandlers, caplog: pytest.LogCaptureFixture
) -> None:
    handlers.stage_mode = "unmounted-midway"
    with (
        caplog.at_level(logging.INFO, logger="cachefsd.control"),
        pytest.raises(ControlError, match=r"^the stage stopped part way \(the daemon is stopping\)"),
    ):
        list(client.stage(StageRequest()))
    assert "stage stopped part way" in caplog.text
    assert "Traceback" not in caplog.text
    assert all(record.levelno < logging.ERROR for record in caplog.records)


def test_a_client_hanging_up_stops_the_stage(server: ControlServer, handlers: FakeHandlers) -> None:
    handlers.stage_mode = "until-gone"
    client = ControlClient(server.path, timeout=WAIT_SECONDS)
    events = client.stage(StageRequest())
    next(events)
    events.close()  # closes the connection
    deadline = threading.Event()
    for _ in range(int(WAIT_SECONDS / 0.05)):
        if handlers.stage_error is not None:
            break
        deadline.wait(0.05)
    assert isinstance(handlers.stage_error, OSError)


def test_stage_fields_are_validated(server: ControlServer, handlers: FakeHandlers) -> None:
    for body, message in (
        ({"tier": 3}, "tier"),
        ({"check": "yes"}, "check"),
        ({"include": ["*"]}, "include"),
        ({"speed": "fast"}, "unknown fields: speed"),
        ([1, 2], "JSON object"),
    ):
        status, answer = raw_request(server.path, post("/stage", json.dumps(body).encode()))
        assert status == 400
        assert message in answer["error"]
    assert handlers.stage_requests == []


def test_bad_json_is_a_400_and_the_server_keeps_serving(
    server: ControlServer, client: ControlClient, handlers: FakeHandlers
) -> None:
    status, answer = raw_request(server.path, post("/hint", b'{"order": ['))
    assert status == 400
    assert "not valid JSON" in answer["error"]
    status, answer = raw_request(server.path, post("/hint", b'{"order": "a"}'))
    assert status == 400
    status, answer = raw_request(server.path, post("/hint", b'{"order": ["a", 1]}'))
    assert status == 400
    assert handlers.orders == []
    assert client.hint(["/a"]) == (1, 0)


def test_oversize_body_is_refused_without_being_read(server: ControlServer, handlers: FakeHandlers) -> None:
    # Announce a body over the limit and send none of it: the answer must
    # come from the headers alone.
    status, answer = raw_request(server.path, post("/hint", b"", length=TEST_BODY_LIMIT + 1))
    assert status == 413
    assert "limit" in answer["error"]
    client = ControlClient(server.path, timeout=WAIT_SECONDS)
    with pytest.raises(ControlError, match=r"\(413\)"):
        client.hint(["/a-rather-long-path-name"] * 100)
    assert handlers.orders == []


def test_missing_length_and_unknown_endpoints(server: ControlServer) -> None:
    status, _ = raw_request(server.path, b"POST /hint HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 411
    status, answer = raw_request(server.path, b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 404
    assert "/nope" in answer["error"]
    status, _ = raw_request(server.path, post("/evict", b"{}"))
    assert status == 404


def test_a_failing_handler_is_a_500_not_a_dead_server(
    client: ControlClient, handlers: FakeHandlers, caplog: pytest.LogCaptureFixture
) -> None:
    handlers.stage_mode = "stats-crash"
    with (
        caplog.at_level(logging.ERROR, logger="cachefsd.control"),
        pytest.raises(ControlError, match=r"\(500\).*stats broke"),
    ):
        client.stats()
    handlers.stage_mode = "normal"
    assert client.stats().mountpoint == STATS["mountpoint"]


def test_a_silent_client_is_dropped(server: ControlServer, client: ControlClient) -> None:
    """A client that connects and sends nothing holds one thread until the
    server's timeout, and does not block other clients meanwhile."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as idle:
        idle.connect(str(server.path))
        assert client.stats().mountpoint == STATS["mountpoint"]


def test_stop_cancels_work_and_removes_the_socket(server: ControlServer, handlers: FakeHandlers) -> None:
    server.stop()
    assert handlers.closed.is_set()
    assert not server.path.exists()
    with pytest.raises(ControlError, match="cannot reach"):
        ControlClient(server.path, timeout=WAIT_SECONDS).stats()


def test_a_stale_socket_is_replaced(tmp_path: Path, handlers: FakeHandlers) -> None:
    path = tmp_path / "control.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()  # a crashed daemon's leftover: bound, nobody listening
    server = ControlServer(path, handlers, accept_poll=QUICK_ACCEPT_POLL)
    server.start()
    try:
        assert ControlClient(path, timeout=WAIT_SECONDS).stats().mountpoint == STATS["mountpoint"]
    finally:
        server.stop()


def test_hinting_sampler_without_a_daemon_yields_the_same_indices(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    paths = [str(tmp_path / f"{i}.bin") for i in range(5)]
    order = [3, 1, 4, 0, 2]
    sampler = HintingSampler(order, paths)
    with caplog.at_level(logging.DEBUG, logger="cachefsd.hints"):
        assert list(sampler) == order
        assert list(sampler) == order
    assert sampler.wait(WAIT_SECONDS)
    assert len(sampler) == 5
    warnings = [record for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "not under a cachefsd mount" in warnings[0].getMessage()


def test_hinting_sampler_never_holds_the_epoch_back_to_build_its_hint(tmp_path: Path) -> None:
    """Placing a million paths under their mounts takes seconds: the loader
    gets its indices at once, the hint follows."""
    release = threading.Event()

    class SlowPaths(list[str]):
        def __getitem__(self, index: int) -> str:  # type: ignore[override]
            release.wait(WAIT_SECONDS)
            return str(tmp_path / f"{index}.bin")

    sampler = HintingSampler([2, 0, 1], SlowPaths(["unused"] * 3))
    assert list(sampler) == [2, 0, 1]  # while the hint's first path is still being looked up
    assert list(sampler) == [2, 0, 1]
    assert not sampler.wait(0)
    release.set()
    assert sampler.wait(WAIT_SECONDS)


def test_hinting_sampler_passes_batches_and_epochs_through() -> None:
    class Batches:
        def __init__(self) -> None:
            self.epoch = -1

        def set_epoch(self, epoch: int) -> None:
            self.epoch = epoch

        def __iter__(self) -> Iterator[list[int]]:
            return iter([[1, 0], [2]])

        def __len__(self) -> int:
            return 2

    inner = Batches()
    sampler = HintingSampler(inner, ["/nowhere/a", "/nowhere/b", "/nowhere/c"])
    sampler.set_epoch(7)
    assert inner.epoch == 7
    assert list(sampler) == [[1, 0], [2]]


def test_a_hint_may_carry_its_rank_and_world_size(client: ControlClient, handlers: FakeHandlers) -> None:
    assert client.hint(["/a"], (1, 4)) == (1, 0)
    assert handlers.parts == [(1, 4)]
    with pytest.raises(ControlError, match="rank"):
        client.hint(["/a"], (4, 4))


def test_mount_paths_resolve_dots_and_keep_to_their_mount(tmp_path: Path) -> None:
    """Paths as a hint file or a sampler gives them: relative to a directory
    in the mount, or absolute; ``..`` is resolved as the kernel would, and
    a path that leads out of the mount is not placed in it."""
    mountpoint = tmp_path / "mnt"
    mount = MountOf(mountpoint, MountState(1, str(mountpoint), "s3://b", "/c", None, ""), "/train")
    paths = MountPaths(mount)
    assert paths.place("cat/../dog/1.jpg") == (mount, "/train/dog/1.jpg")
    assert paths.place("../val/2.jpg") == (mount, "/val/2.jpg")
    assert paths.place("../mnt/3.jpg") == (mount, "/mnt/3.jpg")  # a directory named mnt in the mount
    assert paths.place(f"{mountpoint}/./val/../4.jpg") == (mount, "/4.jpg")
    assert paths.place("../../elsewhere/5.jpg") == (None, str(tmp_path / "elsewhere" / "5.jpg"))
