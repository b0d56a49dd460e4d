"""ChunkBatch.output_tokens: how many sampled tokens each streamed batch carries."""

from __future__ import annotations

from typing import Any

import orjson

from protos import worker_pb2
from tests.worker.harness import mock_and_worker, unpacked

LONG_TEXT = " ".join(f"word{i}" for i in range(12))


def body(text: str, **fields: Any) -> bytes:
    return orjson.dumps(
        {"model": "rollgate-mock", "messages": [{"role": "user", "content": text}], **fields}
    )


async def token_counts(stub: Any, payload: bytes) -> tuple[list[int], Any]:
    """The output_tokens of every batch of one Generate call, and its record."""
    counts: list[int] = []
    record = None
    async for message in stub.Generate(worker_pb2.GenerateRequest(body_json=payload), timeout=10):
        if message.HasField("chunks"):
            counts.append(message.chunks.output_tokens)
        if message.HasField("record"):
            record = unpacked(message.record)
    return counts, record


async def test_batch_token_counts_add_up_to_the_sampled_ids_when_the_upstream_gives_ids() -> None:
    async with mock_and_worker(kind="vllm", token_interval_ms=5) as (_, worker):
        counts, record = await token_counts(worker.stub, body(LONG_TEXT, stream=True))

    assert record.exact_tokens
    assert len(record.output_token_ids) > 5
    assert sum(counts) == len(record.output_token_ids)
    # Tokens arrive spread over the stream, not all in one batch.
    assert sum(1 for c in counts if c > 0) > 1


async def test_batch_token_counts_come_from_logprob_entries_when_there_are_no_ids() -> None:
    async with mock_and_worker(kind="openai", token_interval_ms=5) as (_, worker):
        counts, record = await token_counts(worker.stub, body(LONG_TEXT, stream=True))

    assert not record.output_token_ids
    assert len(record.output_logprobs) > 5
    assert sum(counts) == len(record.output_logprobs)
    assert sum(1 for c in counts if c > 0) > 1


async def prompt_lengths(stub: Any, payload: bytes) -> tuple[list[int], Any]:
    """The prompt_tokens of every batch of one Generate call, and its record."""
    lengths: list[int] = []
    record = None
    async for message in stub.Generate(worker_pb2.GenerateRequest(body_json=payload), timeout=10):
        if message.HasField("chunks"):
            lengths.append(message.chunks.prompt_tokens)
        if message.HasField("record"):
            record = unpacked(message.record)
    return lengths, record


async def test_every_batch_tells_the_prompt_length_once_vllm_sent_the_prompt_ids() -> None:
    async with mock_and_worker(kind="vllm", token_interval_ms=5) as (_, worker):
        lengths, record = await prompt_lengths(worker.stub, body(LONG_TEXT, stream=True))

    # vLLM sends the prompt ids on its first chunk: the first batch already knows the length.
    assert len(lengths) > 1 and record.prompt_token_ids
    assert lengths == [len(record.prompt_token_ids)] * len(lengths)


async def test_the_prompt_length_stays_0_when_the_upstream_sends_no_ids() -> None:
    async with mock_and_worker(kind="openai", token_interval_ms=5) as (_, worker):
        lengths, _ = await prompt_lengths(worker.stub, body(LONG_TEXT, stream=True))

    assert lengths and set(lengths) == {0}
