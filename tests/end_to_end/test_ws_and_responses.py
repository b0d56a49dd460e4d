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
from rollgate.trajectory import inline_content

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
    trajectory: dict[str, Any] = inline_content(msgpack.unpackb(entries[-1][1][b"data"], raw=False))
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
            answers: list[dict[str, Any]] = []
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


WEATHER_TOOL: Any = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
}


async def _responses_session(stack: Stack, key: str) -> dict[str, Any]:
    """A streamed call, a tool-call loop and a 3-turn chain with the SDK; their ids and texts."""
    sdk = openai.AsyncOpenAI(base_url=stack.gateway_url + "/v1", api_key=key, max_retries=0)
    async with sdk:
        stream = await sdk.responses.create(model=MODEL, input="stream it", stream=True)
        events: list[Any] = [event async for event in stream]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        streamed = events[-1].response
        assert events[-1].type == "response.completed"
        asked = await sdk.responses.create(
            model=MODEL, input="weather in Oslo /tool", tools=[WEATHER_TOOL]
        )
        [call] = [item for item in asked.output if item.type == "function_call"]
        answered = await sdk.responses.create(
            model=MODEL,
            previous_response_id=asked.id,
            tools=[WEATHER_TOOL],
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "snow"}],
        )
        chain = [await sdk.responses.create(model=MODEL, input="c1")]
        for text in ("c2", "c3"):
            chain.append(
                await sdk.responses.create(
                    model=MODEL, input=text, previous_response_id=chain[-1].id
                )
            )
    return {
        "streamed": streamed,
        "call": call,
        "asked": asked,
        "answered": answered,
        "chain": chain,
    }


async def test_responses_stream_tool_loop_and_chain_with_the_sdk_are_recorded(
    stack: Stack,
) -> None:
    async with aiohttp.ClientSession() as http:
        key = (await _start(http, stack, task_id="responses-e2e"))["api_key"]
        got = await _responses_session(stack, key)
        await _start(http, stack, task_id="responses-e2e", api_key=key)
    interactions = _last_trajectory(stack)["interactions"]
    by_id = {i["interaction_id"]: i for i in interactions}
    assert len(interactions) == 6
    streamed = by_id[got["streamed"].id]
    assert streamed["output"]["content"] == got["streamed"].output_text
    asked = by_id[got["asked"].id]
    assert asked["finish_reason"] == "tool_calls"
    assert asked["tools"][0]["function"]["name"] == "get_weather"
    call = got["call"]
    assert by_id[got["answered"].id]["messages"][-1] == {
        "role": "tool",
        "tool_call_id": call.call_id,
        "content": "snow",
    }
    c1, c2, c3 = got["chain"]
    assert [m["content"] for m in by_id[c3.id]["messages"]] == [
        "c1",
        c1.output_text,
        "c2",
        c2.output_text,
        "c3",
    ]
    assert by_id[c3.id]["output"]["content"] == c3.output_text


async def _frame(ws: aiohttp.ClientWebSocketResponse) -> dict[str, Any]:
    msg = await ws.receive(timeout=T)
    assert msg.type == aiohttp.WSMsgType.TEXT, msg
    frame: dict[str, Any] = orjson.loads(msg.data)
    return frame


async def test_the_tui_websocket_sequence_is_recorded(stack: Stack) -> None:
    """ws_tui.txt: connect (ui client, device block), the start-up calls, chat.send, events."""
    session = "agent:main:rc-ws-1795942933"
    run_id = str(uuid.uuid4())
    calls: list[tuple[str, dict[str, Any]]] = [
        ("sessions.subscribe", {}),
        ("agents.list", {}),
        ("question.list", {}),
        ("plugin.approval.list", {}),
        ("chat.history", {"sessionKey": session, "limit": 200}),
        (
            "chat.send",
            {
                "sessionKey": session,
                "message": "hello from the tui",
                "deliver": False,
                "idempotencyKey": run_id,
            },
        ),
        ("commands.list", {"agentId": "main", "scope": "text", "includeArgs": False}),
        ("sessions.describe", {"key": session}),
        ("sessions.list", {"agentId": "main", "limit": 1}),
    ]
    async with aiohttp.ClientSession() as http:
        key = (await _start(http, stack, task_id="tui-e2e"))["api_key"]
        ws_url = stack.gateway_url.replace("http://", "ws://") + "/ws"
        async with http.ws_connect(ws_url) as ws:
            assert (await _frame(ws))["event"] == "connect.challenge"
            connect = {
                "minProtocol": 4,
                "maxProtocol": 4,
                "client": {
                    "id": "openclaw-tui",
                    "displayName": "openclaw-tui",
                    "version": "2026.9.6",
                    "platform": "linux",
                    "deviceFamily": "Linux",
                    "mode": "ui",
                    "instanceId": str(uuid.uuid4()),
                },
                "caps": ["agent-kind", "plugin-approvals", "task-suggestions", "tool-events"],
                "auth": {"token": key},
                "role": "operator",
                "scopes": ["operator.admin", "operator.read", "operator.write"],
                "device": {
                    "id": "ab" * 32,
                    "publicKey": "k" * 43,
                    "signature": "s" * 86,
                    "signedAt": 1795942937263,
                    "nonce": "n",
                },
            }
            for n, (method, params) in enumerate([("connect", connect), *calls], start=1):
                request = {"type": "req", "id": f"{n}:{uuid.uuid4()}", "method": method}
                await ws.send_str(orjson.dumps(request | {"params": params}).decode())
            answers: dict[int, dict[str, Any]] = {}
            final: dict[str, Any] = {}
            while len(answers) < len(calls) + 1 or not final:
                frame = await _frame(ws)
                if frame["type"] == "res":
                    answers[int(frame["id"].split(":")[0])] = frame
                elif frame.get("event") == "chat" and frame["payload"]["state"] == "final":
                    final = frame["payload"]
            assert all(answer["ok"] for answer in answers.values()), answers
            assert answers[7]["payload"] == {"runId": run_id, "status": "started"}
            assert answers[6]["payload"]["messages"] == []
        await _start(http, stack, task_id="tui-e2e", api_key=key)
    text = final["message"]["content"][0]["text"]
    [interaction] = _last_trajectory(stack)["interactions"]
    assert interaction["interaction_id"] == run_id
    assert interaction["messages"][-1] == {"role": "user", "content": "hello from the tui"}
    assert interaction["output"]["content"] == text
