"""What the test S3 servers share: request counts by kind, and running one in
the foreground until a signal.

Both servers (moto's in ``s3_server``, the file-backed one in ``file_s3``)
count the same kinds the same way, so a test or a benchmark can swap one
for the other. This module is stdlib only: ``file_s3`` must not pull moto in.

Concurrency: ``RequestCounter`` is shared by a server's per-connection
threads; every field is guarded by its ``_lock``.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import socketserver
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Protocol

# How long stop() waits for the serving thread after asking it to shut down.
# serve_forever polls every 0.5 s, so 5 s only trips on a real hang.
STOP_JOIN_SECONDS = 5.0

# Request kinds.
GET_OBJECT = "get_object"
HEAD_OBJECT = "head_object"
PUT_OBJECT = "put_object"
LIST = "list"
OTHER = "other"
TOTAL = "total"

# The foreground server's main thread wakes this often to notice a signal.
_SIGNAL_POLL_SECONDS = 1.0


def request_kind(method: str, bucket: str, key: str) -> str:
    """Classify an S3 request by its method and whether it names a bucket and a key."""
    if key:
        return {"GET": GET_OBJECT, "HEAD": HEAD_OBJECT, "PUT": PUT_OBJECT}.get(method, OTHER)
    if method == "GET" and bucket:
        return LIST
    return OTHER


class RequestCounter:
    """Requests by kind since the last reset, and the most answered at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._in_flight: Counter[str] = Counter()  # requests being answered, by kind
        self._peak_in_flight: Counter[str] = Counter()

    @contextmanager
    def answering(self, kind: str) -> Iterator[None]:
        """Count one request of ``kind`` and hold it in flight while the block runs."""
        with self._lock:
            self._counts[kind] += 1
            self._counts[TOTAL] += 1
            self._in_flight[kind] += 1
            self._peak_in_flight[kind] = max(self._peak_in_flight[kind], self._in_flight[kind])
        try:
            yield
        finally:
            with self._lock:
                self._in_flight[kind] -= 1

    def counts(self) -> dict[str, int]:
        """A snapshot of requests by kind (``get_object``, ``list``, ...) and ``total``."""
        with self._lock:
            return dict(self._counts)

    def count(self, kind: str) -> int:
        with self._lock:
            return self._counts[kind]

    def in_flight(self, kind: str) -> int:
        """Requests of ``kind`` being answered now."""
        with self._lock:
            return self._in_flight[kind]

    def peak_in_flight(self, kind: str) -> int:
        """The most requests of ``kind`` answered at once since the last reset."""
        with self._lock:
            return self._peak_in_flight[kind]

    def reset(self) -> None:
        with self._lock:
            self._counts.clear()
            self._peak_in_flight = self._in_flight.copy()


class Server(Protocol):
    """A test server as ``serve_in_foreground`` drives it."""

    @property
    def endpoint_url(self) -> str: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...


def serve_in_foreground(server: Server) -> None:
    """Start ``server``, print its endpoint (the first line of output, for
    scripts that start it) and serve until SIGINT or SIGTERM."""
    stopping = threading.Event()

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        stopping.set()

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    server.start()
    print(server.endpoint_url, flush=True)
    while not stopping.wait(_SIGNAL_POLL_SECONDS):
        pass
    server.stop()


class CountedServer:
    """A test server on its own thread: what it tells of its requests
    (``counter``, which its request handling counts into), the connections
    it serves (``track``, so ``stop`` can cut kept-alive ones), and its
    lifecycle. ``S3TestServer`` and ``FileS3Server`` answer alike, so a
    benchmark or test may take either. ``_lock`` guards ``_connections``."""

    def __init__(self, host: str, port: int, latency_seconds: float) -> None:
        self.host = host
        self.port = port
        self.latency_seconds = latency_seconds
        self.counter = RequestCounter()
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._server: socketserver.BaseServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def endpoint_url(self) -> str:
        if self.port == 0:
            raise RuntimeError(f"{type(self).__name__} has no port until start() is called")
        return f"http://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._server is not None

    def _serve(self, server: socketserver.BaseServer, port: int, name: str) -> None:
        """Serve ``server`` (listening on ``port``) on a thread named after ``name``."""
        self.port = port
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name=f"{name}-{port}", daemon=True)
        self._thread.start()

    def track(self, connection: socket.socket, is_open: bool) -> None:
        """Note a connection opened or closed, so ``stop()`` can cut kept-alive ones."""
        with self._lock:
            if is_open:
                self._connections.add(connection)
            else:
                self._connections.discard(connection)

    def stop(self) -> None:
        """Stop listening and drop every open connection, so clients see the
        server gone (a kept-alive connection would otherwise keep being served)."""
        server, thread = self._server, self._thread
        if server is None:
            return
        self._server = self._thread = None
        server.shutdown()
        server.server_close()
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            with contextlib.suppress(OSError):  # already closed by its peer
                conn.shutdown(socket.SHUT_RDWR)
        if thread is not None:
            thread.join(STOP_JOIN_SECONDS)

    def counts(self) -> dict[str, int]:
        """A snapshot of requests by kind (``get_object``, ``list``, ...) and ``total``."""
        return self.counter.counts()

    @property
    def get_object_count(self) -> int:
        return self.counter.count(GET_OBJECT)

    @property
    def request_count(self) -> int:
        return self.counter.count(TOTAL)

    def peak_in_flight(self, kind: str) -> int:
        """The most requests of ``kind`` answered at once since the last reset."""
        return self.counter.peak_in_flight(kind)

    def reset_counts(self) -> None:
        self.counter.reset()
