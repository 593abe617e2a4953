"""How every store uses obstore (the data path of S3, GCS and Azure): the
same timeouts and retries, whatever the service, and files sent the same
way (``send_file``). Only the cloud stores import it: a local source loads
no cloud client.

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

import asyncio
import datetime
from typing import TYPE_CHECKING

from obstore import put_async

from cachefsd.store.source import FileParts, SourceFile

if TYPE_CHECKING:
    from obstore import PutResult
    from obstore.store import ClientConfig, RetryConfig
    from obstore.store import ObjectStore as ObstoreStore

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


async def send_file(
    client: ObstoreStore, key: str, source: SourceFile, part_size: int, in_flight: int
) -> tuple[PutResult, list[bytes]]:
    """Upload ``source`` as ``key`` through obstore: one PUT up to
    ``part_size``, else ``part_size`` parts (``FileParts``), ``in_flight``
    at once. obstore's answer, and the MD5 of each part sent (of the one
    PUT's body alone), for the caller's check of what the store holds; the
    file is checked unchanged before the upload is completed. Errors are
    obstore's, for the caller to translate."""
    if source.size <= part_size:
        body, md5 = await asyncio.to_thread(source.read_with_md5, 0, source.size)
        await asyncio.to_thread(source.check_unchanged)
        return await put_async(client, key, body, use_multipart=False), [md5]
    parts = FileParts(source, part_size)
    try:
        result = await put_async(client, key, parts, chunk_size=part_size, max_concurrency=in_flight)
    except BaseException:
        await parts.drain()
        raise
    return result, parts.md5s
