"""Open Responses through the gateway, driven by the `openai` SDK, in front of the real router,
dataproxy and worker (in-process, port 0), the mock LLM and a real Redis; each test checks the
trajectory that was recorded."""

from __future__ import annotations

from typing import Any

import msgpack  # type: ignore[import-untyped]
import openai
import orjson
import pytest
import redis.asyncio as aioredis

from rollgate.trajectory import inline_content
from tests.gateway.conftest import ADMIN_KEY
from tests.gateway.test_full_chain import MODEL, Stack, _auth, _count_pushes, _start, stack

__all__ = ["stack"]


def client(stack: Stack, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0)


async def published(stack: Stack, redis: aioredis.Redis, key: str) -> dict[str, Any]:
    """Refreshes the key (which publishes its episode) and reads the trajectory."""
    before = await redis.xlen(f"{stack.prefix}trajectories")
    await _start(stack, api_key=key)
    entries = await redis.xrange(f"{stack.prefix}trajectories")
    assert len(entries) == before + 1
    trajectory: dict[str, Any] = inline_content(msgpack.unpackb(entries[-1][1][b"data"], raw=False))
    return trajectory


async def test_a_plain_response_is_translated_and_recorded(
    stack: Stack, redis_client: aioredis.Redis
) -> None:
    key = (await _start(stack))["api_key"]
    async with client(stack, key) as sdk:
        response = await sdk.responses.create(
            model=MODEL, input="hello bridge", instructions="Be brief.", max_output_tokens=64
        )
    assert response.id.startswith("resp_")
    assert response.status == "completed"
    assert response.output_text.startswith("Mock reply")
    assert "hello bridge" in response.output_text
    assert response.usage is not None and response.usage.output_tokens > 0
    trajectory = await published(stack, redis_client, key)
    [interaction] = trajectory["interactions"]
    assert interaction["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hello bridge"},
    ]
    assert interaction["output"]["content"] == response.output_text
    assert stack.mock.stats.last_body is not None
    assert stack.mock.stats.last_body["max_tokens"] == 64


async def test_a_three_turn_chain_prepends_history_without_inheriting_instructions(
    stack: Stack, redis_client: aioredis.Redis
) -> None:
    key = (await _start(stack))["api_key"]
    async with client(stack, key) as sdk:
        first = await sdk.responses.create(model=MODEL, input="one", instructions="first rules")
        second = await sdk.responses.create(model=MODEL, input="two", previous_response_id=first.id)
        third = await sdk.responses.create(
            model=MODEL, input="three", previous_response_id=second.id, instructions="third"
        )
        assert third.previous_response_id == second.id
        stored = await sdk.responses.retrieve(second.id)
    assert stored.output_text == second.output_text
    trajectory = await published(stack, redis_client, key)
    messages = [i["messages"] for i in trajectory["interactions"]]
    assert messages[2] == [
        {"role": "system", "content": "third"},
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "two"},
        {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "three"},
    ]
    assert messages[1][0] == {"role": "user", "content": "one"}


async def test_an_unknown_previous_response_is_404(stack: Stack) -> None:
    key = (await _start(stack))["api_key"]
    async with client(stack, key) as sdk:
        with pytest.raises(openai.NotFoundError) as caught:
            await sdk.responses.create(model=MODEL, input="x", previous_response_id="resp_nope")
    body: Any = caught.value.body
    assert body["code"] == "previous_response_not_found"


async def test_store_false_is_not_kept(stack: Stack) -> None:
    key = (await _start(stack))["api_key"]
    async with client(stack, key) as sdk:
        response = await sdk.responses.create(model=MODEL, input="forget me", store=False)
        assert response.store is False
        with pytest.raises(openai.NotFoundError):
            await sdk.responses.retrieve(response.id)
        with pytest.raises(openai.NotFoundError):
            await sdk.responses.create(model=MODEL, input="x", previous_response_id=response.id)


WEATHER_TOOL: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
}


async def test_a_tool_call_loop_round_trips_function_calls_and_outputs(
    stack: Stack, redis_client: aioredis.Redis
) -> None:
    key = (await _start(stack))["api_key"]
    async with client(stack, key) as sdk:
        asked = await sdk.responses.create(
            model=MODEL, input="weather in Paris /tool", tools=[WEATHER_TOOL]
        )
        [call] = [item for item in asked.output if item.type == "function_call"]
        assert call.name == "get_weather"
        assert orjson.loads(call.arguments) == {"query": "weather in Paris /tool"}
        answered = await sdk.responses.create(
            model=MODEL,
            previous_response_id=asked.id,
            tools=[WEATHER_TOOL],
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        )
    assert answered.status == "completed"
    trajectory = await published(stack, redis_client, key)
    first, second = trajectory["interactions"]
    assert first["tools"][0]["function"]["name"] == "get_weather"
    assert first["finish_reason"] == "tool_calls"
    assert second["messages"][1:] == [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
    ]


async def test_a_length_cut_answer_is_incomplete(stack: Stack) -> None:
    key = (await _start(stack))["api_key"]
    async with client(stack, key) as sdk:
        response = await sdk.responses.create(
            model=MODEL, input="a question long enough to be cut", max_output_tokens=16
        )
        short = await sdk.responses.create(model=MODEL, input="x " * 40, max_output_tokens=16)
    assert response.status in ("completed", "incomplete")
    assert short.status == "incomplete"
    assert short.incomplete_details is not None
    assert short.incomplete_details.reason == "max_output_tokens"


async def test_streaming_emits_the_full_event_sequence(
    stack: Stack, redis_client: aioredis.Redis
) -> None:
    key = (await _start(stack))["api_key"]
    async with client(stack, key) as sdk:
        stream = await sdk.responses.create(model=MODEL, input="stream this", stream=True)
        events = [event async for event in stream]
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    # Chunks that arrived together are one delta (the mock sends the answer at once).
    assert kinds.count("response.output_text.delta") >= 1
    numbers = [event.sequence_number for event in events]
    assert numbers == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == text
    trajectory = await published(stack, redis_client, key)
    assert trajectory["interactions"][0]["output"]["content"] == text


async def test_stream_event_names_match_types_and_end_with_done(stack: Stack) -> None:
    key = (await _start(stack))["api_key"]
    body = {"model": MODEL, "input": "raw stream", "stream": True}
    async with stack.http.post(stack.url + "/responses", json=body, headers=_auth(key)) as resp:
        assert resp.status == 200
        assert resp.content_type == "text/event-stream"
        raw = (await resp.read()).decode()
    blocks = raw.strip().split("\n\n")
    assert blocks[-1] == "data: [DONE]"
    for block in blocks[:-1]:
        event_line, data_line = block.split("\n")
        assert event_line.removeprefix("event: ") == orjson.loads(data_line[6:])["type"]


async def test_an_upstream_failure_mid_stream_ends_with_error_and_failed(stack: Stack) -> None:
    key = (await _start(stack))["api_key"]
    body = {"model": MODEL, "input": "please /fail-midstream now", "stream": True}
    async with stack.http.post(stack.url + "/v1/responses", json=body, headers=_auth(key)) as resp:
        assert resp.status == 200
        raw = (await resp.read()).decode()
    blocks = raw.strip().split("\n\n")
    kinds = [orjson.loads(b.split("\n")[1][6:])["type"] for b in blocks[:-1]]
    assert kinds[0] == "response.created"
    assert kinds[-2:] == ["error", "response.failed"]
    failed = orjson.loads(blocks[-2].split("\n")[1][6:])
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["code"]


async def test_an_upstream_failure_before_streaming_is_a_json_error(stack: Stack) -> None:
    key = (await _start(stack))["api_key"]
    body = {"model": MODEL, "input": "please /fail-500", "stream": True}
    async with stack.http.post(stack.url + "/v1/responses", json=body, headers=_auth(key)) as resp:
        assert resp.status == 502
        assert (await resp.json())["error"]["type"] == "upstream_error"


async def test_the_admin_key_and_bad_bodies_are_rejected(stack: Stack) -> None:
    async with stack.http.post(
        stack.url + "/v1/responses", json={"model": MODEL, "input": "x"}, headers=_auth(ADMIN_KEY)
    ) as resp:
        assert resp.status == 401
    key = (await _start(stack))["api_key"]
    async with stack.http.post(
        stack.url + "/v1/responses", json={"model": MODEL, "input": 3}, headers=_auth(key)
    ) as resp:
        assert resp.status == 400
        assert "input" in (await resp.json())["error"]["message"]


async def test_a_chain_survives_a_refresh_of_the_key(stack: Stack) -> None:
    key = (await _start(stack))["api_key"]
    async with client(stack, key) as sdk:
        first = await sdk.responses.create(model=MODEL, input="before refresh")
        await _start(stack, api_key=key)
        second = await sdk.responses.create(
            model=MODEL, input="after refresh", previous_response_id=first.id
        )
    assert second.status == "completed"
    assert stack.mock.stats.last_body is not None
    contents = [m["content"] for m in stack.mock.stats.last_body["messages"]]
    assert contents[0] == "before refresh"


@pytest.mark.parametrize("stream", [False, True])
async def test_the_interaction_id_is_the_response_id_and_set_reward_takes_it(
    stack: Stack, redis_client: aioredis.Redis, stream: bool
) -> None:
    key = (await _start(stack))["api_key"]
    async with client(stack, key) as sdk:
        if stream:
            events = await sdk.responses.create(model=MODEL, input="reward me", stream=True)
            response_id = ""
            async for event in events:
                if event.type == "response.completed":
                    response_id = event.response.id
        else:
            response = await sdk.responses.create(model=MODEL, input="reward me")
            response_id = response.id
        await sdk.responses.create(model=MODEL, input="a later turn")
    assert response_id.startswith("resp_")
    async with stack.http.post(
        stack.url + "/rl/set_reward",
        json={"reward": 0.75, "interaction_id": response_id},
        headers=_auth(key),
    ) as resp:
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["interaction_id"] == response_id
    trajectory = await published(stack, redis_client, key)
    first, second = trajectory["interactions"]
    assert first["interaction_id"] == response_id
    assert first["reward"] == 0.75 and first["reward_set"] is True
    assert second["interaction_id"].startswith("resp_")
    assert second["reward_set"] is False


async def test_a_streamed_function_call_has_the_arguments_event_sequence(
    stack: Stack, redis_client: aioredis.Redis
) -> None:
    key = (await _start(stack))["api_key"]
    async with client(stack, key) as sdk:
        stream = await sdk.responses.create(
            model=MODEL, input="weather in Rome /tool", tools=[WEATHER_TOOL], stream=True
        )
        # Any: the SDK's event and item unions are too wide to narrow one by one here.
        events: list[Any] = [event async for event in stream]
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    call_events = kinds[kinds.index("response.output_item.added") : -1]
    n_deltas = call_events.count("response.function_call_arguments.delta")
    assert n_deltas >= 1
    assert call_events == [
        "response.output_item.added",
        *["response.function_call_arguments.delta"] * n_deltas,
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added = events[kinds.index("response.output_item.added")]
    assert added.item.type == "function_call"
    arguments = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )
    done = events[kinds.index("response.function_call_arguments.done")]
    assert done.arguments == arguments
    assert orjson.loads(arguments) == {"query": "weather in Rome /tool"}
    item_done = events[kinds.index("response.output_item.done")].item
    assert item_done.type == "function_call" and item_done.name == "get_weather"
    assert item_done.arguments == arguments and item_done.status == "completed"
    final = events[-1].response
    [call] = [item for item in final.output if item.type == "function_call"]
    assert call.call_id == item_done.call_id
    [interaction] = (await published(stack, redis_client, key))["interactions"]
    assert interaction["finish_reason"] == "tool_calls"
    assert interaction["interaction_id"] == final.id


async def test_a_streamed_response_after_its_first_delta_is_pushed_whole_and_in_order(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = (await _start(stack))["api_key"]
    question = "tell me something long enough for many tokens"
    async with client(stack, key) as sdk:
        whole = (await sdk.responses.create(model=MODEL, input=question)).output_text
        pushed = _count_pushes(monkeypatch)
        stack.mock.token_interval_s = 0.005  # each token its own read: its own delta
        stream = await sdk.responses.create(model=MODEL, input=question, stream=True)
        events = [event async for event in stream]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[-1].type == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole and len(whole) > 20
    assert len(pushed) >= 3
