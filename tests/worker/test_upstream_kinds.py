"""Each upstream kind end to end through a real Worker gRPC server and the mock LLM speaking
that kind's wire shapes: exact ids where the kind offers them, aliases, defaults, group
sampling, and the configured key variable in error messages."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import orjson
import pytest
from tokenizers import Tokenizer

from chatml.template import render_chatml
from chatml.tokenizer import LocalTokenizer
from protos import worker_pb2
from rollgate.mock_llm import MockLLM, token_id, tokenize
from services.runtime.errors import UpstreamError, from_rpc_error
from services.worker.upstream import RequestPolicy
from tests.worker.harness import running_worker, unpacked
from tests.worker.test_worker_grpc import generate
from tests.worker.tokenizer_file import build_tokenizer, decode_fn

TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]


def body(text: str = "hello there", model: str = "rollgate-mock", **fields: Any) -> bytes:
    return orjson.dumps({"model": model, "messages": [{"role": "user", "content": text}], **fields})


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


async def test_sglang_generate_path_sends_template_ids_and_records_the_sampled_ids_exactly(
    tokenizer_path: Path,
) -> None:
    tokenizer = LocalTokenizer(str(tokenizer_path))
    async with (
        MockLLM(port=0, flavor="sglang", decode=decode_fn(tokenizer_path)) as mock,
        running_worker(
            mock.base_url, kind="sglang", sglang_path="generate", tokenizer=tokenizer
        ) as worker,
    ):
        batches, record = await generate(worker.stub, body(stream=True, logprobs=True))
        sent = mock.stats.last_body
    assert sent is not None
    messages = [{"role": "user", "content": "hello there"}]
    assert sent["input_ids"] == tokenizer.encode(render_chatml(messages))
    assert sent["return_logprob"] is True
    assert record.exact_tokens and not record.length_mismatch
    assert record.upstream_kind == "sglang"
    assert list(record.prompt_token_ids) == sent["input_ids"]
    text = "".join(
        c["choices"][0]["delta"].get("content", "") for b in batches for c in b if c["choices"]
    )
    assert text.startswith("Mock reply") and "you said hello there" in text
    assert list(record.output_token_ids) == [token_id(p) for p in tokenize(text)]
    assert len(record.output_logprobs) == len(record.output_token_ids)
    assert all("token_ids" not in c["choices"][0] for b in batches for c in b if c["choices"])


async def test_sglang_generate_path_non_streaming_splits_reasoning_and_tool_calls(
    tokenizer_path: Path,
) -> None:
    tokenizer = LocalTokenizer(str(tokenizer_path))
    async with (
        MockLLM(port=0, flavor="sglang", decode=decode_fn(tokenizer_path)) as mock,
        running_worker(
            mock.base_url, kind="sglang", sglang_path="generate", tokenizer=tokenizer
        ) as worker,
    ):
        reply = await worker.stub.Complete(
            worker_pb2.GenerateRequest(body_json=body("/think /tool weather", tools=TOOLS)),
            timeout=10,
        )
    client = orjson.loads(reply.body_json)
    message = client["choices"][0]["message"]
    assert client["choices"][0]["finish_reason"] == "tool_calls"
    assert message["reasoning_content"].startswith("Let me think")
    assert message["tool_calls"][0]["function"]["name"] == "search"
    assert orjson.loads(message["tool_calls"][0]["function"]["arguments"]) == {
        "query": "/think /tool weather"
    }
    assert client["choices"][0]["logprobs"] is None
    recorded = orjson.loads(unpacked(reply.record).assistant_message_json)
    assert recorded["tool_calls"][0]["function"]["name"] == "search"
    # The exact ids cover the whole raw output, reasoning and tool markup included.
    assert unpacked(reply.record).exact_tokens
    assert (
        len(unpacked(reply.record).output_token_ids)
        == len(unpacked(reply.record).output_logprobs)
        > 15
    )


async def test_sglang_generate_path_streams_reasoning_then_tool_call(tokenizer_path: Path) -> None:
    tokenizer = LocalTokenizer(str(tokenizer_path))
    async with (
        MockLLM(port=0, flavor="sglang", decode=decode_fn(tokenizer_path)) as mock,
        running_worker(
            mock.base_url, kind="sglang", sglang_path="generate", tokenizer=tokenizer
        ) as worker,
    ):
        batches, record = await generate(
            worker.stub, body("/think /tool weather", tools=TOOLS, stream=True)
        )
    chunks = [c for b in batches for c in b if c["choices"]]
    reasoning = "".join(c["choices"][0]["delta"].get("reasoning_content", "") for c in chunks)
    assert reasoning.strip() == "Let me think about what the user asked before I answer."
    assert not any("<tool_call>" in c["choices"][0]["delta"].get("content", "") for c in chunks)
    calls = [
        c["choices"][0]["delta"]["tool_calls"]
        for c in chunks
        if "tool_calls" in c["choices"][0]["delta"]
    ]
    assert calls and calls[0][0]["function"]["name"] == "search"
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert record.exact_tokens and record.finish_reason == "tool_calls"


async def test_sglang_chat_path_records_logprobs_but_is_not_exact_without_ids() -> None:
    async with (
        MockLLM(port=0, flavor="sglang") as mock,
        running_worker(mock.base_url, kind="sglang") as worker,
    ):
        _, record = await generate(worker.stub, body(stream=True))
    assert record.upstream_kind == "sglang"
    assert not record.exact_tokens and list(record.output_token_ids) == []
    assert len(record.output_logprobs) > 3


async def test_openai_kind_never_sends_return_token_ids_to_a_hosted_api() -> None:
    async with (
        MockLLM(port=0, flavor="openai") as mock,
        running_worker(mock.base_url, kind="openai") as worker,
    ):
        _, record = await generate(worker.stub, body(stream=True))
        sent = mock.stats.last_body
    assert sent is not None and "return_token_ids" not in sent
    assert not record.exact_tokens and len(record.output_logprobs) > 3


async def test_openai_kind_with_a_local_tokenizer_records_ids_flagged_not_exact(
    tokenizer_path: Path,
) -> None:
    tokenizer = LocalTokenizer(str(tokenizer_path))
    async with (
        MockLLM(port=0, flavor="openai") as mock,
        running_worker(mock.base_url, kind="openai", tokenizer=tokenizer) as worker,
    ):
        batches, record = await generate(worker.stub, body(stream=True))
        assert worker.runner.length_mismatches == (1 if record.length_mismatch else 0)
    text = "".join(
        c["choices"][0]["delta"].get("content", "") for b in batches for c in b if c["choices"]
    )
    assert not record.exact_tokens
    assert list(record.output_token_ids) == tokenizer.encode(text)
    messages = [{"role": "user", "content": "hello there"}]
    assert list(record.prompt_token_ids) == tokenizer.encode(render_chatml(messages))
    # Never padded or truncated: the lengths are whatever they are, and a difference is flagged.
    assert record.length_mismatch == (len(record.output_logprobs) != len(record.output_token_ids))


async def test_a_length_mismatch_is_flagged_and_counted_never_padded(tokenizer_path: Path) -> None:
    tokenizer = LocalTokenizer(str(tokenizer_path))
    long_text = "zq xv wk " * 6
    async with (
        MockLLM(port=0, flavor="openai") as mock,
        running_worker(mock.base_url, kind="openai", tokenizer=tokenizer) as worker,
    ):
        _, first = await generate(worker.stub, body(long_text, stream=True))
        reply = await worker.stub.Complete(
            worker_pb2.GenerateRequest(body_json=body(long_text)), timeout=10
        )
        counted = worker.runner.length_mismatches
    # The tiny tokenizer splits unseen words into many pieces: more ids than sampled tokens.
    for record in (first, unpacked(reply.record)):
        assert record.length_mismatch
        assert len(record.output_token_ids) > len(record.output_logprobs)
    assert counted == 2


async def test_an_alias_is_rewritten_to_the_served_id_before_forwarding() -> None:
    policy = RequestPolicy(aliases={"qwen": "Qwen/Qwen3-8B"})
    async with (
        MockLLM(port=0, model="Qwen/Qwen3-8B", strict_model=True) as mock,
        running_worker(mock.base_url, policy=policy) as worker,
    ):
        _, record = await generate(worker.stub, body(model="qwen", stream=True))
        sent = mock.stats.last_body
    assert sent is not None and sent["model"] == "Qwen/Qwen3-8B"
    assert record.upstream_model == "Qwen/Qwen3-8B"


async def test_default_sampling_applies_only_when_the_client_leaves_it_out() -> None:
    policy = RequestPolicy(default_max_tokens=3, default_temperature=0.7)
    async with (
        MockLLM(port=0) as mock,
        running_worker(mock.base_url, policy=policy) as worker,
    ):
        _, record = await generate(worker.stub, body(stream=True))
        defaulted = dict(mock.stats.last_body or {})
        await generate(worker.stub, body(stream=True, max_completion_tokens=5, temperature=0))
        chosen = dict(mock.stats.last_body or {})
    assert (defaulted["max_tokens"], defaulted["temperature"]) == (3, 0.7)
    assert record.finish_reason == "length" and len(record.output_token_ids) == 3
    assert "max_tokens" not in chosen and chosen["temperature"] == 0


@pytest.mark.parametrize("stream", [True, False])
async def test_group_sampling_gives_the_client_one_choice_and_records_all(stream: bool) -> None:
    policy = RequestPolicy(n_samples=3)
    async with (
        MockLLM(port=0) as mock,
        running_worker(mock.base_url, policy=policy) as worker,
    ):
        if stream:
            batches, record = await generate(worker.stub, body(stream=True, logprobs=True))
            chunks = [c for b in batches for c in b]
            assert {c["choices"][0]["index"] for c in chunks if c["choices"]} == {0}
        else:
            reply = await worker.stub.Complete(
                worker_pb2.GenerateRequest(body_json=body()), timeout=10
            )
            assert len(orjson.loads(reply.body_json)["choices"]) == 1
            record = unpacked(reply.record)
        assert mock.stats.last_body is not None and mock.stats.last_body["n"] == 3
    assert len(record.extra_samples) == 2
    samples = [record, *record.extra_samples]
    for sample in samples:
        assert sample.exact_tokens and not sample.length_mismatch
        assert len(sample.output_token_ids) == len(sample.output_logprobs) > 0
    # Different samples of the same prompt (the mock seeds each index differently).
    assert len({tuple(s.output_token_ids) for s in samples}) > 1


async def test_upstream_401_names_the_configured_key_variable_and_never_the_key() -> None:
    async with (
        MockLLM(port=0, api_key="right") as mock,
        running_worker(
            mock.base_url, api_key="sk-wrong-secret", key_var="TAOTOKEN_API_KEY"
        ) as worker,
    ):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await generate(worker.stub, body(stream=True))
    err = from_rpc_error(caught.value, hop="worker")
    assert isinstance(err, UpstreamError) and err.http_status == 502
    assert "check TAOTOKEN_API_KEY" in err.message
    assert "sk-wrong-secret" not in err.message


async def test_unknown_model_at_the_upstream_is_a_502_without_the_url() -> None:
    async with (
        MockLLM(port=0, model="served", strict_model=True) as mock,
        running_worker(mock.base_url) as worker,
    ):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await generate(worker.stub, body(model="other", stream=True))
    err = from_rpc_error(caught.value, hop="worker")
    assert err.http_status == 502 and "model id" in err.message
    assert f"127.0.0.1:{mock.port}" not in err.message


def test_the_tokenizer_file_round_trips(tokenizer_path: Path) -> None:
    text = render_chatml([{"role": "user", "content": "hi"}])
    ids = LocalTokenizer(str(tokenizer_path)).encode(text)
    assert Tokenizer.from_file(str(tokenizer_path)).decode(ids, skip_special_tokens=False) == text
