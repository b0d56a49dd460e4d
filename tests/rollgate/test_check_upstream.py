"""`rollgate check-upstream` against the mock LLM in each flavor, and through a real stack."""

from __future__ import annotations

import asyncio

from rollgate.check_upstream import check_stack, check_upstream
from rollgate.mock_llm import MockLLM
from stackconfig import load_config


def _config(base_url: str, kind: str, model: str = "rollgate-mock", key: bool = False) -> object:
    key_line = "\n      api_key: ${MOCK_KEY}" if key else ""
    text = f"""
admin_key: ${{ADMIN}}
worker:
  upstreams:
    - name: m
      kind: {kind}
      base_url: {base_url}
      models: [{model}]
      workers: 1{key_line}
"""
    return load_config(text=text, environ={"ADMIN": "admin-k", "MOCK_KEY": "x"})


async def test_a_vllm_upstream_passes_every_check() -> None:
    async with MockLLM(port=0) as mock:
        config = _config(mock.base_url, "vllm")
        checks = await asyncio.to_thread(check_upstream, config.upstreams[0], {})  # type: ignore[attr-defined]
    assert [(c.name, c.ok) for c in checks] == [
        ("reachable", True),
        ("key accepted", True),
        ("model served", True),
        ("logprobs returned", True),
        ("token ids exact", True),
    ]


async def test_a_hosted_api_is_reported_as_not_exact() -> None:
    async with MockLLM(port=0, flavor="openai") as mock:
        config = _config(mock.base_url, "openai")
        checks = await asyncio.to_thread(check_upstream, config.upstreams[0], {})  # type: ignore[attr-defined]
    result = {c.name: c.ok for c in checks}
    assert result["logprobs returned"] and not result["token ids exact"]


async def test_a_rejected_key_names_the_variable_to_check() -> None:
    async with MockLLM(port=0, api_key="right") as mock:
        config = _config(mock.base_url, "vllm", key=True)
        checks = await asyncio.to_thread(
            check_upstream,
            config.upstreams[0],  # type: ignore[attr-defined]
            {"MOCK_KEY": "wrong"},
        )
    assert checks[-1].name == "key accepted" and not checks[-1].ok
    assert "MOCK_KEY" in checks[-1].detail and "wrong" not in checks[-1].detail


async def test_an_unserved_model_and_an_unreachable_upstream_are_reported() -> None:
    async with MockLLM(port=0, model="served", strict_model=True) as mock:
        config = _config(mock.base_url, "vllm", model="other")
        checks = await asyncio.to_thread(check_upstream, config.upstreams[0], {})  # type: ignore[attr-defined]
    assert checks[-1].name == "model served" and not checks[-1].ok
    assert "other" in checks[-1].detail
    gone = _config("http://127.0.0.1:9", "vllm")
    checks = await asyncio.to_thread(check_upstream, gone.upstreams[0], {})  # type: ignore[attr-defined]
    assert [(c.name, c.ok) for c in checks] == [("reachable", False)]


async def test_one_request_goes_through_the_full_stack_to_each_upstream() -> None:
    async with MockLLM(port=0, model="served", strict_model=True) as mock:
        config = _config(mock.base_url, "vllm", model="served")
        checks = await asyncio.to_thread(check_stack, config)  # type: ignore[arg-type]
    assert all(c.ok for c in checks), checks
    names = [c.name for c in checks]
    assert "through the stack (m)" in names and names[-1] == "exact ids recorded (m)"
