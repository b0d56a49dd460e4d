"""The gateway's side of tracing: each HTTP request continues the client's `traceparent`
(or starts a trace when export is on) for every gRPC call it makes (services/runtime/tracing.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web
from aiohttp.typedefs import Handler

from services.gateway.backends import SETTINGS
from services.runtime.tracing import TRACEPARENT, TraceContext, Tracer, tracer_for

TRACER = web.AppKey("tracer", Tracer)


async def tracing_ctx(app: web.Application) -> AsyncIterator[None]:
    """cleanup_ctx: the tracer (and its exporter, when an endpoint is set)."""
    async with tracer_for("gateway", app[SETTINGS].tracing) as tracer:
        app[TRACER] = tracer
        yield


@web.middleware
async def tracing_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Runs the request in its trace; untraced requests without export cost one lookup."""
    tracer = request.app.get(TRACER)
    parent = TraceContext.parse(request.headers.get(TRACEPARENT))
    if tracer is None or (parent is None and tracer.exporter is None):
        return await handler(request)
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else "unmatched"
    attributes = {"http.request.method": request.method, "http.route": route}
    with tracer.serve(f"{request.method} {route}", parent, attributes=attributes) as span:
        response = await handler(request)
        if span is not None:
            span.attributes["http.response.status_code"] = response.status
            if response.status >= 500:
                span.fail(f"HTTP {response.status}")
        return response
