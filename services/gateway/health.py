"""Liveness and readiness on the public port (/health, /ready), and the gateway's request
metrics, which the metrics port serves (services/runtime/metrics.py), never the public one."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from aiohttp import web
from grpc_health.v1 import health_pb2
from prometheus_client import CollectorRegistry, Counter, Histogram

from protos import router_pb2
from services.gateway.backends import BACKENDS, SETTINGS
from services.gateway.http_errors import json_response
from services.runtime.logs import get_logger
from services.runtime.metrics import DURATION_BUCKETS, Children
from services.runtime.tasks import cancel_and_wait

log = get_logger(__name__)

# The status recorded for a request whose client went away before it finished.
CLIENT_CLOSED_STATUS = 499
# The route label of requests the HTTP edge refused before routing (services/gateway/edge.py).
EDGE_ROUTE = "edge"


class Metrics:
    """The gateway's HTTP metrics, in the process's registry (a fresh one when not given)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.requests = Counter(
            "rollgate_gateway_requests",
            "HTTP requests by route, method and status.",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "rollgate_gateway_request_duration_seconds",
            "Time to the end of the response (streams included), by route and status.",
            ["route", "method", "status"],
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        # Routes are the app's (unmatched paths count as one), methods and statuses bounded.
        self._requests = Children(self.requests)
        self._latency = Children(self.latency)

    def observe(self, *, route: str, method: str, status: int, duration_s: float) -> None:
        """Counts one finished request."""
        labels = (route, method, str(status))
        self._requests(*labels).inc()
        self._latency(*labels).observe(duration_s)

    def refused_at_edge(self, method: str, status: int) -> None:
        """Counts a request the HTTP edge answered before routing (route `edge`; method
        `unparsed` when the request line never parsed). Not timed: nothing was handled."""
        self.requests.labels(route=EDGE_ROUTE, method=method, status=str(status)).inc()


METRICS = web.AppKey("metrics", Metrics)


def route_label(request: web.Request) -> str:
    """The route label of a request: its route's path pattern, or `unmatched`."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


# /health's count is refreshed when a /health finds it older than this (without waiting for
# the refresh: the next one sees it), and in the background every `health_workers_refresh_s`.
LIVE_WORKERS_FRESH_S = 2.0


class LiveWorkers:
    """The router's count of live workers for /health, never waited for.

    /health is the liveness probe: it answers from this count and never waits on the router.
    A /health that finds the count older than LIVE_WORKERS_FRESH_S starts one refresh in the
    background (so whoever polls /health sees a count at most that old, plus the poll's
    interval); a background task refreshes it every `health_workers_refresh_s` (10 s) when
    nobody asks. Each refresh is a `ListWorkers` call: at the old fixed 2 s they cost an
    idle stack ≈ 2.5 ms of CPU a second across gateway and router, ≈ 2 % of a one-client
    stack's CPU (docs/internals.md, *One write fewer per stream, /health's count refreshed
    when asked*).
    """

    def __init__(self) -> None:
        self.count = 0
        # Monotonic time of the last successful refresh (None: never).
        self.refreshed_at: float | None = None
        self._refreshing: asyncio.Task[None] | None = None

    def record(self, count: int) -> None:
        """Stores a fresh count (also from /ready, which asks the router anyway)."""
        self.count = count
        self.refreshed_at = time.monotonic()

    def current(self, app: web.Application) -> int:
        """The count for /health; starts a refresh (not awaited) when it is stale."""
        at = self.refreshed_at
        if self._refreshing is None and (
            at is None or time.monotonic() - at > LIVE_WORKERS_FRESH_S
        ):
            self._refreshing = asyncio.create_task(self._refresh_once(app), name="live-workers-now")
        return self.count

    async def _refresh_once(self, app: web.Application) -> None:
        try:
            await self.refresh(app)
        finally:
            self._refreshing = None

    async def refresh(self, app: web.Application) -> None:
        """Asks the router once; on failure the last count stays."""
        try:
            response = await app[BACKENDS].router.ListWorkers(
                router_pb2.ListWorkersRequest(), timeout=app[SETTINGS].rpc_timeout_s
            )
        except grpc.aio.AioRpcError as err:
            log.debug("live_workers_refresh_failed", code=err.code().name)
            return
        self.record(sum(1 for worker in response.workers if worker.live))

    async def run(self, app: web.Application) -> None:
        """Refreshes every `health_workers_refresh_s` until cancelled (then stops a refresh a
        /health started)."""
        interval_s = app[SETTINGS].health_workers_refresh_s
        try:
            while True:
                await self.refresh(app)
                await asyncio.sleep(interval_s)
        finally:
            if self._refreshing is not None:
                await cancel_and_wait(self._refreshing)


LIVE_WORKERS = web.AppKey("live_workers", LiveWorkers)


async def live_workers_ctx(app: web.Application) -> AsyncIterator[None]:
    """cleanup_ctx (after the backends): the background refresh of /health's worker count."""
    task = asyncio.create_task(app[LIVE_WORKERS].run(app), name="live-workers")
    try:
        yield
    finally:
        await cancel_and_wait(task)


async def health(request: web.Request) -> web.Response:
    """GET /health: the process answers, with the live workers counted at the last refresh."""
    return json_response(
        {"status": "ok", "workers": request.app[LIVE_WORKERS].current(request.app)}
    )


def _rpc_problem(what: str, err: grpc.aio.AioRpcError) -> str:
    """What /ready says about a failed call: the status, never its details (they name internal
    addresses: 'ipv4:10.0.0.7:50051: Connection refused'), which go to the log."""
    log.info("ready_check_failed", what=what, code=err.code().name, details=err.details())
    return f"{what}: {err.code().name}; see the gateway's log"


async def _check_serving(stub: Any, timeout_s: float) -> str | None:
    """None when the peer's health service says SERVING, else what is wrong."""
    try:
        response = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
    except grpc.aio.AioRpcError as err:
        return _rpc_problem("health check failed", err)
    if response.status != health_pb2.HealthCheckResponse.SERVING:
        return f"health status {health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)}"
    return None


async def _count_live_workers(request: web.Request, timeout_s: float) -> tuple[int, str | None]:
    try:
        response = await request.app[BACKENDS].router.ListWorkers(
            router_pb2.ListWorkersRequest(), timeout=timeout_s
        )
    except grpc.aio.AioRpcError as err:
        return 0, _rpc_problem("cannot list workers", err)
    live = sum(1 for worker in response.workers if worker.live)
    request.app[LIVE_WORKERS].record(live)
    return live, None if live else "no live worker is registered with the router"


async def ready(request: web.Request) -> web.Response:
    """GET /ready: 200 when the dataproxy and router serve and ≥1 worker is live, else 503."""
    backends = request.app[BACKENDS]
    timeout_s = request.app[SETTINGS].ready_timeout_s
    dataproxy_problem, router_problem, (live, workers_problem) = await asyncio.gather(
        _check_serving(backends.dataproxy_health, timeout_s),
        _check_serving(backends.router_health, timeout_s),
        _count_live_workers(request, timeout_s),
    )
    problems = {
        part: problem
        for part, problem in (
            ("dataproxy", dataproxy_problem),
            ("router", router_problem),
            ("workers", workers_problem),
        )
        if problem is not None
    }
    if problems:
        body = {"status": "not_ready", "missing": list(problems), "detail": problems}
        return json_response(body, status=503)
    return json_response({"status": "ready", "live_workers": live})
