"""`rollgate check-upstream`: SGLang's generate path really calls /generate, an empty `models`
asks the upstream's /models, and the stack check reports what the trajectory recorded."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rollgate.check_upstream import Check, check_stack, check_upstream
from rollgate.mock_llm import MockLLM
from stackconfig import RollgateConfig, load_config
from tests.worker.tokenizer_file import build_tokenizer, decode_fn


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def generate_config(base_url: str, tokenizer: Path) -> RollgateConfig:
    text = f"""
worker:
  upstreams:
    - name: sg
      kind: sglang
      base_url: {base_url}
      models: [rollgate-mock]
      sglang_path: generate
      tokenizer: {tokenizer}
      workers: 1
"""
    return load_config(text=text, environ={})


def result(checks: list[Check]) -> dict[str, bool]:
    return {c.name: c.ok for c in checks}


async def test_the_generate_path_calls_generate_and_checks_the_returned_ids(
    tokenizer_path: Path,
) -> None:
    async with MockLLM(port=0, flavor="sglang", decode=decode_fn(tokenizer_path)) as mock:
        config = generate_config(mock.base_url, tokenizer_path)
        checks = await asyncio.to_thread(check_upstream, config.upstreams[0], {})
        sent = mock.stats.last_body
    assert all(c.ok for c in checks), checks
    exact = next(c for c in checks if c.name == "token ids exact")
    assert "/generate" in exact.detail and "output ids" in exact.detail
    assert sent is not None and sent["return_logprob"] is True
    assert isinstance(sent["input_ids"], list) and sent["input_ids"]


async def test_the_generate_path_fails_when_the_server_has_no_generate(
    tokenizer_path: Path,
) -> None:
    # A vLLM server behind `sglang_path: generate`: chat works, /generate does not.
    async with MockLLM(port=0, flavor="vllm") as mock:
        config = generate_config(mock.base_url, tokenizer_path)
        checks = await asyncio.to_thread(check_upstream, config.upstreams[0], {})
    exact = next(c for c in checks if c.name == "token ids exact")
    assert not exact.ok and "404" in exact.detail and "/generate" in exact.detail


async def test_empty_models_asks_the_upstream_for_a_model_id() -> None:
    text = "worker:\n  upstreams:\n    - {name: m, kind: vllm, base_url: BASE, workers: 1}\n"
    async with MockLLM(port=0, model="served-x", strict_model=True) as mock:
        config = load_config(text=text.replace("BASE", mock.base_url), environ={})
        checks = await asyncio.to_thread(check_upstream, config.upstreams[0], {})
        sent = mock.stats.last_body
    assert all(c.ok for c in checks), checks
    served = next(c for c in checks if c.name == "model served")
    assert "served-x" in served.detail and "/models" in served.detail
    assert sent is not None and sent["model"] == "served-x"


async def test_empty_models_behind_a_refused_key_reports_the_key_first() -> None:
    text = "worker:\n  upstreams:\n    - {name: m, kind: vllm, base_url: BASE, workers: 1}\n"
    async with MockLLM(port=0, api_key="right") as mock:
        config = load_config(text=text.replace("BASE", mock.base_url), environ={})
        checks = await asyncio.to_thread(check_upstream, config.upstreams[0], {})
    # No key configured: the upstream refuses both /models and the chat.
    assert result(checks)["key accepted"] is False


async def test_the_stack_check_reports_what_the_trajectory_recorded_per_upstream() -> None:
    async with (
        MockLLM(port=0, model="served-v", strict_model=True) as vllm,
        MockLLM(port=0, model="served-o", flavor="openai", strict_model=True) as hosted,
    ):
        text = f"""
worker:
  upstreams:
    - {{name: v, kind: vllm, base_url: {vllm.base_url}, workers: 1}}
    - {{name: o, kind: openai, base_url: {hosted.base_url}, workers: 1}}
"""
        config = load_config(text=text, environ={})
        checks = await asyncio.to_thread(check_stack, config, {})
        vllm_model = vllm.stats.last_body and vllm.stats.last_body["model"]
        hosted_model = hosted.stats.last_body and hosted.stats.last_body["model"]
    by_name = {c.name: c for c in checks}
    assert (
        by_name["through the stack (v)"].ok
        and "served-v" in by_name["through the stack (v)"].detail
    )
    assert (
        by_name["through the stack (o)"].ok
        and "served-o" in by_name["through the stack (o)"].detail
    )
    assert (vllm_model, hosted_model) == ("served-v", "served-o")
    assert by_name["trajectory published"].ok, checks
    assert by_name["logprobs recorded (v)"].ok and by_name["logprobs recorded (o)"].ok
    assert by_name["exact ids recorded (v)"].ok
    assert not by_name["exact ids recorded (o)"].ok
    assert "exact_tokens=false" in by_name["exact ids recorded (o)"].detail
