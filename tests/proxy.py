"""A small HTTP proxy in front of a test server (S3, GCS, Azurite) that forwards every
request and can refuse, hold or alter one: the faults a real server cannot
be made to show (a refused part, a 503, a reply HTTP allows and a client
refuses), injected on the wire, with the store under test unmocked."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import aiohttp
from aiohttp import web

from cachefsd.store.base import ObjectStore

MIB = 1 << 20
# What one store call through the proxy may take, retries and all.
CALL_TIMEOUT_SECONDS = 60.0

StoreT = TypeVar("StoreT", bound=ObjectStore)
T = TypeVar("T")

# What the proxy does with a request: forward this body, or answer instead.
Decision = bytes | web.Response
Rule = Callable[[web.Request, bytes], Awaitable[Decision]]

_HOP_BY_HOP = frozenset({"host", "content-length", "transfer-encoding", "connection", "content-encoding"})


class Proxy:
    """Forwards requests to ``upstream`` after ``rule`` saw each (it may
    change the body or answer itself), on the running loop."""

    def __init__(self, upstream: str, rule: Rule) -> None:
        self._upstream = upstream
        self._rule = rule
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> str:
        app = web.Application(client_max_size=64 * MIB)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self._session = aiohttp.ClientSession(auto_decompress=False)
        return f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self._session is not None:
            await self._session.close()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _forward(self, request: web.Request) -> web.Response:
        assert self._session is not None
        decision = await self._rule(request, await request.read())
        if isinstance(decision, web.Response):
            return decision
        headers = {name: value for name, value in request.headers.items() if name.lower() not in _HOP_BY_HOP}
        # No Content-Type the client did not send: Azure's Shared Key signs it.
        async with self._session.request(
            request.method,
            self._upstream + request.raw_path,
            headers=headers,
            data=decision,
            skip_auto_headers=("Content-Type",),
        ) as reply:
            body = await reply.read()
            answer = {name: value for name, value in reply.headers.items() if name.lower() not in _HOP_BY_HOP}
            if request.method == "HEAD":  # no body, and the length is the object's
                answer["Content-Length"] = reply.headers["Content-Length"]
                return web.Response(status=reply.status, headers=answer)
            return web.Response(status=reply.status, headers=answer, body=body)


def through_proxy(
    upstream: str, rule: Rule, open_store: Callable[[str], StoreT], body: Callable[[StoreT], Awaitable[T]]
) -> T:
    """``body``'s result with the store ``open_store`` makes for the
    endpoint of a proxy to ``upstream`` whose every request passes
    ``rule``; both closed after."""

    async def main() -> T:
        proxy = Proxy(upstream, rule)
        store = open_store(await proxy.start())
        try:
            return await asyncio.wait_for(body(store), CALL_TIMEOUT_SECONDS)
        finally:
            await store.close()
            await proxy.stop()

    return asyncio.run(main())
