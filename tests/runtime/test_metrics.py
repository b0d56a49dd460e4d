"""The metrics every service runs: the port setting, the RPC interceptor's counts by status,
the metrics server, and the lease that makes exactly one replica export global values."""

from __future__ import annotations

import socket
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
    RpcMetricsInterceptor,
    ServiceMetrics,
    gauge,
    metrics_endpoint,
)


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


async def test_exactly_one_replica_exports_global_values_and_another_takes_over(
    redis_client: aioredis.Redis, key_prefix: str
) -> None:
    key = key_prefix + "metrics:exporter:dataproxy"
    replicas = [ServiceMetrics("dataproxy") for _ in range(3)]
    leases = [ExporterLease(redis_client, key=key, ttl_s=30) for _ in replicas]
    for metrics, lease in zip(replicas, leases, strict=True):

        async def refresh() -> list[Any]:
            return [gauge("rollgate_episodes_open", "Open episodes.", 7)]

        metrics.export_globals(lease, refresh)
    texts = [(await m.render()).decode() for m in replicas]
    exporting = [t for t in texts if "rollgate_episodes_open 7.0" in t]
    assert len(exporting) == 1
    assert "rollgate_metrics_global_exporter 1.0" in texts[0]
    assert all("rollgate_metrics_global_exporter 0.0" in t for t in texts[1:])
    # The exporter stops (and gives its lease up): the next replica scraped takes over.
    await leases[0].release()
    await leases[0].release()  # twice is harmless
    replicas[1]._refreshed_at = 0.0  # past the one-second scrape cache
    text = (await replicas[1].render()).decode()
    assert "rollgate_episodes_open 7.0" in text
    assert "rollgate_metrics_global_exporter 1.0" in text
    assert await redis_client.pttl(key) > 25_000


async def test_global_values_are_dropped_when_redis_cannot_be_read() -> None:
    dead = aioredis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.5)
    metrics = ServiceMetrics("dataproxy")

    async def refresh() -> list[Any]:
        return [gauge("rollgate_episodes_open", "Open episodes.", 7)]

    metrics.export_globals(ExporterLease(dead, key="x"), refresh)
    text = (await metrics.render()).decode()
    assert "rollgate_episodes_open" not in text
    assert "rollgate_metrics_global_read_errors_total 1.0" in text
    assert "rollgate_metrics_global_exporter 0.0" in text
    await dead.aclose()
