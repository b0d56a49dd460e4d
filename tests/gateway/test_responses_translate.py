"""Responses → chat completions request translation (services/gateway/responses_translate.py):
the pure functions, without a server."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from services.gateway.responses_translate import chat_body, parse_request
from services.runtime.errors import InvalidRequest

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "strict": True,
}


def translate(body: dict[str, Any], prior: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return chat_body(parse_request(orjson.dumps({"model": "m"} | body)), prior or [])


def test_instructions_become_a_leading_system_message_and_a_string_input_one_user_message() -> None:
    out = translate({"input": "hello", "instructions": "Be brief."})
    assert out == {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hello"},
        ],
    }


def test_developer_items_become_system_messages() -> None:
    out = translate(
        {
            "input": [
                {"role": "developer", "content": "dev rules"},
                {"type": "message", "role": "system", "content": "sys rules"},
                {"role": "user", "content": "hi"},
            ]
        }
    )
    assert out["messages"] == [
        {"role": "system", "content": "dev rules"},
        {"role": "system", "content": "sys rules"},
        {"role": "user", "content": "hi"},
    ]


def test_item_input_with_input_text_parts_is_joined_text_and_images_stay_parts() -> None:
    text_only = translate(
        {
            "input": [
                {
                    "type": "message",
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "part one, "},
                        {"type": "input_text", "text": "part two"},
                    ],
                },
                {
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "earlier answer"}],
                },
            ]
        }
    )
    assert text_only["messages"] == [
        {"role": "user", "content": "part one, part two"},
        {"role": "assistant", "content": "earlier answer"},
    ]
    with_image = translate(
        {
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "what is this?"},
                        {"type": "input_image", "image_url": "data:image/png;base64,AA=="},
                    ],
                }
            ]
        }
    )
    assert with_image["messages"][0]["content"] == [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
    ]


def test_function_calls_join_one_assistant_message_and_outputs_become_tool_messages() -> None:
    out = translate(
        {
            "input": [
                {"role": "user", "content": "weather in Paris and Rome?"},
                {"type": "function_call", "call_id": "c1", "name": "w", "arguments": '{"c":"P"}'},
                {"type": "function_call", "call_id": "c2", "name": "w", "arguments": '{"c":"R"}'},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                {
                    "type": "function_call_output",
                    "call_id": "c2",
                    "output": [{"type": "input_text", "text": "rain"}],
                },
                {"type": "reasoning", "summary": []},
            ]
        }
    )
    assert out["messages"] == [
        {"role": "user", "content": "weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "w", "arguments": '{"c":"P"}'},
                },
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "w", "arguments": '{"c":"R"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
    ]


def test_a_prior_chain_comes_after_the_instructions_and_before_the_input() -> None:
    prior = [
        {"type": "message", "role": "user", "content": "one"},
        {"type": "message", "role": "assistant", "content": "answer one"},
    ]
    out = translate({"input": "two", "instructions": "now"}, prior)
    assert [m["content"] for m in out["messages"]] == ["now", "one", "answer one", "two"]


def test_flat_function_tools_and_tool_choice_take_the_chat_form() -> None:
    out = translate(
        {
            "input": "weather?",
            "tools": [WEATHER_TOOL],
            "tool_choice": {"type": "function", "name": "get_weather"},
        }
    )
    assert out["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city.",
                "parameters": WEATHER_TOOL["parameters"],
                "strict": True,
            },
        }
    ]
    assert out["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert translate({"input": "x", "tool_choice": "required"})["tool_choice"] == "required"
    with pytest.raises(InvalidRequest):
        translate({"input": "x", "tools": [{"type": "web_search"}]})


def test_max_output_tokens_is_max_tokens_and_sampling_fields_pass_through() -> None:
    sampling = {
        "temperature": 0.3,
        "top_p": 0.9,
        "presence_penalty": 0.1,
        "frequency_penalty": 0.2,
        "parallel_tool_calls": False,
        "seed": 7,
    }
    out = translate(
        {
            "input": "x",
            "max_output_tokens": 64,
            "top_logprobs": 2,
            "reasoning": {"effort": "low"},
            "text": {"format": {"type": "json_schema", "name": "s", "schema": {}}},
            "metadata": {"not": "forwarded"},
            "previous_response_id": "resp_x",
            "store": False,
        }
        | sampling
    )
    assert {k: out[k] for k in sampling} == sampling
    assert out["max_tokens"] == 64 and "max_output_tokens" not in out
    assert out["logprobs"] is True and out["top_logprobs"] == 2
    assert out["reasoning_effort"] == "low"
    assert out["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "s", "schema": {}},
    }
    assert not {"metadata", "previous_response_id", "store", "input", "instructions"} & set(out)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"input": 3}, "input"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "instructions": 1}, "instructions"),
        ({"input": [{"type": "function_call", "call_id": "c"}]}, "name"),
        ({"input": [{"role": "tool", "content": "x"}]}, "role"),
        ({"input": [{"type": "message", "role": "user", "content": 5}]}, "content"),
        ({"input": []}, "empty"),
    ],
)
def test_invalid_requests_say_what_is_wrong(body: dict[str, Any], says: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        translate(body)
    assert says in caught.value.message
