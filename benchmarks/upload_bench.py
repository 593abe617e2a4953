"""Client CPU and throughput of a multipart upload of one file, three
ways on the same server: obstore's ``put_async`` of a path (its own
multipart, parts read and sent in Rust, no check); aiobotocore driven part
by part with Content-MD5, each part read and hashed in a thread; and
``S3Store.put_file`` (obstore fed parts read and hashed in a thread, the
etag checked against the MD5s).

A moto S3 server (or with ``--server file`` the file-backed endpoint) in
its own process on 127.0.0.1; one file of ``--mib`` MiB, ``--part-mib``
MiB parts, ``--in-flight`` parts at once, on uvloop, after one warm-up
upload. This process's CPU (``time.process_time``, all
threads) and the event loop thread's (``time.thread_time``) per MiB, and
MB/s, of the upload alone (clients are made and used once before). moto
buffers every part in Python, so MB/s is moto's ceiling, not the
client's; the file-backed endpoint goes faster, but shares the machine's
cores with the client. CPU is the client's alone.

    .venv/bin/python -m benchmarks.upload_bench [--mib 256] [--part-mib 8] [--in-flight 8] [--rounds 2]
        [--server moto|file]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import os
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path

import boto3
import uvloop
from aiobotocore.config import AioConfig
from aiobotocore.session import get_session
from obstore import put_async

os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")

from benchmarks.client_bench import obstore_client
from benchmarks.profile_daemon import s3_server
from cachefsd.config import StoreSettings
from cachefsd.store.s3 import S3Store, UploadTuning

BUCKET = "upload-bench"


class Meter:
    """This process's CPU (all threads), the event loop thread's, and wall
    time, from ``start`` to ``stop``: the upload alone, not the client's setup."""

    def start(self) -> None:
        self._cpu, self._loop, self._wall = time.process_time(), time.thread_time(), time.perf_counter()

    def stop(self) -> tuple[float, float, float]:
        return (
            time.process_time() - self._cpu,
            time.thread_time() - self._loop,
            time.perf_counter() - self._wall,
        )


async def with_obstore(
    endpoint: str, path: Path, part_size: int, in_flight: int
) -> tuple[float, float, float]:
    store = obstore_client(endpoint, BUCKET)
    meter = Meter()
    meter.start()
    await put_async(store, "k", path, chunk_size=part_size, max_concurrency=in_flight)
    return meter.stop()


def _read_part(path: Path, offset: int, size: int) -> tuple[bytes, str]:
    with path.open("rb") as file:
        data = os.pread(file.fileno(), size, offset)
    return data, base64.b64encode(hashlib.md5(data).digest()).decode()


async def with_aiobotocore(
    endpoint: str, path: Path, part_size: int, in_flight: int
) -> tuple[float, float, float]:
    config = AioConfig(
        max_pool_connections=in_flight,
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    async with get_session().create_client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", config=config
    ) as client:
        await client.head_bucket(Bucket=BUCKET)  # the client's first request sets it up
        meter = Meter()
        meter.start()
        upload = await client.create_multipart_upload(Bucket=BUCKET, Key="k")
        size = path.stat().st_size
        slots = asyncio.Semaphore(in_flight)

        async def one(number: int) -> dict[str, object]:
            async with slots:
                offset = (number - 1) * part_size
                data, md5 = await asyncio.to_thread(_read_part, path, offset, min(part_size, size - offset))
                reply = await client.upload_part(
                    Bucket=BUCKET,
                    Key="k",
                    UploadId=upload["UploadId"],
                    PartNumber=number,
                    Body=data,
                    ContentMD5=md5,
                )
                return {"PartNumber": number, "ETag": reply["ETag"]}

        parts = await asyncio.gather(*(one(number) for number in range(1, -(-size // part_size) + 1)))
        await client.complete_multipart_upload(
            Bucket=BUCKET, Key="k", UploadId=upload["UploadId"], MultipartUpload={"Parts": list(parts)}
        )
        return meter.stop()


async def with_store(endpoint: str, path: Path, part_size: int, in_flight: int) -> tuple[float, float, float]:
    tuning = UploadTuning(part_size=part_size, parts_in_flight=in_flight)
    settings = StoreSettings(endpoint_url=endpoint, region="us-east-1")
    store = S3Store(BUCKET, "", settings, attempt_timeout=30.0, upload=tuning)
    try:
        await store.check()  # makes both clients, as a daemon's first request does
        meter = Meter()
        meter.start()
        await store.put_file("k", path)
        return meter.stop()
    finally:
        await store.close()


CLIENTS: dict[str, Callable[[str, Path, int, int], Coroutine[None, None, tuple[float, float, float]]]] = {
    "obstore": with_obstore,
    "aiobotocore": with_aiobotocore,
    "put_file": with_store,
}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--part-mib", type=int, default=8)
    parser.add_argument("--in-flight", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2, help="each client this many times, alternating")
    parser.add_argument(
        "--server",
        choices=["moto", "file"],
        default="moto",
        help="moto, or the file-backed endpoint (faster)",
    )
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory() as scratch,
        s3_server(Path(scratch) / "server" if args.server == "file" else None) as endpoint,
    ):
        path = Path(scratch) / "upload.bin"
        with path.open("wb") as file:
            for _ in range(args.mib):
                file.write(os.urandom(1 << 20))
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=BUCKET)
        part_size = args.part_mib << 20
        for _ in range(args.rounds):
            for name, client in CLIENTS.items():
                uvloop.run(client(endpoint, path, part_size, args.in_flight))  # warm-up
                cpu, loop_cpu, wall = uvloop.run(client(endpoint, path, part_size, args.in_flight))
                print(
                    f"{name:<12} {args.mib * (1 << 20) / wall / 1e6:6.0f} MB/s   client CPU "
                    f"{cpu / args.mib * 1e3:.2f} ms a MiB (event loop thread {loop_cpu / args.mib * 1e3:.2f})"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
