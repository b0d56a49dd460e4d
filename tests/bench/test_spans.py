"""bench/spans.py: the collector keeps what services post over OTLP/HTTP, and the report
places each turn's spans and the gaps between them."""

from __future__ import annotations

import re
import urllib.request
from typing import Any

import orjson

from tests.bench.test_hotspots import _load

MS = 1_000_000  # nanoseconds


def _document(service: str, spans: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "resourceSpans": [
            {
                "resource": {
                    "attributes": [{"key": "service.name", "value": {"stringValue": service}}]
                },
                "scopeSpans": [{"spans": spans}],
            }
        ]
    }


def _span(trace: str, name: str, start_ms: float, end_ms: float) -> dict[str, Any]:
    return {
        "traceId": trace,
        "name": name,
        "startTimeUnixNano": str(int(1e12 + start_ms * MS)),
        "endTimeUnixNano": str(int(1e12 + end_ms * MS)),
    }


def test_the_collector_keeps_each_services_spans() -> None:
    spans = _load("spans")
    collector = spans.Collector()
    try:
        body = orjson.dumps(_document("rollgate-worker", [_span("t", "x", 0, 1)]))
        request = urllib.request.Request(collector.url + "/v1/traces", data=body, method="POST")
        with urllib.request.urlopen(request, timeout=10) as answer:
            assert answer.status == 200
    finally:
        collector.close()
    assert [(service, span["name"]) for service, span in collector.spans] == [("worker", "x")]


def test_the_report_places_each_turns_spans_and_gaps() -> None:
    spans = _load("spans")
    gateway, begin, generate, record = (name for _, name in spans.TURN_SPANS)
    collected = []
    for trace, shift in (("a", 0.0), ("b", 10.0)):
        collected += [
            ("gateway", _span(trace, gateway, shift, shift + 60)),
            ("dataproxy", _span(trace, begin, shift + 0.5, shift + 1)),
            ("worker", _span(trace, generate, shift + 2, shift + 55)),
            ("dataproxy", _span(trace, record, shift + 57, shift + 58)),
        ]
    # A turn without its record (it failed) is left out of the report.
    collected += [
        ("gateway", _span("c", gateway, 0, 5)),
        ("dataproxy", _span("c", begin, 9, 9.5)),
    ]
    text = spans.report(collected)
    assert text.startswith("2 turns with all four spans")

    def numbers(prefix: str) -> list[float]:
        line = next(line for line in text.splitlines() if line.strip().startswith(prefix))
        return [float(n) for n in re.findall(r"-?\d+\.\d+", line)]

    # p50 and p90 of both turns alike (their times only shifted).
    assert numbers("gateway start") == [0.5, 0.5]
    assert numbers("begin answered") == [1.0, 1.0]
    assert numbers("worker ends") == [2.0, 2.0]
    assert numbers("record answered") == [2.0, 2.0]
    # A span's start and end (p50, p90) from its turn's gateway span.
    assert numbers("worker " + generate) == [2.0, 2.0, 55.0, 55.0]
    assert numbers("dataproxy " + record) == [57.0, 57.0, 58.0, 58.0]


def test_a_unary_turns_worker_span_takes_the_streamed_ones_place() -> None:
    spans = _load("spans")
    gateway, begin, _, record = (name for _, name in spans.TURN_SPANS)
    collected = [
        ("gateway", _span("u", gateway, 0, 30)),
        ("dataproxy", _span("u", begin, 0.5, 1)),
        ("worker", _span("u", "rollgate.v1.Worker/Complete", 2, 25)),
        ("dataproxy", _span("u", record, 26, 27)),
    ]
    text = spans.report(collected)
    assert text.startswith("1 turns with all four spans")
    assert re.search(r"worker ends → record arrives\s+1\.00", text)
