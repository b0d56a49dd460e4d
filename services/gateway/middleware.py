"""The app's one middleware: each request's trace, its metrics, its protocol's error shape and
the mapping of errors to HTTP, in that order from the outside in.

One coroutine instead of four middlewares: a request's frames are resumed at every await of
its handler, and each middleware was one more frame each time (and a streamed answer awaits
once per chunk). The concerns stay where they were written: the span is tracing.py's, the
counts are `health.Metrics`, the shape is `ErrorShapes.reshape`, the mapping is http_errors.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from contextlib import AbstractContextManager

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from services.gateway.health import CLIENT_CLOSED_STATUS, Metrics, route_label
from services.gateway.http_errors import failure_response, http_exception_response
from services.gateway.protocols import ErrorShapes
from services.gateway.tracing_http import TRACER
from services.runtime.tracing import TRACEPARENT, Span, TraceContext

# The scope of a request that records no span and carries no trace on (the usual case).
_UNTRACED: AbstractContextManager[Span | None] = contextlib.nullcontext()


def request_middleware(shapes: ErrorShapes, metrics: Metrics) -> Middleware:
    """The middleware: the trace spans everything; the metrics count the status the client
    gets; an error on a protocol's paths takes its shape (`shapes`) after the error mapping,
    so auth, routing, limits and relay errors all do."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        scope = _trace_scope(request)
        with scope as span:
            started = time.perf_counter()
            status = 500
            try:
                try:
                    response = await handler(request)
                except web.HTTPException as exc:
                    if exc.status < 400:
                        raise
                    response = http_exception_response(request, exc)
                except Exception as exc:
                    response = failure_response(request, exc)
                response = shapes.reshape(request, response)
                status = response.status
            except asyncio.CancelledError:
                status = CLIENT_CLOSED_STATUS
                raise
            finally:
                metrics.observe(
                    route=route_label(request),
                    method=request.method,
                    status=status,
                    duration_s=time.perf_counter() - started,
                )
            if span is not None:
                span.attributes["http.response.status_code"] = status
                if status >= 500:
                    span.fail(f"HTTP {status}")
            return response

    return middleware


def _trace_scope(request: web.Request) -> AbstractContextManager[Span | None]:
    """The request's span (when recorded) and trace; untraced requests without export cost
    one lookup and no context change."""
    tracer = request.app.get(TRACER)
    if tracer is None:
        return _UNTRACED
    parent = TraceContext.parse(request.headers.get(TRACEPARENT))
    if parent is None and tracer.exporter is None:
        return _UNTRACED
    route = route_label(request)
    attributes = {"http.request.method": request.method, "http.route": route}
    return tracer.serve(f"{request.method} {route}", parent, attributes=attributes)
