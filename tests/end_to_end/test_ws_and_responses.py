"""The WebSocket and Responses protocols against the real processes (`rollgate up` style)."""

from __future__ import annotations

import uuid
from typing import Any

import aiohttp
import msgpack  # type: ignore[import-untyped]
import openai
import orjson
import redis

from rollgate.stack import Stack

MODEL = "rollgate-mock"
T = 30.0


async def _start(http: aiohttp.ClientSession, stack: Stack, **body: Any) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {stack.config.admin_key}"}
    async with http.post(stack.gateway_url + "/rl/start_session", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        payload: dict[str, Any] = await r.json()
        return payload


def _last_trajectory(stack: Stack) -> dict[str, Any]:
    client = redis.Redis.from_url(stack.config.redis_url or "")
    try:
        entries: Any = client.xrange(f"{stack.config.redis_prefix}trajectories")
    finally:
        client.close()
    trajectory: dict[str, Any] = msgpack.unpackb(entries[-1][1][b"data"], raw=False)
    return trajectory


async def test_an_openclaw_agent_run_and_a_responses_chain_are_recorded(stack: Stack) -> None:
    async with aiohttp.ClientSession() as http:
        key = (await _start(http, stack, task_id="protocols"))["api_key"]
        ws_url = stack.gateway_url.replace("http://", "ws://") + "/ws"
        async with http.ws_connect(ws_url) as ws:
            challenge = orjson.loads((await ws.receive(timeout=T)).data)
            assert challenge["event"] == "connect.challenge"
            connect = {
                "minProtocol": 4,
                "maxProtocol": 4,
                "client": {"id": "cli", "version": "2026.9.6", "platform": "linux", "mode": "cli"},
                "caps": [],
                "auth": {"token": key},
                "role": "operator",
                "scopes": ["operator.write"],
            }
            await ws.send_str(
                orjson.dumps(
                    {"type": "req", "id": "1", "method": "connect", "params": connect}
                ).decode()
            )
            assert orjson.loads((await ws.receive(timeout=T)).data)["ok"]
            run_id = str(uuid.uuid4())
            agent = {
                "message": "hello e2e",
                "agentId": "main",
                "deliver": False,
                "timeout": 60,
                "idempotencyKey": run_id,
            }
            await ws.send_str(
                orjson.dumps(
                    {"type": "req", "id": "2", "method": "agent", "params": agent}
                ).decode()
            )
            answers = []
            while len(answers) < 2:
                frame = orjson.loads((await ws.receive(timeout=T)).data)
                if frame["type"] == "res" and frame["id"] == "2":
                    answers.append(frame["payload"])
            assert [a["status"] for a in answers] == ["accepted", "ok"]
            text = answers[1]["result"]["payloads"][0]["text"]
        sdk = openai.AsyncOpenAI(base_url=stack.gateway_url + "/v1", api_key=key, max_retries=0)
        async with sdk:
            first = await sdk.responses.create(model=MODEL, input="one")
            second = await sdk.responses.create(
                model=MODEL, input="two", previous_response_id=first.id
            )
        await _start(http, stack, task_id="protocols", api_key=key)
    trajectory = _last_trajectory(stack)
    ws_turn, first_turn, second_turn = trajectory["interactions"]
    assert ws_turn["output"]["content"] == text
    assert first_turn["output"]["content"] == first.output_text
    assert [m["content"] for m in second_turn["messages"]] == ["one", first.output_text, "two"]
    assert second_turn["output"]["content"] == second.output_text
