"""Group sampling per call (n = G > 1) end to end: a real worker asking the mock LLM for 3
samples, a real dataproxy recording them, the published trajectory and its training rows."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
import pytest

from protos import dataproxy_pb2
from rollgate.tensors import to_tensors
from rollgate.trajectory import decode_trajectory
from schema.packing import unpack_float32, unpack_int32
from services.runtime.keys import key_digest
from services.worker.upstream import RequestPolicy
from tests.harness.inprocess import (
    RPC_TIMEOUT_S,
    DataproxyChain,
    chunk_payloads,
    running_dataproxy_chain,
)

G = 3


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupStack(DataproxyChain):
    """A dataproxy and a worker with n_samples = G over the mock LLM."""

    async def start(self) -> str:
        """A new session's key digest."""
        started = await self.dataproxy.StartSession(
            dataproxy_pb2.StartSessionRequest(task_id="group"), timeout=RPC_TIMEOUT_S
        )
        return key_digest(started.api_key)


def group_stack(
    redis_url: str, key_prefix: str, *, n_samples: int = G, token_interval_ms: float = 0.0
) -> contextlib.AbstractAsyncContextManager[GroupStack]:
    """Mock LLM, a worker (vllm kind, `n_samples`), a dataproxy; all on port 0."""
    return running_dataproxy_chain(
        redis_url,
        key_prefix,
        chain_type=GroupStack,
        token_interval_ms=token_interval_ms,
        worker_timeout_s=10.0,
        policy=RequestPolicy(n_samples=n_samples),
    )


@pytest.fixture
async def stack(redis_url: str, key_prefix: str) -> AsyncIterator[GroupStack]:
    async with group_stack(redis_url, key_prefix) as running:
        yield running


async def _published(stack: GroupStack, digest: str) -> bytes:
    ended = await stack.dataproxy.EndSession(
        dataproxy_pb2.EndSessionRequest(key_digest=digest), timeout=RPC_TIMEOUT_S
    )
    entries: Any = await stack.redis.xrange(stack.keys.trajectories)
    (fields,) = [f for _, f in entries if f[b"trajectory_id"] == ended.trajectory_id.encode()]
    return bytes(fields[b"data"])


@pytest.mark.parametrize("stream", [True, False])
async def test_the_client_gets_one_sample_and_the_turn_records_all_three(
    stack: GroupStack, stream: bool
) -> None:
    digest = await stack.start()
    text = "tell me something varied"

    if stream:
        events = await stack.stream(digest, text, request_id="req-group")
        payloads = [orjson.loads(c) for c in chunk_payloads(events)]
        assert all(c["choices"][0]["index"] == 0 for c in payloads if c.get("choices"))
        assert all(len(c["choices"]) <= 1 for c in payloads)
    else:
        body, _ = await stack.complete(digest, text, request_id="req-group")
        assert [c["index"] for c in body["choices"]] == [0]

    assert stack.mock.stats.last_body is not None
    assert stack.mock.stats.last_body["n"] == G
    (turn,) = await stack.turns(digest)
    samples = turn["extra_samples"]
    assert len(samples) == G - 1
    outputs = [unpack_int32(turn["output_token_ids"])]
    for sample in samples:
        ids = unpack_int32(sample["output_token_ids"])
        assert ids
        assert len(unpack_float32(sample["output_logprobs"])) == len(ids)
        assert sample["exact_tokens"] is True
        assert sample["length_mismatch"] is False
        assert sample["finish_reason"] in ("stop", "length")
        assert orjson.loads(sample["assistant_message_json"])["role"] == "assistant"
        outputs.append(ids)
    # The mock seeds each choice differently: the samples are distinct answers.
    assert len({tuple(o) for o in outputs}) == G


async def test_the_published_trajectory_carries_the_samples_with_the_turns_reward(
    stack: GroupStack,
) -> None:
    digest = await stack.start()
    _, first = await stack.complete(digest, "first question")
    await stack.dataproxy.SetReward(
        dataproxy_pb2.SetRewardRequest(
            key_digest=digest, reward=0.5, interaction_id=first.interaction_id
        ),
        timeout=RPC_TIMEOUT_S,
    )
    turns = await stack.turns(digest)

    trajectory = decode_trajectory(await _published(stack, digest))

    (interaction,) = trajectory.interactions
    assert interaction.reward == 0.5
    assert [s.sample_index for s in interaction.samples] == [1, 2]
    for sample, stored in zip(interaction.samples, turns[0]["extra_samples"], strict=True):
        assert sample.output_token_ids == unpack_int32(stored["output_token_ids"])
        assert sample.output_logprobs == unpack_float32(stored["output_logprobs"])
        assert sample.output_versions == [0] * len(sample.output_token_ids)
        assert sample.output["content"] == orjson.loads(stored["assistant_message_json"])["content"]
        assert sample.reward == 0.5 and sample.reward_set is True

    rows = to_tensors(trajectory)
    assert rows.sample_group == (0, 0, 0)
    assert rows.sample_index == (0, 1, 2)
    assert rows.original_rewards == [0.5, 0.5, 0.5]
    prompt = interaction.prompt_token_ids
    for row, output in zip(
        rows.input_ids,
        [interaction.output_token_ids, *(s.output_token_ids for s in interaction.samples)],
        strict=True,
    ):
        assert row[: len(prompt) + len(output)] == prompt + output


async def test_without_group_sampling_no_samples_are_recorded(
    redis_url: str, key_prefix: str
) -> None:
    async with group_stack(redis_url, key_prefix, n_samples=1) as stack:
        digest = await stack.start()
        await stack.complete(digest, "one")
        (turn,) = await stack.turns(digest)
        assert "extra_samples" not in turn
        assert stack.mock.stats.last_body is not None
        assert "n" not in stack.mock.stats.last_body
        trajectory = decode_trajectory(await _published(stack, digest))
        assert trajectory.interactions[0].samples == ()
        assert to_tensors(trajectory).sample_index == (0,)
