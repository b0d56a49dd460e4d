"""Several upstreams behind one gateway: the request's `model` picks the upstream, an alias
reaches its served model, and an unknown model is a 404 listing every model that exists
(real router, dataproxy, two workers on two mock LLMs, gateway; in-process, port 0)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

from rollgate.mock_llm import MockLLM
from services.dataproxy.__main__ import serving as dataproxy_serving
from services.dataproxy.settings import DataProxySettings
from services.gateway.app import GatewayServer
from services.router.__main__ import serving as router_serving
from services.router.settings import RouterSettings
from services.worker.__main__ import serving as worker_serving
from services.worker.settings import WorkerSettings
from tests.gateway.conftest import ADMIN_KEY, gateway_settings
from tests.gateway.test_full_chain import _auth, _wait_ready


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
    async with contextlib.AsyncExitStack() as exits:
        router = await exits.enter_async_context(
            router_serving(
                RouterSettings(port=0, redis_url=redis_url, redis_prefix=key_prefix, grace_s=1.0)
            )
        )
        router_addr = f"127.0.0.1:{router.port}"
        dataproxy = await exits.enter_async_context(
            dataproxy_serving(
                DataProxySettings(
                    port=0,
                    redis_url=redis_url,
                    redis_prefix=key_prefix,
                    admin_key=ADMIN_KEY,
                    grace_s=1.0,
                )
            )
        )
        mock_a = await exits.enter_async_context(MockLLM(port=0, model="org/model-a"))
        mock_b = await exits.enter_async_context(MockLLM(port=0, model="org/model-b"))
        for worker_id, mock, aliases in (
            ("w-a", mock_a, (("alias-a", "org/model-a"),)),
            ("w-b", mock_b, ()),
        ):
            await exits.enter_async_context(
                worker_serving(
                    WorkerSettings(
                        port=0,
                        router_addr=router_addr,
                        worker_id=worker_id,
                        upstream_base_url=mock.base_url,
                        upstream_models=(mock.model,),
                        upstream_aliases=aliases,
                        grace_s=1.0,
                    )
                )
            )
        settings = gateway_settings(
            router_addr=router_addr, dataproxy_addr=f"127.0.0.1:{dataproxy.port}"
        )
        server = await exits.enter_async_context(GatewayServer(settings))
        http = await exits.enter_async_context(aiohttp.ClientSession())
        url = f"http://127.0.0.1:{server.port}"
        await _wait_ready(http, url)
        yield TwoUpstreams(url=url, http=http, mock_a=mock_a, mock_b=mock_b)


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
    assert listed == ["alias-a", "org/model-a", "org/model-b"]
