"""Contract tests of the SGLang adapters against realistic SGLang answers (reference §D.4), as
pure unit tests; then the mock LLM's SGLang chat emulation and the usage-chunk variants through
a real worker."""

from __future__ import annotations

import itertools
from typing import Any

import orjson
import pytest

from chatml.tokenizer import LocalTokenizer
from rollgate.mock_llm import USAGE_CHOICES, MockLLM
from services.worker.adapters import adapter_for
from services.worker.turn import ClientAsk, TurnAccumulator, TurnTiming, client_chunk
from tests.worker.harness import running_worker
from tests.worker.test_worker_grpc import generate
from tests.worker.tokenizer_file import build_tokenizer

TIMING = TurnTiming(started_at_unix_s=1_700_000_000.0, latency_s=0.5, ttft_s=0.1)
MODEL = "Qwen/Qwen3-8B"
HEAD = {"id": "8c1f0e4b2a", "object": "chat.completion.chunk", "created": 1735000000}


def lp(token: str, logprob: float) -> dict[str, Any]:
    """One SGLang logprob entry (token, bytes, logprob, top_logprobs)."""
    return {"token": token, "bytes": list(token.encode()), "logprob": logprob, "top_logprobs": []}


# ------------------------------------------------------------------ SGLang chat (reasoning parser)

# The raw output was `<think>\n2 plus 2 is 4.\n</think>\n\nIt is 4.<|im_end|>`: the reasoning
# parser moved the thinking to reasoning_content, the logprobs still cover every sampled token.
REASONING_LOGPROBS = [
    lp("<think>", -0.0001),
    lp("\n", -0.01),
    lp("2", -0.2),
    lp(" plus", -0.7),
    lp(" 2", -0.01),
    lp(" is", -0.05),
    lp(" 4", -0.02),
    lp(".", -0.3),
    lp("\n", -0.01),
    lp("</think>", -0.0002),
    lp("\n\n", -0.001),
    lp("It", -0.4),
    lp(" is", -0.1),
    lp(" 4", -0.02),
    lp(".", -0.05),
    lp("<|im_end|>", -0.0003),
]
SGLANG_CHAT_COMPLETION = {
    "id": "8c1f0e4b2a",
    "object": "chat.completion",
    "created": 1735000000,
    "model": MODEL,
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": "It is 4.",
                "reasoning_content": "2 plus 2 is 4.",
                "tool_calls": None,
            },
            "logprobs": {"content": REASONING_LOGPROBS},
            "finish_reason": "stop",
            "matched_stop": 151645,
        }
    ],
    "usage": {
        "prompt_tokens": 14,
        "total_tokens": 30,
        "completion_tokens": 16,
        "prompt_tokens_details": None,
    },
}

# `<tool_call>\n{"name": "search", "arguments": {"query": "weather"}}\n</tool_call>` parsed
# by the tool parser: content is empty, the markup is still in the logprobs.
TOOL_LOGPROBS = [
    lp("<tool_call>", -0.01),
    lp("\n", -0.001),
    lp('{"', -0.002),
    lp("name", -0.001),
    lp('":', -0.001),
    lp(' "', -0.001),
    lp("search", -0.3),
    lp('",', -0.001),
    lp(' "', -0.001),
    lp("arguments", -0.001),
    lp('":', -0.001),
    lp(' {"', -0.01),
    lp("query", -0.2),
    lp('":', -0.001),
    lp(' "', -0.001),
    lp("weather", -0.9),
    lp('"}}\n', -0.01),
    lp("</tool_call>", -0.001),
    lp("<|im_end|>", -0.002),
]
SGLANG_CHAT_TOOL_COMPLETION = {
    **SGLANG_CHAT_COMPLETION,
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": None,
                "reasoning_content": None,
                "tool_calls": [
                    {
                        "id": "call_9b2d0c5e1f",
                        "index": 0,
                        "type": "function",
                        "function": {"name": "search", "arguments": '{"query": "weather"}'},
                    }
                ],
            },
            "logprobs": {"content": TOOL_LOGPROBS},
            "finish_reason": "tool_calls",
            "matched_stop": None,
        }
    ],
    "usage": {"prompt_tokens": 40, "total_tokens": 59, "completion_tokens": 19},
}


def schunk(delta: dict[str, Any], entries: list[dict[str, Any]] | None = None, **choice: Any) -> dict[str, Any]:  # fmt: skip
    """One SGLang chat stream chunk (choice 0, `usage: null`)."""
    body = {
        "index": 0,
        "delta": delta,
        "logprobs": {"content": entries} if entries is not None else None,
        "finish_reason": None,
        "matched_stop": None,
        **choice,
    }
    return {**HEAD, "model": MODEL, "choices": [body], "usage": None}


def sglang_stream(usage_choices: str) -> list[dict[str, Any]]:
    """Reasoning, a content sentence, then a tool call, as SGLang streams them; markup tokens
    come on chunks whose delta shows nothing."""
    usage: dict[str, Any] = {
        **HEAD,
        "model": MODEL,
        "usage": {"prompt_tokens": 40, "completion_tokens": 18, "total_tokens": 58},
    }
    if usage_choices == "empty":
        usage["choices"] = []
    elif usage_choices == "null":
        usage["choices"] = None
    return [
        schunk({"role": "assistant", "content": ""}),
        schunk({"content": None, "reasoning_content": None}, [lp("<think>", -0.0001)]),
        schunk({"reasoning_content": "Check"}, [lp("\n", -0.01), lp("Check", -0.5)]),
        schunk({"reasoning_content": " it."}, [lp(" it", -0.2), lp(".", -0.1)]),
        schunk({}, [lp("\n", -0.01), lp("</think>", -0.0002), lp("\n\n", -0.001)]),
        schunk({"content": "Searching."}, [lp("Searching", -0.6), lp(".", -0.1)]),
        schunk(
            {
                "tool_calls": [
                    {
                        "id": "call_9b2d0c5e1f",
                        "index": 0,
                        "type": "function",
                        "function": {"name": "search", "arguments": ""},
                    }
                ]
            },
            [lp("\n", -0.01), lp("<tool_call>", -0.01), lp('\n{"name": "search"', -0.3)],
        ),
        schunk(
            {"tool_calls": [{"index": 0, "function": {"arguments": '{"query": '}}]},
            [lp(', "arguments": {"query": ', -0.02)],
        ),
        schunk(
            {"tool_calls": [{"index": 0, "function": {"arguments": '"weather"}'}}]},
            [lp(' "weather"', -0.9)],
        ),
        schunk({}, [lp("}}\n", -0.01), lp("</tool_call>", -0.001)]),
        schunk({}, finish_reason="tool_calls"),
        usage,
    ]


def read_stream(kind: str, chunks: list[dict[str, Any]], **options: Any) -> Any:
    adapter = adapter_for(kind, **options)
    acc = TurnAccumulator()
    for c in chunks:
        adapter.read_chunk(orjson.loads(orjson.dumps(c)), acc)
    return acc.result(kind=adapter.kind, timing=TIMING)


def read_completion(adapter: Any, body: dict[str, Any]) -> Any:
    acc = TurnAccumulator()
    adapter.read_completion(orjson.loads(orjson.dumps(body)), acc)
    return acc.result(kind=adapter.kind, timing=TIMING)


def test_sglang_chat_records_every_sampled_logprob_reasoning_markup_included() -> None:
    record = read_completion(adapter_for("sglang"), SGLANG_CHAT_COMPLETION)
    # 16 sampled tokens, while the content "It is 4." is 4 of them: recorded as sampled.
    assert record.output_logprobs == [e["logprob"] for e in REASONING_LOGPROBS]
    assert orjson.loads(record.assistant_message_json) == {
        "role": "assistant",
        "content": "It is 4.",
        "reasoning_content": "2 plus 2 is 4.",
    }
    # No ids in SGLang's chat answer: not exact, and nothing is aligned, padded or flagged.
    assert record.exact_tokens is False and record.output_token_ids == []
    assert record.prompt_token_ids == [] and record.length_mismatch is False
    assert record.finish_reason == "stop" and record.upstream_model == MODEL
    assert orjson.loads(record.usage_json)["completion_tokens"] == 16


def test_sglang_chat_tool_markup_is_in_the_logprobs_and_the_call_in_the_message() -> None:
    record = read_completion(adapter_for("sglang"), SGLANG_CHAT_TOOL_COMPLETION)
    assert len(record.output_logprobs) == len(TOOL_LOGPROBS) == 19
    message = orjson.loads(record.assistant_message_json)
    assert message["content"] is None and "reasoning_content" not in message
    assert message["tool_calls"][0]["function"] == {
        "name": "search",
        "arguments": '{"query": "weather"}',
    }
    assert record.finish_reason == "tool_calls" and not record.exact_tokens


def test_sglang_chat_with_ids_in_the_answer_is_exact() -> None:
    body = orjson.loads(orjson.dumps(SGLANG_CHAT_COMPLETION))
    body["prompt_token_ids"] = list(range(14))
    body["choices"][0]["token_ids"] = list(range(1000, 1016))
    record = read_completion(adapter_for("sglang"), body)
    assert record.exact_tokens and not record.length_mismatch
    assert record.output_token_ids == list(range(1000, 1016))


@pytest.mark.parametrize("usage_choices", USAGE_CHOICES)
def test_sglang_chat_stream_records_markup_logprobs_tool_call_and_usage(usage_choices: str) -> None:
    stream = sglang_stream(usage_choices)
    record = read_stream("sglang", stream)
    expected = [
        e["logprob"]
        for c in stream
        for ch in c.get("choices") or []
        for e in (ch["logprobs"] or {}).get("content", [])
    ]
    assert record.output_logprobs == expected and len(expected) == 17
    message = orjson.loads(record.assistant_message_json)
    assert message["reasoning_content"] == "Check it."
    assert message["content"] == "Searching."
    assert message["tool_calls"] == [
        {
            "id": "call_9b2d0c5e1f",
            "type": "function",
            "function": {"name": "search", "arguments": '{"query": "weather"}'},
        }
    ]
    assert record.finish_reason == "tool_calls" and not record.exact_tokens
    assert orjson.loads(record.usage_json)["total_tokens"] == 58


@pytest.mark.parametrize("usage_choices", USAGE_CHOICES)
def test_the_usage_chunk_reaches_only_a_client_that_asked_whatever_its_choices(
    usage_choices: str,
) -> None:
    usage = sglang_stream(usage_choices)[-1]
    asked = ClientAsk(logprobs=False, token_ids=False, usage=True)
    not_asked = ClientAsk(logprobs=False, token_ids=False, usage=False)
    assert client_chunk(orjson.loads(orjson.dumps(usage)), not_asked) is None
    kept = client_chunk(orjson.loads(orjson.dumps(usage)), asked)
    assert kept is not None and kept["usage"]["total_tokens"] == 58
    markup = client_chunk(orjson.loads(orjson.dumps(sglang_stream(usage_choices)[4])), not_asked)
    assert markup is not None and markup["choices"][0]["logprobs"] is None


# ------------------------------------------------------------------ SGLang native /generate

PROMPT_IDS = [151644, 872, 198, 14990, 151645, 198, 151644, 77091, 198]
# (logprob, id, text) of `<think>\nhm\n</think>\n\nHello there!` then the stop token.
TRIPLES: list[list[Any]] = [
    [-0.0001, 151667, "<think>"],
    [-0.01, 198, "\n"],
    [-1.25, 16790, "hm"],
    [-0.02, 198, "\n"],
    [-0.0002, 151668, "</think>"],
    [-0.001, 271, "\n\n"],
    [-0.4, 9707, "Hello"],
    [-0.3, 1052, " there"],
    [-0.2, 0, "!"],
]
RAW_TEXT = "".join(t[2] for t in TRIPLES)


def generate_body(upto: int, *, finish: dict[str, Any] | None, cumulative: bool = True, start: int = 0) -> dict[str, Any]:  # fmt: skip
    """A /generate answer (or streamed event) after `upto` tokens, as SGLang sends it."""
    shown = TRIPLES[:upto] if cumulative else TRIPLES[start:upto]
    return {
        "text": "".join(t[2] for t in shown),
        "output_ids": [t[1] for t in shown],
        "meta_info": {
            "id": "5d8e2f0a9c",
            "finish_reason": finish,
            "prompt_tokens": len(PROMPT_IDS),
            "weight_version": "default",
            "completion_tokens": upto,
            "cached_tokens": 0,
            "e2e_latency": 0.05,
            "output_token_logprobs": shown,
        },
    }


@pytest.fixture(scope="module")
def generate_adapter(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = build_tokenizer(tmp_path_factory.mktemp("tok"))
    return adapter_for("sglang", sglang_path="generate", tokenizer=LocalTokenizer(str(path)))


def sent(prompt_ids: list[int]) -> bytes:
    return orjson.dumps({"input_ids": prompt_ids, "sampling_params": {}, "return_logprob": True})


def test_generate_answer_gives_the_exact_ids_logprobs_reasoning_and_usage(
    generate_adapter: Any,
) -> None:
    translator = generate_adapter.translator(sent(PROMPT_IDS), MODEL)
    answer = generate_body(len(TRIPLES), finish={"type": "stop", "matched": 151645})
    completion = translator.completion(answer)
    record = read_completion(generate_adapter, completion)
    assert record.prompt_token_ids == PROMPT_IDS
    assert record.output_token_ids == [t[1] for t in TRIPLES]
    assert record.output_logprobs == [t[0] for t in TRIPLES]
    assert record.exact_tokens and not record.length_mismatch
    assert record.finish_reason == "stop"
    assert orjson.loads(record.assistant_message_json) == {
        "role": "assistant",
        "content": "Hello there!",
        "reasoning_content": "hm",
    }
    assert orjson.loads(record.usage_json) == {
        "prompt_tokens": 9,
        "completion_tokens": 9,
        "total_tokens": 18,
    }
    assert completion["choices"][0]["logprobs"]["content"][4]["token"] == "</think>"


def test_generate_length_finish_dict_becomes_length(generate_adapter: Any) -> None:
    translator = generate_adapter.translator(sent(PROMPT_IDS), MODEL)
    answer = generate_body(7, finish={"type": "length", "length": 7})
    record = read_completion(generate_adapter, translator.completion(answer))
    assert record.finish_reason == "length"
    assert record.output_token_ids == [t[1] for t in TRIPLES[:7]]


def test_generate_tool_call_block_becomes_a_tool_call(generate_adapter: Any) -> None:
    call = '<tool_call>\n{"name": "search", "arguments": {"query": "weather"}}\n</tool_call>'
    answer = {
        "text": call,
        "meta_info": {
            "finish_reason": {"type": "stop", "matched": 151645},
            "prompt_tokens": 9,
            "completion_tokens": 2,
            "output_token_logprobs": [[-0.1, 151657, "<tool_call>"], [-0.2, 2000, call[11:]]],
        },
    }
    translator = generate_adapter.translator(sent(PROMPT_IDS), MODEL)
    completion = translator.completion(answer)
    record = read_completion(generate_adapter, completion)
    assert completion["choices"][0]["finish_reason"] == "tool_calls"
    message = orjson.loads(record.assistant_message_json)
    assert message["tool_calls"][0]["function"] == {
        "name": "search",
        "arguments": '{"query":"weather"}',
    }
    assert record.output_token_ids == [151657, 2000] and record.exact_tokens


@pytest.mark.parametrize("cumulative", [True, False], ids=["cumulative", "incremental"])
def test_generate_stream_gives_the_same_record_cumulative_or_incremental(
    generate_adapter: Any, cumulative: bool
) -> None:
    translator = generate_adapter.translator(sent(PROMPT_IDS), MODEL)
    acc = TurnAccumulator()
    client: list[dict[str, Any]] = []
    # Two tokens per event at first, then one: SGLang batches as it decodes.
    bounds = [0, 2, 4, 5, 6, 7, 8, 9]
    for start, upto in itertools.pairwise(bounds):
        finish = {"type": "stop", "matched": 151645} if upto == len(TRIPLES) else None
        event = generate_body(upto, finish=finish, cumulative=cumulative, start=start)
        for chunk in translator.events(orjson.loads(orjson.dumps(event))):
            generate_adapter.read_chunk(chunk, acc)
            client.append(chunk)
    record = acc.result(kind="sglang", timing=TIMING)
    assert record.prompt_token_ids == PROMPT_IDS
    assert record.output_token_ids == [t[1] for t in TRIPLES]
    assert record.output_logprobs == [t[0] for t in TRIPLES]
    assert record.exact_tokens and record.finish_reason == "stop"
    deltas = [c["choices"][0]["delta"] for c in client if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "hm"
    assert "".join(d.get("content", "") for d in deltas) == "Hello there!"
    assert not any("<think>" in d.get("content", "") for d in deltas)
    assert client[-1]["usage"] == {"prompt_tokens": 9, "completion_tokens": 9, "total_tokens": 18}
    assert "".join(d.get("content", "") for d in deltas) + "hm" in RAW_TEXT + "hm"


# ------------------------------------------------------------------ the mock, through a worker

TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]


def body(**fields: Any) -> bytes:
    return orjson.dumps(
        {
            "model": "rollgate-mock",
            "messages": [{"role": "user", "content": "/tool weather please"}],
            "tools": TOOLS,
            "chat_template_kwargs": {"enable_thinking": True},
            **fields,
        }
    )


@pytest.mark.parametrize("stream", [True, False])
async def test_the_mock_speaks_sglang_chat_with_markup_in_the_logprobs(stream: bool) -> None:
    async with (
        MockLLM(port=0, flavor="sglang") as mock,
        running_worker(mock.base_url, kind="sglang") as worker,
    ):
        batches, record = await generate(worker.stub, body(stream=stream, logprobs=True))
    message = orjson.loads(record.assistant_message_json)
    assert "<think>" not in message["reasoning_content"]
    assert message["tool_calls"][0]["function"]["name"] == "search"
    tokens = [
        e["token"]
        for b in batches
        for c in b
        for ch in c.get("choices") or []
        for e in ((ch.get("logprobs") or {}).get("content") or [])
    ]
    for marker in ("<think>", "</think>", "<tool_call>", "</tool_call>"):
        assert marker in tokens
    visible = len(message["reasoning_content"].split()) + 2  # words + two argument fragments
    assert len(record.output_logprobs) == len(tokens) > visible
    assert not record.exact_tokens and not record.length_mismatch


async def test_the_mock_vllm_flavor_keeps_its_shape_without_sglang_markup() -> None:
    async with (
        MockLLM(port=0, flavor="vllm") as mock,
        running_worker(mock.base_url, kind="vllm") as worker,
    ):
        _, record = await generate(worker.stub, body(stream=True))
    assert record.exact_tokens and len(record.output_token_ids) == len(record.output_logprobs)


@pytest.mark.parametrize("usage_choices", USAGE_CHOICES)
async def test_every_usage_chunk_shape_reaches_the_client_and_the_record(
    usage_choices: str,
) -> None:
    async with (
        MockLLM(port=0, flavor="openai", usage_choices=usage_choices) as mock,
        running_worker(mock.base_url, kind="openai") as worker,
    ):
        payload = body(stream=True, stream_options={"include_usage": True})
        batches, record = await generate(worker.stub, payload)
        plain, plain_record = await generate(worker.stub, body(stream=True))
    chunks = [c for b in batches for c in b]
    usage = [c for c in chunks if c.get("usage")]
    assert len(usage) == 1 and usage[0]["usage"]["total_tokens"] > 0
    assert usage[0].get("choices", "absent") == {"empty": [], "null": None}.get(
        usage_choices, "absent"
    )
    assert orjson.loads(record.usage_json) == usage[0]["usage"]
    assert not any(c.get("usage") for b in plain for c in b)
    assert orjson.loads(plain_record.usage_json)["total_tokens"] > 0


def test_the_mock_refuses_an_unknown_usage_shape() -> None:
    with pytest.raises(ValueError, match="usage_choices"):
        MockLLM(port=0, usage_choices="sometimes")
