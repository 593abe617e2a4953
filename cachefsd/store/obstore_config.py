"""How every store sets up its obstore clients (the data path of S3, GCS
and Azure): the same timeouts and retries, whatever the service.

A client for reads and small writes makes one attempt a request: the
fetcher owns retries, backoff and the total deadline, and a client's own
retries would multiply its and could outlive it. A stalled connection is
dropped after the fetch's attempt timeout without a byte.

A client for uploads retries a failed request (a part, a block) on its
own, after 0.1, 0.2, 0.4 s, as S3 asks of clients it answers 503
SlowDown: a multi-GiB upload is hundreds of requests, and failing the
whole file would send every part again. A request may take
``UPLOAD_REQUEST_SECONDS`` in all, and as long without a byte: a store
may say nothing until it has joined the parts of a large object (S3 sends
spaces meanwhile; moto nothing, for over 30 s on 1 GiB), and a completion
sent again after a read timeout finds its upload gone. A stalled part is
cut by the uploader's deadline for the whole file instead.
"""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from obstore.store import ClientConfig, RetryConfig

# obstore's own default for a request: a block read.
REQUEST_SECONDS = 30.0
UPLOAD_REQUEST_SECONDS = 900.0
UPLOAD_RETRIES = 3
UPLOAD_FIRST_BACKOFF_SECONDS = 0.1


def obstore_config(
    connect_seconds: float, attempt_seconds: float, connections: int, upload: bool
) -> tuple[ClientConfig, RetryConfig]:
    """Client options and retries of a store's obstore client, for reads
    or for ``upload`` (the module docstring); the caller adds what is its
    own (``allow_http``, headers)."""
    retries, first_backoff = (UPLOAD_RETRIES, UPLOAD_FIRST_BACKOFF_SECONDS) if upload else (0, 0.0)
    request_seconds = UPLOAD_REQUEST_SECONDS if upload else REQUEST_SECONDS
    silence_seconds = UPLOAD_REQUEST_SECONDS if upload else attempt_seconds
    options: ClientConfig = {
        "connect_timeout": datetime.timedelta(seconds=connect_seconds),
        "timeout": datetime.timedelta(seconds=request_seconds),
        "read_timeout": datetime.timedelta(seconds=silence_seconds),
        "pool_max_idle_per_host": str(connections),
    }
    retry: RetryConfig = {
        "max_retries": retries,
        "retry_timeout": datetime.timedelta(seconds=attempt_seconds * (retries + 1)),
        "backoff": {
            "init_backoff": datetime.timedelta(seconds=first_backoff),
            "max_backoff": datetime.timedelta(seconds=first_backoff * 2**retries),
            "base": 2,
        },
    }
    return options, retry
