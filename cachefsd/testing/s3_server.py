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
set of open connections is shared with werkzeug's per-connection threads
and guarded by ``_lock``, the counters by their own; ``latency_seconds`` is a
plain float read without the lock (a torn read is impossible in CPython and
a stale one is harmless).
"""

from __future__ import annotations

import argparse
import ipaddress
import time
from collections.abc import Callable, Iterable
from typing import Any

from moto.moto_server.werkzeug_app import MotoRequestHandler
from moto.s3.models import FakeKey
from moto.server import DomainDispatcherApplication, create_backend_app
from werkzeug.serving import make_server

from cachefsd.testing.counting import CountedServer, request_kind, serve_in_foreground

DEFAULT_HOST = "127.0.0.1"

WsgiEnviron = dict[str, Any]
StartResponse = Callable[..., Any]


_unlocked_etag: Callable[[FakeKey], str] = FakeKey.__dict__["etag"].fget


def _etag_under_the_keys_lock(key: FakeKey) -> str:
    """moto computes an object's ETag on first use by seeking and reading
    the one buffer that holds its bytes, without the lock its ``value``
    reads take: two requests at once (a PUT's answer and a listing, a HEAD,
    a GET) interleave their reads and the object keeps a wrong ETag, or a GET
    other bytes. Both take the key's lock here."""
    with key.lock:
        etag: str = _unlocked_etag(key)
        return etag


FakeKey.etag = property(_etag_under_the_keys_lock)  # type: ignore[assignment,method-assign]


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


def _request_kind(environ: WsgiEnviron) -> str:
    """Classify a WSGI request (``counting.request_kind``)."""
    path = environ.get("PATH_INFO", "").lstrip("/")
    if _is_path_style_host(environ.get("HTTP_HOST", "")):
        bucket, _, key = path.partition("/")
    else:
        bucket, key = environ.get("HTTP_HOST", ""), path
    return request_kind(environ.get("REQUEST_METHOD", ""), bucket, key)


class S3TestServer(CountedServer):
    """moto S3 on ``host:port`` in a background thread, with counters and latency.

    ``port=0`` picks a free port on the first ``start()``; later starts reuse it.
    """

    def __init__(self, host: str = DEFAULT_HOST, port: int = 0, latency_seconds: float = 0.0) -> None:
        super().__init__(host, port, latency_seconds)
        self._app = DomainDispatcherApplication(create_backend_app)

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
        self._serve(server, server.server_port, "moto-s3")

    def __enter__(self) -> S3TestServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- plumbing -------------------------------------------------------------

    def _middleware(self, environ: WsgiEnviron, start_response: StartResponse) -> Iterable[bytes]:
        with self.counter.answering(_request_kind(environ)):
            latency = self.latency_seconds
            if latency > 0:
                time.sleep(latency)
            served: Iterable[bytes] = self._app(environ, start_response)
            return served

    def _handler_class(self) -> type[MotoRequestHandler]:
        """A request handler that registers its connection with this server,
        so ``stop()`` can cut kept-alive connections."""
        owner = self

        class Handler(MotoRequestHandler):
            def setup(self) -> None:
                super().setup()
                owner.track(self.connection, True)

            def finish(self) -> None:
                owner.track(self.connection, False)
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

    serve_in_foreground(
        S3TestServer(host=args.host, port=args.port, latency_seconds=args.latency_ms / 1000.0)
    )


if __name__ == "__main__":
    main()
