"""One agent turn is one trace: a client's traceparent reaches the gateway, router, dataproxy
(admission and record on the ledger stream), the worker, and the upstream's request; every
service's span names its caller's span as parent. Without export nothing is recorded, but
the traceparent still reaches the upstream."""

from __future__ import annotations

from typing import Any

import pytest

from services.runtime.tracing import TraceContext, TracingSettings
from tests.gateway.conftest import ADMIN_KEY
from tests.harness.inprocess import MOCK_MODEL, Upstream, running_full_chain
from tests.harness.poll import eventually
from tests.runtime.test_tracing import _Collector, collector  # noqa: F401

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"


async def _turns(url: str, http: Any, headers: dict[str, str]) -> None:
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with http.post(url + "/rl/start_session", json={}, headers=admin) as resp:
        key = (await resp.json())["api_key"]
    auth = {"Authorization": f"Bearer {key}", **headers}
    for stream in (True, False):
        body = {
            "model": MOCK_MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "stream": stream,
        }
        async with http.post(url + "/v1/chat/completions", json=body, headers=auth) as resp:
            assert resp.status == 200
            await resp.read()


@pytest.mark.parametrize("export", [True, False])
async def test_a_turn_is_one_trace_across_every_service(
    redis_url: str,
    key_prefix: str,
    collector: tuple[_Collector, str],  # noqa: F811
    export: bool,
) -> None:
    received, collector_url = collector
    tracing = TracingSettings(endpoint=collector_url) if export else TracingSettings()
    async with running_full_chain(
        redis_url,
        key_prefix,
        admin_key=ADMIN_KEY,
        upstreams=[Upstream(worker_id="w-trace", kind="vllm")],
        tracing=tracing,
    ) as chain:
        received.bodies.clear()  # readiness checks before this point are traces of their own
        await _turns(chain.url, chain.http, {"traceparent": TRACEPARENT})
        # The upstream got the turn's trace, with a span of ours as parent (export on) or the
        # client's own span (export off: nothing of ours in between).
        upstream = TraceContext.parse(chain.mocks[0].stats.last_headers.get("traceparent"))
        assert upstream is not None and upstream.trace_id == CLIENT_TRACE
        assert (upstream.span_id == CLIENT_SPAN) is not export
        if not export:
            return

        def names() -> list[str]:
            return [s["name"] for s in received.spans() if s["traceId"] == CLIENT_TRACE]

        def every_hop_exported() -> bool:
            found = names()
            return (
                found.count("POST /v1/chat/completions") == 2
                and found.count("rollgate.v1.DataProxy/Ledger.record") == 2
                and "rollgate.v1.Worker/Complete" in found
            )

        await eventually(
            every_hop_exported, timeout_s=15, interval_s=0.1, what="every hop's span exported"
        )
        spans = [s for s in received.spans() if s["traceId"] == CLIENT_TRACE]
    by_id = {s["spanId"]: s for s in spans}
    gateway = [s for s in spans if s["name"] == "POST /v1/chat/completions"]
    assert all(s["parentSpanId"] == CLIENT_SPAN for s in gateway)
    assert {s["service"] for s in gateway} == {"rollgate-gateway"}
    children = {
        "rollgate.v1.Router/Route": "rollgate-router",
        "rollgate.v1.DataProxy/Ledger.begin": "rollgate-dataproxy",
        "rollgate.v1.DataProxy/Ledger.record": "rollgate-dataproxy",
        "rollgate.v1.Worker/Generate": "rollgate-worker",
        "rollgate.v1.Worker/Complete": "rollgate-worker",
    }
    for name, service in children.items():
        matching = [s for s in spans if s["name"] == name]
        assert matching, name
        for span in matching:
            assert span["service"] == service
            parent = by_id[span["parentSpanId"]]
            assert parent["name"] == "POST /v1/chat/completions", (name, parent["name"])
    # The worker's span is the upstream request's parent.
    (complete,) = [s for s in spans if s["name"] == "rollgate.v1.Worker/Complete"]
    assert upstream.span_id == complete["spanId"]
    # The session API carries the trace on too; start_session came without a traceparent, so
    # with export on the gateway started a trace of its own for it.
    every = {s["spanId"]: s for s in received.spans()}
    (start,) = [s for s in every.values() if s["name"] == "rollgate.v1.DataProxy/StartSession"]
    gateway_start = every[start["parentSpanId"]]
    assert gateway_start["name"] == "POST /rl/start_session"
    assert "parentSpanId" not in gateway_start and start["traceId"] != CLIENT_TRACE
