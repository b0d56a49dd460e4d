"""The metrics every service runs: the port setting, the RPC interceptor's counts by status,
the metrics server, and the lease that makes exactly one replica export global values."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import grpc
import pytest
import redis.asyncio as aioredis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import router_pb2, router_pb2_grpc
from services.runtime.errors import InvalidRequest, abort_with
from services.runtime.grpc_client import open_channel
from services.runtime.grpc_server import GrpcServer, ServerSpec
from services.runtime.metrics import (
    ExporterLease,
    MetricsEndpoint,
    MetricsServer,
    Refresh,
    RpcMetricsInterceptor,
    ServiceMetrics,
    gauge,
    metrics_endpoint,
)
from tests.harness.poll import eventually


def test_the_metrics_port_has_a_default_per_service_and_can_be_set_or_turned_off() -> None:
    assert metrics_endpoint({}, service="dataproxy", host="0.0.0.0") == MetricsEndpoint(
        host="0.0.0.0", port=9052
    )
    assert metrics_endpoint({}, service="gateway", host="h").port == 9080
    assert metrics_endpoint({}, service="router", host="h").port == 9051
    assert metrics_endpoint({}, service="worker", host="h").port == 9061
    assert metrics_endpoint({"ROLLGATE_METRICS_PORT": "0"}, service="worker", host="h").port == 0
    assert (
        metrics_endpoint({"ROLLGATE_METRICS_PORT": "off"}, service="worker", host="h").port is None
    )
    env = {"ROLLGATE_METRICS_PORT": "9999", "ROLLGATE_METRICS_HOST": "10.0.0.1"}
    assert metrics_endpoint(env, service="router", host="h") == MetricsEndpoint(
        host="10.0.0.1", port=9999
    )
    with pytest.raises(ValueError, match="ROLLGATE_METRICS_PORT='abc' is not a port"):
        metrics_endpoint({"ROLLGATE_METRICS_PORT": "abc"}, service="router", host="h")
    with pytest.raises(ValueError, match="not a TCP port"):
        metrics_endpoint({"ROLLGATE_METRICS_PORT": "70000"}, service="router", host="h")


class _Router(router_pb2_grpc.RouterServicer):
    """Route succeeds for session "ok" and fails with INVALID_ARGUMENT otherwise."""

    async def Route(self, request: router_pb2.RouteRequest, context: Any) -> Any:
        if request.session != "ok":
            await abort_with(context, InvalidRequest("bad session"))
        return router_pb2.RouteResponse(worker_id="w", address="a:1")


@pytest.fixture
async def served() -> AsyncIterator[tuple[ServiceMetrics, MetricsServer, str, list[Any]]]:
    metrics = ServiceMetrics("router")
    failures: list[Any] = []
    server = GrpcServer(
        ServerSpec(
            name="router",
            host="127.0.0.1",
            port=0,
            service_names=("rollgate.v1.Router",),
            grace_s=0.5,
            interceptors=(
                RpcMetricsInterceptor(metrics.rpc, on_error=lambda *a: failures.append(a)),
            ),
        )
    )
    router_pb2_grpc.add_RouterServicer_to_server(_Router(), server.server)
    async with server, MetricsServer(metrics, MetricsEndpoint(port=0)) as http:
        await server.set_serving()
        yield metrics, http, f"127.0.0.1:{server.port}", failures


async def _scrape(port: int | None) -> str:
    assert port is not None
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{port}/metrics") as resp,
    ):
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        return await resp.text()


async def test_the_interceptor_counts_each_rpc_by_method_and_final_status_code(
    served: tuple[ServiceMetrics, MetricsServer, str, list[Any]],
) -> None:
    _, http, address, failures = served
    async with open_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        for _ in range(3):
            await stub.Route(router_pb2.RouteRequest(session="ok"), timeout=5)
        for _ in range(2):
            with pytest.raises(grpc.aio.AioRpcError):
                await stub.Route(router_pb2.RouteRequest(session="bad"), timeout=5)
        # A crashing method (the generated base raises NotImplementedError) is counted with
        # the code the error interceptor answered; health checks are not counted.
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=5)
        health = health_pb2_grpc.HealthStub(channel)
        await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    text = await _scrape(http.port)
    labels = 'grpc_code="{}",grpc_method="{}",grpc_service="rollgate.v1.Router"'
    assert f"rollgate_grpc_server_handled_total{{{labels.format('OK', 'Route')}}} 3.0" in text
    assert (
        f"rollgate_grpc_server_handled_total{{{labels.format('INVALID_ARGUMENT', 'Route')}}} 2.0"
        in text
    )
    assert (
        f"rollgate_grpc_server_handled_total{{{labels.format('INTERNAL', 'ListWorkers')}}}"
        " 1.0" in text
    )
    assert "grpc.health" not in text
    assert (
        'rollgate_grpc_server_handling_seconds_count{grpc_method="Route",'
        'grpc_service="rollgate.v1.Router"} 5.0' in text
    )
    assert (
        'rollgate_grpc_server_in_flight{grpc_method="Route",grpc_service="rollgate.v1.Router"} 0.0'
        in text
    )
    assert 'rollgate_build_info{service="router",version="0.1.0"} 1.0' in text
    assert "process_cpu_seconds_total" in text
    # The error hook saw the failures (and only those), with their messages.
    codes = [(method, code) for method, code, _ in failures]
    assert codes.count(("/rollgate.v1.Router/Route", "INVALID_ARGUMENT")) == 2
    assert ("/rollgate.v1.Router/ListWorkers", "INTERNAL") in codes
    assert len(failures) == 3
    assert any(message == "bad session" for _, _, message in failures)


async def test_a_metrics_port_in_use_fails_with_a_message_naming_the_setting() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = MetricsServer(ServiceMetrics("worker"), MetricsEndpoint(port=port))
        with pytest.raises(OSError, match=f"cannot serve metrics on 127.0.0.1:{port}") as err:
            await server.__aenter__()
        assert "ROLLGATE_METRICS_PORT" in str(err.value)


async def test_no_metrics_port_means_no_listener() -> None:
    async with MetricsServer(ServiceMetrics("worker"), MetricsEndpoint(port=None)) as server:
        assert server.port is None


def _open_episodes(value: int = 7) -> Refresh:
    """A refresh that exports one global value."""

    async def refresh() -> list[Any]:
        return [gauge("rollgate_episodes_open", "Open episodes.", value)]

    return refresh


async def _render(metrics: ServiceMetrics) -> str:
    metrics._refreshed_at = 0.0  # past the one-second scrape cache
    return (await metrics.render()).decode()


async def test_exactly_one_replica_exports_global_values_and_another_takes_over(
    redis_client: aioredis.Redis, key_prefix: str
) -> None:
    key = key_prefix + "metrics:exporter:dataproxy"
    replicas = [ServiceMetrics("dataproxy") for _ in range(3)]
    leases = [ExporterLease(redis_client, key=key, ttl_s=3) for _ in replicas]
    async with contextlib.AsyncExitStack() as others:
        async with leases[0]:
            for lease in leases[1:]:
                await others.enter_async_context(lease)
            for metrics, lease in zip(replicas, leases, strict=True):
                metrics.export_globals(lease, _open_episodes())
            texts = [await _render(m) for m in replicas]
            exporting = [t for t in texts if "rollgate_episodes_open 7.0" in t]
            assert len(exporting) == 1
            assert "rollgate_metrics_global_exporter 1.0" in texts[0]
            assert all("rollgate_metrics_global_exporter 0.0" in t for t in texts[1:])
        # The exporter stops (and gives its lease up): another replica takes it over at its
        # next renewal (a third of the lease), before anyone scrapes it.
        assert not leases[0].held
        await leases[0].release()  # again: harmless
        await eventually(
            lambda: [lease.held for lease in leases[1:]].count(True), want=1, timeout_s=15,
            interval_s=0.05, what="another replica holding the lease",
        )  # fmt: skip
        successor = next(m for m, lease in zip(replicas, leases, strict=True) if lease.held)
        text = await _render(successor)
        assert "rollgate_episodes_open 7.0" in text
        assert "rollgate_metrics_global_exporter 1.0" in text
        assert await redis_client.pttl(key) > 1_500
    assert await redis_client.exists(key) == 0


# Short enough to outlive several leases in a test; renewed a few times per lease.
TINY_LEASE_S = 0.6


class CuttableLink:
    """`async with`: a TCP relay to Redis on a port of its own; `cut()` drops every
    connection and refuses new ones (a replica losing its network)."""

    def __init__(self, target_port: int) -> None:
        self._target_port = target_port
        self._writers: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None
        self.port = 0

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._target_port)
        self._writers += [writer, up_writer]
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    async def __aenter__(self) -> CuttableLink:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def cut(self) -> None:
        """Closes the port and every relayed connection."""
        if self._server is not None:
            self._server.close()
        for writer in self._writers:
            writer.close()

    async def __aexit__(self, *exc: object) -> None:
        self.cut()
        if self._server is not None:
            await self._server.wait_closed()


async def test_a_replica_that_is_not_scraped_keeps_its_lease_and_nobody_double_exports(
    redis_client: aioredis.Redis, key_prefix: str
) -> None:
    key = key_prefix + "metrics:exporter:router"
    redis_port = int(redis_client.connection_pool.connection_kwargs["port"])
    first, second = ServiceMetrics("router"), ServiceMetrics("router")
    async with CuttableLink(redis_port) as link:
        first_redis = aioredis.Redis(host="127.0.0.1", port=link.port, socket_timeout=0.2)
        try:
            async with (
                ExporterLease(first_redis, key=key, ttl_s=TINY_LEASE_S) as first_lease,
                ExporterLease(redis_client, key=key, ttl_s=TINY_LEASE_S) as second_lease,
            ):
                first.export_globals(first_lease, _open_episodes())
                second.export_globals(second_lease, _open_episodes())
                assert "rollgate_episodes_open 7.0" in await _render(first)
                # Only the second replica is scraped, for several lease lifetimes: the first
                # one's lease is renewed in the background all along, so the second never
                # takes it and never exports.
                started = time.monotonic()

                async def second_never_exported() -> bool:
                    text = await _render(second)
                    assert "rollgate_episodes_open" not in text
                    assert "rollgate_metrics_global_exporter 0.0" in text
                    return time.monotonic() - started >= 4 * TINY_LEASE_S

                await eventually(
                    second_never_exported, timeout_s=10, interval_s=0.05,
                    what="four leases scraping only the second replica",
                )  # fmt: skip
                assert "rollgate_episodes_open 7.0" in await _render(first)
                assert first_lease.held and not second_lease.held
                # The first replica loses Redis (it cannot renew): it stops exporting once its
                # lease may have lapsed, the second takes over, and never do both export.
                link.cut()

                async def second_took_over() -> bool:
                    texts = [await _render(first), await _render(second)]
                    assert sum("rollgate_episodes_open 7.0" in t for t in texts) <= 1, texts
                    assert not (first_lease.held and second_lease.held)
                    return "rollgate_episodes_open 7.0" in texts[1]

                await eventually(
                    second_took_over, timeout_s=10, interval_s=0.02,
                    what="the second replica exporting",
                )  # fmt: skip
                assert "rollgate_metrics_global_exporter 0.0" in await _render(first)
        finally:
            await first_redis.aclose()


async def test_global_values_are_dropped_when_redis_cannot_be_read(
    redis_client: aioredis.Redis, key_prefix: str
) -> None:
    metrics = ServiceMetrics("dataproxy")

    async def refresh() -> list[Any]:
        raise OSError("connection refused")

    async with ExporterLease(redis_client, key=key_prefix + "metrics:exporter:x") as lease:
        metrics.export_globals(lease, refresh)
        assert lease.held
        text = (await metrics.render()).decode()
    assert "rollgate_episodes_open" not in text
    assert "rollgate_metrics_global_read_errors_total 1.0" in text
    assert "rollgate_metrics_global_exporter 0.0" in text


async def test_a_lease_that_cannot_reach_redis_is_not_held_and_starts_anyway() -> None:
    dead = aioredis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.5)
    metrics = ServiceMetrics("dataproxy")
    try:
        async with ExporterLease(dead, key="x") as lease:
            metrics.export_globals(lease, _open_episodes())
            assert not lease.held
            text = (await metrics.render()).decode()
            assert "rollgate_episodes_open" not in text
            assert "rollgate_metrics_global_exporter 0.0" in text
    finally:
        await dead.aclose()
