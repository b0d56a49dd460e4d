"""The gateway continues a client's traceparent on each HTTP request (one span per request,
exported when an endpoint is set; nothing recorded otherwise)."""

from __future__ import annotations

import dataclasses

import aiohttp
import orjson

from services.gateway.app import GatewayServer
from services.runtime.keys import new_session_key
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


async def test_a_protocol_shaped_error_is_counted_and_traced_with_the_status_the_client_got(
    collector: tuple[_Collector, str],  # noqa: F811
    dead_address: str,
) -> None:
    # The concerns of the request middleware, outermost first: the trace, the metrics, the
    # protocol's error shape, the error mapping. An error the mapping made and the Messages
    # protocol reshaped is what the metrics count and the span records.
    received, url = collector
    settings = dataclasses.replace(
        gateway_settings(router_addr=dead_address, dataproxy_addr=dead_address),
        tracing=TracingSettings(endpoint=url),
    )
    body = orjson.dumps(
        {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    )
    async with GatewayServer(settings) as server, aiohttp.ClientSession() as http:
        base = f"http://127.0.0.1:{server.port}"
        answers = {}
        for name, key in (("no key", None), ("no dataproxy", new_session_key())):
            headers = {"traceparent": PARENT} | ({"x-api-key": key} if key else {})
            async with http.post(base + "/v1/messages", data=body, headers=headers) as resp:
                answers[name] = resp.status, orjson.loads(await resp.read())
        assert answers["no key"][0] == 401
        assert answers["no dataproxy"][0] == 503
        for _, error in answers.values():
            assert error["type"] == "error" and "message" in error["error"]  # Anthropic's shape
        await eventually(
            lambda: len(received.spans()) >= 2, interval_s=0.05, what="both spans arrived"
        )
        port = server.metrics_server.port
        async with http.get(f"http://127.0.0.1:{port}/metrics") as resp:
            metrics = await resp.text()
    for status in (401, 503):
        assert (
            "rollgate_gateway_requests_total"
            f'{{method="POST",route="/v1/messages",status="{status}"}} 1.0' in metrics
        )
    spans = sorted(
        (s for s in received.spans() if s["name"] == "POST /v1/messages"),
        key=lambda s: int(s["startTimeUnixNano"]),
    )
    statuses = [
        {a["key"]: a["value"] for a in s["attributes"]}["http.response.status_code"] for s in spans
    ]
    assert statuses == [{"intValue": "401"}, {"intValue": "503"}]
    assert all(s["traceId"] == "4bf92f3577b34da6a3ce929d0e0e4736" for s in spans)
    # A client error leaves the span OK; a server error fails it.
    assert spans[0]["status"] == {}
    assert spans[1]["status"] == {"code": 2, "message": "HTTP 503"}
