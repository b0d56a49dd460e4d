"""W3C trace context and the OTLP/HTTP exporter: parsing as the spec says, propagation
without recording, spans with the right parents, batches a real HTTP collector receives."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import orjson
import pytest
from aiohttp import web

from protos import router_pb2, router_pb2_grpc
from services.runtime.errors import InvalidRequest
from services.runtime.grpc_client import open_channel
from services.runtime.grpc_server import GrpcServer, ServerSpec
from services.runtime.metrics import RpcMetricsInterceptor, ServiceMetrics
from services.runtime.secret import Secret
from services.runtime.tracing import (
    TraceContext,
    Tracer,
    TracingSettings,
    current,
    grpc_metadata,
    http_headers,
    incoming,
    tracer_for,
    tracing_settings,
    with_trace,
)
from tests.harness.poll import eventually

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_traceparent_is_parsed_as_the_w3c_spec_says() -> None:
    ctx = TraceContext.parse(PARENT)
    assert ctx == TraceContext(
        trace_id="4bf92f3577b34da6a3ce929d0e0e4736", span_id="00f067aa0ba902b7", sampled=True
    )
    assert ctx.header() == PARENT
    assert TraceContext.parse(PARENT[:-2] + "00").sampled is False  # type: ignore[union-attr]
    assert TraceContext.parse(PARENT.upper()) == ctx
    # A later version may carry more fields; version 00 may not.
    assert TraceContext.parse("01" + PARENT[2:] + "-extra") is not None
    for bad in [
        None,
        "",
        "garbage",
        PARENT + "-extra",
        "ff" + PARENT[2:],
        "00-" + "0" * 32 + "-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-" + "0" * 16 + "-01",
        "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
    ]:
        assert TraceContext.parse(bad) is None, bad
    child = ctx.child()
    assert child.trace_id == ctx.trace_id and child.span_id != ctx.span_id
    root = TraceContext.new_root()
    assert len(root.trace_id) == 32 and len(root.span_id) == 16
    assert incoming((("x", "1"), ("traceparent", PARENT.encode()))) == ctx
    assert incoming(None) is None


def test_settings_are_off_by_default_and_checked() -> None:
    assert tracing_settings({}).endpoint == ""
    on = tracing_settings(
        {"ROLLGATE_OTLP_ENDPOINT": "http://c:4318/", "ROLLGATE_OTLP_HEADERS": "api-key=s3cret"}
    )
    assert on.endpoint == "http://c:4318" and "s3cret" not in repr(on)
    with pytest.raises(ValueError, match="must be an http"):
        tracing_settings({"ROLLGATE_OTLP_ENDPOINT": "c:4318"})
    with pytest.raises(ValueError, match="between 0 and 1"):
        tracing_settings({"ROLLGATE_OTLP_ENDPOINT": "http://c", "ROLLGATE_OTLP_SAMPLE_RATIO": "2"})


def test_without_export_the_incoming_context_is_passed_on_unchanged() -> None:
    tracer = Tracer()
    assert grpc_metadata() is None and http_headers() == {}
    with tracer.serve("x", None) as span:
        assert span is None and current() is None and grpc_metadata() is None
    parent = TraceContext.parse(PARENT)
    with tracer.serve("x", parent) as span:
        assert span is None
        assert grpc_metadata() == (("traceparent", PARENT),)
        assert http_headers() == {"traceparent": PARENT}
        assert with_trace((("authorization", "Bearer k"),)) == (
            ("authorization", "Bearer k"),
            ("traceparent", PARENT),
        )
    assert current() is None


class _Collector:
    """An OTLP/HTTP collector: records every JSON export request."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.status = 200

    async def handle(self, request: web.Request) -> web.Response:
        self.bodies.append(orjson.loads(await request.read()))
        self.headers.append(dict(request.headers))
        return web.json_response({}, status=self.status)

    def spans(self) -> list[dict[str, Any]]:
        return [
            {**span, "service": _service(rs)}
            for body in self.bodies
            for rs in body["resourceSpans"]
            for ss in rs["scopeSpans"]
            for span in ss["spans"]
        ]


def _service(resource_spans: dict[str, Any]) -> str:
    for attr in resource_spans["resource"]["attributes"]:
        if attr["key"] == "service.name":
            return str(attr["value"]["stringValue"])
    return ""


@pytest.fixture
async def collector() -> AsyncIterator[tuple[_Collector, str]]:
    received = _Collector()
    app = web.Application()
    app.router.add_post("/v1/traces", received.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield received, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_spans_reach_the_collector_with_their_parents(
    collector: tuple[_Collector, str],
) -> None:
    received, url = collector
    settings = TracingSettings(endpoint=url, headers=Secret("x-api-key=abc"))
    async with tracer_for("gateway", settings) as tracer:
        with tracer.serve("HTTP POST /v1/chat/completions", TraceContext.parse(PARENT)) as outer:
            assert outer is not None
            inner_parent = TraceContext.parse(grpc_metadata()[0][1])  # type: ignore[index]
            with tracer.serve("rollgate.v1.DataProxy/Chat", inner_parent) as inner:
                assert inner is not None
                inner.attributes["rpc.grpc.status_code"] = "OK"
        with pytest.raises(RuntimeError), tracer.serve("fails", None):
            raise RuntimeError("boom")
        await eventually(
            lambda: len(received.spans()) >= 3, interval_s=0.05, what="the spans arrived"
        )
    spans = {s["name"]: s for s in received.spans()}
    http, rpc, failed = (
        spans["HTTP POST /v1/chat/completions"],
        spans["rollgate.v1.DataProxy/Chat"],
        spans["fails"],
    )
    assert http["traceId"] == rpc["traceId"] == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert http["parentSpanId"] == "00f067aa0ba902b7"
    assert rpc["parentSpanId"] == http["spanId"]
    assert (
        int(http["endTimeUnixNano"]) >= int(rpc["endTimeUnixNano"]) >= int(rpc["startTimeUnixNano"])
    )
    assert http["kind"] == 2 and rpc["attributes"] == [
        {"key": "rpc.grpc.status_code", "value": {"stringValue": "OK"}}
    ]
    assert "parentSpanId" not in failed and failed["status"]["code"] == 2
    assert failed["traceId"] != http["traceId"]
    assert {s["service"] for s in received.spans()} == {"rollgate-gateway"}
    assert all(h["x-api-key"] == "abc" for h in received.headers)


async def test_an_unreachable_collector_only_drops_spans() -> None:
    settings = TracingSettings(endpoint="http://127.0.0.1:1")
    async with tracer_for("worker", settings) as tracer:
        with tracer.serve("x", None):
            pass
        await tracer.exporter.flush()
        assert tracer.exporter.dropped == 1 and tracer.exporter.exported == 0


class _Router(router_pb2_grpc.RouterServicer):
    """Route answers with the traceparent its handler runs under (what it would send on)."""

    async def Route(self, request: router_pb2.RouteRequest, context: Any) -> Any:
        if request.session == "bad":
            raise InvalidRequest("bad session")
        metadata = grpc_metadata()
        return router_pb2.RouteResponse(worker_id="w", address=metadata[0][1] if metadata else "")


async def test_every_rpc_continues_the_callers_trace_and_exports_its_span(
    collector: tuple[_Collector, str],
) -> None:
    received, url = collector
    async with tracer_for("router", TracingSettings(endpoint=url)) as tracer:
        metrics = ServiceMetrics("router")
        server = GrpcServer(
            ServerSpec(
                name="router",
                host="127.0.0.1",
                port=0,
                service_names=(),
                interceptors=(RpcMetricsInterceptor(metrics.rpc, tracer=tracer),),
            )
        )
        router_pb2_grpc.add_RouterServicer_to_server(_Router(), server.server)
        async with server, open_channel(f"127.0.0.1:{server.port}") as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            reply = await stub.Route(
                router_pb2.RouteRequest(session="ok"), metadata=(("traceparent", PARENT),)
            )
            with pytest.raises(grpc.aio.AioRpcError):
                await stub.Route(
                    router_pb2.RouteRequest(session="bad"), metadata=(("traceparent", PARENT),)
                )
            untraced = await stub.Route(router_pb2.RouteRequest(session="ok"))
        await tracer.exporter.flush()
    ok, bad, root = received.spans()
    # The handler ran as a child of the caller's span, and that is what it passes on.
    sent_on = TraceContext.parse(reply.address)
    assert sent_on is not None and sent_on.trace_id == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert ok["name"] == "rollgate.v1.Router/Route" and ok["parentSpanId"] == "00f067aa0ba902b7"
    assert ok["spanId"] == sent_on.span_id and ok["service"] == "rollgate-router"
    attrs = {a["key"]: a["value"]["stringValue"] for a in ok["attributes"]}
    assert attrs == {
        "rpc.system": "grpc",
        "rpc.service": "rollgate.v1.Router",
        "rpc.method": "Route",
        "rpc.grpc.status_code": "OK",
    }
    assert bad["status"] == {"code": 2, "message": "INVALID_ARGUMENT"}
    # With export on, a call that brought no trace starts one.
    assert "parentSpanId" not in root and TraceContext.parse(untraced.address) is not None


async def test_without_export_an_rpc_passes_the_trace_on_and_records_nothing() -> None:
    metrics = ServiceMetrics("router")
    server = GrpcServer(
        ServerSpec(
            name="router",
            host="127.0.0.1",
            port=0,
            service_names=(),
            interceptors=(RpcMetricsInterceptor(metrics.rpc, tracer=Tracer()),),
        )
    )
    router_pb2_grpc.add_RouterServicer_to_server(_Router(), server.server)
    async with server, open_channel(f"127.0.0.1:{server.port}") as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        traced = await stub.Route(
            router_pb2.RouteRequest(session="ok"), metadata=(("traceparent", PARENT),)
        )
        untraced = await stub.Route(router_pb2.RouteRequest(session="ok"))
    assert traced.address == PARENT  # unchanged: no span of ours in between
    assert untraced.address == ""
