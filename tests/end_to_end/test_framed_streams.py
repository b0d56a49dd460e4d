"""The turn's two hot streams framed (services/runtime/framed.py), and their gRPC fallback, on
the real processes: the same turns answered and recorded whichever transport carries them."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rollgate.stack import Stack
from tests.end_to_end.test_walkthrough import chat_body, request, run_example, stderr_vars
from tests.harness.processes import log_level_env, published_interactions, stack_config

# (name, environment of every service, the transport each peer's stream must use)
CASES = [
    ("default", {}, "framed"),
    ("gateway-off", {"ROLLGATE_FRAMED_STREAMS": "false"}, "grpc"),
    (
        "services-off",
        {"ROLLGATE_WORKER_FRAMED_PORT": "off", "ROLLGATE_DATAPROXY_FRAMED_PORT": "off"},
        "grpc",
    ),
]


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def configured(
    request: pytest.FixtureRequest, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Stack, str]]:
    name, env, transport = request.param
    config = stack_config(
        redis_url,
        Path(tmp_path_factory.mktemp(f"framed-{name}")),
        prefix="rgframed",
        mock_token_interval_ms=2.0,
        extra_env=log_level_env() | env,
    )
    with Stack(config) as running:
        yield running, transport


def _opened(stack: Stack) -> dict[str, set[str]]:
    """peer → the transports the gateway opened its streams to that peer on (its log)."""
    opened: dict[str, set[str]] = {}
    for line in (stack.log_dir / "gateway.log").read_text().splitlines():
        if '"peer_stream_opened"' not in line:
            continue
        event = json.loads(line)
        opened.setdefault(event["peer"], set()).add(event["transport"])
    return opened


def _streams_counted(stack: Stack) -> dict[tuple[str, str], float]:
    """(peer, transport) → streams opened, from the gateway's /metrics."""
    with urllib.request.urlopen(stack.metrics_urls()["gateway"], timeout=10) as page:
        text = page.read().decode()
    return {
        (sample.labels["peer"], sample.labels["transport"]): sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "rollgate_gateway_peer_streams"
        for sample in family.samples
        if sample.name.endswith("_total")
    }


def test_turns_are_answered_and_recorded_on_either_transport(
    configured: tuple[Stack, str],
) -> None:
    stack, transport = configured
    started = run_example(stack, "start_session.py")
    assert started.returncode == 0, started.stdout + started.stderr
    key = stderr_vars(started)["SESSION_API_KEY"]

    status, _, raw = request(stack, "POST", "/v1/chat/completions", chat_body("one"), key)
    assert status == 200, raw
    answer = json.loads(raw)["choices"][0]["message"]["content"]
    status, _, raw = request(
        stack, "POST", "/v1/chat/completions", chat_body("two", stream=True), key
    )
    assert status == 200, raw
    assert raw.rstrip().endswith(b"data: [DONE]"), raw[-200:]
    status, _, raw = request(stack, "POST", "/rl/end_session", {}, key)
    assert status == 200, raw
    ended = json.loads(raw)
    assert ended["interaction_count"] == 2, ended

    interactions = published_interactions(stack, ended["trajectory_id"])
    assert [i.exact_tokens for i in interactions] == [True, True]
    assert all(i.output_token_ids_bytes for i in interactions)
    assert interactions[0].output["content"] == answer
    assert _opened(stack) == {"worker": {transport}, "dataproxy": {transport}}
    if transport == "framed":
        # The stack chose each framed port itself (as it chooses every port), and there it is.
        for name in ("dataproxy", "worker-1"):
            service = stack.services[name]
            variable = f"ROLLGATE_{service.kind.upper()}_FRAMED_PORT"
            listening = [
                event["port"]
                for event in map(json.loads, service.log_path.read_text().splitlines())
                if event.get("event") == "framed_stream_listening"
            ]
            assert listening == [int(service.env[variable])], name
    counted = _streams_counted(stack)
    assert set(counted) == {("worker", transport), ("dataproxy", transport)}, counted
    assert all(count >= 1 for count in counted.values())
