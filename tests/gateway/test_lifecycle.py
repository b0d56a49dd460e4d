"""The episode lifecycle as an HTTP client sees it: capacity 429s, 503 between episodes,
groups and late rewards, through the gateway in front of the real services."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

from protos import trainer_pb2, trainer_pb2_grpc
from rollgate.mock_llm import MockLLM
from services.dataproxy.__main__ import serving as dataproxy_serving
from services.dataproxy.redis_keys import RedisKeys
from services.dataproxy.settings import DataProxySettings
from services.gateway.app import GatewayServer
from services.gateway.session_api import parse_start_session
from services.router.__main__ import serving as router_serving
from services.router.settings import RouterSettings
from services.runtime.errors import InvalidRequest
from services.runtime.grpc_client import open_channel
from services.runtime.keys import key_digest
from services.worker.__main__ import serving as worker_serving
from services.worker.settings import WorkerSettings
from tests.gateway.conftest import ADMIN_KEY, gateway_settings

MODEL = "rollgate-mock"
AUTH_METADATA = (("authorization", f"Bearer {ADMIN_KEY}"),)


@dataclass(frozen=True, slots=True, kw_only=True)
class Chain:
    """A gateway over router, dataproxy, worker and mock LLM, plus the Trainer stub."""

    url: str
    http: aiohttp.ClientSession
    trainer: trainer_pb2_grpc.TrainerStub
    redis: aioredis.Redis
    keys: RedisKeys
    mock: MockLLM

    async def post(
        self, path: str, key: str, body: dict[str, Any]
    ) -> tuple[int, dict[str, Any], Any]:
        async with self.http.post(
            self.url + path, json=body, headers={"Authorization": f"Bearer {key}"}
        ) as resp:
            return resp.status, await resp.json(), resp.headers

    async def chat(self, key: str, text: str) -> tuple[int, dict[str, Any], Any]:
        body = {"model": MODEL, "messages": [{"role": "user", "content": text}]}
        return await self.post("/v1/chat/completions", key, body)

    async def grant(self, episodes: int) -> None:
        await self.trainer.GrantCapacity(
            trainer_pb2.GrantCapacityRequest(episodes=episodes), metadata=AUTH_METADATA, timeout=5
        )


ChainFactory = Callable[..., contextlib.AbstractAsyncContextManager[Chain]]


@pytest.fixture
def chain(redis_url: str, key_prefix: str, redis_client: aioredis.Redis) -> ChainFactory:
    @contextlib.asynccontextmanager
    async def make(**dataproxy: Any) -> AsyncIterator[Chain]:
        async with contextlib.AsyncExitStack() as exits:
            router = await exits.enter_async_context(
                router_serving(
                    RouterSettings(
                        port=0, redis_url=redis_url, redis_prefix=key_prefix, grace_s=1.0
                    )
                )
            )
            router_addr = f"127.0.0.1:{router.port}"
            proxy = await exits.enter_async_context(
                dataproxy_serving(
                    DataProxySettings(
                        port=0,
                        redis_url=redis_url,
                        redis_prefix=key_prefix,
                        admin_key=ADMIN_KEY,
                        grace_s=1.0,
                        **dataproxy,
                    )
                )
            )
            proxy_addr = f"127.0.0.1:{proxy.port}"
            mock = await exits.enter_async_context(MockLLM(port=0, model=MODEL))
            await exits.enter_async_context(
                worker_serving(
                    WorkerSettings(
                        port=0,
                        router_addr=router_addr,
                        worker_id="w-lifecycle",
                        upstream_base_url=mock.base_url,
                        upstream_models=(MODEL,),
                        grace_s=1.0,
                    )
                )
            )
            settings = gateway_settings(router_addr=router_addr, dataproxy_addr=proxy_addr)
            server = await exits.enter_async_context(GatewayServer(settings))
            http = await exits.enter_async_context(aiohttp.ClientSession())
            channel = open_channel(proxy_addr)
            exits.push_async_callback(channel.close)
            url = f"http://127.0.0.1:{server.port}"
            await _wait_ready(http, url)
            yield Chain(
                url=url,
                http=http,
                trainer=trainer_pb2_grpc.TrainerStub(channel),
                redis=redis_client,
                keys=RedisKeys(key_prefix),
                mock=mock,
            )

    return make


async def _wait_ready(http: aiohttp.ClientSession, url: str) -> None:
    deadline = time.monotonic() + 15
    while True:
        async with http.get(url + "/ready") as resp:
            if resp.status == 200:
                return
        assert time.monotonic() < deadline, "gateway never became ready"
        await asyncio.sleep(0.05)


async def _until(check: Callable[[], Awaitable[bool]], *, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def _refresh_waiting(c: Chain, digest: str) -> bool:
    marker = await c.redis.exists(c.keys.refreshing(digest))
    return bool(marker) and await c.redis.hget(c.keys.key(digest), "state") == b"idle"


async def test_refresh_timeout_is_429_with_retry_after_and_the_same_key_works_after(
    chain: ChainFactory,
) -> None:
    async with chain(refresh_timeout_s=0.3) as c:
        await c.grant(1)
        status, started, _ = await c.post("/rl/start_session", ADMIN_KEY, {"task_id": "t"})
        assert status == 200
        key = started["api_key"]
        assert (await c.chat(key, "one"))[0] == 200

        status, body, headers = await c.post("/rl/start_session", ADMIN_KEY, {"api_key": key})
        assert status == 429, body
        assert "trainer has not caught up" in body["error"]["message"]
        assert int(headers["Retry-After"]) >= 1
        assert await c.redis.xlen(c.keys.trajectories) == 1  # the old episode is published

        status, body, headers = await c.chat(key, "between")
        assert status == 503 and "Retry-After" in headers, body

        await c.grant(1)
        status, again, _ = await c.post("/rl/start_session", ADMIN_KEY, {"api_key": key})
        assert status == 200 and again["api_key"] == key
        assert (await c.chat(key, "two"))[0] == 200


async def test_during_a_waiting_refresh_chat_is_503_and_another_refresh_is_429_at_once(
    chain: ChainFactory,
) -> None:
    async with chain(refresh_timeout_s=10.0) as c:
        await c.grant(1)
        _, started, _ = await c.post("/rl/start_session", ADMIN_KEY, {})
        key = started["api_key"]
        waiting = asyncio.create_task(c.post("/rl/start_session", ADMIN_KEY, {"api_key": key}))
        # The refresh holds its marker and has ended the old episode: it waits for capacity.
        await _until(lambda: _refresh_waiting(c, key_digest(key)))
        status, body, headers = await c.chat(key, "during")
        assert status == 503 and "Retry-After" in headers, body
        began = time.monotonic()
        status, body, _ = await c.post("/rl/start_session", ADMIN_KEY, {"api_key": key})
        assert status == 429 and time.monotonic() - began < 2, body
        await c.grant(1)
        async with asyncio.timeout(10):
            status, refreshed, _ = await waiting
        assert status == 200 and refreshed["api_key"] == key


async def test_group_start_returns_every_member_and_each_key_chats(chain: ChainFactory) -> None:
    async with chain() as c:
        status, body, _ = await c.post(
            "/rl/start_session", ADMIN_KEY, {"task_id": "math", "group_size": 3}
        )
        assert status == 200, body
        assert body["group_id"].startswith("grp-") and len(body["members"]) == 3
        assert body["members"][0] == {"session_id": body["session_id"], "api_key": body["api_key"]}
        for member in body["members"]:
            assert (await c.chat(member["api_key"], "hi"))[0] == 200


async def test_late_reward_after_end_session_publishes_the_held_episode(
    chain: ChainFactory,
) -> None:
    async with chain(late_reward_timeout_s=30.0) as c:
        _, started, _ = await c.post("/rl/start_session", ADMIN_KEY, {})
        key = started["api_key"]
        await c.chat(key, "solve")
        status, ended, _ = await c.post("/rl/end_session", key, {})
        assert status == 200 and ended["interaction_count"] == 1
        assert await c.redis.xlen(c.keys.trajectories) == 0  # held for its reward
        status, body, _ = await c.post(
            "/rl/set_reward", key, {"reward": 1.0, "session_id": started["session_id"]}
        )
        assert status == 200, body
        assert await c.redis.xlen(c.keys.trajectories) == 1


@pytest.mark.parametrize(
    "body",
    [
        b'{"group_size": 0}',
        b'{"group_size": "3"}',
        b'{"group_size": 2.5}',
        b'{"group_size": true}',
        b'{"group_size": 100000}',
        b'{"group_size": 2, "api_key": "sk-sess-abcdefghijklmnopqrstuvwxyz0123456789ABCDEFG"}',
    ],
)
def test_invalid_group_sizes_are_400(body: bytes) -> None:
    with pytest.raises(InvalidRequest):
        parse_start_session(body, ADMIN_KEY)


def test_group_size_one_is_a_plain_start() -> None:
    assert parse_start_session(b'{"group_size": 1}', ADMIN_KEY).group_size == 1
