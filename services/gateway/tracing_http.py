"""The gateway's side of tracing: its tracer, in which the request middleware (middleware.py)
runs each HTTP request, so that it continues the client's `traceparent` (or starts a trace
when export is on) for every gRPC call it makes (services/runtime/tracing.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

from services.gateway.backends import SETTINGS
from services.runtime.tracing import Tracer, tracer_for

TRACER = web.AppKey("tracer", Tracer)


async def tracing_ctx(app: web.Application) -> AsyncIterator[None]:
    """cleanup_ctx: the tracer (and its exporter, when an endpoint is set)."""
    async with tracer_for("gateway", app[SETTINGS].tracing) as tracer:
        app[TRACER] = tracer
        yield
