"""Several upstreams behind one gateway: the request's `model` picks the upstream, an alias
reaches its served model, and an unknown model is a 404 listing every model that exists
(real router, dataproxy, two workers on two mock LLMs, gateway; in-process, port 0)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

from rollgate.mock_llm import MockLLM
from tests.gateway.conftest import ADMIN_KEY
from tests.gateway.test_full_chain import _auth
from tests.harness.inprocess import Upstream, running_full_chain


@dataclass(frozen=True, slots=True, kw_only=True)
class TwoUpstreams:
    """A gateway in front of two upstreams, each with its own worker and models."""

    url: str
    http: aiohttp.ClientSession
    mock_a: MockLLM
    mock_b: MockLLM


@pytest.fixture
async def two_upstreams(
    redis_url: str, key_prefix: str, redis_client: aioredis.Redis
) -> AsyncIterator[TwoUpstreams]:
    del redis_client  # its flush runs before the stack writes anything
    upstreams = [
        Upstream(worker_id="w-a", model="org/model-a", aliases=(("alias-a", "org/model-a"),)),
        Upstream(worker_id="w-b", model="org/model-b"),
    ]
    async with running_full_chain(
        redis_url, key_prefix, admin_key=ADMIN_KEY, upstreams=upstreams
    ) as chain:
        mock_a, mock_b = chain.mocks
        yield TwoUpstreams(url=chain.url, http=chain.http, mock_a=mock_a, mock_b=mock_b)


async def _key(stack: TwoUpstreams) -> str:
    async with stack.http.post(
        stack.url + "/rl/start_session", json={"task_id": "models"}, headers=_auth(ADMIN_KEY)
    ) as resp:
        assert resp.status == 200
        return str((await resp.json())["api_key"])


async def _chat(stack: TwoUpstreams, key: str, model: str, *, stream: bool) -> tuple[int, Any]:
    body = {"model": model, "stream": stream, "messages": [{"role": "user", "content": "hi"}]}
    async with stack.http.post(
        stack.url + "/v1/chat/completions", json=body, headers=_auth(key)
    ) as resp:
        if resp.content_type == "application/json":
            return resp.status, await resp.json()
        return resp.status, await resp.read()


@pytest.mark.parametrize("stream", [False, True])
async def test_an_unknown_model_is_404_listing_every_model_of_every_upstream(
    two_upstreams: TwoUpstreams, stream: bool
) -> None:
    key = await _key(two_upstreams)

    status, body = await _chat(two_upstreams, key, "gpt-4o", stream=stream)

    assert status == 404
    error = body["error"]
    assert error["code"] == "model_not_found"
    assert "'gpt-4o'" in error["message"]
    for model in ("org/model-a", "alias-a", "org/model-b"):
        assert model in error["message"]
    assert two_upstreams.mock_a.stats.requests == 0
    assert two_upstreams.mock_b.stats.requests == 0


async def test_the_model_picks_the_upstream_and_an_alias_reaches_its_served_model(
    two_upstreams: TwoUpstreams,
) -> None:
    key = await _key(two_upstreams)

    status_b, answer_b = await _chat(two_upstreams, key, "org/model-b", stream=False)
    status_a, answer_a = await _chat(two_upstreams, key, "alias-a", stream=False)

    assert (status_a, status_b) == (200, 200)
    assert answer_b["model"] == "org/model-b"
    assert answer_a["model"] == "org/model-a"
    assert two_upstreams.mock_a.stats.requests == 1
    assert two_upstreams.mock_b.stats.requests == 1
    assert two_upstreams.mock_a.stats.last_body is not None
    assert two_upstreams.mock_a.stats.last_body["model"] == "org/model-a"
    async with two_upstreams.http.get(
        two_upstreams.url + "/v1/models", headers=_auth(ADMIN_KEY)
    ) as resp:
        listed = sorted(m["id"] for m in (await resp.json())["data"])
    assert listed == ["alias-a", "default", "org/model-a", "org/model-b"]


async def test_default_reaches_the_first_upstream_only(two_upstreams: TwoUpstreams) -> None:
    key = await _key(two_upstreams)
    for stream in (False, True):
        status, _ = await _chat(two_upstreams, key, "default", stream=stream)
        assert status == 200
    assert two_upstreams.mock_a.stats.models == {"org/model-a": 2}
    assert two_upstreams.mock_b.stats.requests == 0
