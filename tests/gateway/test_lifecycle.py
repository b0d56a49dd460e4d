"""The episode lifecycle as an HTTP client sees it: capacity 429s, 503 between episodes,
groups and late rewards, through the gateway in front of the real services."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

from protos import trainer_pb2, trainer_pb2_grpc
from rollgate.mock_llm import MockLLM
from services.dataproxy.redis_keys import RedisKeys
from services.gateway.session_api import parse_start_session
from services.runtime.errors import InvalidRequest
from services.runtime.keys import key_digest
from services.runtime.secret import Secret
from tests.gateway.conftest import ADMIN_KEY
from tests.harness.inprocess import Upstream, running_full_chain
from tests.harness.poll import eventually

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
        async with running_full_chain(
            redis_url,
            key_prefix,
            admin_key=ADMIN_KEY,
            upstreams=[Upstream(worker_id="w-lifecycle", model=MODEL)],
            **dataproxy,
        ) as running:
            yield Chain(
                url=running.url,
                http=running.http,
                trainer=running.trainer,
                redis=redis_client,
                keys=RedisKeys(key_prefix),
                mock=running.mocks[0],
            )

    return make


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
        await eventually(lambda: _refresh_waiting(c, key_digest(key)))
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
        parse_start_session(body, Secret(ADMIN_KEY))


def test_group_size_one_is_a_plain_start() -> None:
    assert parse_start_session(b'{"group_size": 1}', Secret(ADMIN_KEY)).group_size == 1
