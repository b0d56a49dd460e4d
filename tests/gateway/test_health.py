"""Liveness, readiness (bounded by deadlines) and metrics (on the metrics port only)."""

from __future__ import annotations

import dataclasses
import socket
import time
from collections.abc import Iterator

import aiohttp
import orjson
import pytest

from services.gateway.app import GatewayServer
from tests.gateway.conftest import Gateway, gateway_settings


@pytest.fixture
def blackhole_address() -> Iterator[str]:
    """host:port that accepts TCP connections (the kernel's backlog) and never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield f"127.0.0.1:{sock.getsockname()[1]}"


async def test_health_is_ok_without_backends(gateway_without_backends: Gateway) -> None:
    gateway = gateway_without_backends
    async with gateway.http.get(gateway.url + "/health") as resp:
        assert resp.status == 200
        assert resp.content_type == "application/json"
        assert await resp.json() == {"status": "ok", "workers": 0}


async def test_health_answers_while_the_router_never_does(blackhole_address: str) -> None:
    # A router that accepts connections and never speaks: every RPC to it hangs until its
    # deadline, here far longer than the test's own timeout. /health must not wait on it.
    settings = dataclasses.replace(
        gateway_settings(router_addr=blackhole_address, dataproxy_addr=blackhole_address),
        rpc_timeout_s=3600.0,
    )
    async with GatewayServer(settings) as server, aiohttp.ClientSession() as http:
        for _ in range(3):
            async with http.get(f"http://127.0.0.1:{server.port}/health") as resp:
                assert resp.status == 200
                assert await resp.json() == {"status": "ok", "workers": 0}


async def test_ready_is_503_naming_every_missing_part(gateway_without_backends: Gateway) -> None:
    gateway = gateway_without_backends
    started = time.monotonic()
    async with gateway.http.get(gateway.url + "/ready") as resp:
        assert resp.status == 503
        assert resp.content_type == "application/json"
        body = await resp.json()
    # Three checks run concurrently, each bounded by ready_timeout_s (1 s in tests).
    assert time.monotonic() - started < 3 * gateway.settings.ready_timeout_s
    assert body["status"] == "not_ready"
    assert body["missing"] == ["dataproxy", "router", "workers"]
    assert "UNAVAILABLE" in body["detail"]["router"]
    # Public (load balancers probe it): never an internal address or an RPC's details.
    text = orjson.dumps(body).decode()
    for internal in (gateway.settings.router_addr, "127.0.0.1", "ipv4", "Connection refused"):
        assert internal not in text, text


async def test_metrics_count_requests_by_route_and_status(
    gateway_without_backends: Gateway,
) -> None:
    gateway = gateway_without_backends
    async with gateway.http.get(gateway.url + "/health"):
        pass
    async with gateway.http.get(gateway.url + "/no/such/path"):
        pass
    # Not on the public port, where agents connect.
    async with gateway.http.get(gateway.url + "/metrics") as resp:
        assert resp.status == 404
    port = gateway.server.metrics_server.port
    assert port is not None and port != gateway.server.port
    async with gateway.http.get(f"http://127.0.0.1:{port}/metrics") as resp:
        assert resp.status == 200
        assert resp.content_type == "text/plain"
        text = await resp.text()
    assert 'rollgate_gateway_requests_total{method="GET",route="/health",status="200"} 1.0' in text
    assert 'route="unmatched",status="404"' in text
    assert (
        'rollgate_gateway_requests_total{method="GET",route="unmatched",status="404"} 2.0' in text
    )
    assert "rollgate_gateway_request_duration_seconds_bucket" in text
