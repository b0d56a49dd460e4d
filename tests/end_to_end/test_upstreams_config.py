"""Two upstreams from one configuration file, run as `rollgate up --config` runs them: real
processes (two mock LLMs, router, dataproxy, a worker per upstream, gateway), an alias, and a
key named by `${VAR}` that only its upstream's worker gets and no log ever shows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollgate.redis_server import free_port
from rollgate.stack import Stack
from rollgate.trajectory import Interaction
from stackconfig import load_config
from tests.harness.poll import eventually_sync
from tests.harness.processes import published_interactions, stack_config

HOSTED_KEY = "sk-e2e-hosted-" + uuid.uuid4().hex
VLLM_MODEL = "Qwen/Qwen3-8B"
HOSTED_MODEL = "deepseek-v3"


def call(url: str, body: dict[str, Any] | None = None, key: str = "") -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode() if body is not None else None,
        headers=headers,
        method="POST" if body is not None else "GET",
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


@pytest.fixture(scope="module")
def mocks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, int]]:
    """Two mock LLM processes: a vLLM one, and a hosted OpenAI-style one that needs a key."""
    logs = tmp_path_factory.mktemp("mocks")
    ports = {"vllm": free_port(), "openai": free_port()}
    argv = {
        "vllm": ["--flavor", "vllm", "--model", VLLM_MODEL],
        "openai": ["--flavor", "openai", "--model", HOSTED_MODEL, "--api-key", HOSTED_KEY,
                   "--usage-choices", "null"],
    }  # fmt: skip
    processes = []
    for name, port in ports.items():
        with (logs / f"{name}.log").open("wb") as log:
            processes.append(
                subprocess.Popen(
                    [sys.executable, "-m", "rollgate.mock_llm", "--port", str(port),
                     "--strict-model", *argv[name]],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                )
            )  # fmt: skip
    try:
        for port in ports.values():

            def up(port: int = port) -> bool:
                try:
                    return call(f"http://127.0.0.1:{port}/mock/stats")[0] == 200
                except OSError:
                    return False

            eventually_sync(up, timeout_s=30, what="the mock LLM started")
        yield ports
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=10)


@pytest.fixture(scope="module")
def stack(
    mocks: dict[str, int],
    redis_url: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:
    """The stack from a config file, built the way `rollgate up --config FILE` builds it."""
    state = tmp_path_factory.mktemp("state")
    path = state / "rollgate.yaml"
    path.write_text(
        f"""
admin_key: ${{E2E_UPSTREAMS_ADMIN}}
worker:
  upstreams:
    - name: local-vllm
      kind: vllm
      base_url: http://127.0.0.1:{mocks["vllm"]}
      models: [{VLLM_MODEL}]
      aliases: {{qwen3: {VLLM_MODEL}}}
      workers: 1
    - name: hosted
      kind: openai
      base_url: http://127.0.0.1:{mocks["openai"]}/v1
      api_key: ${{E2E_UPSTREAMS_HOSTED_KEY}}
      models: [{HOSTED_MODEL}]
      workers: 1
"""
    )
    with pytest.MonkeyPatch.context() as env:
        # `rollgate up` reads the key variables from its own environment.
        env.setenv("E2E_UPSTREAMS_ADMIN", "rg-admin-" + uuid.uuid4().hex)
        env.setenv("E2E_UPSTREAMS_HOSTED_KEY", HOSTED_KEY)
        file = load_config(path, environ=os.environ, overrides=["worker.upstreams.1.workers=1"])
        config = stack_config(
            redis_url, state, prefix="rge2eup", admin_key=file.admin_key, file=file
        )
        with Stack(config) as running:
            yield running


def chat(stack: Stack, key: str, model: str, *, stream: bool) -> tuple[int, bytes]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": f"hello {model}"}],
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return call(f"{stack.gateway_url}/v1/chat/completions", body, key)


def published(stack: Stack, trajectory_id: str) -> list[Interaction]:
    return published_interactions(stack, trajectory_id, timeout_s=10)


def test_two_upstreams_an_alias_and_a_key_from_one_config_file(
    stack: Stack, mocks: dict[str, int]
) -> None:
    admin = stack.config.admin_key
    status, raw = call(f"{stack.gateway_url}/rl/start_session", {"task_id": "up"}, admin)
    assert status == 200, raw
    key = json.loads(raw)["api_key"]

    streamed = chat(stack, key, VLLM_MODEL, stream=True)
    aliased = chat(stack, key, "qwen3", stream=False)
    hosted = chat(stack, key, HOSTED_MODEL, stream=True)
    # No worker.default_model: `default` is the first upstream's first model.
    default = chat(stack, key, "default", stream=False)
    for status, body in (streamed, aliased, hosted, default):
        assert status == 200, body
    assert json.loads(aliased[1])["choices"][0]["message"]["content"]
    # The hosted mock sends its usage chunk with `choices: null`: it still reaches the client.
    usage = [json.loads(line[6:]) for line in hosted[1].splitlines() if line.startswith(b"data: {")]
    assert any(c.get("usage") for c in usage)

    status, raw = chat(stack, key, "no-such-model", stream=False)
    assert status == 404, raw
    message = json.loads(raw)["error"]["message"]
    for name in (VLLM_MODEL, "qwen3", HOSTED_MODEL, "default"):
        assert name in message

    # Each upstream got exactly its own requests; the alias arrived as the served id.
    vllm_stats = json.loads(call(f"http://127.0.0.1:{mocks['vllm']}/mock/stats")[1])
    hosted_stats = json.loads(call(f"http://127.0.0.1:{mocks['openai']}/mock/stats")[1])
    assert vllm_stats["models"] == {VLLM_MODEL: 3}
    assert hosted_stats["models"] == {HOSTED_MODEL: 1}

    status, raw = call(f"{stack.gateway_url}/rl/end_session", {}, key)
    assert status == 200, raw
    interactions = published(stack, json.loads(raw)["trajectory_id"])
    assert [i.upstream_kind for i in interactions] == ["vllm", "vllm", "openai", "vllm"]
    for exact in (*interactions[:2], interactions[3]):
        assert exact.model == VLLM_MODEL
        assert exact.exact_tokens and not exact.length_mismatch
        assert exact.prompt_token_ids and len(exact.output_token_ids) == len(exact.output_logprobs)
    inexact = interactions[2]
    assert inexact.model == HOSTED_MODEL
    assert not inexact.exact_tokens and inexact.output_token_ids == []
    assert inexact.output_logprobs and inexact.usage.get("total_tokens")


def test_the_key_reaches_only_its_worker_and_no_log(stack: Stack) -> None:
    hosted = [s for n, s in stack.services.items() if n.startswith("worker-hosted")]
    others = [s for n, s in stack.services.items() if not n.startswith("worker-hosted")]
    assert hosted and all(s.env.get("E2E_UPSTREAMS_HOSTED_KEY") == HOSTED_KEY for s in hosted)
    assert all(HOSTED_KEY not in s.env.values() for s in others)
    logs = [p for p in Path(stack.state_dir).rglob("*") if p.is_file() and p.suffix == ".log"]
    assert len(logs) >= 5
    for log in logs:
        assert HOSTED_KEY not in log.read_text(errors="replace"), log
    # The worker logged where its key comes from, by name only.
    hosted_log = hosted[0].log_path.read_text()
    assert "E2E_UPSTREAMS_HOSTED_KEY" in hosted_log
