"""The adapters, the SSE parser, the upstream request and the error mapping, without I/O."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
import structlog
from multidict import CIMultiDict, CIMultiDictProxy

from services.runtime.errors import InvalidRequest, TooManyRequests, UpstreamError
from services.worker.adapters import adapter_for
from services.worker.settings import normalize_base_url
from services.worker.turn import (
    ClientAsk,
    TurnAccumulator,
    TurnTiming,
    client_chunk,
    client_completion,
)
from services.worker.turns import _parse_chunk
from services.worker.upstream import (
    SseParser,
    build_upstream_request,
    client_request,
    error_for_status,
    parse_client_body,
)

TIMING = TurnTiming(started_at_unix_s=1_700_000_000.0, latency_s=1.5, ttft_s=0.25)
HEAD = {"id": "chatcmpl-abc", "object": "chat.completion.chunk", "created": 1, "model": "qwen"}


def lp(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": []}


def chunk(
    delta: dict[str, Any],
    *,
    logprobs: list[dict[str, Any]] | None = None,
    finish: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0,
        "delta": delta,
        "logprobs": {"content": logprobs, "refusal": None} if logprobs is not None else None,
        "finish_reason": finish,
    }
    choice.update(extra.pop("choice", {}))
    return {**HEAD, "choices": [choice], "usage": None, **extra}


# What vLLM streams with return_token_ids and logprobs: prompt ids on the first chunk, the ids
# of each delta on its chunk, one chunk with two tokens, a special token with empty text.
VLLM_STREAM = [
    chunk(
        {"role": "assistant", "content": ""}, prompt_token_ids=[1, 2, 3], choice={"token_ids": []}
    ),
    chunk({"content": "Hel"}, logprobs=[lp("Hel", -0.1)], choice={"token_ids": [10]}),
    chunk(
        {"content": "lo wor"},
        logprobs=[lp("lo", -0.2), lp(" wor", -0.3)],
        choice={"token_ids": [11, 12]},
    ),
    chunk({"content": ""}, logprobs=[lp("", -0.4)], choice={"token_ids": [13]}),
    chunk({"content": "ld"}, logprobs=[lp("ld", -0.5)], choice={"token_ids": [14]}),
    chunk({}, finish="stop", choice={"token_ids": []}),
    {
        **HEAD,
        "choices": [],
        "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8},
    },
]

# What a hosted OpenAI-compatible API streams: logprobs, no ids, a tool call in fragments.
OPENAI_TOOL_STREAM = [
    chunk({"role": "assistant", "content": None}),
    chunk(
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "search", "arguments": ""},
                }
            ]
        },
        logprobs=[lp("<tc>", -0.01)],
    ),
    chunk(
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"q":'}}]},
        logprobs=[lp('{"q":', -0.02)],
    ),
    chunk(
        {"tool_calls": [{"index": 0, "function": {"arguments": ' "x"}'}}]},
        logprobs=[lp(' "x"}', -0.03)],
    ),
    chunk(
        {
            "tool_calls": [
                {
                    "index": 1,
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "open", "arguments": "{}"},
                }
            ]
        },
        logprobs=[lp("{}", -0.04)],
    ),
    chunk({}, finish="tool_calls"),
    {
        **HEAD,
        "choices": None,
        "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13},
    },
]

REASONING_STREAM = [
    chunk({"role": "assistant", "content": ""}),
    chunk({"reasoning_content": "Think"}, logprobs=[lp("Think", -1.0)]),
    chunk({"reasoning": " more"}, logprobs=[lp(" more", -1.1)]),
    chunk({"content": "Answer"}, logprobs=[lp("Answer", -0.9)]),
    chunk({}, finish="stop"),
]


def run(kind: str, chunks: list[dict[str, Any]]) -> Any:
    adapter = adapter_for(kind)
    acc = TurnAccumulator()
    for c in chunks:
        adapter.read_chunk(orjson.loads(orjson.dumps(c)), acc)
    return acc.result(kind=adapter.kind, timing=TIMING)


def test_vllm_stream_gives_exact_ids_and_logprobs_including_multi_token_and_empty_tokens() -> None:
    record = run("vllm", VLLM_STREAM)
    assert record.prompt_token_ids == [1, 2, 3]
    assert record.output_token_ids == [10, 11, 12, 13, 14]
    assert record.output_logprobs == [-0.1, -0.2, -0.3, -0.4, -0.5]
    assert record.exact_tokens is True
    assert record.length_mismatch is False
    assert record.finish_reason == "stop"
    assert record.interaction_id == "chatcmpl-abc"
    assert record.upstream_model == "qwen"
    assert record.upstream_kind == "vllm"
    assert orjson.loads(record.assistant_message_json) == {
        "role": "assistant",
        "content": "Hello world",
    }
    assert orjson.loads(record.usage_json)["total_tokens"] == 8
    assert (record.latency_s, record.ttft_s) == (1.5, 0.25)


def test_vllm_prompt_ids_on_the_choice_are_read_too() -> None:
    stream = [
        chunk(
            {"content": "a"},
            logprobs=[lp("a", -0.1)],
            choice={"prompt_token_ids": [7, 8], "token_ids": [5]},
        ),
        chunk({}, finish="stop"),
    ]
    record = run("vllm", stream)
    assert record.prompt_token_ids == [7, 8]
    assert record.output_token_ids == [5]


def test_a_logprob_count_that_differs_from_the_ids_is_flagged_not_padded() -> None:
    stream = [
        chunk({"content": "ab"}, logprobs=[lp("ab", -0.1)], choice={"token_ids": [1, 2]}),
        chunk({}, finish="stop"),
    ]
    record = run("vllm", stream)
    assert record.length_mismatch is True
    assert record.output_token_ids == [1, 2]
    assert record.output_logprobs == [-0.1]


def test_openai_adapter_ignores_ids_and_is_never_exact() -> None:
    record = run("openai", VLLM_STREAM)
    assert record.exact_tokens is False
    assert record.output_token_ids == []
    assert record.prompt_token_ids == []
    assert record.length_mismatch is False
    assert len(record.output_logprobs) == 5


def test_tool_call_fragments_are_joined_by_index() -> None:
    record = run("openai", OPENAI_TOOL_STREAM)
    message = orjson.loads(record.assistant_message_json)
    assert message == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "search", "arguments": '{"q": "x"}'},
            },
            {"id": "call_2", "type": "function", "function": {"name": "open", "arguments": "{}"}},
        ],
    }
    assert record.finish_reason == "tool_calls"
    assert record.output_logprobs == [-0.01, -0.02, -0.03, -0.04]
    assert orjson.loads(record.usage_json)["total_tokens"] == 13


def test_reasoning_deltas_under_either_name_are_recorded_apart_from_content() -> None:
    record = run("vllm", REASONING_STREAM)
    message = orjson.loads(record.assistant_message_json)
    assert message == {"role": "assistant", "content": "Answer", "reasoning_content": "Think more"}
    assert record.exact_tokens is False  # no ids came: the upstream did not give them
    assert orjson.loads(record.usage_json) == {}


def test_non_streaming_vllm_completion() -> None:
    body = {
        "id": "chatcmpl-x",
        "object": "chat.completion",
        "model": "qwen",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hi", "reasoning": "hm"},
                "logprobs": {"content": [lp("H", -0.5), lp("i", -0.6)]},
                "finish_reason": "length",
                "token_ids": [4, 5],
            }
        ],
        "usage": {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4},
        "prompt_token_ids": [1, 2],
    }
    adapter = adapter_for("vllm")
    acc = TurnAccumulator()
    adapter.read_completion(body, acc)
    record = acc.result(kind="vllm", timing=TIMING)
    assert record.output_token_ids == [4, 5]
    assert record.prompt_token_ids == [1, 2]
    assert record.output_logprobs == [-0.5, -0.6]
    assert record.exact_tokens and not record.length_mismatch
    assert record.finish_reason == "length"
    assert orjson.loads(record.assistant_message_json) == {
        "role": "assistant",
        "content": "Hi",
        "reasoning_content": "hm",
    }


def test_only_choice_zero_is_recorded() -> None:
    two = {
        **HEAD,
        "choices": [
            {"index": 1, "delta": {"content": "other"}, "logprobs": {"content": [lp("o", -2.0)]}},
            {"index": 0, "delta": {"content": "mine"}, "logprobs": {"content": [lp("m", -1.0)]}},
        ],
    }
    record = run("openai", [two, chunk({}, finish="stop")])
    assert orjson.loads(record.assistant_message_json)["content"] == "mine"
    assert record.output_logprobs == [-1.0]


NOTHING = ClientAsk(logprobs=False, token_ids=False, usage=False)
EVERYTHING = ClientAsk(logprobs=True, token_ids=True, usage=True)


def test_client_chunk_strips_what_the_client_did_not_ask_for() -> None:
    first = orjson.loads(orjson.dumps(VLLM_STREAM[1]))
    first["prompt_token_ids"] = [1]
    view = client_chunk(first, NOTHING)
    assert view is not None
    assert "prompt_token_ids" not in view
    assert view["choices"][0]["logprobs"] is None
    assert "token_ids" not in view["choices"][0]
    assert view["choices"][0]["delta"] == {"content": "Hel"}
    assert client_chunk(orjson.loads(orjson.dumps(VLLM_STREAM[-1])), NOTHING) is None
    assert client_chunk(orjson.loads(orjson.dumps(OPENAI_TOOL_STREAM[-1])), NOTHING) is None


def test_client_chunk_keeps_everything_asked_for() -> None:
    original = orjson.loads(orjson.dumps(VLLM_STREAM[2]))
    assert client_chunk(orjson.loads(orjson.dumps(original)), EVERYTHING) == original
    usage = orjson.loads(orjson.dumps(VLLM_STREAM[-1]))
    assert client_chunk(usage, EVERYTHING) == VLLM_STREAM[-1]


def test_client_completion_strips_ids_and_logprobs() -> None:
    body = {
        "id": "x",
        "prompt_token_ids": [1],
        "choices": [
            {"index": 0, "message": {"content": "a"}, "logprobs": {"content": []}, "token_ids": [2]}
        ],
    }
    assert client_completion(body, NOTHING) == {
        "id": "x",
        "choices": [{"index": 0, "message": {"content": "a"}, "logprobs": None}],
    }


def test_sse_parser_handles_split_reads_crlf_comments_and_several_events_per_read() -> None:
    parser = SseParser()
    assert parser.feed(b'data: {"a":') == []
    assert parser.feed(b'1}\n\n: keep-alive\n\ndata: {"b":2}\r\n\r\ndata: [DO') == [
        b'{"a":1}',
        b'{"b":2}',
    ]
    assert parser.feed(b"NE]\n\n") == [b"[DONE]"]
    assert parser.feed(b"data: tail") == []
    assert parser.close() == [b"tail"]


def test_sse_parser_gives_the_same_payloads_however_the_stream_is_cut() -> None:
    big = b'{"prompt_token_ids":[' + b",".join(b"%d" % i for i in range(12000)) + b"]}"
    stream = (
        b"data: " + big + b"\n\n: ping\r\n\r\ndata:nospace\r\n\r\n"
        b"data: two\ndata: lines\n\ndata: [DONE]\n\n"
    )
    want = [big, b"nospace", b"two\nlines", b"[DONE]"]
    for size in (1, 2, 7, 1000, 16384, len(stream)):
        parser = SseParser()
        got = []
        for at in range(0, len(stream), size):
            got += parser.feed(stream[at : at + size])
        assert got == want, size
        assert parser.close() == []
    # Cut once at every byte of the small events' part.
    tail = stream[len(big) + 8 :]
    for cut in range(len(tail) + 1):
        parser = SseParser()
        assert parser.feed(tail[:cut]) + parser.feed(tail[cut:]) == want[1:], cut


def test_upstream_request_strips_the_denylist_and_forces_logprobs() -> None:
    client = client_request(
        request_json=b"",
        params_json=b"",
        body_json=orjson.dumps(
            {
                "model": "m",
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"t": 1}],
                "store": False,
                "session_id": "s",
                "api_key": "sk",
                "base_url": "http://evil",
                "extra_headers": {"X": "1"},
                "metadata": {"a": 1},
                "prompt_cache_key": "k",
                "top_logprobs": 3,
                "temperature": 0.2,
            }
        ),
    )
    request = build_upstream_request(client, stream=True, prepare=adapter_for("vllm").prepare)
    sent = orjson.loads(request.body)
    assert sent == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"t": 1}],
        "temperature": 0.2,
        "logprobs": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    # Tools first: the next turn's request extends this one's bytes.
    assert request.request_json == orjson.dumps(
        {"tools": [{"t": 1}], "messages": [{"role": "user", "content": "hi"}]}
    )
    assert request.ask == NOTHING


def test_what_the_gateway_parsed_is_forwarded_without_parsing_the_messages() -> None:
    request_json = b'{"tools":[{"t":1}],"messages":[{"role":"user","content":"hi"}]}'
    client = client_request(
        body_json=b"",
        request_json=request_json,
        params_json=orjson.dumps({"model": "m", "messages": ["ignored"], "api_key": "sk"}),
    )
    request = build_upstream_request(client, stream=False, prepare=adapter_for("vllm").prepare)
    assert request.body.startswith(request_json[:-1] + b",")
    assert orjson.loads(request.body) == {
        "tools": [{"t": 1}],
        "messages": [{"role": "user", "content": "hi"}],
        "model": "m",
        "logprobs": True,
        "stream": False,
        "return_token_ids": True,
    }
    assert request.request_json == request_json
    assert request.conversation() == ([{"role": "user", "content": "hi"}], [{"t": 1}])


def test_upstream_request_keeps_top_logprobs_when_the_client_asked_for_logprobs() -> None:
    client = client_request(
        request_json=b'{"messages":[]}',
        body_json=b"",
        params_json=orjson.dumps(
            {"logprobs": True, "top_logprobs": 3, "stream_options": {"include_usage": True}}
        ),
    )
    request = build_upstream_request(client, stream=False, prepare=adapter_for("openai").prepare)
    sent = orjson.loads(request.body)
    assert sent == {"messages": [], "logprobs": True, "top_logprobs": 3, "stream": False}
    assert list(orjson.loads(request.body)) == ["messages", "logprobs", "top_logprobs", "stream"]
    assert request.ask == ClientAsk(logprobs=True, token_ids=False, usage=True)


@pytest.mark.parametrize("raw", [b"not json", b"[]", b'{"model": "m"}'])
def test_a_body_that_is_not_a_chat_request_is_invalid(raw: bytes) -> None:
    with pytest.raises(InvalidRequest):
        parse_client_body(raw)


def headers(**values: str) -> CIMultiDictProxy[str]:
    return CIMultiDictProxy(CIMultiDict(values))


def test_error_mapping() -> None:
    url = "http://up/v1/chat/completions"
    body = orjson.dumps({"error": {"message": "model 'x' does not exist"}})
    auth = error_for_status(401, body, headers(), url=url)
    assert isinstance(auth, UpstreamError) and "ROLLGATE_UPSTREAM_API_KEY" in auth.message
    assert isinstance(error_for_status(403, b"", headers(), url=url), UpstreamError)
    missing = error_for_status(404, body, headers(), url=url)
    assert isinstance(missing, UpstreamError) and url not in missing.message
    limited = error_for_status(429, body, headers(**{"Retry-After": "7"}), url=url)
    assert isinstance(limited, TooManyRequests) and limited.retry_after_s == 7.0
    bad = error_for_status(400, body, headers(), url=url)
    assert isinstance(bad, InvalidRequest) and "model 'x' does not exist" in bad.message
    assert isinstance(error_for_status(503, b"<html>", headers(), url=url), UpstreamError)


def test_an_upstream_error_text_reaches_the_client_without_addresses_or_secrets() -> None:
    url = "http://10.1.2.3:8000/v1/chat/completions"
    said = (
        "litellm.APIConnectionError: cannot reach http://10.9.8.7:8001/v1/chat/completions "
        "(vllm-0.internal:8000, 172.16.0.4) with Authorization: Bearer sk-live-0123456789abcdef "
        "for sk-sess-" + "A" * 43 + ": the model is overloaded"
    )
    leaks = ("10.9.8.7", "vllm-0.internal", "172.16.0.4", "sk-live-0123", "sk-sess-AAAA", url)
    for status in (400, 404, 429, 500, 503):
        for body in (orjson.dumps({"error": {"message": said}}), said.encode()):
            with structlog.testing.capture_logs() as logged:
                error = error_for_status(status, body, headers(), url=url)
            assert "the model is overloaded" in error.message, (status, error.message)
            assert "<address>" in error.message
            assert not [leak for leak in leaks if leak in error.message], (status, error.message)
            # The operator's log keeps what the upstream said, and the URL called.
            assert any(e.get("url") == url and "10.9.8.7" in e["message"] for e in logged)
    # The same text, streamed after the first token (vLLM's `data: {"error": ...}`).
    with pytest.raises(UpstreamError) as failed:
        _parse_chunk(orjson.dumps({"error": {"message": said}}))
    assert "the model is overloaded" in failed.value.message
    assert not [leak for leak in leaks if leak in failed.value.message], failed.value.message


def test_a_404_logs_the_url_called_and_points_at_the_documented_base_url_and_model() -> None:
    url = "https://open.bigmodel.cn/api/paas/v4/chat/completions"
    body = orjson.dumps({"error": {"message": "model glm-x not found"}})
    with structlog.testing.capture_logs() as logged:
        error = error_for_status(404, body, headers(), url=url)
    assert isinstance(error, UpstreamError) and error.code == "upstream_not_found"
    # The URL is for the operator (the worker's log), never for the client.
    assert url not in error.message and "the worker's log names the URL" in error.message
    assert [e["url"] for e in logged if e["event"] == "upstream_not_found"] == [url]
    assert "model glm-x not found" in error.message
    assert "base URL the provider documents" in error.message
    assert "model id" in error.message
    # The rule of normalize_base_url: a base with its own path is never given /v1.
    assert "lacks /v1" not in error.message
    assert "used exactly as given" in error.message


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("http://h:8000", "http://h:8000/v1"),
        ("http://h:8000/v1/", "http://h:8000/v1"),
        ("https://api.example.com/openai/v1", "https://api.example.com/openai/v1"),
    ],
)
def test_base_url_gets_v1_once(raw: str, expected: str) -> None:
    assert normalize_base_url(raw) == expected


@pytest.mark.parametrize(
    "raw", ["h:8000", "http://h/v1?x=1", "http://h/v1/v1", "http://h/v1/chat/completions"]
)
def test_bad_base_urls_are_refused(raw: str) -> None:
    with pytest.raises(ValueError):
        normalize_base_url(raw)


def _wire_chunks(name: str) -> list[dict[str, Any]]:
    path = Path(__file__).resolve().parent / "vllm_wire" / name
    lines = path.read_bytes().splitlines()
    return [orjson.loads(line[6:]) for line in lines if line.startswith(b"data: {")]


# Chunks the one-pass reading must leave to the general one (or read the same way).
ODD_STREAM = [
    chunk({"role": "assistant", "content": ""}, prompt_token_ids=[7, 8]),
    chunk({"content": "a"}, logprobs=[lp("a", -0.1)], choice={"token_ids": [20]}),
    chunk({"content": "b", "tool_calls": None}, logprobs=[lp("b", -0.2)]),
    {**HEAD, "choices": [{"index": 0, "delta": None, "logprobs": None, "finish_reason": None}]},
    {**HEAD, "choices": [{"index": 0, "delta": "text", "logprobs": None, "finish_reason": None}]},
    {**HEAD, "choices": [{"index": 0, "logprobs": {"content": "x"}, "finish_reason": None}]},
    {**HEAD, "choices": [{"index": 1, "delta": {"content": "other"}, "finish_reason": None}]},
    {
        **HEAD,
        "choices": [
            {"index": 0, "delta": {"content": "c"}, "logprobs": None, "finish_reason": None},
            {"index": 1, "delta": {"content": "d"}, "logprobs": None, "finish_reason": None},
        ],
    },
    {**HEAD, "choices": ["not a choice"]},
    chunk({"content": "e"}, logprobs=[lp("e", -0.3), {"token": "no logprob"}], token_ids=[9]),
    chunk({}, finish="length", choice={"token_ids": [21, 22]}),
    {**HEAD, "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3}},
]

STREAMS = {
    "vllm": VLLM_STREAM,
    "tools": OPENAI_TOOL_STREAM,
    "reasoning": REASONING_STREAM,
    "odd": ODD_STREAM,
    "vllm_wire_usage": _wire_chunks("vllm_chat_stream_usage.response.txt"),
    "vllm_wire_eos": _wire_chunks("vllm_chat_eos_stream.response.txt"),
}
ASKS = [
    ClientAsk(logprobs=False, token_ids=False, usage=False),
    ClientAsk(logprobs=True, token_ids=True, usage=True),
    ClientAsk(logprobs=True, token_ids=False, usage=False, only_choice_zero=True),
    ClientAsk(logprobs=False, token_ids=True, usage=True, only_choice_zero=True),
]


def _read(kind: str, stream: list[dict[str, Any]], ask: ClientAsk, *, one_pass: bool) -> Any:
    adapter = adapter_for(kind)
    acc = TurnAccumulator()
    views: list[bytes | None] = []
    taken = 0
    for c in stream:
        c = orjson.loads(orjson.dumps(c))
        if one_pass and acc.take_common(c, ask, token_ids=adapter.reads_token_ids):
            taken += 1
            views.append(orjson.dumps(c))
            continue
        adapter.read_chunk(c, acc)
        view = client_chunk(c, ask)
        views.append(None if view is None else orjson.dumps(view))
    return acc.result(kind=adapter.kind, timing=TIMING), acc.sampled_text(), views, taken


@pytest.mark.parametrize("kind", ["openai", "vllm", "sglang"])
@pytest.mark.parametrize("stream", sorted(STREAMS))
@pytest.mark.parametrize("ask", range(len(ASKS)))
def test_the_one_pass_reading_of_a_common_chunk_records_and_shows_what_the_general_one_does(
    kind: str, stream: str, ask: int
) -> None:
    chunks, client = STREAMS[stream], ASKS[ask]
    general = _read(kind, chunks, client, one_pass=False)
    one_pass = _read(kind, chunks, client, one_pass=True)
    # The same record, the same sampled text, the same bytes for the client, chunk by chunk.
    assert one_pass[:3] == general[:3]
    # And the one pass did read the token chunks of the plain streams (not only fall back).
    if stream.startswith("vllm"):
        assert one_pass[3] >= len(chunks) - 3
    assert general[3] == 0


def test_the_worker_reads_chunks_in_one_pass_for_every_chat_kind() -> None:
    # A kind that read chunks its own way would fall back to the general reading for every
    # chunk: the one-pass reading is taken only where the standard `read_chunk` is.
    from services.worker.openai_compat import OpenAICompatAdapter

    for kind in ("openai", "vllm", "sglang"):
        assert type(adapter_for(kind)).read_chunk is OpenAICompatAdapter.read_chunk
