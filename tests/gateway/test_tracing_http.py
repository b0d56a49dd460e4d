"""The gateway continues a client's traceparent on each HTTP request (one span per request,
exported when an endpoint is set; nothing recorded otherwise)."""

from __future__ import annotations

import dataclasses

import aiohttp

from services.gateway.app import GatewayServer
from services.runtime.tracing import TracingSettings
from tests.gateway.conftest import gateway_settings
from tests.harness.poll import eventually
from tests.runtime.test_tracing import PARENT, _Collector, collector  # noqa: F401


async def test_a_request_with_a_traceparent_is_a_span_of_that_trace(
    collector: tuple[_Collector, str],  # noqa: F811
    dead_address: str,
) -> None:
    received, url = collector
    settings = dataclasses.replace(
        gateway_settings(router_addr=dead_address, dataproxy_addr=dead_address),
        tracing=TracingSettings(endpoint=url),
    )
    async with GatewayServer(settings) as server, aiohttp.ClientSession() as http:
        base = f"http://127.0.0.1:{server.port}"
        async with http.get(base + "/health", headers={"traceparent": PARENT}) as resp:
            assert resp.status == 200
        async with http.get(base + "/no/such/path") as resp:
            assert resp.status == 404
        await eventually(
            lambda: len(received.spans()) >= 2, interval_s=0.05, what="both spans arrived"
        )
    spans = {s["name"]: s for s in received.spans()}
    health = spans["GET /health"]
    assert health["traceId"] == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert health["parentSpanId"] == "00f067aa0ba902b7"
    attrs = {a["key"]: a["value"] for a in health["attributes"]}
    assert attrs["http.route"] == {"stringValue": "/health"}
    assert attrs["http.response.status_code"] == {"intValue": "200"}
    assert health["service"] == "rollgate-gateway"
    # No traceparent: a new trace, its own root.
    assert "parentSpanId" not in spans["GET unmatched"]
