"""A real Worker gRPC server against a real mock LLM: streaming, records, stripping, errors."""

from __future__ import annotations

import time
from typing import Any

import grpc
import orjson
import pytest

from protos import worker_pb2
from rollgate.mock_llm import MockLLM
from services.runtime.errors import (
    InvalidRequest,
    TooManyRequests,
    Unavailable,
    UpstreamError,
    UpstreamTimeout,
    from_rpc_error,
)
from services.worker.upstream import DENYLIST
from tests.harness.poll import eventually
from tests.worker.harness import mock_and_worker, running_worker, unpacked


def body(text: str = "hello there", **fields: Any) -> bytes:
    return orjson.dumps(
        {"model": "rollgate-mock", "messages": [{"role": "user", "content": text}], **fields}
    )


async def generate(stub: Any, payload: bytes) -> tuple[list[list[dict[str, Any]]], Any]:
    """All chunk batches (parsed) and the final record of one Generate call."""
    batches: list[list[dict[str, Any]]] = []
    record = None
    async for message in stub.Generate(worker_pb2.GenerateRequest(body_json=payload), timeout=10):
        if message.HasField("chunks"):
            batches.append([orjson.loads(c) for c in message.chunks.chunks])
        if message.HasField("record"):
            record = unpacked(message.record)
    return batches, record


LONG_TEXT = " ".join(f"word{i}" for i in range(20))


async def test_first_chunks_reach_the_client_while_the_upstream_is_still_generating() -> None:
    async with mock_and_worker(token_interval_ms=30) as (mock, worker):
        call = worker.stub.Generate(
            worker_pb2.GenerateRequest(body_json=body(LONG_TEXT, stream=True))
        )
        first = await call.read()
        assert first.HasField("chunks")
        # The mock streams ~25 tokens; it has neither finished nor sent most of them yet.
        assert mock.stats.streams_finished == 0
        assert mock.stats.tokens_streamed < 10
        last = first
        while (message := await call.read()) is not grpc.aio.EOF:
            last = message
        assert last.HasField("record")
        assert mock.stats.streams_finished == 1


async def test_vllm_turn_record_has_exact_ids_and_one_logprob_per_output_id() -> None:
    async with mock_and_worker(kind="vllm") as (_, worker):
        batches, record = await generate(worker.stub, body(LONG_TEXT, stream=True))
    assert record.exact_tokens is True
    assert record.upstream_kind == "vllm"
    assert len(record.output_token_ids) > 10
    assert len(record.output_logprobs) == len(record.output_token_ids)
    assert record.length_mismatch is False
    assert all(-3 < lp < 0 for lp in record.output_logprobs)
    assert len(record.prompt_token_ids) > 0
    chunks = [c for batch in batches for c in batch]
    assert record.interaction_id == chunks[0]["id"]
    assert record.interaction_id.startswith("chatcmpl-")
    assert record.upstream_model == "rollgate-mock"
    assert record.finish_reason == "stop"
    message = orjson.loads(record.assistant_message_json)
    streamed_text = "".join(
        c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
    )
    assert message == {"role": "assistant", "content": streamed_text}
    assert streamed_text.startswith("Mock reply")
    usage = orjson.loads(record.usage_json)
    assert usage["completion_tokens"] == len(record.output_token_ids)
    assert usage["prompt_tokens"] == len(record.prompt_token_ids)
    assert 0 <= record.ttft_s <= record.latency_s
    assert abs(record.started_at_unix_s - time.time()) < 60


async def test_openai_kind_records_logprobs_without_ids_and_not_exact() -> None:
    async with mock_and_worker(kind="openai") as (mock, worker):
        _, record = await generate(worker.stub, body(stream=True))
        assert "return_token_ids" not in (mock.stats.last_body or {})
    assert record.exact_tokens is False
    assert record.upstream_kind == "openai"
    assert list(record.output_token_ids) == []
    assert list(record.prompt_token_ids) == []
    assert len(record.output_logprobs) > 3
    assert record.length_mismatch is False


async def test_logprobs_and_ids_are_stripped_when_the_client_did_not_ask() -> None:
    async with mock_and_worker(kind="vllm") as (mock, worker):
        batches, record = await generate(worker.stub, body(stream=True))
        sent = mock.stats.last_body or {}
    assert sent["logprobs"] is True
    assert sent["return_token_ids"] is True
    assert sent["stream_options"] == {"include_usage": True}
    assert "top_logprobs" not in sent
    chunks = [c for batch in batches for c in batch]
    assert all(c["choices"] for c in chunks), "the usage-only chunk must be dropped"
    for chunk in chunks:
        assert "prompt_token_ids" not in chunk
        for choice in chunk["choices"]:
            assert choice.get("logprobs") is None
            assert "token_ids" not in choice
    assert len(record.output_logprobs) > 0


async def test_logprobs_ids_and_usage_are_kept_when_the_client_asked() -> None:
    async with mock_and_worker(kind="vllm") as (mock, worker):
        batches, record = await generate(
            worker.stub,
            body(
                stream=True,
                logprobs=True,
                top_logprobs=2,
                return_token_ids=True,
                stream_options={"include_usage": True},
            ),
        )
        assert (mock.stats.last_body or {})["top_logprobs"] == 2
    chunks = [c for batch in batches for c in batch]
    client_logprobs = [
        e["logprob"]
        for c in chunks
        for ch in c["choices"]
        if ch.get("logprobs")
        for e in ch["logprobs"]["content"]
    ]
    # The record carries them as float32 (as they are stored).
    assert record.output_logprobs == pytest.approx(client_logprobs, abs=1e-6)
    assert chunks[0]["prompt_token_ids"] == list(record.prompt_token_ids)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 0


async def test_denylisted_fields_never_reach_the_upstream() -> None:
    client_fields: dict[str, Any] = {name: "x" for name in DENYLIST}
    client_fields["metadata"] = {"a": "b"}
    client_fields["extra_headers"] = {"X-Evil": "1"}
    async with mock_and_worker() as (mock, worker):
        await generate(worker.stub, body(stream=True, temperature=0.5, **client_fields))
        sent = mock.stats.last_body or {}
        headers = mock.stats.last_headers
    assert not DENYLIST & sent.keys()
    assert sent["temperature"] == 0.5
    assert "X-Evil" not in headers
    assert "Authorization" not in headers


# OpenClaw-RL's body keys (the gateway reads them) and the rest of the denylist, spelled out
# here so that a name dropped from DENYLIST fails this test.
OPENCLAW_RL_BODY_KEYS: dict[str, Any] = {
    "session_id": "claw-1",
    "turn_type": "side",
    "session_done": True,
}
OTHER_DENIED_KEYS: dict[str, Any] = {
    "store": True,
    "api_base": "http://elsewhere/v1",
    "base_url": "http://elsewhere/v1",
    "api_key": "sk-client",
    "extra_headers": {"X-Evil": "1"},
    "extra_query": {"q": "1"},
    "extra_body": {"x": 1},
    "metadata": {"a": "b"},
    "prompt_cache_key": "k",
}


def test_the_denylist_holds_every_openclaw_rl_body_key_and_the_redirecting_fields() -> None:
    assert OPENCLAW_RL_BODY_KEYS.keys() | OTHER_DENIED_KEYS.keys() <= DENYLIST


@pytest.mark.parametrize("kind", ["vllm", "sglang", "openai"])
@pytest.mark.parametrize("unary", [False, True])
async def test_openclaw_rl_body_keys_never_reach_the_upstream(kind: str, unary: bool) -> None:
    payload = body(stream=not unary, temperature=0.5, **OPENCLAW_RL_BODY_KEYS, **OTHER_DENIED_KEYS)
    async with (
        MockLLM(port=0, flavor=kind) as mock,
        running_worker(mock.base_url, kind=kind) as worker,
    ):
        if unary:
            reply = await worker.stub.Complete(
                worker_pb2.GenerateRequest(body_json=payload), timeout=10
            )
            assert reply.record.finish_reason == "stop"
        else:
            _, record = await generate(worker.stub, payload)
            assert record.finish_reason == "stop"
        sent = mock.stats.last_body or {}
    assert sent, "the upstream got no body"
    assert not sent.keys() & (OPENCLAW_RL_BODY_KEYS.keys() | OTHER_DENIED_KEYS.keys()), sent
    assert sent["temperature"] == 0.5  # everything else passes through


async def test_upstream_key_is_sent_as_bearer_only_from_the_server_side() -> None:
    async with mock_and_worker(mock_key="sk-up", worker_key="sk-up") as (mock, worker):
        _, record = await generate(worker.stub, body(stream=True, api_key="sk-client"))
        assert mock.stats.last_headers["Authorization"] == "Bearer sk-up"
    assert record.finish_reason == "stop"


async def test_tool_call_fragments_and_reasoning_are_assembled_in_the_record() -> None:
    tools = [{"type": "function", "function": {"name": "search", "parameters": {}}}]
    async with mock_and_worker() as (mock, worker):
        _, record = await generate(
            worker.stub,
            body(
                "please /tool look this up",
                stream=True,
                tools=tools,
                chat_template_kwargs={"enable_thinking": True},
            ),
        )
    message = orjson.loads(record.assistant_message_json)
    assert record.finish_reason == "tool_calls"
    assert message["content"] is None
    assert message["reasoning_content"].startswith("Let me think")
    [call] = message["tool_calls"]
    assert call["function"]["name"] == "search"
    assert orjson.loads(call["function"]["arguments"]) == {"query": "please /tool look this up"}
    assert call["id"].startswith("call_")
    assert (mock.stats.last_body or {})["tools"] == tools
    assert len(record.output_logprobs) == len(record.output_token_ids)


async def test_max_tokens_ends_with_length() -> None:
    async with mock_and_worker() as (_, worker):
        _, record = await generate(worker.stub, body(LONG_TEXT, stream=True, max_tokens=3))
    assert record.finish_reason == "length"
    assert len(record.output_token_ids) == 3


async def test_complete_returns_the_client_body_and_the_record() -> None:
    async with mock_and_worker(kind="vllm") as (mock, worker):
        reply = await worker.stub.Complete(
            worker_pb2.GenerateRequest(body_json=body(stream=True, stream_options={"x": 1})),
            timeout=10,
        )
        sent = mock.stats.last_body or {}
    assert sent["stream"] is False
    assert "stream_options" not in sent
    client = orjson.loads(reply.body_json)
    assert client["object"] == "chat.completion"
    assert client["choices"][0]["logprobs"] is None
    assert "token_ids" not in client["choices"][0]
    assert "prompt_token_ids" not in client
    record = unpacked(reply.record)
    assert record.interaction_id == client["id"]
    assert record.exact_tokens is True
    assert len(record.output_logprobs) == len(record.output_token_ids) > 0
    assert (
        orjson.loads(record.assistant_message_json)["content"]
        == (client["choices"][0]["message"]["content"])
    )


async def test_complete_keeps_logprobs_when_asked() -> None:
    async with mock_and_worker(kind="openai") as (_, worker):
        reply = await worker.stub.Complete(
            worker_pb2.GenerateRequest(body_json=body(logprobs=True)), timeout=10
        )
    client = orjson.loads(reply.body_json)
    values = [e["logprob"] for e in client["choices"][0]["logprobs"]["content"]]
    assert values == pytest.approx(unpacked(reply.record).output_logprobs, abs=1e-6)
    assert reply.record.exact_tokens is False


async def rpc_error(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value


async def stream_error(stub: Any, payload: bytes) -> tuple[int, grpc.aio.AioRpcError]:
    """Chunks received before the stream failed, and the failure."""
    received = 0
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for message in stub.Generate(
            worker_pb2.GenerateRequest(body_json=payload), timeout=10
        ):
            assert message.HasField("chunks")
            received += len(message.chunks.chunks)
    return received, caught.value


async def test_a_wrong_upstream_key_is_reported_as_the_servers_key_problem() -> None:
    async with mock_and_worker(mock_key="right", worker_key="wrong") as (_, worker):
        _, err = await stream_error(worker.stub, body(stream=True))
    error = from_rpc_error(err, hop="worker")
    assert isinstance(error, UpstreamError)
    assert "ROLLGATE_UPSTREAM_API_KEY" in error.message
    assert "wrong" not in error.message


async def test_upstream_429_becomes_too_many_requests_with_retry_after() -> None:
    async with mock_and_worker() as (_, worker):
        err = await rpc_error(
            worker.stub.Complete(
                worker_pb2.GenerateRequest(body_json=body("/fail-429")), timeout=10
            )
        )
    error = from_rpc_error(err, hop="worker")
    assert isinstance(error, TooManyRequests)
    assert error.retry_after_s == 2.0
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_upstream_500_becomes_upstream_error() -> None:
    async with mock_and_worker() as (_, worker):
        _, err = await stream_error(worker.stub, body("/fail-500", stream=True))
    error = from_rpc_error(err, hop="worker")
    assert isinstance(error, UpstreamError)
    assert "500" in error.message


async def test_upstream_400_carries_the_upstreams_message() -> None:
    async with mock_and_worker() as (_, worker):
        err = await rpc_error(
            worker.stub.Complete(
                worker_pb2.GenerateRequest(body_json=body("/fail-400")), timeout=10
            )
        )
    error = from_rpc_error(err, hop="worker")
    assert isinstance(error, InvalidRequest)
    assert "mock failure 400" in error.message


async def test_upstream_404_names_the_usual_cause_but_not_the_url() -> None:
    # A base URL that points at a path the mock does not serve.
    async with (
        MockLLM(port=0) as mock,
        running_worker(f"http://127.0.0.1:{mock.port}/nothing/v1") as worker,
    ):
        err = await rpc_error(
            worker.stub.Complete(worker_pb2.GenerateRequest(body_json=body()), timeout=10)
        )
    error = from_rpc_error(err, hop="worker")
    assert isinstance(error, UpstreamError)
    assert f"127.0.0.1:{mock.port}" not in error.message and "nothing" not in error.message
    assert "/v1" in error.message and "model" in error.message


async def test_a_refused_connection_is_unavailable_without_the_upstream_address() -> None:
    async with MockLLM(port=0) as mock:
        url = mock.base_url
    # The mock is closed: nothing listens on its port any more.
    async with running_worker(url) as worker:
        err = await rpc_error(
            worker.stub.Complete(worker_pb2.GenerateRequest(body_json=body()), timeout=10)
        )
    error = from_rpc_error(err, hop="worker")
    assert isinstance(error, Unavailable)
    assert "refused the connection" in error.message and error.retry_after_s
    assert url not in error.message and str(mock.port) not in error.message


async def test_a_hanging_upstream_times_out_and_the_upstream_connection_is_closed() -> None:
    async with mock_and_worker(timeout_s=0.3) as (mock, worker):
        _, err = await stream_error(worker.stub, body("/hang", stream=True))
        await eventually(lambda: mock.stats.disconnects == 1)
        assert worker.runner.in_flight == 0
    assert isinstance(from_rpc_error(err, hop="worker"), UpstreamTimeout)
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED


async def test_a_stream_broken_midway_fails_after_the_chunks_already_sent() -> None:
    async with mock_and_worker() as (_, worker):
        received, err = await stream_error(worker.stub, body("/fail-midstream", stream=True))
    assert received == 2  # the role chunk and the first token, as the mock sent them
    error = from_rpc_error(err, hop="worker")
    assert isinstance(error, UpstreamError)
    assert "mid-response" in error.message


async def test_a_cancelled_call_closes_the_upstream_response() -> None:
    async with mock_and_worker(token_interval_ms=50) as (mock, worker):
        call = worker.stub.Generate(
            worker_pb2.GenerateRequest(body_json=body(LONG_TEXT, stream=True))
        )
        await call.read()
        assert worker.runner.in_flight == 1
        call.cancel()
        await eventually(lambda: mock.stats.disconnects == 1)
        await eventually(lambda: worker.runner.in_flight == 0)
        assert mock.stats.streams_finished == 0


async def test_a_body_that_is_not_chat_completions_is_an_invalid_request() -> None:
    async with mock_and_worker() as (mock, worker):
        err = await rpc_error(
            worker.stub.Complete(worker_pb2.GenerateRequest(body_json=b"[1]"), timeout=10)
        )
        assert mock.stats.requests == 0
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_deltas_only_streams_what_each_batch_added_and_no_chunks() -> None:
    tools = [{"type": "function", "function": {"name": "search", "parameters": {}}}]
    async with mock_and_worker(token_interval_ms=5) as (_, worker):
        messages = [
            m
            async for m in worker.stub.Generate(
                worker_pb2.GenerateRequest(
                    body_json=body("please /tool look this up", stream=True, tools=tools),
                    deltas_only=True,
                ),
                timeout=10,
            )
        ]
        plain = [
            m
            async for m in worker.stub.Generate(
                worker_pb2.GenerateRequest(
                    body_json=body(LONG_TEXT, stream=True), deltas_only=True
                ),
                timeout=10,
            )
        ]
    assert all(not m.chunks.chunks for m in messages + plain)
    record = unpacked(messages[-1].record)
    [call] = orjson.loads(record.assistant_message_json)["tool_calls"]
    fragments = [f for m in messages for f in m.chunks.delta.tool_calls]
    assert len(fragments) >= 2  # the arguments stream in pieces
    assert {(f.id, f.name) for f in fragments if f.id} == {(call["id"], "search")}
    assert "".join(f.arguments for f in fragments) == call["function"]["arguments"]
    text = "".join(m.chunks.delta.content for m in plain)
    assert text == orjson.loads(plain[-1].record.assistant_message_json)["content"]
    assert sum(1 for m in plain if m.chunks.delta.content) > 1


async def test_the_batch_that_ends_the_answer_travels_with_the_record() -> None:
    async with mock_and_worker(token_interval_ms=5) as (_, worker):
        spread = [
            m
            async for m in worker.stub.Generate(
                worker_pb2.GenerateRequest(body_json=body(LONG_TEXT, stream=True)), timeout=10
            )
        ]
    # Earlier batches went out alone (the first token is never held back); the last one,
    # with the finish reason, came in the record's message.
    assert spread[0].HasField("chunks") and not spread[0].HasField("record")
    last = spread[-1]
    assert last.HasField("record") and last.chunks.chunks
    finish = [orjson.loads(c)["choices"][0].get("finish_reason") for c in last.chunks.chunks]
    assert "stop" in finish
    assert sum(1 for m in spread if m.HasField("record")) == 1
