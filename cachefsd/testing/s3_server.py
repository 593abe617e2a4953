"""A moto S3 server over real HTTP on 127.0.0.1, for tests and benchmarks.

moto's ``ThreadedMotoServer`` is close, but a test of the cache needs three
things it lacks: request counts (did the second read hit the network?), a
fixed per-request latency (a benchmark must feel like a remote bucket, not a
loopback one), and a restart on the *same* port after a real outage (the
clients keep their endpoint URL). So the moto WSGI app is wrapped in a small
middleware and served by werkzeug here.

moto keeps its buckets in process-global backends, so objects survive
``stop()`` / ``start()``: the server goes away and comes back with its data,
like a bucket after a network partition.

Concurrency: ``start``/``stop`` are called from one controlling thread. The
counters and the set of open connections are shared with werkzeug's
per-connection threads and guarded by ``_lock``; ``latency_seconds`` is a
plain float read without the lock (a torn read is impossible in CPython and
a stale one is harmless).
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

from moto.moto_server.werkzeug_app import MotoRequestHandler
from moto.server import DomainDispatcherApplication, create_backend_app
from werkzeug.serving import BaseWSGIServer, make_server

DEFAULT_HOST = "127.0.0.1"

# How long stop() waits for the serving thread after asking it to shut down.
# serve_forever polls every 0.5 s, so 5 s only trips on a real hang.
_STOP_JOIN_SECONDS = 5.0

# The foreground server's main thread wakes this often to notice a signal.
_SIGNAL_POLL_SECONDS = 1.0

# Request kinds counted by the middleware.
GET_OBJECT = "get_object"
HEAD_OBJECT = "head_object"
PUT_OBJECT = "put_object"
LIST = "list"
OTHER = "other"
TOTAL = "total"

WsgiEnviron = dict[str, Any]
StartResponse = Callable[..., Any]


def _is_path_style_host(host: str) -> bool:
    """Path-style requests name the bucket in the path; virtual-hosted ones in
    the Host header (``bucket.localhost:port``). botocore uses path style for
    IP endpoints and may use virtual hosts for names."""
    name = host[1:].partition("]")[0] if host.startswith("[") else host.rpartition(":")[0] or host
    if name in ("localhost", ""):
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return "." not in name
    return True


def request_kind(environ: WsgiEnviron) -> str:
    """Classify an S3 request by method and whether it names an object key."""
    method = environ.get("REQUEST_METHOD", "")
    path = environ.get("PATH_INFO", "").lstrip("/")
    if _is_path_style_host(environ.get("HTTP_HOST", "")):
        _, _, key = path.partition("/")
    else:
        key = path
    if key:
        return {"GET": GET_OBJECT, "HEAD": HEAD_OBJECT, "PUT": PUT_OBJECT}.get(method, OTHER)
    if method == "GET" and path:
        return LIST
    return OTHER


class S3TestServer:
    """moto S3 on ``host:port`` in a background thread, with counters and latency.

    ``port=0`` picks a free port on the first ``start()``; later starts reuse it.
    """

    def __init__(self, host: str = DEFAULT_HOST, port: int = 0, latency_seconds: float = 0.0) -> None:
        self.host = host
        self.port = port
        self.latency_seconds = latency_seconds
        self._app = DomainDispatcherApplication(create_backend_app)
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._in_flight: Counter[str] = Counter()  # requests being answered, by kind
        self._peak_in_flight: Counter[str] = Counter()
        self._connections: set[socket.socket] = set()
        self._server: BaseWSGIServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def endpoint_url(self) -> str:
        if self.port == 0:
            raise RuntimeError("S3TestServer has no port until start() is called")
        return f"http://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._server is not None

    # -- counters -------------------------------------------------------------

    def counts(self) -> dict[str, int]:
        """A snapshot of requests by kind (``get_object``, ``list``, ...) and ``total``."""
        with self._lock:
            return dict(self._counts)

    @property
    def get_object_count(self) -> int:
        with self._lock:
            return self._counts[GET_OBJECT]

    @property
    def request_count(self) -> int:
        with self._lock:
            return self._counts[TOTAL]

    def peak_in_flight(self, kind: str) -> int:
        """The most requests of ``kind`` answered at once since the last reset."""
        with self._lock:
            return self._peak_in_flight[kind]

    def reset_counts(self) -> None:
        with self._lock:
            self._counts.clear()
            self._peak_in_flight = self._in_flight.copy()

    # -- lifecycle ------------------------------------------------------------

    def start(self) -> None:
        if self._server is not None:
            return
        server = make_server(
            self.host,
            self.port,
            self._middleware,
            threaded=True,
            request_handler=self._handler_class(),
        )
        self.port = server.server_port
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name=f"moto-s3-{self.port}", daemon=True)
        self._thread.start()

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
            thread.join(_STOP_JOIN_SECONDS)

    def __enter__(self) -> S3TestServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- plumbing -------------------------------------------------------------

    def _middleware(self, environ: WsgiEnviron, start_response: StartResponse) -> Iterable[bytes]:
        kind = request_kind(environ)
        with self._lock:
            self._counts[kind] += 1
            self._counts[TOTAL] += 1
            self._in_flight[kind] += 1
            self._peak_in_flight[kind] = max(self._peak_in_flight[kind], self._in_flight[kind])
        try:
            latency = self.latency_seconds
            if latency > 0:
                time.sleep(latency)
            served: Iterable[bytes] = self._app(environ, start_response)
            return served
        finally:
            with self._lock:
                self._in_flight[kind] -= 1

    def _handler_class(self) -> type[MotoRequestHandler]:
        """A request handler that registers its connection with this server,
        so ``stop()`` can cut kept-alive connections."""
        owner = self

        class Handler(MotoRequestHandler):
            def setup(self) -> None:
                super().setup()
                with owner._lock:
                    owner._connections.add(self.connection)

            def finish(self) -> None:
                with owner._lock:
                    owner._connections.discard(self.connection)
                super().finish()

            def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
                """One line per request would drown benchmark output."""

        return Handler


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m cachefsd.testing.s3_server",
        description="Serve a moto S3 bucket over HTTP, optionally with a fixed latency per request.",
    )
    parser.add_argument("--host", default=DEFAULT_HOST, help="address to bind (default: %(default)s)")
    parser.add_argument("--port", type=int, default=0, help="port to bind; 0 picks a free one")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="delay added to every request")
    args = parser.parse_args(argv)

    server = S3TestServer(host=args.host, port=args.port, latency_seconds=args.latency_ms / 1000.0)
    stopping = threading.Event()

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        stopping.set()

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    server.start()
    # The first line of output is the endpoint, for scripts that start the server.
    print(server.endpoint_url, flush=True)
    while not stopping.wait(_SIGNAL_POLL_SECONDS):
        pass
    server.stop()


if __name__ == "__main__":
    main()
