"""Anthropic Messages through the gateway, driven by the `anthropic` SDK and by raw Claude-Code
requests, in front of the real router, dataproxy and worker (in-process, port 0), the mock LLM
and a real Redis; each test checks what was recorded."""

from __future__ import annotations

from typing import Any

import anthropic
import msgpack  # type: ignore[import-untyped]
import orjson
import pytest
import redis.asyncio as aioredis

from rollgate.trajectory import inline_content
from tests.gateway.anthropic_shapes import (
    BASH_TOOL,
    CLAUDE_CODE_HEADERS,
    REMINDER,
    SYSTEM_BLOCKS,
    first_turn,
    tool_result_turn,
)
from tests.gateway.conftest import ADMIN_KEY
from tests.gateway.test_full_chain import MODEL, Stack, _count_pushes, _start, stack

__all__ = ["stack"]

SYSTEM_TEXT = "\n".join(block["text"] for block in SYSTEM_BLOCKS)


def client(stack: Stack, key: str, base_url: str = "") -> anthropic.AsyncAnthropic:
    # The SDK appends /v1/messages to its base URL and sends the key as x-api-key.
    return anthropic.AsyncAnthropic(base_url=base_url or stack.url, api_key=key, max_retries=0)


async def published(stack: Stack, redis: aioredis.Redis, key: str) -> dict[str, Any]:
    """Refreshes the key (which publishes its episode) and reads the trajectory."""
    before = await redis.xlen(f"{stack.prefix}trajectories")
    await _start(stack, api_key=key)
    entries = await redis.xrange(f"{stack.prefix}trajectories")
    assert len(entries) == before + 1
    trajectory: dict[str, Any] = inline_content(msgpack.unpackb(entries[-1][1][b"data"], raw=False))
    return trajectory


def sse(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    """(event, data) of each event of an Anthropic stream."""
    out = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((lines["event"], orjson.loads(lines["data"])))
    return out


async def test_the_sdk_gets_a_message_recorded_under_its_msg_id(
    stack: Stack, redis_client: aioredis.Redis
) -> None:
    key = (await _start(stack))["api_key"]
    async with client(stack, key) as sdk:
        message = await sdk.messages.create(
            model=MODEL,
            max_tokens=64,
            system="Be brief.",
            messages=[{"role": "user", "content": "hello there"}],
        )
    assert message.id.startswith("msg_") and message.type == "message"
    assert message.role == "assistant" and message.model == MODEL
    (block,) = message.content
    assert block.type == "text" and "you said hello there" in block.text
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0

    trajectory = await published(stack, redis_client, key)
    (interaction,) = trajectory["interactions"]
    assert interaction["interaction_id"] == message.id
    assert interaction["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hello there"},
    ]
    assert interaction["output"]["content"] == block.text
    assert interaction["finish_reason"] == "stop"
    assert len(interaction["output_logprobs"]) // 4 == message.usage.output_tokens


async def test_the_sdk_streams_a_message_and_its_final_text_is_what_was_recorded(
    stack: Stack, redis_client: aioredis.Redis
) -> None:
    key = (await _start(stack))["api_key"]
    async with client(stack, key) as sdk:
        kinds = []
        async with sdk.messages.stream(
            model=MODEL,
            max_tokens=64,
            system=SYSTEM_BLOCKS,  # type: ignore[arg-type]
            messages=[{"role": "user", "content": "stream me something"}],
        ) as stream:
            async for event in stream:
                kinds.append(event.type)
            final = await stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "text" in kinds and "content_block_stop" in kinds and "message_delta" in kinds
    assert final.id.startswith("msg_")
    (block,) = final.content
    assert block.type == "text" and "you said stream me something" in block.text
    assert final.stop_reason == "end_turn"
    # message_delta carries the usage, input tokens included.
    assert final.usage.input_tokens > 0 and final.usage.output_tokens > 0

    (interaction,) = (await published(stack, redis_client, key))["interactions"]
    assert interaction["interaction_id"] == final.id
    assert interaction["messages"][0] == {"role": "system", "content": SYSTEM_TEXT}
    assert interaction["output"]["content"] == block.text
    assert interaction["usage"]["completion_tokens"] == final.usage.output_tokens


@pytest.mark.parametrize("streamed", [False, True])
async def test_a_tool_use_round_trip_with_claude_codes_bash_tool(
    stack: Stack, redis_client: aioredis.Redis, streamed: bool
) -> None:
    key = (await _start(stack))["api_key"]
    async with client(stack, key) as sdk:
        asked: dict[str, Any] = {
            "model": MODEL,
            "max_tokens": 256,
            "tools": [BASH_TOOL],
            "messages": [{"role": "user", "content": "list the files /tool"}],
        }
        if streamed:
            async with sdk.messages.stream(**asked) as stream:
                partial = [e.partial_json async for e in stream if e.type == "input_json"]
                first = await stream.get_final_message()
            assert len(partial) >= 2  # the arguments arrived in fragments
        else:
            first = await sdk.messages.create(**asked)
        assert first.stop_reason == "tool_use"
        (tool_use,) = first.content
        assert tool_use.type == "tool_use" and tool_use.name == "Bash"
        assert tool_use.input == {"query": "list the files /tool"}
        follow_up = {
            **asked,
            "messages": [
                *asked["messages"],
                {"role": "assistant", "content": [tool_use.model_dump()]},
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": tool_use.id, "content": "a.txt"},
                        {"type": "text", "text": "thanks"},
                    ],
                },
            ],
        }
        second = await sdk.messages.create(**follow_up)
        assert second.stop_reason == "end_turn"

    first_turn_recorded, second_turn = (await published(stack, redis_client, key))["interactions"]
    assert first_turn_recorded["interaction_id"] == first.id
    assert second_turn["interaction_id"] == second.id
    assert first_turn_recorded["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "Bash",
                "parameters": BASH_TOOL["input_schema"],
                "description": BASH_TOOL["description"],
            },
        }
    ]
    recorded_call = first_turn_recorded["output"]["tool_calls"][0]
    assert recorded_call["id"] == tool_use.id
    assert orjson.loads(recorded_call["function"]["arguments"]) == tool_use.input
    assert second_turn["messages"][1:] == [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": tool_use.id,
                    "type": "function",
                    "function": {
                        "name": "Bash",
                        "arguments": orjson.dumps(tool_use.input).decode(),
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": tool_use.id, "content": "a.txt"},
        {"role": "user", "content": "thanks"},
    ]


@pytest.mark.parametrize("streamed", [False, True])
async def test_a_forced_tool_call_stops_for_tool_use_though_the_upstream_says_stop(
    stack: Stack, redis_client: aioredis.Redis, streamed: bool
) -> None:
    key = (await _start(stack))["api_key"]
    read_tool = {**BASH_TOOL, "name": "Read"}
    asked: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 256,
        "tools": [BASH_TOOL, read_tool],
        "tool_choice": {"type": "tool", "name": "Read"},
        "messages": [{"role": "user", "content": "open the readme"}],
    }
    async with client(stack, key) as sdk:
        if streamed:
            async with sdk.messages.stream(**asked) as stream:
                message = await stream.get_final_message()
        else:
            message = await sdk.messages.create(**asked)
    assert message.stop_reason == "tool_use" and message.stop_sequence is None
    (tool_use,) = message.content
    assert tool_use.type == "tool_use" and tool_use.name == "Read"
    (interaction,) = (await published(stack, redis_client, key))["interactions"]
    # The upstream (the mock, as vLLM does for a named tool_choice) finished with "stop".
    assert interaction["finish_reason"] == "stop"
    assert interaction["output"]["tool_calls"][0]["function"]["name"] == "Read"


async def test_claude_codes_raw_stream_is_anthropics_event_sequence_and_rewardable(
    stack: Stack, redis_client: aioredis.Redis
) -> None:
    key = (await _start(stack))["api_key"]
    # Claude Code with ANTHROPIC_AUTH_TOKEN sends the key as a Bearer token.
    headers = {**CLAUDE_CODE_HEADERS, "Authorization": f"Bearer {key}"}
    async with stack.http.post(
        stack.url + "/v1/messages?beta=true", json=first_turn(MODEL, "hi there"), headers=headers
    ) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = sse(await resp.read())
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert all(data["type"] == name for name, data in events)
    message_id = events[0][1]["message"]["id"]
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] == "end_turn"
    assert delta["usage"]["input_tokens"] > 0 and delta["usage"]["output_tokens"] > 0
    text = "".join(data["delta"]["text"] for name, data in events if name == "content_block_delta")

    async with stack.http.post(
        stack.url + "/rl/set_reward",
        json={"reward": 0.75, "interaction_id": message_id},
        headers={"Authorization": f"Bearer {key}"},
    ) as resp:
        assert resp.status == 200, await resp.text()
    (interaction,) = (await published(stack, redis_client, key))["interactions"]
    assert interaction["interaction_id"] == message_id and interaction["reward"] == 0.75
    assert interaction["output"]["content"] == text
    assert interaction["messages"][1] == {"role": "user", "content": f"{REMINDER}\nhi there"}


async def test_a_claude_code_tool_result_turn_is_recorded_with_its_tool_message(
    stack: Stack, redis_client: aioredis.Redis
) -> None:
    key = (await _start(stack))["api_key"]
    tool_use = {"type": "tool_use", "id": "toolu_01", "name": "Bash", "input": {"command": "ls"}}
    body = tool_result_turn(MODEL, "list files", tool_use, "a.txt\nb.txt", stream=False)
    headers = {**CLAUDE_CODE_HEADERS, "x-api-key": key}
    async with stack.http.post(stack.url + "/v1/messages", json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        message = await resp.json()
    (interaction,) = (await published(stack, redis_client, key))["interactions"]
    assert interaction["interaction_id"] == message["id"]
    assert [m["role"] for m in interaction["messages"]] == [
        "system",
        "user",
        "assistant",
        "tool",
        "user",
    ]
    assert interaction["messages"][3] == {
        "role": "tool",
        "tool_call_id": "toolu_01",
        "content": "a.txt\nb.txt",
    }


def _anthropic_error(body: dict[str, Any], kind: str) -> str:
    assert body["type"] == "error" and set(body) == {"type", "error"}, body
    assert body["error"]["type"] == kind, body
    # rollgate's code rides along (what the README's error table names).
    assert set(body["error"]) == {"type", "message", "code"} and body["error"]["code"], body
    message: str = body["error"]["message"]
    assert message
    return message


async def test_errors_on_the_messages_route_take_anthropics_shape(stack: Stack) -> None:
    key = (await _start(stack))["api_key"]
    url = stack.url + "/v1/messages"
    valid = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}
    cases: list[tuple[str, str, dict[str, str], Any, int, str, str]] = [
        ("POST", url, {}, valid, 401, "authentication_error", "missing API key"),
        ("POST", url, {"x-api-key": ADMIN_KEY}, valid, 401, "authentication_error", "admin key"),
        ("POST", url, {"x-api-key": "sk-ant-api03-xyz"}, valid, 401, "authentication_error", "not a rollgate session key"),
        ("POST", url, {"x-api-key": key}, {"model": MODEL}, 400, "invalid_request_error", "max_tokens"),
        ("POST", url, {"x-api-key": key}, valid | {"model": "claude-sonnet-4-5"}, 404, "not_found_error", "claude-sonnet-4-5"),
        ("GET", url, {"x-api-key": key}, None, 405, "invalid_request_error", "POST"),
        ("POST", url + "/count_tokens", {"x-api-key": key}, valid, 404, "not_found_error", "does not serve /v1/messages/count_tokens"),
        ("POST", url + "/batches", {"x-api-key": key}, valid, 404, "not_found_error", "no such endpoint"),
    ]  # fmt: skip
    for method, target, headers, body, status, kind, says in cases:
        async with stack.http.request(method, target, json=body, headers=headers) as resp:
            assert resp.status == status, (target, headers, await resp.text())
            assert resp.headers["Content-Type"].startswith("application/json")
            assert says in _anthropic_error(await resp.json(), kind), (target, headers)
    async with stack.http.post(
        url, data=b"{" + b" " * (2 * 1024 * 1024) + b"}", headers={"x-api-key": key}
    ) as resp:
        assert resp.status == 413
        _anthropic_error(await resp.json(), "request_too_large")


@pytest.mark.parametrize("base", ["", "/sessions/claude-1", "/rollout/r1/attempt/a1"])
async def test_count_tokens_is_a_404_that_says_it_is_not_served_and_what_to_do(
    stack: Stack, base: str
) -> None:
    # Any key or none: the answer is the same, and nothing is routed or recorded.
    async with client(stack, "sk-sess-" + "x" * 43, stack.url + base) as sdk:
        with pytest.raises(anthropic.NotFoundError) as raised:
            await sdk.messages.count_tokens(
                model=MODEL, messages=[{"role": "user", "content": "how long am I?"}]
            )
    message = _anthropic_error(raised.value.body, "not_found_error")  # type: ignore[arg-type]
    assert "does not serve /v1/messages/count_tokens" in message
    assert "tokenizer" in message and "usage.input_tokens" in message
    assert raised.value.body["error"]["code"] == "count_tokens_not_served"  # type: ignore[index]


async def test_a_stream_for_default_names_the_served_model_from_message_start_on(
    stack: Stack, redis_client: aioredis.Redis
) -> None:
    key = (await _start(stack))["api_key"]
    ask = {"max_tokens": 32, "messages": [{"role": "user", "content": "who answers?"}]}
    async with client(stack, key) as sdk:
        async with sdk.messages.stream(model="default", **ask) as stream:
            starts = [e.message async for e in stream if e.type == "message_start"]
            final = await stream.get_final_message()
        plain = await sdk.messages.create(model="default", **ask)
    # `default` is an alias: the message, streamed or not, names the model that answered.
    assert [m.model for m in starts] == [MODEL]
    assert final.model == plain.model == MODEL
    recorded = (await published(stack, redis_client, key))["interactions"]
    assert [i["model"] for i in recorded] == [MODEL, MODEL]


async def test_between_episodes_the_sdk_sees_overloaded_503_with_retry_after(stack: Stack) -> None:
    key = (await _start(stack))["api_key"]
    async with stack.http.post(
        stack.url + "/rl/end_session", json={}, headers={"Authorization": f"Bearer {key}"}
    ) as resp:
        assert resp.status == 200
    async with client(stack, key) as sdk:
        with pytest.raises(anthropic.APIStatusError) as raised:
            await sdk.messages.create(
                model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "late"}]
            )
    assert raised.value.status_code == 503
    assert int(raised.value.response.headers["Retry-After"]) >= 1
    assert _anthropic_error(raised.value.body, "overloaded_error")  # type: ignore[arg-type]


async def test_the_sdk_raises_its_own_error_classes(stack: Stack) -> None:
    key = (await _start(stack))["api_key"]
    ask = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}
    async with client(stack, "sk-sess-" + "x" * 43) as sdk:
        with pytest.raises(anthropic.AuthenticationError):
            await sdk.messages.create(**ask)
    async with client(stack, key) as sdk:
        with pytest.raises(anthropic.NotFoundError):
            await sdk.messages.create(**(ask | {"model": "nope"}))
        with pytest.raises(anthropic.BadRequestError) as raised:
            await sdk.messages.create(**(ask | {"messages": [{"role": "system", "content": "x"}]}))
        assert "user or assistant" in raised.value.message


async def test_an_upstream_failure_before_and_after_the_first_token(stack: Stack) -> None:
    key = (await _start(stack))["api_key"]
    headers = {"x-api-key": key}
    failing = {"model": MODEL, "max_tokens": 64, "stream": True}
    early = failing | {"messages": [{"role": "user", "content": "/fail-500"}]}
    async with stack.http.post(stack.url + "/v1/messages", json=early, headers=headers) as resp:
        assert resp.status == 502
        _anthropic_error(await resp.json(), "api_error")
    late = failing | {"messages": [{"role": "user", "content": "go on /fail-midstream"}]}
    async with stack.http.post(stack.url + "/v1/messages", json=late, headers=headers) as resp:
        assert resp.status == 200
        events = sse(await resp.read())
    assert events[0][0] == "message_start"
    name, data = events[-1]
    assert name == "error" and data["type"] == "error" and data["error"]["message"]
    assert "message_stop" not in [n for n, _ in events]


async def test_a_session_in_the_url_path_names_the_episode_for_an_anthropic_client(
    stack: Stack, redis_client: aioredis.Redis
) -> None:
    async with stack.http.post(
        stack.url + "/rl/keys", json={}, headers={"Authorization": f"Bearer {ADMIN_KEY}"}
    ) as resp:
        header_key = (await resp.json())["api_key"]
    async with client(stack, header_key, f"{stack.url}/sessions/claude-1") as sdk:
        message = await sdk.messages.create(
            model=MODEL, max_tokens=16, messages=[{"role": "user", "content": "in a session"}]
        )
    async with stack.http.post(
        stack.url + "/sessions/claude-1/rl/end_session",
        json={},
        headers={"x-api-key": header_key},
    ) as resp:
        assert resp.status == 200, await resp.text()
    entries = await redis_client.xrange(f"{stack.prefix}trajectories")
    trajectory = inline_content(msgpack.unpackb(entries[-1][1][b"data"], raw=False))
    assert trajectory["session_id"] == "claude-1"
    assert [i["interaction_id"] for i in trajectory["interactions"]] == [message.id]
    # A per-episode key there: the 400 in Anthropic's shape.
    key = (await _start(stack))["api_key"]
    async with client(stack, key, f"{stack.url}/sessions/claude-1") as sdk:
        with pytest.raises(anthropic.BadRequestError) as raised:
            await sdk.messages.create(
                model=MODEL, max_tokens=16, messages=[{"role": "user", "content": "x"}]
            )
    assert "header-mode key" in _anthropic_error(raised.value.body, "invalid_request_error")  # type: ignore[arg-type]


async def test_a_streamed_message_after_its_first_batch_is_pushed_whole_and_in_order(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = (await _start(stack))["api_key"]
    ask: Any = [{"role": "user", "content": "tell me something long enough for many tokens"}]
    async with client(stack, key) as sdk:
        whole = await sdk.messages.create(model=MODEL, max_tokens=64, messages=ask)
        pushed = _count_pushes(monkeypatch)
        stack.mock.token_interval_s = 0.005  # each token its own read: its own batch
        texts = []
        async with sdk.messages.stream(model=MODEL, max_tokens=64, messages=ask) as stream:
            async for event in stream:
                if event.type == "text":
                    texts.append(event.text)
            final = await stream.get_final_message()
    (block,) = whole.content
    assert block.type == "text" and len(block.text) > 20
    assert "".join(texts) == block.text
    assert final.content[0].type == "text" and final.content[0].text == block.text
    assert len(pushed) >= 3
