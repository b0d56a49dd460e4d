"""The gateway's aiohttp application and the server that runs it."""

from __future__ import annotations

import time

from aiohttp import web

from services.gateway import (
    chat,
    console,
    health,
    key_admin,
    messages,
    models,
    responses,
    session_api,
    url_sessions,
    ws,
)
from services.gateway.backends import ROUTE_CACHE, SETTINGS, TURN_METRICS, backends_ctx
from services.gateway.edge import EdgeLimits, GatewayRunner
from services.gateway.middleware import request_middleware
from services.gateway.protocols import ERROR_SHAPES, ErrorShapes, Protocol, routes_of
from services.gateway.routing import RouteCache
from services.gateway.settings import GatewaySettings
from services.gateway.tracing_http import tracing_ctx
from services.gateway.turn_metrics import TurnMetrics
from services.runtime.logs import get_logger
from services.runtime.metrics import MetricsServer, ServiceMetrics

log = get_logger(__name__)

# The HTTP protocols this gateway speaks (services/gateway/protocols.py), mounted in this order.
# A new protocol is its module and a line here.
PROTOCOLS: tuple[Protocol, ...] = (
    session_api.PROTOCOL,
    chat.PROTOCOL,
    models.PROTOCOL,
    responses.PROTOCOL,
    messages.PROTOCOL,
)


def build_app(settings: GatewaySettings, metrics: ServiceMetrics | None = None) -> web.Application:
    """The application: routes, middlewares, and the gRPC channels as a cleanup context.
    Its metrics go into `metrics`'s registry (served on the metrics port, not here)."""
    # One middleware (middleware.py): the trace spans everything; the metrics count the status
    # the client gets; errors are mapped, then reshaped on a protocol's paths (Messages).
    shapes = ErrorShapes(PROTOCOLS)
    http_metrics = health.Metrics(metrics.registry if metrics is not None else None)
    app = web.Application(
        middlewares=[request_middleware(shapes, http_metrics)],
        client_max_size=settings.max_body_bytes,
    )
    app[SETTINGS] = settings
    app[ERROR_SHAPES] = shapes
    app[ROUTE_CACHE] = RouteCache(
        ttl_s=settings.route_cache_ttl_s, max_entries=settings.route_cache_size
    )
    app[health.METRICS] = http_metrics
    app[TURN_METRICS] = TurnMetrics(app[health.METRICS].registry)
    app[health.LIVE_WORKERS] = health.LiveWorkers()
    app[models.STARTED_AT] = int(time.time())
    app.cleanup_ctx.append(tracing_ctx)
    app.cleanup_ctx.append(backends_ctx)
    app.cleanup_ctx.append(health.live_workers_ctx)
    for protocol in PROTOCOLS:
        protocol.mount(app)
    key_admin.mount(app)
    console.mount(app, settings)
    ws.mount(app, ws.config_from(settings))
    # Each session-key route gets its /sessions/{id} twins (url_sessions.py).
    url_sessions.mount(app, routes_of(PROTOCOLS))
    app.router.add_get("/health", health.health, allow_head=False)
    app.router.add_get("/ready", health.ready, allow_head=False)
    return app


class GatewayServer:
    """`async with`: serves `build_app(settings)` on settings.host:settings.port (0: any)."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.metrics = ServiceMetrics("gateway")
        limits = EdgeLimits(
            header_timeout_s=settings.header_timeout_s,
            body_timeout_s=settings.body_timeout_s,
            keepalive_timeout_s=settings.keepalive_timeout_s,
            max_header_bytes=settings.max_header_bytes,
            max_headers=settings.max_headers,
        )
        app = build_app(settings, self.metrics)
        self.runner = GatewayRunner(
            app,
            limits=limits,
            on_refused=app[health.METRICS].refused_at_edge,
            shapes=app[ERROR_SHAPES],
        )
        self.metrics_server = MetricsServer(self.metrics, settings.metrics)
        self.port = 0

    async def __aenter__(self) -> GatewayServer:
        await self.metrics_server.__aenter__()
        try:
            await self.runner.setup()
        except BaseException:
            await self.metrics_server.__aexit__(None, None, None)
            raise
        site = web.TCPSite(self.runner, self.settings.host, self.settings.port)
        try:
            await site.start()
        except BaseException:
            await self.runner.cleanup()
            await self.metrics_server.__aexit__(None, None, None)
            raise
        self.port = self.runner.addresses[0][1]
        log.info("service_started", name="gateway", host=self.settings.host, port=self.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.runner.cleanup()
        await self.metrics_server.__aexit__(None, None, None)
        log.info("service_stopped", name="gateway")
