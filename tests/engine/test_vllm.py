"""rollgate in front of a real vLLM: what the client received through rollgate is what the
trajectory records, and at temperature 0 it is what vLLM answers when asked directly.

Every direct request runs one at a time, after the gateway's, so batching cannot change a
greedy choice between the two.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import orjson
import pytest

from rollgate.stack import Stack
from rollgate.trajectory import Interaction
from services.gateway.messages_translate import parse_request
from tests.engine.client import (
    Seen,
    as_float32,
    chat,
    end_and_read,
    from_completion,
    from_stream,
    start_session,
)
from tests.engine.conftest import MODEL, OPENAI_MODEL, Vllm, http_call

LOGPROB_TOLERANCE = 1e-3
EOS = "<|im_end|>"
TOOL = {
    "type": "function",
    "function": {
        "name": "set_flag",
        "description": "Sets the flag.",
        "parameters": {
            "type": "object",
            "properties": {"on": {"type": "boolean"}},
            "required": ["on"],
            "additionalProperties": False,
        },
    },
}


def body(text: str, **extra: Any) -> dict[str, Any]:
    """A greedy chat request for the kind: vllm upstream, asking for logprobs and ids."""
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 12,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        "return_token_ids": True,
        **extra,
    }


def through(stack: Stack, key: str, request: dict[str, Any]) -> dict[int, Seen]:
    """The request through rollgate's gateway."""
    return chat(stack.gateway_url + "/v1/chat/completions", request, key)


def direct(vllm: Vllm, request: dict[str, Any]) -> dict[int, Seen]:
    """The same request straight to vLLM, streamed or not as asked."""
    return chat(vllm.base_url + "/v1/chat/completions", request)


def assert_recorded(interaction: Interaction, seen: Seen) -> None:
    """The record holds exactly the ids and logprobs the client received."""
    assert seen.token_ids is not None and seen.prompt_token_ids
    assert interaction.output_token_ids == seen.token_ids
    assert interaction.prompt_token_ids == seen.prompt_token_ids
    assert interaction.output_logprobs == as_float32(seen.logprobs)
    assert len(interaction.output_logprobs) == len(interaction.output_token_ids)
    assert interaction.exact_tokens and not interaction.length_mismatch
    assert interaction.upstream_kind == "vllm" and interaction.model == MODEL
    assert interaction.finish_reason == seen.finish_reason


def assert_same_as_direct(seen: Seen, alone: Seen) -> None:
    """Greedy: the same ids; the logprobs within the tolerance."""
    assert seen.token_ids == alone.token_ids
    assert seen.prompt_token_ids == alone.prompt_token_ids
    assert seen.logprobs == pytest.approx(alone.logprobs, abs=LOGPROB_TOLERANCE)
    assert seen.finish_reason == alone.finish_reason


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_greedy_chat_records_what_the_client_got_and_what_vllm_answers_directly(
    stack: Stack, vllm: Vllm, stream: bool
) -> None:
    key = start_session(stack, "engine-chat")
    request = body("Hello! How are you?", stream=stream, ignore_eos=True)
    if stream:
        request["stream_options"] = {"include_usage": True}
    seen = through(stack, key, request)
    alone = direct(vllm, request)
    [interaction] = end_and_read(stack, key)
    assert set(seen) == {0}
    assert len(seen[0].token_ids or []) == 12 and seen[0].finish_reason == "length"
    assert_recorded(interaction, seen[0])
    assert_same_as_direct(seen[0], alone[0])
    assert interaction.output["content"] == seen[0].content
    assert interaction.usage["completion_tokens"] == 12
    # top_logprobs (2 asked): vLLM puts the sampled token first, then the best other one.
    for token, logprob, top in zip(
        seen[0].tokens, seen[0].logprobs, seen[0].top_logprobs, strict=True
    ):
        assert len(top) == 2 and (top[0]["token"], top[0]["logprob"]) == (token, logprob)


def test_the_client_that_asks_for_nothing_gets_no_ids_and_the_record_still_has_them(
    stack: Stack, vllm: Vllm
) -> None:
    key = start_session(stack, "engine-plain-client")
    request = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "What is 12 * 15 + 3?"}],
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }
    status, raw = http_call(stack.gateway_url + "/v1/chat/completions", request, key)
    assert status == 200, raw
    answer = json.loads(raw)
    assert "prompt_token_ids" not in answer
    assert "token_ids" not in answer["choices"][0]
    assert answer["choices"][0]["logprobs"] is None
    [interaction] = end_and_read(stack, key)
    alone = direct(vllm, body("What is 12 * 15 + 3?", max_tokens=8, ignore_eos=True))[0]
    assert interaction.output_token_ids == alone.token_ids
    assert interaction.prompt_token_ids == alone.prompt_token_ids
    assert interaction.output_logprobs == pytest.approx(alone.logprobs, abs=LOGPROB_TOLERANCE)
    assert interaction.exact_tokens and answer["model"] == MODEL


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_n_2_records_choice_0_as_the_client_got_it(stack: Stack, vllm: Vllm, stream: bool) -> None:
    key = start_session(stack, "engine-n2")
    request = body("Hi", n=2, temperature=0.8, seed=7, max_tokens=6, ignore_eos=True)
    request["stream"] = stream
    seen = through(stack, key, request)
    alone = direct(vllm, request)
    [interaction] = end_and_read(stack, key)
    assert set(seen) == {0, 1}
    assert_recorded(interaction, seen[0])
    # Seeded sampling: the same samples when asked directly.
    for index in (0, 1):
        assert_same_as_direct(seen[index], alone[index])


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_stop_string_ends_the_answer_and_its_token_is_recorded(
    stack: Stack, vllm: Vllm, stream: bool
) -> None:
    probe = direct(vllm, body("Tell me about Paris.", max_tokens=16, ignore_eos=True))[0]
    # A stop string the greedy answer reaches at its fourth token, not earlier.
    stop_at = next(
        i
        for i, token in enumerate(probe.tokens)
        if i >= 3 and token.strip() and token not in "".join(probe.tokens[:i])
    )
    stop = probe.tokens[stop_at]
    key = start_session(stack, "engine-stop")
    request = body("Tell me about Paris.", max_tokens=16, stop=[stop], stream=stream)
    seen = through(stack, key, request)
    alone = direct(vllm, request)
    [interaction] = end_and_read(stack, key)
    assert seen[0].finish_reason == "stop" and seen[0].stop_reason == stop
    # The token that matched is sampled (and recorded) but its text is not in the content.
    assert probe.token_ids is not None
    assert seen[0].token_ids == probe.token_ids[: stop_at + 1]
    assert not seen[0].content.endswith(stop)
    assert_recorded(interaction, seen[0])
    assert_same_as_direct(seen[0], alone[0])


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_eos_is_recorded_though_its_text_never_reaches_the_content(
    stack: Stack, vllm: Vllm, stream: bool
) -> None:
    eos = vllm.tokenizer.token_to_id(EOS)
    key = start_session(stack, "engine-eos")
    request = body("Hello!", logit_bias={str(eos): 100}, stream=stream)
    seen = through(stack, key, request)
    [interaction] = end_and_read(stack, key)
    assert seen[0].token_ids == [eos] and seen[0].finish_reason == "stop"
    assert seen[0].content == "" and seen[0].tokens == [EOS]
    assert_recorded(interaction, seen[0])


def test_a_length_limit_records_exactly_max_tokens(stack: Stack, vllm: Vllm) -> None:
    key = start_session(stack, "engine-length")
    request = body("Count: 1 2 3", max_tokens=3, ignore_eos=True, stream=True)
    request["stream_options"] = {"include_usage": True}
    seen = through(stack, key, request)
    [interaction] = end_and_read(stack, key)
    assert len(interaction.output_token_ids) == 3 and interaction.finish_reason == "length"
    assert interaction.usage["completion_tokens"] == 3
    assert_recorded(interaction, seen[0])


def _fragment_prompt(vllm: Vllm) -> tuple[str, int]:
    """A prompt whose greedy answer has a lone UTF-8 fragment token, and its position."""
    # Chinese, French, Japanese, Russian, an emoji, Greek: multi-byte characters.
    texts = (
        "\u4f60\u597d\uff0c\u4e16\u754c",
        "Caf\u00e9, na\u00efve",
        "\u3053\u3093\u306b\u3061\u306f",
        "\u041f\u0440\u0438\u0432\u0435\u0442",
        "Emoji: \U0001f642",
        "\u0393\u03b5\u03b9\u03ac",
    )
    for text in texts:
        seen = direct(vllm, body(text, max_tokens=16, ignore_eos=True))[0]
        for position, token_id in enumerate(seen.token_ids or []):
            # Decoded alone, a fragment is not valid UTF-8; vLLM then sends no bytes for it.
            alone = vllm.tokenizer.decode([token_id], skip_special_tokens=False)
            if "\ufffd" in alone and seen.token_bytes[position] == []:
                return text, position
    raise AssertionError("no prompt made the tiny model sample a lone UTF-8 fragment")


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_lone_utf8_fragment_token_is_recorded_by_id_with_its_logprob(
    stack: Stack, vllm: Vllm, stream: bool
) -> None:
    text, position = _fragment_prompt(vllm)
    key = start_session(stack, "engine-fragment")
    request = body(text, max_tokens=16, ignore_eos=True, stream=stream)
    seen = through(stack, key, request)
    alone = direct(vllm, request)
    [interaction] = end_and_read(stack, key)
    # vLLM names the fragment "" with no bytes; its id and logprob are still the sample's.
    assert seen[0].tokens[position] == "" and seen[0].token_bytes[position] == []
    assert "".join(seen[0].tokens) != seen[0].content
    assert_recorded(interaction, seen[0])
    assert_same_as_direct(seen[0], alone[0])


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_forced_tool_call_is_recorded_with_its_ids_and_the_tools(
    stack: Stack, vllm: Vllm, stream: bool
) -> None:
    key = start_session(stack, "engine-tools")
    choice = {"type": "function", "function": {"name": "set_flag"}}
    request = body("Set the flag.", max_tokens=32, tools=[TOOL], tool_choice=choice, stream=stream)
    seen = through(stack, key, request)
    alone = direct(vllm, request)
    [interaction] = end_and_read(stack, key)
    [call] = seen[0].tool_calls
    assert call["function"]["name"] == "set_flag"
    assert json.loads(call["function"]["arguments"]) in ({"on": True}, {"on": False})
    assert_recorded(interaction, seen[0])
    assert_same_as_direct(seen[0], alone[0])
    assert interaction.tools == [TOOL]
    [recorded] = interaction.output["tool_calls"]
    assert recorded["function"] == call["function"]
    # The sampled ids end with EOS, after the arguments' tokens.
    assert interaction.output_token_ids[-1] == vllm.tokenizer.token_to_id(EOS)


def test_default_is_the_configured_model_and_the_record_names_the_real_one(
    stack: Stack, vllm: Vllm
) -> None:
    key = start_session(stack, "engine-default")
    seen = through(stack, key, body("Hello! How are you?", model="default", ignore_eos=True))
    alone = direct(vllm, body("Hello! How are you?", ignore_eos=True))
    # While the episode is open (a turn is admitted before it is routed, so an ended episode's
    # key is refused as 503 episode_ended before its model is looked at): an unknown model is
    # the 404 that lists the served ones, and records nothing.
    status, raw = http_call(
        stack.gateway_url + "/v1/chat/completions", body("hi", model="no-such-model"), key
    )
    assert status == 404, raw
    message = json.loads(raw)["error"]["message"]
    assert MODEL in message and OPENAI_MODEL in message
    [interaction] = end_and_read(stack, key)
    assert seen[0].model == MODEL
    assert_recorded(interaction, seen[0])
    assert_same_as_direct(seen[0], alone[0])


def openai_body(text: str, **extra: Any) -> dict[str, Any]:
    """What a hosted-API client sends: logprobs, no return_token_ids."""
    return {
        "model": OPENAI_MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 10,
        "temperature": 0,
        "logprobs": True,
        "ignore_eos": True,
        **extra,
    }


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_kind_openai_records_text_and_logprobs_without_exact_ids(
    stack: Stack, vllm: Vllm, stream: bool
) -> None:
    key = start_session(stack, "engine-openai")
    request = openai_body("Hello! How are you?", stream=stream)
    if stream:
        request["stream_options"] = {"include_usage": True}
    status, raw = http_call(stack.gateway_url + "/v1/chat/completions", request, key)
    assert status == 200, raw
    seen = from_stream(raw)[0][0] if stream else chat_body_seen(raw)
    assert seen.token_ids is None and seen.prompt_token_ids is None
    alone = direct(vllm, {**request, "model": MODEL, "return_token_ids": True})[0]
    [interaction] = end_and_read(stack, key)
    # vLLM names its first served name in every answer, whichever name was asked for.
    assert interaction.upstream_kind == "openai" and interaction.model == MODEL
    assert not interaction.exact_tokens
    assert interaction.output_token_ids == [] and interaction.prompt_token_ids == []
    assert interaction.output_logprobs == as_float32(seen.logprobs)
    assert seen.logprobs == pytest.approx(alone.logprobs, abs=LOGPROB_TOLERANCE)
    assert seen.content == alone.content == interaction.output["content"]
    assert len(seen.logprobs) == 10


def chat_body_seen(raw: bytes) -> Seen:
    """Choice 0 of a non-streamed answer."""
    return from_completion(json.loads(raw))[0]


# The same tool as TOOL, as an Anthropic client declares it.
ANTHROPIC_TOOL = {
    "name": "set_flag",
    "description": "Sets the flag.",
    "input_schema": TOOL["function"]["parameters"],  # type: ignore[index]
}


SAMPLING = ("temperature", "top_p", "top_k")


def sdk(stack: Stack, key: str) -> anthropic.Anthropic:
    """An Anthropic client pointed at the gateway (it appends /v1/messages)."""
    return anthropic.Anthropic(base_url=stack.gateway_url, api_key=key, max_retries=0)


def translated(ask: dict[str, Any], stream: bool) -> dict[str, Any]:
    """The chat body rollgate sends vLLM for a Messages request, as vLLM is asked directly:
    the served id, with the ids and logprobs the worker asks for."""
    chat_body = parse_request(orjson.dumps(ask)).chat
    return chat_body | {
        "model": MODEL,
        "stream": stream,
        "logprobs": True,
        "return_token_ids": True,
    }


def message_through(stack: Stack, key: str, ask: dict[str, Any], stream: bool) -> tuple[Any, Any]:
    """The Message the SDK got, and (streamed) the message of its message_start event."""
    # The SDK (2.10) has no sampling arguments: they travel as extra body fields.
    sampling = {name: ask[name] for name in SAMPLING if name in ask}
    args = {name: value for name, value in ask.items() if name not in SAMPLING}
    with sdk(stack, key) as client:
        if not stream:
            return client.messages.create(**args, extra_body=sampling), None
        with client.messages.stream(**args, extra_body=sampling) as events:
            starts = [event.message for event in events if event.type == "message_start"]
            final = events.get_final_message()
    [started] = starts
    return final, started


def assert_same_as_vllm_alone(interaction: Interaction, alone: Seen) -> None:
    """The record of a Messages turn against its chat body sent straight to vLLM (greedy)."""
    assert interaction.output_token_ids == alone.token_ids
    assert interaction.prompt_token_ids == alone.prompt_token_ids
    assert interaction.output_logprobs == pytest.approx(alone.logprobs, abs=LOGPROB_TOLERANCE)
    assert len(interaction.output_logprobs) == len(interaction.output_token_ids)
    assert interaction.exact_tokens and not interaction.length_mismatch
    assert interaction.upstream_kind == "vllm" and interaction.model == MODEL
    assert interaction.finish_reason == alone.finish_reason


def _stop_sequence_request(vllm: Vllm) -> tuple[dict[str, Any], int, Seen]:
    """A greedy Messages request whose answer (EOS allowed: Messages cannot ignore it) has a
    token at its fourth position or later whose text is new there: (request, position, the
    answer vLLM gives its chat body)."""
    for text in ("Tell me about Paris.", "Hello! How are you?", "Count: 1 2 3", "Hi"):
        # `default`, as AReaL's and Anthropic-style clients send it: an alias of the served model.
        ask = {
            "model": "default",
            "max_tokens": 16,
            "temperature": 0,
            "system": "Be brief.",
            "messages": [{"role": "user", "content": text}],
        }
        probe = direct(vllm, translated(ask, stream=False))[0]
        for position, token in enumerate(probe.tokens):
            earlier = "".join(probe.tokens[:position])
            if position >= 3 and token.strip() and token != EOS and token not in earlier:
                return ask, position, probe
    raise AssertionError("no prompt gave a greedy answer long enough for a stop sequence")


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_anthropic_messages_with_a_stop_sequence_record_what_vllm_answers_directly(
    stack: Stack, vllm: Vllm, stream: bool
) -> None:
    unstopped, stop_at, probe = _stop_sequence_request(vllm)
    stop = probe.tokens[stop_at]
    key = start_session(stack, "engine-messages")
    ask = unstopped | {"stop_sequences": [stop]}
    message, started = message_through(stack, key, ask, stream)
    alone = direct(vllm, translated(ask, stream))[0]
    [interaction] = end_and_read(stack, key)
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    assert (alone.finish_reason, alone.stop_reason) == ("stop", stop)
    # The stop string's token is sampled and recorded; its text reaches nobody.
    assert probe.token_ids is not None
    assert interaction.output_token_ids == probe.token_ids[: stop_at + 1]
    [block] = message.content
    assert block.type == "text" and not block.text.endswith(stop)
    assert block.text == interaction.output["content"] == alone.content
    assert interaction.interaction_id == message.id and message.id.startswith("msg_")
    assert interaction.messages[0] == {"role": "system", "content": "Be brief."}
    assert_same_as_vllm_alone(interaction, alone)
    # What the client was told of the tokens is what was recorded.
    assert message.model == MODEL
    assert message.usage.output_tokens == len(interaction.output_token_ids)
    assert message.usage.input_tokens == len(interaction.prompt_token_ids)
    if started is not None:
        # message_start already names the served model and the prompt's length.
        assert started.model == MODEL
        assert started.usage.input_tokens == len(interaction.prompt_token_ids)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_an_anthropic_forced_tool_call_stops_for_tool_use_on_vllm(
    stack: Stack, vllm: Vllm, stream: bool
) -> None:
    key = start_session(stack, "engine-messages-tool")
    ask = {
        "model": MODEL,
        "max_tokens": 32,
        "temperature": 0,
        "tools": [ANTHROPIC_TOOL],
        "tool_choice": {"type": "tool", "name": "set_flag"},
        "messages": [{"role": "user", "content": "Set the flag."}],
    }
    message, _ = message_through(stack, key, ask, stream)
    alone = direct(vllm, translated(ask, stream))[0]
    [interaction] = end_and_read(stack, key)
    # vLLM ends a named tool_choice with finish_reason "stop"; Anthropic says tool_use.
    assert alone.finish_reason == "stop" and interaction.finish_reason == "stop"
    assert message.stop_reason == "tool_use" and message.stop_sequence is None
    [tool_use] = [block for block in message.content if block.type == "tool_use"]
    assert tool_use.name == "set_flag" and tool_use.input in ({"on": True}, {"on": False})
    [recorded] = interaction.output["tool_calls"]
    assert recorded["id"] == tool_use.id and recorded["function"]["name"] == "set_flag"
    assert json.loads(recorded["function"]["arguments"]) == tool_use.input
    assert interaction.tools == translated(ask, stream)["tools"]
    assert_same_as_vllm_alone(interaction, alone)
    assert interaction.output_token_ids[-1] == vllm.tokenizer.token_to_id(EOS)
