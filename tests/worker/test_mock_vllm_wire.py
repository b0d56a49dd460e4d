"""The mock's `vllm` flavor sends what a real vLLM 0.32 sends (the shapes tests/engine checks
against the real server), and the worker records those shapes exactly."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest

from rollgate.mock_llm import EOS_ID, EOS_PIECE, FRAGMENT_ID, MockLLM
from tests.worker.harness import running_worker
from tests.worker.test_worker_grpc import generate


@pytest.fixture
async def mock() -> AsyncIterator[MockLLM]:
    async with MockLLM(port=0, model="tiny", strict_model=True) as server:
        yield server


async def post(mock: MockLLM, **fields: Any) -> tuple[int, bytes]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}], **fields}
    async with (
        aiohttp.ClientSession() as http,
        http.post(mock.base_url + "/chat/completions", json=body) as resp,
    ):
        return resp.status, await resp.read()


def chunks(raw: bytes) -> list[dict[str, Any]]:
    lines = [line for line in raw.split(b"\n") if line.startswith(b"data: ")]
    assert lines[-1] == b"data: [DONE]"
    return [orjson.loads(line[6:]) for line in lines[:-1]]


async def test_a_stream_has_vllms_chunk_shapes(mock: MockLLM) -> None:
    status, raw = await post(
        mock,
        stream=True,
        logprobs=True,
        return_token_ids=True,
        stream_options={"include_usage": True},
    )
    assert status == 200
    events = chunks(raw)
    role, *tokens, usage = events
    # prompt_token_ids on the role chunk, which has no token_ids; then one id per chunk.
    assert role["prompt_token_ids"] and "token_ids" not in role["choices"][0]
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(len(c["choices"][0]["token_ids"]) == 1 for c in tokens)
    # The finish rides on the last token's chunk: EOS, whose text never reaches the content.
    last = tokens[-1]["choices"][0]
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", None)
    assert last["token_ids"] == [EOS_ID] and last["delta"] == {"content": ""}
    assert last["logprobs"]["content"][0]["token"] == EOS_PIECE
    assert all(c["choices"][0]["finish_reason"] is None for c in tokens[:-1])
    # Usage only in its own chunk; the fingerprint only there; no `usage: null` elsewhere.
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(tokens)
    assert "system_fingerprint" in usage
    assert all("usage" not in c and "system_fingerprint" not in c for c in events[:-1])
    assert all("refusal" not in c["choices"][0]["logprobs"] for c in tokens)


async def test_a_stop_strings_token_is_sent_but_not_its_text(mock: MockLLM) -> None:
    status, raw = await post(mock, return_token_ids=True, logprobs=True, stop=[" said"])
    assert status == 200
    [choice] = orjson.loads(raw)["choices"]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", " said")
    assert choice["message"]["content"].endswith(": you")
    tokens = [e["token"] for e in choice["logprobs"]["content"]]
    assert tokens[-1] == " said" and len(choice["token_ids"]) == len(tokens)


async def test_a_lone_utf8_fragment_is_an_empty_token_and_a_replacement_character_next(
    mock: MockLLM,
) -> None:
    messages = [{"role": "user", "content": "hello /utf8-fragment"}]
    status, raw = await post(
        mock, messages=messages, stream=True, logprobs=True, return_token_ids=True
    )
    assert status == 200
    tokens = chunks(raw)[1:]
    fragment, after = tokens[1]["choices"][0], tokens[2]["choices"][0]
    assert fragment["token_ids"] == [FRAGMENT_ID]
    assert fragment["logprobs"]["content"][0] | {"logprob": 0} == {
        "token": "",
        "logprob": 0,
        "bytes": [],
        "top_logprobs": [],
    }
    assert fragment["delta"] == {"content": ""}
    assert after["delta"]["content"].startswith("\ufffd")
    assert not after["logprobs"]["content"][0]["token"].startswith("\ufffd")


def _function(name: str) -> dict[str, Any]:
    parameters = {"type": "object", "properties": {"query": {"type": "string"}}}
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


NAMED = {"type": "function", "function": {"name": "second"}}


async def test_a_named_tool_choice_forces_that_call_and_finishes_with_stop(mock: MockLLM) -> None:
    tools = [_function("first"), _function("second")]
    status, raw = await post(mock, tools=tools, tool_choice=NAMED, return_token_ids=True)
    assert status == 200
    [choice] = orjson.loads(raw)["choices"]
    # As vLLM 0.32 (and OpenAI) answer a named tool_choice: the call, finish_reason "stop".
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", None)
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "second" and choice["message"]["content"] == ""
    assert orjson.loads(call["function"]["arguments"]) == {"query": "hello there"}
    assert choice["token_ids"][-1] == EOS_ID

    status, raw = await post(mock, tools=tools, tool_choice=NAMED, stream=True)
    assert status == 200
    streamed = chunks(raw)
    fragments = [f for c in streamed for f in c["choices"][0]["delta"].get("tool_calls", [])]
    assert fragments[0]["function"]["name"] == "second" and len(fragments) >= 2
    assert streamed[-1]["choices"][0]["finish_reason"] == "stop"


async def test_other_tool_choices_keep_the_mocks_answers(mock: MockLLM) -> None:
    tools = [_function("first"), _function("second")]
    # "auto": the model decides, and the mock's model replies with text.
    status, raw = await post(mock, tools=tools, tool_choice="auto")
    [answer] = orjson.loads(raw)["choices"]
    assert status == 200 and answer["finish_reason"] == "stop"
    assert "tool_calls" not in answer["message"]
    # `/tool` still calls the first tool and finishes with tool_calls.
    messages = [{"role": "user", "content": "go /tool"}]
    status, raw = await post(mock, tools=tools, messages=messages)
    [answer] = orjson.loads(raw)["choices"]
    assert answer["finish_reason"] == "tool_calls"
    assert answer["message"]["tool_calls"][0]["function"]["name"] == "first"


async def test_n_2_streams_the_prompt_ids_on_each_choices_role_chunk(mock: MockLLM) -> None:
    status, raw = await post(mock, stream=True, n=2, return_token_ids=True, max_tokens=2)
    assert status == 200
    roles = [c for c in chunks(raw) if c["choices"][0]["delta"].get("role")]
    assert [c["choices"][0]["index"] for c in roles] == [0, 1]
    assert roles[0]["prompt_token_ids"] == roles[1]["prompt_token_ids"]


async def test_errors_have_vllms_shape(mock: MockLLM) -> None:
    status, raw = await post(mock, model="no-such-model")
    assert status == 404
    assert orjson.loads(raw) == {
        "error": {
            "message": "The model `no-such-model` does not exist. Valid aliases: tiny.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }
    status, raw = await post(mock, messages=[])
    assert status == 400 and orjson.loads(raw)["error"]["type"] == "BadRequestError"


@pytest.mark.parametrize("stream", [False, True])
async def test_the_worker_records_the_fragment_and_eos_by_id_with_every_logprob(
    mock: MockLLM, stream: bool
) -> None:
    payload = orjson.dumps(
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi /utf8-fragment"}],
            "stream": stream,
        }
    )
    async with running_worker(mock.base_url) as worker:
        _, record = await generate(worker.stub, payload)
    ids = list(record.output_token_ids)
    assert record.exact_tokens and not record.length_mismatch
    assert ids[1] == FRAGMENT_ID and ids[-1] == EOS_ID
    assert len(record.output_logprobs) == len(ids)
    content = orjson.loads(record.assistant_message_json)["content"]
    assert "\ufffd" in content and EOS_PIECE not in content
