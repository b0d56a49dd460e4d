"""Prometheus metrics every service runs: a registry per process, the metrics port that serves
it (never a public port), one counter and histogram per RPC, and the lease that lets exactly
one replica export values that are global because they are read from Redis.

Naming (docs/metrics.md): `rollgate_<service>_…` is what this process counted itself (summing
over replicas is right); `rollgate_…` without a service name is a global value read from Redis,
exported only by the replica holding the exporter lease (`rollgate_metrics_global_exporter`
is 1 there and 0 elsewhere), so summing over replicas is right for those too.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
import redis.asyncio as aioredis
from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from services.runtime.errors import RollgateError
from services.runtime.logs import get_logger
from services.runtime.redis_scripts import KEY, Script, ScriptCall, as_bool
from services.runtime.tasks import cancel_and_wait
from services.runtime.tracing import Span, TraceContext, Tracer, incoming
from stackconfig import env_str

log = get_logger(__name__)

VERSION = "0.1.0"

# Each service's metrics port unless ROLLGATE_METRICS_PORT says otherwise: 9 + the last
# digits of its main port, so several services on one host never collide by default.
DEFAULT_METRICS_PORTS = {"gateway": 9080, "router": 9051, "dataproxy": 9052, "worker": 9061}

# A scrape must answer even when Redis is slow: global values are read within this budget.
GLOBAL_READ_TIMEOUT_S = 2.0
# Several Prometheus servers (or a person with curl) scraping at once read Redis once.
GLOBAL_CACHE_S = 1.0
# The exporter lease, renewed by its holder's background task three times per lease
# (scrapes play no part): a dead exporter is replaced within a lease and a renewal interval.
EXPORTER_LEASE_S = 30.0
LEASE_RENEWALS_PER_TTL = 3

# Latency buckets (seconds) shared by every duration histogram: sub-millisecond hops up to
# ten-minute generations.
DURATION_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricsEndpoint:
    """Where a service serves /metrics; port None: nowhere, 0: any free port."""

    host: str = "127.0.0.1"
    port: int | None = None


# The settings' default: services built in-process (tests) open no metrics port unless asked.
NO_METRICS_PORT = MetricsEndpoint()


def metrics_endpoint(environ: Mapping[str, str], *, service: str, host: str) -> MetricsEndpoint:
    """`ROLLGATE_METRICS_PORT` (a port, 0: any free one, `off`: none; default per service)
    and `ROLLGATE_METRICS_HOST` (default: the service's own host)."""
    raw = env_str(environ, "ROLLGATE_METRICS_PORT", str(DEFAULT_METRICS_PORTS[service]))
    port: int | None
    if raw.lower() in {"off", "none", "no"}:
        port = None
    else:
        try:
            port = int(raw)
        except ValueError:
            raise ValueError(
                f"ROLLGATE_METRICS_PORT={raw!r} is not a port (a number, 0 for any, or off)"
            ) from None
        if not 0 <= port <= 65535:
            raise ValueError(f"ROLLGATE_METRICS_PORT={port} is not a TCP port (0-65535)")
    return MetricsEndpoint(host=env_str(environ, "ROLLGATE_METRICS_HOST", host), port=port)


# -- the registry a process owns -----------------------------------------------------------


class GlobalValues(Collector):
    """Gauge families read from Redis before a scrape; empty unless this replica exports."""

    def __init__(self) -> None:
        self.families: list[Metric] = []

    def collect(self) -> Iterable[Metric]:
        """The families of the last refresh."""
        return list(self.families)

    def describe(self) -> Iterable[Metric]:
        """Nothing up front: the families are known only after a refresh."""
        return []


Refresh = Callable[[], Awaitable[list[Metric]]]


class _Exporting:
    """Whether this replica exports the global values, and failed reads of them."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.exporter = Gauge(
            "rollgate_metrics_global_exporter",
            "1 on the one replica that exports the global values read from Redis, else 0.",
            registry=registry,
        )
        self.read_errors = Counter(
            "rollgate_metrics_global_read_errors",
            "Scrapes whose global values could not be read from Redis in time.",
            registry=registry,
        )


class ServiceMetrics:
    """One process's registry: process and build info, RPC metrics, and global values."""

    def __init__(self, service: str) -> None:
        self.service = service
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        build = Gauge(
            "rollgate_build_info",
            "Always 1: the rollgate version and which service this process is.",
            ["service", "version"],
            registry=self.registry,
        )
        build.labels(service=service, version=VERSION).set(1)
        self._globals = GlobalValues()
        self.registry.register(self._globals)
        self._exporting: _Exporting | None = None
        self._refresh: Refresh | None = None
        self._lease: ExporterLease | None = None
        self._refreshed_at = 0.0
        self._lock = asyncio.Lock()
        self._rpc: RpcMetrics | None = None

    @property
    def rpc(self) -> RpcMetrics:
        """The per-RPC counters (created on first use: the gateway has none)."""
        if self._rpc is None:
            self._rpc = RpcMetrics(self.registry)
        return self._rpc

    def export_globals(self, lease: ExporterLease, refresh: Refresh) -> None:
        """Before each scrape, `refresh` reads the global values while `lease` is held (the
        lease must be running: `async with lease`). Only the services that read global
        values (router, dataproxy) serve the exporter's own two metrics."""
        if self._exporting is None:
            self._exporting = _Exporting(self.registry)
        self._lease = lease
        self._refresh = refresh

    async def render(self) -> bytes:
        """The Prometheus text format, with global values refreshed first."""
        await self._refresh_globals()
        return bytes(generate_latest(self.registry))

    async def _refresh_globals(self) -> None:
        if self._refresh is None or self._lease is None or self._exporting is None:
            return
        exporting = self._exporting
        async with self._lock:
            if time.monotonic() - self._refreshed_at < GLOBAL_CACHE_S:
                return
            # Held as of the last renewal, which its background task makes: a replica that is
            # not scraped for a while keeps the lease, and one scraped often takes nothing.
            held = self._lease.held
            try:
                async with asyncio.timeout(GLOBAL_READ_TIMEOUT_S):
                    self._globals.families = await self._refresh() if held else []
            except (TimeoutError, OSError, aioredis.RedisError, RollgateError) as err:
                # No value beats a stale one: a wrong backlog would be believed.
                exporting.read_errors.inc()
                self._globals.families = []
                held = False
                log.warning("metrics_global_read_failed", error=type(err).__name__)
            exporting.exporter.set(1 if held else 0)
            self._refreshed_at = time.monotonic()


@dataclass(frozen=True, slots=True, kw_only=True)
class ClaimLeaseCall(ScriptCall):
    """claim_exporter_lease.lua: takes the lease if free, renews it if `holder`'s; 1 if held."""

    SCRIPT = "claim_exporter_lease"
    lease: str = field(metadata=KEY)
    holder: str
    ttl_ms: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ReleaseLeaseCall(ScriptCall):
    """release_exporter_lease.lua: gives the lease up if `holder`'s (always 0)."""

    SCRIPT = "release_exporter_lease"
    lease: str = field(metadata=KEY)
    holder: str


class ExporterLease:
    """`async with`: which replica of a service exports the global values — whoever holds
    this Redis key. A background task takes the lease when it is free and renews it while it
    is this replica's, every third of its TTL; leaving gives it up."""

    def __init__(self, redis: aioredis.Redis, *, key: str, ttl_s: float = EXPORTER_LEASE_S):
        self._redis = redis
        self._key = key
        self._ttl_s = ttl_s
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._renew_every_s = ttl_s / LEASE_RENEWALS_PER_TTL
        self._me = secrets.token_hex(8)
        self._script = Script.load(ClaimLeaseCall, as_bool)
        self._release = Script.load(ReleaseLeaseCall, as_bool)
        # Monotonic time until which the lease is surely ours: a claim's start plus the TTL
        # (the key, set after that start, expires later), so this replica stops exporting
        # before another one can take the lease over.
        self._held_until = 0.0
        self._failing = False
        self._task: asyncio.Task[None] | None = None

    @property
    def held(self) -> bool:
        """True while this replica surely holds the lease (as of its last renewal)."""
        return time.monotonic() < self._held_until

    async def __aenter__(self) -> ExporterLease:
        # The first claim before serving, so the first scrape already knows who exports.
        await self._claim()
        self._task = asyncio.create_task(self._renew(), name=f"exporter-lease:{self._key}")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        await self.release()

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(self._renew_every_s)
            await self._claim()

    async def _claim(self) -> None:
        """Takes the lease if free, renews it if ours. A failed round trip changes nothing:
        the lease, if ours, lapses on its own at `_held_until`."""
        started = time.monotonic()
        try:
            async with asyncio.timeout(min(GLOBAL_READ_TIMEOUT_S, self._renew_every_s)):
                ours = await self._script.run(
                    self._redis,
                    ClaimLeaseCall(lease=self._key, holder=self._me, ttl_ms=self._ttl_ms),
                )
        except (TimeoutError, OSError, aioredis.RedisError) as err:
            if not self._failing:
                log.warning(
                    "metrics_exporter_lease_failed", key=self._key, error=type(err).__name__
                )
            self._failing = True
            return
        self._failing = False
        self._held_until = started + self._ttl_s if ours else 0.0

    async def release(self) -> None:
        """Gives the lease up (only if still ours), so another replica takes over at its next
        renewal instead of after the lease expires. Never raises: it runs at shutdown, when
        Redis may already be gone."""
        self._held_until = 0.0
        with contextlib.suppress(TimeoutError, OSError, aioredis.RedisError):
            async with asyncio.timeout(GLOBAL_READ_TIMEOUT_S):
                await self._release.run(
                    self._redis, ReleaseLeaseCall(lease=self._key, holder=self._me)
                )


def gauge(name: str, documentation: str, value: float) -> Metric:
    """A one-sample gauge family."""
    family = Metric(name, documentation, "gauge")
    family.add_sample(name, {}, float(value))
    return family


def labelled_gauge(
    name: str, documentation: str, label: str, values: Mapping[str, float]
) -> Metric:
    """A gauge family with one label (whose values must be bounded: workers, groups, …)."""
    family = Metric(name, documentation, "gauge")
    for key, value in sorted(values.items()):
        family.add_sample(name, {label: key}, float(value))
    return family


def counter(name: str, documentation: str, value: float) -> Metric:
    """A one-sample counter family (`name` without `_total`; the sample gets it)."""
    family = Metric(name, documentation, "counter")
    family.add_sample(name + "_total", {}, float(value))
    return family


# -- the metrics port ----------------------------------------------------------------------


SERVICE_METRICS = web.AppKey("service_metrics", ServiceMetrics)


async def _metrics(request: web.Request) -> web.Response:
    body = await request.app[SERVICE_METRICS].render()
    response = web.Response(body=body)
    response.headers["Content-Type"] = CONTENT_TYPE_LATEST
    return response


async def _alive(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", "service": request.app[SERVICE_METRICS].service})


class MetricsServer:
    """`async with`: serves GET /metrics (and GET /health) on the service's metrics port."""

    def __init__(self, metrics: ServiceMetrics, endpoint: MetricsEndpoint) -> None:
        self.metrics = metrics
        self.endpoint = endpoint
        self.port: int | None = None
        self._runner: web.AppRunner | None = None

    async def __aenter__(self) -> MetricsServer:
        if self.endpoint.port is None:
            return self
        app = web.Application()
        app[SERVICE_METRICS] = self.metrics
        app.router.add_get("/metrics", _metrics, allow_head=False)
        app.router.add_get("/health", _alive, allow_head=False)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.endpoint.host, self.endpoint.port)
        try:
            await site.start()
        except OSError as err:
            await runner.cleanup()
            raise OSError(
                f"cannot serve metrics on {self.endpoint.host}:{self.endpoint.port} "
                f"({err.strerror or err}); set ROLLGATE_METRICS_PORT (0: any free port, off: none)"
            ) from None
        self._runner = runner
        self.port = int(runner.addresses[0][1])
        log.info(
            "metrics_serving",
            service=self.metrics.service,
            host=self.endpoint.host,
            port=self.port,
            path="/metrics",
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


# -- RPCs ----------------------------------------------------------------------------------


class Children:
    """A labelled metric's children by their label values (in the metric's label order),
    each looked up once: prometheus_client's `labels()` checks and joins the values on every
    call (≈ 4 µs), and the hot paths count a few series per turn. Only for metrics whose
    series are never removed (a removed child would stay cached here)."""

    __slots__ = ("_children", "_metric")

    def __init__(self, metric: Any) -> None:
        self._metric = metric
        self._children: dict[tuple[str, ...], Any] = {}

    def __call__(self, *values: str) -> Any:
        """The child for `values` (the metric's `labels(*values)`)."""
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._metric.labels(*values)
        return child


class RpcMetrics:
    """Handled RPCs by service, method and status code; their durations; how many run."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.handled = Counter(
            "rollgate_grpc_server_handled",
            "RPCs finished, by gRPC service, method and status code.",
            ["grpc_service", "grpc_method", "grpc_code"],
            registry=registry,
        )
        self.duration = Histogram(
            "rollgate_grpc_server_handling_seconds",
            "Time from an RPC's start to its end (streams included), by service and method.",
            ["grpc_service", "grpc_method"],
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        self.in_flight = Gauge(
            "rollgate_grpc_server_in_flight",
            "RPCs running now, by service and method.",
            ["grpc_service", "grpc_method"],
            registry=registry,
        )
        # By (service, method, code) and (service, method): the ledger ops and worker turns
        # count here once per op.
        self.handled_by = Children(self.handled)
        self.duration_by = Children(self.duration)


def _split_method(full: str) -> tuple[str, str]:
    """`/rollgate.v1.Router/Route` → ("rollgate.v1.Router", "Route")."""
    service, _, method = full.lstrip("/").rpartition("/")
    return service, method


def _final_code(context: grpc.aio.ServicerContext[Any, Any], raised: BaseException | None) -> str:
    if isinstance(raised, asyncio.CancelledError | GeneratorExit):
        return "CANCELLED"
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return str(code.name)
    return "UNKNOWN" if raised is not None else "OK"


def _serving(
    tracer: Tracer | None,
    name: str,
    parent: TraceContext | None,
    attributes: Mapping[str, str | int | float | bool],
) -> contextlib.AbstractContextManager[Span | None]:
    """The RPC's span (or nothing when untraced)."""
    if tracer is None:
        return contextlib.nullcontext()
    return tracer.serve(name, parent, attributes=attributes)


def _end_span(span: Span | None, code: str) -> None:
    if span is not None:
        span.attributes["rpc.grpc.status_code"] = code
        if code != "OK":
            span.fail(code)


# Called with (`/pkg.Service/Method`, status code name, details) for every failed RPC; must
# not block (it runs as the RPC ends).
ErrorHook = Callable[[str, str, str], None]


class RpcMetricsInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # untyped grpc
    """Counts every RPC but health checks, by its final status code (outermost interceptor,
    so it sees the code the others produced)."""

    def __init__(
        self,
        metrics: RpcMetrics,
        *,
        on_error: ErrorHook | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        self._metrics = metrics
        self._on_error = on_error
        self._tracer = tracer

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        full = handler_call_details.method
        if handler is None or full.startswith("/grpc.health"):
            return handler
        service, method = _split_method(full)
        # The caller's trace (a traceparent in the metadata) continues here; without one and
        # without export, nothing is traced and nothing costs.
        parent = incoming(handler_call_details.invocation_metadata)
        tracer = self._tracer
        if tracer is not None and parent is None and tracer.exporter is None:
            tracer = None
        span_name = full.lstrip("/")
        attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}
        handled = self._metrics.handled
        duration = self._metrics.duration.labels(grpc_service=service, grpc_method=method)
        running = self._metrics.in_flight.labels(grpc_service=service, grpc_method=method)

        on_error = self._on_error

        def finish(context: Any, started: float, raised: BaseException | None) -> str:
            running.dec()
            duration.observe(time.perf_counter() - started)
            code = _final_code(context, raised)
            handled.labels(grpc_service=service, grpc_method=method, grpc_code=code).inc()
            if on_error is not None and code != "OK":
                on_error(full, code, str(context.details() or ""))
            return code

        if handler.unary_unary is not None:
            inner_uu = handler.unary_unary

            async def unary_unary(request: Any, context: Any) -> Any:
                with _serving(tracer, span_name, parent, attributes) as span:
                    started, raised = time.perf_counter(), None
                    running.inc()
                    try:
                        return await inner_uu(request, context)
                    except BaseException as err:
                        raised = err
                        raise
                    finally:
                        _end_span(span, finish(context, started, raised))

            return grpc.unary_unary_rpc_method_handler(
                unary_unary,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            inner_us = handler.unary_stream

            async def unary_stream(request: Any, context: Any) -> Any:
                with _serving(tracer, span_name, parent, attributes) as span:
                    started, raised = time.perf_counter(), None
                    running.inc()
                    try:
                        produced = inner_us(request, context)
                        if hasattr(produced, "__aiter__"):
                            async for item in produced:
                                yield item
                        else:  # a handler that writes with context.write() and returns
                            await produced
                    except BaseException as err:
                        raised = err
                        raise
                    finally:
                        _end_span(span, finish(context, started, raised))

            return grpc.unary_stream_rpc_method_handler(
                unary_stream,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler
