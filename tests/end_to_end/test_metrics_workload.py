"""Metrics after a scripted workload on real processes: every count must match exactly what
the script did, global values come from exactly one exporter, and no key is in any metric."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import urllib.request
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from rollgate.stack import Stack
from rollgate.trainer_client import TrainerClient
from tests.deploy.test_grafana import metric_names as dashboard_metric_names
from tests.end_to_end.test_walkthrough import chat_body, request
from tests.harness.poll import eventually_sync
from tests.harness.processes import log_level_env, stack_config

ROLLGATE = str(Path(sys.executable).parent / "rollgate")
SESSIONS = 4
# Final rewards, negative ones too (a counter of their sum would go down).
REWARDS = (-1.0, -0.5, 0.0, 0.5)
GROUP = "trainer-a"

Samples = dict[str, list[tuple[dict[str, str], float]]]


@pytest.fixture(scope="module")
def metrics_stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    config = stack_config(
        redis_url,
        Path(tmp_path_factory.mktemp("metrics")),
        prefix="rgmetrics",
        workers=2,
        extra_env=log_level_env(),
    )
    with Stack(config) as running:
        yield running


def scrape(url: str) -> Samples:
    """Every sample of one /metrics page, by sample name."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    samples: Samples = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name].append((dict(sample.labels), sample.value))
    samples["__text__"] = [({"text": text}, 0.0)]
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels` (0 when none)."""
    return sum(v for got, v in samples.get(name, []) if labels.items() <= got.items())


def total(pages: list[Samples], name: str, **labels: str) -> float:
    """`value` summed over replicas: what a Prometheus sum() shows."""
    return sum(value(page, name, **labels) for page in pages)


def run_workload(stack: Stack) -> dict[str, Any]:
    """Sessions with 1..SESSIONS turns (streamed and not), rewards, ends, and bad keys."""
    admin = stack.config.admin_key
    keys, streamed, unary = [], 0, 0
    for i in range(SESSIONS):
        status, _, raw = request(stack, "POST", "/rl/start_session", {"task_id": "m"}, admin)
        assert status == 200
        key = json.loads(raw)["api_key"]
        keys.append(key)
        for turn in range(i + 1):
            stream = turn % 2 == 0
            status, _, raw = request(
                stack, "POST", "/v1/chat/completions", chat_body(f"q{turn}", stream=stream), key
            )
            assert status == 200, raw
            streamed, unary = streamed + stream, unary + (not stream)
        reward = REWARDS[i]
        assert request(stack, "POST", "/rl/set_reward", {"reward": reward}, key)[0] == 200
        assert request(stack, "POST", "/rl/end_session", {}, key)[0] == 200
    bad = "sk-sess-" + "x" * 43
    for _ in range(2):
        status, _, _ = request(stack, "POST", "/v1/chat/completions", chat_body("q"), bad)
        assert status == 401
    return {"keys": keys, "streamed": streamed, "unary": unary}


async def train(stack: Stack) -> None:
    """Pulls 3 trajectories, acks 2, moves the weight version to 2, pauses and resumes."""
    async with TrainerClient(stack.trainer_address, stack.config.admin_key) as trainer:
        pulled = [
            t.stream_id async for t in trainer.pull(GROUP, "c1", max_count=3, include_history=True)
        ]
        assert len(pulled) == 3
        assert await trainer.ack(GROUP, pulled[:2]) == 2
        await trainer.set_weight_version(2)
        await trainer.pause_submission(timeout_s=2)
        await trainer.resume_submission()


def test_metrics_match_a_scripted_workload_exactly(metrics_stack: Stack) -> None:
    stack = metrics_stack
    done = run_workload(stack)
    asyncio.run(train(stack))
    urls = stack.metrics_urls()
    assert set(urls) == {"router", "dataproxy", "worker-1", "worker-2", "gateway"}
    pages = {name: scrape(url) for name, url in urls.items()}
    turns = done["streamed"] + done["unary"]
    assert turns == SESSIONS * (SESSIONS + 1) // 2

    gateway = pages["gateway"]

    def requests(route: str, status: str) -> float:
        return value(gateway, "rollgate_gateway_requests_total", route=route, status=status)

    assert requests("/rl/start_session", "200") == SESSIONS
    assert requests("/v1/chat/completions", "200") == turns
    assert requests("/v1/chat/completions", "401") == 2
    assert requests("/rl/set_reward", "200") == SESSIONS
    assert requests("/rl/end_session", "200") == SESSIONS
    assert (
        value(
            gateway, "rollgate_gateway_request_duration_seconds_count", route="/v1/chat/completions"
        )
        == turns + 2
    )

    dataproxy = [pages["dataproxy"]]
    handled = "rollgate_grpc_server_handled_total"
    dp = "rollgate.v1.DataProxy"
    assert total(dataproxy, handled, grpc_service=dp, grpc_method="StartSession") == SESSIONS
    # Each turn is one begin and one record on the turn ledger, counted like RPCs.
    for op in ("begin", "record"):
        codes = {
            labels["grpc_code"]: v
            for labels, v in pages["dataproxy"][handled]
            if labels["grpc_method"] == f"Ledger.{op}"
        }
        assert codes.get("OK") == turns, (op, codes)
    # The unknown key is refused by the dataproxy: counted by its code, and in the error list.
    assert total(dataproxy, handled, grpc_service=dp, grpc_code="UNAUTHENTICATED") == 2
    trainer = "rollgate.v1.Trainer"
    assert total(dataproxy, handled, grpc_service=trainer, grpc_method="Ack", grpc_code="OK") == 1

    workers = [pages["worker-1"], pages["worker-2"]]
    wk = "rollgate.v1.Worker"
    assert total(workers, handled, grpc_service=wk, grpc_method="Generate") == done["streamed"]
    assert total(workers, handled, grpc_service=wk, grpc_method="Complete") == done["unary"]
    assert total(workers, "rollgate_worker_turns_in_flight") == 0

    # Global values: one exporter for the dataproxies, one for the routers.
    assert total(dataproxy, "rollgate_metrics_global_exporter") == 1
    g = pages["dataproxy"]
    assert value(g, "rollgate_trajectories_published_total") == SESSIONS
    assert value(g, "rollgate_trajectories_acked_total") == 2
    assert value(g, "rollgate_interactions_published_total") == turns
    assert value(g, "rollgate_episodes_open") == 0
    assert value(g, "rollgate_stream_backlog_entries", group=GROUP) == SESSIONS - 3
    assert value(g, "rollgate_stream_pending_entries", group=GROUP) == 1
    assert value(g, "rollgate_stream_consumers", group=GROUP) == 1
    assert value(g, "rollgate_weight_version") == 2
    assert value(g, "rollgate_submission_paused") == 0
    assert value(g, "rollgate_turns_in_flight") == 0
    assert value(g, "rollgate_final_reward_positive_total") == 0.5
    assert value(g, "rollgate_final_reward_negative_total") == 1.5
    assert "rollgate_final_reward_sum_total" not in g
    assert (
        value(
            g, "rollgate_dataproxy_episodes_ended_total", status="published", reason="end_session"
        )
        == SESSIONS
    )
    assert value(g, "rollgate_dataproxy_episodes_ended_total") == SESSIONS
    assert value(g, "rollgate_dataproxy_publication_lag_seconds_count") == SESSIONS
    assert value(g, "rollgate_dataproxy_pauses_total") == 1
    assert value(g, "rollgate_dataproxy_pause_duration_seconds_count") == 1
    # Every turn of the mock (kind vllm) has the engine's token ids.
    assert value(g, "rollgate_interactions_exact_tokens_total") == turns
    assert value(g, "rollgate_exact_token_ratio") == 1.0
    assert value(g, "rollgate_interactions_length_mismatch_total") == 0
    client = redis.Redis.from_url(stack.redis_url)
    try:
        prefix = stack.config.redis_prefix
        import msgpack  # type: ignore[import-untyped]

        interactions = [
            i
            for _, fields in client.xrange(prefix + "trajectories")
            for i in msgpack.unpackb(fields[b"data"])["interactions"]
        ]
    finally:
        client.close()
    tokens = sum(len(i["output_token_ids"]) // 4 for i in interactions)
    # The whole prompt: a prefix shared with an earlier interaction, then its own ids.
    prompt_tokens = sum(
        len(i["prompt_token_ids"]) // 4 + (i.get("prompt_prefix") or {}).get("length", 0)
        for i in interactions
    )
    assert value(g, "rollgate_output_tokens_published_total") == tokens > 0

    # The relay's per-turn metrics at the gateway, and the workers' own.
    assert (
        value(gateway, "rollgate_gateway_turns_total", stream="true", outcome="ok")
        == (done["streamed"])
    )
    assert (
        value(gateway, "rollgate_gateway_turns_total", stream="false", outcome="ok")
        == (done["unary"])
    )
    # The unknown key is refused at admission, inside the relay.
    assert value(gateway, "rollgate_gateway_turns_total", outcome="401") == 2
    assert value(gateway, "rollgate_gateway_turn_duration_seconds_count") == turns
    assert value(gateway, "rollgate_gateway_turn_added_seconds_count") == turns
    assert value(gateway, "rollgate_gateway_time_to_first_token_seconds_count") == done["streamed"]
    assert (
        value(gateway, "rollgate_gateway_added_time_to_first_token_seconds_count")
        == (done["streamed"])
    )
    assert value(gateway, "rollgate_gateway_tokens_total", direction="out") == tokens
    assert value(gateway, "rollgate_gateway_tokens_total", direction="in") == prompt_tokens > 0
    assert total(workers, "rollgate_worker_turns_total", outcome="ok") == turns
    assert total(workers, "rollgate_worker_tokens_total", direction="out") == tokens
    assert total(workers, "rollgate_worker_tokens_total", direction="in") == prompt_tokens
    assert total(workers, "rollgate_worker_turns_exact_tokens_total", exact="true") == turns
    assert total(workers, "rollgate_worker_upstream_errors_total") == 0
    assert total(workers, "rollgate_worker_upstream_duration_seconds_count") == turns

    # An upstream that refuses (429): counted by kind at the worker and by status at the gateway.
    status, _, raw = request(stack, "POST", "/rl/start_session", {}, stack.config.admin_key)
    key = json.loads(raw)["api_key"]
    status, _, _ = request(stack, "POST", "/v1/chat/completions", chat_body("/fail-429"), key)
    assert status == 429
    after = [scrape(urls["worker-1"]), scrape(urls["worker-2"])]
    assert total(after, "rollgate_worker_upstream_errors_total", kind="upstream_rate_limited") == 1
    assert total(after, "rollgate_worker_upstream_errors_total") == 1
    assert (
        value(
            scrape(urls["gateway"]), "rollgate_gateway_turns_total", stream="false", outcome="429"
        )
        == 1
    )
    # ... and listed with the dataproxy's errors (the two unknown keys, then this one), which
    # the console and `rollgate status` show.
    eventually_sync(
        lambda: value(scrape(urls["dataproxy"]), "rollgate_rpc_errors_recorded_total"),
        want=3,
        what="the refused turn in the error list",
    )

    router = pages["router"]
    assert value(router, "rollgate_metrics_global_exporter") == 1
    assert value(router, "rollgate_workers", state="live") == 2
    assert {labels["worker"] for labels, _ in router["rollgate_worker_live"]} == {
        "worker-1",
        "worker-2",
    }
    # Each session's affinity names one worker: the affinities per worker add up to the sessions
    # (one model); the unknown key's turn was refused at admission, before any route, so it
    # has none; the name says what is counted, not sessions running now (none are).
    assert value(router, "rollgate_worker_session_affinities") == SESSIONS
    assert value(g, "rollgate_episodes_open") == 0
    assert "rollgate_worker_sessions" not in router

    # Build info on each, and no key anywhere.
    for name, page in pages.items():
        kind = name.split("-")[0]
        assert value(page, "rollgate_build_info", service=kind) == 1, name
        text = page["__text__"][0][0]["text"]
        for secret in [stack.config.admin_key, *done["keys"]]:
            assert secret not in text, name
    # The public gateway port has no metrics.
    assert request(stack, "GET", "/metrics")[0] == 404

    # The Grafana dashboard asks only for metrics that are served (a few exist only in some
    # states: capacity limits, pauses, read errors).
    served = {name for page in pages.values() for name in page}
    conditional = {
        "rollgate_capacity_left_episodes",
        "rollgate_capacity_granted_episodes",
        "rollgate_capacity_bound_episodes",
        "rollgate_worker_upstream_errors",  # a labelled counter appears with its first error
    }
    for name in dashboard_metric_names() - conditional:
        assert name in served or f"{name}_total" in served or f"{name}_bucket" in served, name

    # `rollgate status` in a terminal: the same numbers, one screen.
    env = {**os.environ, "ROLLGATE_ADMIN_KEY": stack.config.admin_key}
    done_status = subprocess.run(
        [ROLLGATE, "status", "--gateway", stack.gateway_url],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done_status.returncode == 0, done_status.stderr
    screen = done_status.stdout
    assert f"published {SESSIONS} · acked 2" in screen
    assert "weight version 2 · submitting" in screen
    assert "workers 2/2 live" in screen
    assert "exact ids 100.0 %" in screen
    row = next(line.split() for line in screen.splitlines() if line.strip().startswith(GROUP))
    assert row[:4] == [GROUP, "1", str(SESSIONS - 3), "1"]
    assert "UNAUTHENTICATED" in screen
    errors = screen[screen.index("errors (last 3 of 3 recorded)") :]
    assert "Worker.Complete  RESOURCE_EXHAUSTED  upstream_rate_limited: " in errors
    assert stack.config.admin_key not in screen
    wrong = subprocess.run(
        [ROLLGATE, "status", "--gateway", stack.gateway_url],
        env={**env, "ROLLGATE_ADMIN_KEY": "not-the-key"},
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert wrong.returncode == 1 and "answered 401" in wrong.stderr
