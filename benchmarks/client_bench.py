"""Client CPU a ranged GET: obstore (the daemon's S3 data path) against
aiobotocore (its listings, and its data path before), on the same server.

A moto S3 server in its own process on 127.0.0.1; ``--gets`` ranged GETs of
``--kib`` KiB with ``--in-flight`` at once, on uvloop, after one warm-up
round; this process's CPU time (``time.process_time``) divided by the GETs.

    .venv/bin/python -m benchmarks.client_bench [--gets 800] [--kib 128] [--in-flight 32] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING

import boto3
import uvloop
from aiobotocore.config import AioConfig
from aiobotocore.session import get_session
from obstore import get_async
from obstore.store import S3Store

if TYPE_CHECKING:
    from obstore import GetOptions  # a TypedDict of the stubs only

os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")

from benchmarks.profile_daemon import s3_server

BUCKET = "bench"
OBJECTS = 64


def obstore_client(endpoint: str, bucket: str = BUCKET) -> S3Store:
    """obstore's S3 client of ``bucket`` on a plain-HTTP test endpoint."""
    return S3Store(
        bucket,
        endpoint=endpoint,
        region="us-east-1",
        access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
        secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
        client_options={"allow_http": True},
    )


async def with_obstore(endpoint: str, etags: list[str], gets: int, size: int, in_flight: int) -> None:
    store = obstore_client(endpoint)
    slots = asyncio.Semaphore(in_flight)

    async def one(index: int) -> None:
        async with slots:
            options: GetOptions = {"range": (0, size), "if_match": f'"{etags[index % OBJECTS]}"'}
            response = await get_async(store, f"k{index % OBJECTS}", options=options)
            assert len(await response.bytes_async()) == size

    await asyncio.gather(*(one(index) for index in range(gets)))


async def with_aiobotocore(endpoint: str, etags: list[str], gets: int, size: int, in_flight: int) -> None:
    config = AioConfig(max_pool_connections=in_flight)
    async with get_session().create_client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", config=config
    ) as client:
        slots = asyncio.Semaphore(in_flight)

        async def one(index: int) -> None:
            async with slots:
                response = await client.get_object(
                    Bucket=BUCKET,
                    Key=f"k{index % OBJECTS}",
                    Range=f"bytes=0-{size - 1}",
                    IfMatch=f'"{etags[index % OBJECTS]}"',
                )
                async with response["Body"] as body:
                    assert len(await body.read()) == size

        await asyncio.gather(*(one(index) for index in range(gets)))


CLIENTS: dict[str, Callable[[str, list[str], int, int, int], Coroutine[None, None, None]]] = {
    "obstore": with_obstore,
    "aiobotocore": with_aiobotocore,
}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gets", type=int, default=800)
    parser.add_argument("--kib", type=int, default=128)
    parser.add_argument("--in-flight", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="each client this many times, alternating")
    args = parser.parse_args()
    size = args.kib << 10
    with s3_server() as endpoint:
        seeding = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        seeding.create_bucket(Bucket=BUCKET)
        etags = [
            seeding.put_object(Bucket=BUCKET, Key=f"k{index}", Body=os.urandom(size))["ETag"].strip('"')
            for index in range(OBJECTS)
        ]
        for _ in range(args.rounds):
            for name, client in CLIENTS.items():
                uvloop.run(client(endpoint, etags, args.in_flight, size, args.in_flight))  # warm-up
                cpu, wall = time.process_time(), time.perf_counter()
                uvloop.run(client(endpoint, etags, args.gets, size, args.in_flight))
                cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
                rate, each = args.gets / wall, cpu / args.gets * 1e3
                print(f"{name:<12} {rate:6.0f} GETs/s   client CPU {each:.2f} ms a GET")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
