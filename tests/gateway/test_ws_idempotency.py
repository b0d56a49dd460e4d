"""A WebSocket idempotencyKey starts one run across gateway replicas (Conversations.ClaimRun),
against the real router, dataproxy and worker (in-process, port 0), the mock LLM and Redis."""

from __future__ import annotations

import redis.asyncio as aioredis

from services.runtime.keys import key_digest, key_id_of
from tests.gateway.test_full_chain import Stack, _start, stack
from tests.gateway.test_ws import _config, _serve, open_client

__all__ = ["stack"]


async def test_the_same_chat_send_through_two_replicas_starts_one_upstream_call(
    stack: Stack, redis_client: aioredis.Redis
) -> None:
    one_runner, one_url = await _serve(stack, _config())
    two_runner, two_url = await _serve(stack, _config())
    try:
        key = (await _start(stack))["api_key"]
        one = await open_client(stack.http, one_url, key)
        two = await open_client(stack.http, two_url, key)
        stack.mock.token_interval_s = 0.05
        before = stack.mock.stats.requests
        params = {"sessionKey": "main", "message": "once", "idempotencyKey": "dup-x"}
        first = await one.call("chat.send", params)
        assert first["payload"] == {"runId": "dup-x", "status": "started"}
        # The retry reaches the other replica, which does not know the run: in flight there.
        again = await two.call("chat.send", params)
        assert again["ok"] and again["payload"] == {"runId": "dup-x", "status": "in_flight"}
        end = await one.chat_end("dup-x")
        assert end["payload"]["state"] == "final"
        assert stack.mock.stats.requests == before + 1
        # The claim lives under the documented key, holding the first run's id.
        conversation = "agent:main:main"
        claim = f"{stack.prefix}convrun:{key_id_of(key_digest(key))}:{conversation}:dup-x"
        assert await redis_client.get(claim) == b"dup-x"
        assert 0 < await redis_client.pttl(claim) <= 24 * 3600 * 1000
        history = await two.call("chat.history", {"sessionKey": "main"})
        assert [m["role"] for m in history["payload"]["messages"]] == ["user", "assistant"]
        await one.ws.close()
        await two.ws.close()
    finally:
        await one_runner.cleanup()
        await two_runner.cleanup()


async def test_the_same_agent_call_through_two_replicas_runs_once(stack: Stack) -> None:
    one_runner, one_url = await _serve(stack, _config())
    two_runner, two_url = await _serve(stack, _config())
    try:
        key = (await _start(stack))["api_key"]
        one = await open_client(stack.http, one_url, key)
        two = await open_client(stack.http, two_url, key)
        stack.mock.token_interval_s = 0.05
        before = stack.mock.stats.requests
        params = {"message": "hello", "agentId": "main", "idempotencyKey": "agent-x"}
        frame_id = await one.send("agent", params | {"timeout": 30})
        accepted = await one.res(frame_id)
        assert accepted["payload"]["status"] == "accepted"
        # The other replica answers once, naming the first run, and starts nothing.
        again = await two.call("agent", params | {"timeout": 30})
        assert again["ok"] and again["payload"] == {"runId": "agent-x", "status": "in_flight"}
        final = await one.res(frame_id)
        assert final["payload"]["status"] == "ok"
        assert stack.mock.stats.requests == before + 1
        await one.ws.close()
        await two.ws.close()
    finally:
        await one_runner.cleanup()
        await two_runner.cleanup()
