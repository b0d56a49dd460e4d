"""The protocol registry: a protocol declared once is mounted, twinned under the session
prefixes as its routes say, and its errors take its shape in the app and at the edge."""

from __future__ import annotations

import re
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from services.gateway.edge import EdgeLimits, GatewayRunner
from services.gateway.health import Metrics
from services.gateway.middleware import request_middleware
from services.gateway.protocols import ErrorShapes, Protocol, Route, Twins, routes_of
from services.gateway.url_sessions import ATTEMPT_PREFIX, SESSION_PREFIX
from services.gateway.url_sessions import mount as mount_session_twins
from services.runtime.errors import InvalidRequest


def _echo_error(status: int, message: str, code: str) -> dict[str, Any]:
    return {"kind": "echo-error", "status": status, "text": message, "why": code}


async def _refuse(request: web.Request) -> web.StreamResponse:
    raise InvalidRequest("the echo is closed", code="echo_closed")


async def _hello(request: web.Request) -> web.StreamResponse:
    return web.json_response({"hello": request.match_info.get("session_id", "")})


ECHO = Protocol(
    name="echo",
    routes=(
        Route(method="POST", path="/v1/echo", handler=_refuse),
        Route(method="GET", path="/v1/echo/hello", handler=_hello, twins=Twins.SAME),
        Route(method="GET", path="/v1/echo/plain", handler=_hello, twins=Twins.NONE),
    ),
    error_paths=re.compile(r"(/sessions/[^/]*)?/v1/echo(/.*)?"),
    error_body=_echo_error,
)
OTHER = Protocol(name="other", routes=(Route(method="POST", path="/v1/other", handler=_refuse),))


def _app(*protocols: Protocol) -> web.Application:
    shapes = ErrorShapes(protocols)
    app = web.Application(middlewares=[request_middleware(shapes, Metrics())])
    for protocol in protocols:
        protocol.mount(app)
    mount_session_twins(app, routes_of(protocols))
    return app


def test_a_protocol_mounts_its_routes_and_the_twins_its_routes_ask_for() -> None:
    app = _app(ECHO, OTHER)
    routes = {(r.method, r.resource.canonical) for r in app.router.routes() if r.resource}
    session = SESSION_PREFIX.replace(":[^{}/]*", "")
    attempt = ATTEMPT_PREFIX.replace(":[^{}/]*", "")
    assert routes == {
        ("POST", "/v1/echo"),
        ("GET", "/v1/echo/hello"),
        ("GET", "/v1/echo/plain"),
        ("POST", "/v1/other"),
        *((m, prefix + p) for prefix in (session, attempt) for m, p in [
            ("POST", "/v1/echo"), ("GET", "/v1/echo/hello"), ("POST", "/v1/other"),
        ]),
    }  # fmt: skip


def test_the_error_shape_is_the_one_of_the_protocol_whose_paths_match() -> None:
    shapes = ErrorShapes([ECHO, OTHER])
    assert shapes.body_for("/v1/echo") is _echo_error
    assert shapes.body_for("/sessions/s1/v1/echo/x?y=1") is _echo_error
    assert shapes.body_for("/v1/other") is None
    assert shapes.body_for("/v1/echoes") is None
    assert ErrorShapes().body_for("/v1/echo") is None


async def test_errors_on_a_protocols_paths_take_its_shape_in_the_app_and_at_the_edge() -> None:
    app = _app(ECHO, OTHER)
    runner_shapes = ErrorShapes([ECHO, OTHER])
    limits = EdgeLimits(
        header_timeout_s=5, body_timeout_s=5, keepalive_timeout_s=5,
        max_header_bytes=8190, max_headers=100,
    )  # fmt: skip
    runner = GatewayRunner(app, limits=limits, shapes=runner_shapes)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as http:
            async with http.post("/v1/echo", data=b"{}") as response:
                assert response.status == 400
                assert orjson.loads(await response.read()) == {
                    "kind": "echo-error", "status": 400, "text": "the echo is closed",
                    "why": "echo_closed",
                }  # fmt: skip
            async with http.post("/v1/other", data=b"{}") as response:
                body = orjson.loads(await response.read())
                assert response.status == 400 and body["error"]["code"] == "echo_closed"
            # Refused at the edge, before routing (an Expect the gateway does not serve).
            async with http.post("/v1/echo", data=b"{}", headers={"Expect": "x"}) as response:
                assert response.status == 417
                assert orjson.loads(await response.read())["kind"] == "echo-error"
            async with http.post("/v1/other", data=b"{}", headers={"Expect": "x"}) as response:
                assert response.status == 417
                assert "error" in orjson.loads(await response.read())
            async with http.get("/sessions/abc/v1/echo/hello") as response:
                assert await response.json() == {"hello": "abc"}
    finally:
        await runner.cleanup()
