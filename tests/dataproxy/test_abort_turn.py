"""Worker.Abort (what the gateway sends to stop a WebSocket run): a streaming turn stopped
mid-generation ends normally and is recorded with the tokens sampled so far (the gateway's
relay, a real dataproxy, worker, mock LLM, Redis)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import orjson
import pytest

from protos import worker_pb2, worker_pb2_grpc
from rollgate.trajectory import decode_trajectory
from schema.packing import unpack_float32, unpack_int32
from services.gateway.relay import Done, Event
from services.runtime.grpc_client import open_channel
from tests.dataproxy.test_samples_group import (
    RPC_TIMEOUT_S,
    GroupStack,
    _published,
    group_stack,
)
from tests.harness.inprocess import chunk_payloads, collect
from tests.harness.poll import eventually

DEADLINE_S = 10.0


@pytest.fixture
async def slow_stack(redis_url: str, key_prefix: str) -> AsyncIterator[GroupStack]:
    """One sample per call; the mock streams a token every 100 ms."""
    async with group_stack(redis_url, key_prefix, n_samples=1, token_interval_ms=100) as running:
        yield running


async def _abort(stack: GroupStack, request_id: str) -> bool:
    async with open_channel(stack.worker_address) as channel:
        answer = await worker_pb2_grpc.WorkerStub(channel).Abort(
            worker_pb2.AbortRequest(request_id=request_id), timeout=RPC_TIMEOUT_S
        )
    return bool(answer.found)


async def _abort_after_first_tokens(stack: GroupStack, digest: str) -> tuple[list[Event], bool]:
    """Starts a slow streaming turn, aborts it after its first chunks, reads it to the end."""
    call = stack.call(digest, "please write a long answer", max_tokens=200, request_id="req-group")
    messages = [await call.read(), await call.read()]
    disconnects = stack.mock.stats.disconnects
    found = await _abort(stack, "req-group")
    messages += await collect(call)
    await eventually(
        lambda: stack.mock.stats.disconnects > disconnects,
        timeout_s=DEADLINE_S,
        what="the upstream generation stopped",
    )
    return messages, found


async def test_an_aborted_stream_ends_normally_and_records_the_partial_turn(
    slow_stack: GroupStack,
) -> None:
    digest = await slow_stack.start()

    messages, found = await _abort_after_first_tokens(slow_stack, digest)

    assert found is True
    assert isinstance(messages[-1], Done)
    chunks = [orjson.loads(c) for c in chunk_payloads(messages)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
    streamed = "".join(
        c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices")
    )
    (turn,) = await slow_stack.turns(digest)
    assert turn["interaction_id"] == messages[-1].interaction_id
    assert turn["finish_reason"] == "abort"
    ids = unpack_int32(turn["output_token_ids"])
    assert 0 < len(ids) < 200
    assert len(unpack_float32(turn["output_logprobs"])) == len(ids)
    assert orjson.loads(turn["assistant_message_json"])["content"] == streamed
    assert slow_stack.mock.stats.streams_finished == 0

    trajectory = decode_trajectory(await _published(slow_stack, digest))
    (interaction,) = trajectory.interactions
    assert interaction.finish_reason == "abort"
    assert interaction.output_token_ids == ids


async def test_aborting_a_group_sampled_turn_stops_every_sample(
    redis_url: str, key_prefix: str
) -> None:
    async with group_stack(redis_url, key_prefix, n_samples=3, token_interval_ms=100) as stack:
        digest = await stack.start()

        messages, found = await _abort_after_first_tokens(stack, digest)

        assert found is True
        assert isinstance(messages[-1], Done)
        (turn,) = await stack.turns(digest)
        assert turn["finish_reason"] == "abort"
        assert [s["finish_reason"] for s in turn["extra_samples"]] == ["abort", "abort"]
        for sample in turn["extra_samples"]:
            ids = unpack_int32(sample["output_token_ids"])
            assert len(unpack_float32(sample["output_logprobs"])) == len(ids)


async def test_abort_of_no_running_turn_is_not_found(slow_stack: GroupStack) -> None:
    assert await _abort(slow_stack, "no-such-request") is False
