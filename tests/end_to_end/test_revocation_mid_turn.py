"""A key revoked while one of its turns runs, over real processes: the turn is not answered
as a success (a stream gets an error event instead of [DONE], a plain call a 503), nothing of
it is recorded or published, and the turn's lease is given back."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import redis.asyncio as aioredis

from rollgate.stack import Stack
from services.dataproxy.redis_keys import RedisKeys
from tests.end_to_end.test_key_lifecycle import call, chat_body, trajectories_of
from tests.harness.poll import eventually
from tests.harness.processes import log_level_env, stack_config

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def slow_stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One worker and a mock that answers after 1.5 s and streams a token every 150 ms: a
    turn lasts seconds, plain or streamed."""
    config = stack_config(
        redis_url,
        Path(tmp_path_factory.mktemp("slow-stack")),
        prefix="rgmidturn",
        workers=1,
        mock_latency_ms=1500.0,
        mock_token_interval_ms=150.0,
        extra_env=log_level_env(),
    )
    with Stack(config) as running:
        yield running


async def _in_flight(stack: Stack) -> int:
    client = aioredis.Redis.from_url(stack.redis_url)
    try:
        return int(await client.zcard(RedisKeys(stack.config.redis_prefix).in_flight))
    finally:
        await client.aclose()


async def _revoke(http: aiohttp.ClientSession, stack: Stack, key: str) -> dict[str, Any]:
    status, revoked = await call(
        http, "POST", f"{stack.gateway_url}/rl/keys/revoke", stack.config.admin_key,
        {"api_key": key},
    )  # fmt: skip
    assert status == 200, revoked
    return revoked


async def _start(http: aiohttp.ClientSession, stack: Stack) -> dict[str, Any]:
    status, started = await call(
        http, "POST", f"{stack.gateway_url}/rl/start_session", stack.config.admin_key, {}
    )
    assert status == 200, started
    return started


async def test_a_stream_running_when_its_key_is_revoked_ends_in_an_error_not_done(
    slow_stack: Stack,
) -> None:
    gateway = slow_stack.gateway_url
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        started = await _start(http, slow_stack)
        key = started["api_key"]
        body = {**chat_body("one two three four five six seven eight"), "stream": True}
        headers = {"Authorization": f"Bearer {key}"}
        async with http.post(f"{gateway}/v1/chat/completions", json=body, headers=headers) as resp:
            assert resp.status == 200
            first = await resp.content.readline()
            assert first.startswith(b"data: "), first
            assert await _in_flight(slow_stack) == 1, "the turn holds its lease while it streams"
            revoked = await _revoke(http, slow_stack, key)
            rest = (await resp.content.read()).decode()
        events = [line[6:] for line in rest.split("\n") if line.startswith("data: ")]
        assert events and events[-1] != "[DONE]", "a turn that was not recorded was answered"
        error = orjson.loads(events[-1])["error"]
        assert error["code"] in ("episode_ended", "key_revoked"), error
        assert error["message"]
        await eventually(lambda: _in_flight_is(slow_stack, 0), timeout_s=30, what="lease back")
    assert revoked["episodes_discarded"] == 1
    assert trajectories_of(slow_stack, started_key_id(revoked)) == []


async def test_a_plain_call_running_when_its_key_is_revoked_gets_a_503_not_an_answer(
    slow_stack: Stack,
) -> None:
    gateway = slow_stack.gateway_url
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        started = await _start(http, slow_stack)
        key = started["api_key"]
        assert await _in_flight(slow_stack) == 0
        turn = asyncio.create_task(
            call(http, "POST", f"{gateway}/v1/chat/completions", key,
                 chat_body("one two three four five six seven eight"))
        )  # fmt: skip
        # The turn holds its lease from admission to its record: it is running now.
        await eventually(lambda: _in_flight_is(slow_stack, 1), timeout_s=30, what="turn running")
        revoked = await _revoke(http, slow_stack, key)
        status, answer = await asyncio.wait_for(turn, 60)
        assert status == 503, answer
        assert answer["error"]["code"] == "episode_ended", answer
        await eventually(lambda: _in_flight_is(slow_stack, 0), timeout_s=30, what="lease back")
        # And the next call with the key is the revocation's 401.
        status, answer = await call(
            http, "POST", f"{gateway}/v1/chat/completions", key, chat_body("again")
        )
        assert status == 401 and answer["error"]["code"] == "key_revoked", answer
    assert trajectories_of(slow_stack, started_key_id(revoked)) == []


async def _in_flight_is(stack: Stack, count: int) -> bool:
    return await _in_flight(stack) == count


def started_key_id(revoked: dict[str, Any]) -> str:
    return str(revoked["key_id"])
