"""Anthropic Messages ↔ chat completions, without a network: the chat body a Messages request
becomes, the Message a chat completion becomes, the events chat chunks become, error shapes."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from services.gateway.messages_translate import (
    MESSAGES_PATH,
    TOOL_ERROR_PREFIX,
    MessageStream,
    error_body,
    error_event,
    message_from_completion,
    new_message_id,
    parse_request,
    stop_reason,
)
from services.runtime.errors import InvalidRequest
from tests.gateway.anthropic_shapes import BASH_TOOL, REMINDER, first_turn, tool_result_turn


def parse(body: dict[str, Any]) -> Any:
    return parse_request(orjson.dumps(body))


def events(raw: list[bytes]) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each SSE event; the name always equals the data's type."""
    out = []
    for event in raw:
        head, data = event.decode().removesuffix("\n\n").split("\n")
        name = head.removeprefix("event: ")
        payload = orjson.loads(data.removeprefix("data: "))
        assert payload["type"] == name
        out.append((name, payload))
    return out


def test_a_claude_code_request_becomes_the_chat_body_the_upstream_is_sent() -> None:
    call = parse(first_turn("qwen3", "list the files"))
    assert call.stream is True and call.model == "qwen3"
    chat = call.chat
    assert chat["model"] == "qwen3" and chat["max_tokens"] == 32000 and chat["temperature"] == 1
    assert chat["messages"] == [
        {
            "role": "system",
            "content": "You are Claude Code, Anthropic's official CLI for Claude.\n"
            "You are an interactive CLI tool that helps users with software engineering tasks.",
        },
        {"role": "user", "content": f"{REMINDER}\nlist the files"},
    ]
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "Bash",
                "parameters": BASH_TOOL["input_schema"],
                "description": BASH_TOOL["description"],
            },
        }
    ]
    assert chat["user"] == "user_3f2a_account__session_9c1e"
    assert "stream" not in chat and "system" not in chat and "metadata" not in chat


def test_tool_use_and_tool_result_become_tool_calls_and_a_tool_message_in_order() -> None:
    tool_use = {"type": "tool_use", "id": "call_1", "name": "Bash", "input": {"command": "ls"}}
    chat = parse(tool_result_turn("m", "list", tool_use, "a.txt\nb.txt")).chat
    assert chat["messages"][2:] == [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "Bash", "arguments": '{"command":"ls"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "a.txt\nb.txt"},
        {"role": "user", "content": REMINDER},
    ]


def test_content_blocks_images_thinking_and_tool_result_lists() -> None:
    body = {
        "model": "m",
        "max_tokens": 10,
        "system": "Be brief.",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is this?"},
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/png", "data": "iVBOR"},
                    },
                ],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "sig"},
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "t1", "name": "zoom", "input": {}},
                    {"type": "tool_use", "id": "t2", "name": "crop", "input": {"x": 1}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "content": [
                            {"type": "text", "text": "zoomed"},
                            {"type": "image", "source": {"type": "url", "url": "http://i/x.png"}},
                        ],
                    },
                    {"type": "tool_result", "tool_use_id": "t2", "is_error": True},
                ],
            },
        ],
    }
    messages = parse(body).chat["messages"]
    assert messages[0] == {"role": "system", "content": "Be brief."}
    assert messages[1]["content"] == [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBOR"}},
    ]
    # Earlier thinking is dropped; text and both calls stay, in order.
    assert messages[2]["content"] == "Let me look."
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["t1", "t2"]
    assert messages[3] == {"role": "tool", "tool_call_id": "t1", "content": "zoomed"}
    # An error result with no content still tells the model it failed.
    assert messages[4] == {"role": "tool", "tool_call_id": "t2", "content": "Error"}
    # The image a tool returned follows the tool messages as a user message.
    assert messages[5] == {
        "role": "user",
        "content": [{"type": "image_url", "image_url": {"url": "http://i/x.png"}}],
    }


def test_a_tool_result_marked_is_error_reaches_the_model_as_an_error() -> None:
    tool_use = {"type": "tool_use", "id": "call_1", "name": "Bash", "input": {"command": "ls"}}
    body = tool_result_turn("m", "list", tool_use, "ls: cannot open '.': Permission denied")
    body["messages"][-1]["content"][0]["is_error"] = True
    tool = parse(body).chat["messages"][3]
    assert tool == {
        "role": "tool",
        "tool_call_id": "call_1",
        "content": TOOL_ERROR_PREFIX + "ls: cannot open '.': Permission denied",
    }
    assert TOOL_ERROR_PREFIX == "Error: "
    # is_error false (or absent) leaves the content as it is.
    body["messages"][-1]["content"][0]["is_error"] = False
    assert parse(body).chat["messages"][3]["content"] == "ls: cannot open '.': Permission denied"
    body["messages"][-1]["content"][0]["is_error"] = "yes"
    with pytest.raises(InvalidRequest) as raised:
        parse(body)
    assert "`is_error` must be true or false" in raised.value.message


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "auto"}, ("auto", None)),
        ({"type": "any"}, ("required", None)),
        ({"type": "none"}, ("none", None)),
        (
            {"type": "tool", "name": "Bash"},
            ({"type": "function", "function": {"name": "Bash"}}, None),
        ),
        ({"type": "auto", "disable_parallel_tool_use": True}, ("auto", False)),
    ],
)
def test_tool_choice_maps_onto_chat(choice: dict[str, Any], expected: tuple[Any, Any]) -> None:
    body = first_turn("m", "x") | {"tool_choice": choice}
    chat = parse(body).chat
    assert chat["tool_choice"] == expected[0]
    assert chat.get("parallel_tool_calls") == expected[1]


def test_sampling_fields_and_stop_sequences() -> None:
    body = first_turn("m", "x") | {"top_p": 0.9, "top_k": 20, "stop_sequences": ["\n\nHuman:"]}
    call = parse(body)
    assert (call.chat["top_p"], call.chat["top_k"]) == (0.9, 20)
    assert call.chat["stop"] == ["\n\nHuman:"] and call.stop_sequences == ("\n\nHuman:",)


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"max_tokens": None}, "`max_tokens` is required"),
        ({"max_tokens": 0}, "`max_tokens` is required"),
        ({"model": ""}, "`model` is required"),
        ({"messages": []}, "`messages` must be a non-empty list"),
        ({"messages": [{"role": "system", "content": "x"}]}, "user or assistant"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content must be"),
        ({"messages": [{"role": "user", "content": [{"type": "document"}]}]}, "'document'"),
        ({"system": [{"type": "image"}]}, "system[0] must be a text block"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tool"),
        ({"tools": [{"name": "x"}]}, "input_schema"),
        ({"tool_choice": {"type": "sometimes"}}, "`tool_choice` must be"),
        ({"stream": "yes"}, "`stream` must be true or false"),
        ({"stop_sequences": "END"}, "`stop_sequences` must be a list"),
        ({"temperature": "hot"}, "`temperature` must be a number"),
    ],
)
def test_malformed_requests_are_invalid_saying_what_is_wrong(
    change: dict[str, Any], says: str
) -> None:
    body = {k: v for k, v in (first_turn("m", "x") | change).items() if v is not None}
    with pytest.raises(InvalidRequest) as raised:
        parse(body)
    assert says in raised.value.message


def test_a_body_that_is_not_a_json_object_is_invalid() -> None:
    for raw in (b"", b"[1]", b"{oops"):
        with pytest.raises(InvalidRequest):
            parse_request(raw)


def test_a_chat_completion_becomes_a_message() -> None:
    completion = {
        "id": "chatcmpl-1",
        "model": "served-model",
        "choices": [
            {
                "index": 0,
                "finish_reason": "tool_calls",
                "message": {
                    "role": "assistant",
                    "reasoning_content": "I should run ls.",
                    "content": "Running it.",
                    "tool_calls": [
                        {
                            "id": "call_9",
                            "type": "function",
                            "function": {"name": "Bash", "arguments": '{"command": "ls"}'},
                        }
                    ],
                },
            }
        ],
        "usage": {
            "prompt_tokens": 120,
            "completion_tokens": 17,
            "total_tokens": 137,
            "prompt_tokens_details": {"cached_tokens": 100},
        },
    }
    message = message_from_completion(completion, message_id="msg_1", model="asked")
    assert message == {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "served-model",
        "content": [
            {"type": "thinking", "thinking": "I should run ls.", "signature": ""},
            {"type": "text", "text": "Running it."},
            {"type": "tool_use", "id": "call_9", "name": "Bash", "input": {"command": "ls"}},
        ],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {
            "input_tokens": 20,
            "output_tokens": 17,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 100,
        },
    }


def test_stop_reasons_and_the_matched_stop_sequence() -> None:
    assert stop_reason("stop", None, ()) == ("end_turn", None)
    assert stop_reason("length", None, ()) == ("max_tokens", None)
    assert stop_reason("tool_calls", None, ()) == ("tool_use", None)
    assert stop_reason("content_filter", None, ()) == ("refusal", None)
    # vLLM names the stop string it matched (an int is a stop token id: the end of the turn).
    assert stop_reason("stop", "END", ("END",)) == ("stop_sequence", "END")
    assert stop_reason("stop", 151645, ("END",)) == ("end_turn", None)


def test_an_answer_with_a_tool_call_stops_for_tool_use_whatever_the_chat_finish() -> None:
    # A named (forced) tool_choice: vLLM and OpenAI finish with "stop", not "tool_calls".
    assert stop_reason("stop", None, (), tool_used=True) == ("tool_use", None)
    assert stop_reason("tool_calls", None, (), tool_used=True) == ("tool_use", None)
    # A matched stop sequence and the length limit still say what ended the answer.
    assert stop_reason("stop", "END", ("END",), tool_used=True) == ("stop_sequence", "END")
    assert stop_reason("length", None, (), tool_used=True) == ("max_tokens", None)


def _forced_call_completion() -> dict[str, Any]:
    """What vLLM 0.32 answers to a named tool_choice (content "", finish_reason "stop")."""
    call = {
        "id": "chatcmpl-tool-1",
        "type": "function",
        "function": {"name": "set_flag", "arguments": '{"on": true}'},
    }
    message = {"role": "assistant", "content": "", "tool_calls": [call]}
    choice = {"index": 0, "message": message, "finish_reason": "stop", "stop_reason": None}
    return {"id": "chatcmpl-1", "model": "tiny", "choices": [choice]}


def test_a_forced_tool_call_is_a_tool_use_message() -> None:
    message = message_from_completion(_forced_call_completion(), message_id="msg_1", model="m")
    assert message["content"] == [
        {"type": "tool_use", "id": "chatcmpl-tool-1", "name": "set_flag", "input": {"on": True}}
    ]
    assert (message["stop_reason"], message["stop_sequence"]) == ("tool_use", None)
    # The same finish without a tool call is the end of the turn.
    plain = _forced_call_completion()
    plain["choices"][0]["message"] = {"role": "assistant", "content": "hi"}
    assert message_from_completion(plain, message_id="m", model="m")["stop_reason"] == "end_turn"


def test_a_streamed_forced_tool_call_stops_for_tool_use() -> None:
    stream = MessageStream(message_id="msg_2", model="m")
    out = stream.start([_chunk({"role": "assistant", "content": ""})])
    fragment = {"index": 0, "id": "t", "type": "function", "function": {"name": "set_flag"}}
    out += stream.feed(_chunk({"tool_calls": [fragment]}))
    out += stream.feed(_chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}))
    out += stream.feed(_chunk({}, "stop"))
    seen = events(out + stream.finish())
    assert seen[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert stream.message()["stop_reason"] == "tool_use"


def test_message_start_names_the_served_model_and_the_prompt_length_of_the_first_batch() -> None:
    stream = MessageStream(message_id="msg_3", model="default")
    first = [_chunk({"role": "assistant", "content": ""}), _chunk({"content": "Hi"})]
    seen = events(stream.start(first, input_tokens=42))
    assert [name for name, _ in seen] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
    ]
    start = seen[0][1]["message"]
    assert start["model"] == "served" and stream.message()["model"] == "served"
    assert start["usage"] == {
        "input_tokens": 42,
        "output_tokens": 0,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }
    # The model the record names wins (a first batch that came with the record); nothing known:
    # the asked name and 0.
    recorded = MessageStream(message_id="msg_4", model="default")
    assert events(recorded.start([], model="real-id"))[0][1]["message"]["model"] == "real-id"
    unknown = events(MessageStream(message_id="msg_5", model="default").start())[0][1]
    assert unknown["message"]["model"] == "default"
    assert unknown["message"]["usage"]["input_tokens"] == 0


def _chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return {"id": "chatcmpl-1", "model": "served", "choices": [choice], **extra}


def test_streamed_text_and_a_tool_call_become_anthropic_events_block_by_block() -> None:
    stream = MessageStream(message_id="msg_7", model="asked")
    out = stream.start()
    chunks = [
        _chunk({"role": "assistant", "content": ""}),
        _chunk({"reasoning_content": "think"}),
        _chunk({"content": "Hel"}),
        _chunk({"content": "lo"}),
        _chunk(
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "Bash", "arguments": '{"comm'},
                    }
                ]
            }
        ),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": 'and": "ls"}'}}]}),
        _chunk({}, "tool_calls"),
        {"id": "chatcmpl-1", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 6}},
    ]
    for chunk in chunks:
        out += stream.feed(chunk)
    out += stream.finish()
    seen = events(out)
    assert [name for name, _ in seen] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = seen[0][1]["message"]
    assert start["id"] == "msg_7" and start["content"] == [] and start["stop_reason"] is None
    assert seen[2][1]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert seen[3][1]["delta"] == {"type": "thinking_delta", "thinking": "think"}
    assert seen[5][1] == {
        "type": "content_block_start",
        "index": 1,
        "content_block": {"type": "text", "text": ""},
    }
    assert [seen[i][1]["delta"]["text"] for i in (6, 7)] == ["Hel", "lo"]
    assert seen[9][1]["content_block"] == {
        "type": "tool_use",
        "id": "call_1",
        "name": "Bash",
        "input": {},
    }
    partial = [seen[i][1]["delta"] for i in (10, 11)]
    assert partial == [
        {"type": "input_json_delta", "partial_json": '{"comm'},
        {"type": "input_json_delta", "partial_json": 'and": "ls"}'},
    ]
    assert seen[12][1]["index"] == 2
    assert seen[13][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert seen[13][1]["usage"]["input_tokens"] == 9 and seen[13][1]["usage"]["output_tokens"] == 6
    message = stream.message()
    assert message["model"] == "served"
    assert message["content"] == [
        {"type": "thinking", "thinking": "think", "signature": ""},
        {"type": "text", "text": "Hello"},
        {"type": "tool_use", "id": "call_1", "name": "Bash", "input": {"command": "ls"}},
    ]


def test_an_empty_answer_streams_no_block_and_a_stop_sequence_is_named() -> None:
    stream = MessageStream(message_id="msg_8", model="m", stop_sequences=("END",))
    out = stream.start() + stream.feed(_chunk({}, "stop", usage=None))
    out += stream.feed(
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop", "stop_reason": "END"}]}
    )
    seen = events(out + stream.finish())
    assert [name for name, _ in seen] == ["message_start", "ping", "message_delta", "message_stop"]
    assert seen[2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    assert stream.message()["content"] == []


def test_two_parallel_tool_calls_are_two_tool_use_blocks() -> None:
    stream = MessageStream(message_id="msg_9", model="m")
    fragments = [
        {"index": 0, "id": "a", "function": {"name": "f", "arguments": "{}"}},
        {"index": 1, "id": "b", "function": {"name": "g", "arguments": '{"x": 1}'}},
    ]
    out = stream.feed(_chunk({"tool_calls": fragments}, "tool_calls"))
    seen = events(out + stream.finish())
    starts = [data for name, data in seen if name == "content_block_start"]
    assert [(s["index"], s["content_block"]["id"]) for s in starts] == [(0, "a"), (1, "b")]
    tool_uses = stream.message()["content"]
    assert [(t["name"], t["input"]) for t in tool_uses] == [("f", {}), ("g", {"x": 1})]


def test_errors_take_anthropics_shape_and_type_by_status() -> None:
    types = {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        413: "request_too_large",
        429: "rate_limit_error",
        500: "api_error",
        502: "api_error",
        503: "overloaded_error",
        504: "api_error",
    }
    for status, kind in types.items():
        assert error_body(status, "what to do") == {
            "type": "error",
            "error": {"type": kind, "message": "what to do"},
        }
    assert error_body(400, "m", "invalid_session_id")["error"]["code"] == "invalid_session_id"
    ((name, data),) = events([error_event(503, "busy", "episode_not_active")])
    assert name == "error"
    assert data["error"] == {
        "type": "overloaded_error",
        "message": "busy",
        "code": "episode_not_active",
    }


def test_which_paths_answer_in_anthropics_shape() -> None:
    for path in (
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/sessions/s-1/v1/messages",
        "/rollout/ro-1/attempt/at-1/v1/messages",
    ):
        assert MESSAGES_PATH.fullmatch(path), path
    for path in ("/v1/chat/completions", "/v1/messagesx", "/messages", "/sessions/s/v1/models"):
        assert not MESSAGES_PATH.fullmatch(path), path


def test_message_ids_look_like_anthropics_and_do_not_repeat() -> None:
    ids = {new_message_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(i.startswith("msg_") and len(i) == 28 for i in ids)
