"""The floor: one Python hop that relays the request body and the response bytes unchanged.

An aiohttp reverse proxy that parses nothing and records nothing (the same behaviour as
../shared/bench/passthrough.py): what rollgate costs above it is design, not language.
Usage: `python bench/floor.py --port P --upstream http://127.0.0.1:M`.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import AsyncIterator

import aiohttp
import uvloop
from aiohttp import web

SESSION = web.AppKey("session", aiohttp.ClientSession)


def app(upstream: str) -> web.Application:
    """The relay: every method and path goes to `upstream` + the same path."""
    base = upstream.rstrip("/")

    async def session_ctx(app: web.Application) -> AsyncIterator[None]:
        app[SESSION] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60), auto_decompress=False
        )
        yield
        await app[SESSION].close()

    async def relay(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        async with request.app[SESSION].request(
            request.method, base + request.rel_url.path_qs, data=body, headers=headers
        ) as upstream_response:
            response = web.StreamResponse(
                status=upstream_response.status,
                headers={"Content-Type": upstream_response.headers.get("Content-Type", "")},
            )
            await response.prepare(request)
            async for chunk in upstream_response.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    application = web.Application(client_max_size=64 * 1024 * 1024)
    application.cleanup_ctx.append(session_ctx)
    application.router.add_route("*", "/{tail:.*}", relay)
    return application


def main(argv: list[str] | None = None) -> int:
    """Serves the relay until interrupted."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    args = parser.parse_args(argv)
    uvloop.install()
    with contextlib.suppress(KeyboardInterrupt):
        web.run_app(app(args.upstream), host=args.host, port=args.port, access_log=None, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
