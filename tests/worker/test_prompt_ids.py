"""The prompt ids of a streamed answer read once per shared prefix (services/worker/prompt_ids.py):
the packed bytes are those a whole parse gives, whatever the overlap with an earlier prompt;
what a whole parse refuses is refused; the cache stays bounded; and a real streamed turn's
record holds the mock's own prompt ids while a follow-up turn parses only what it added."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import orjson
import pytest

from protos import worker_pb2
from rollgate.mock_llm.plan import prompt_token_ids
from schema.packing import pack_int32
from services.runtime.errors import UpstreamError
from services.runtime.metrics import ServiceMetrics
from services.worker.metrics import WorkerMetrics
from services.worker.prompt_ids import PromptIdsCache, cut_prompt_ids
from tests.worker.harness import mock_and_worker, unpacked

# Raw answers of a real vLLM 0.32 (README.md there).
VLLM_WIRE = Path(__file__).resolve().parent / "vllm_wire"


def _payloads(raw: bytes) -> list[bytes]:
    """A capture's JSON documents: its body, or each SSE event's data."""
    body = raw.replace(b"\r\n", b"\n").split(b"\n\n", 1)[1]
    if body.lstrip().startswith(b"{"):
        return [body]
    return [line[6:] for line in body.splitlines() if line.startswith(b"data: {")]


def _text(ids: list[int], separator: bytes = b",") -> bytes:
    return separator.join(str(i).encode() for i in ids)


def _whole(text: bytes) -> bytes:
    return pack_int32(orjson.loads(b"[" + text + b"]"))


def test_the_array_is_cut_from_the_top_level_or_a_choice_and_the_rest_still_parses() -> None:
    top = orjson.dumps({"id": "c", "prompt_token_ids": [5, 6, 7], "choices": [{"index": 0}]})
    rest, text = cut_prompt_ids(top) or (b"", b"")
    assert text == b"5,6,7"
    assert orjson.loads(rest) == {"id": "c", "prompt_token_ids": None, "choices": [{"index": 0}]}
    nested = orjson.dumps({"choices": [{"index": 0, "prompt_token_ids": [9]}]})
    rest, text = cut_prompt_ids(nested) or (b"", b"")
    assert text == b"9" and orjson.loads(rest)["choices"][0]["prompt_token_ids"] is None
    assert cut_prompt_ids(orjson.dumps({"choices": [{"index": 0, "token_ids": [1]}]})) is None
    assert cut_prompt_ids(b'{"prompt_token_ids":[1,2') is None
    assert cut_prompt_ids(b'{"prompt_token_ids": null, "choices": []}') is None
    # Pretty-printed JSON (a space after the colon, ids on lines of their own) is cut too.
    pretty = b'{\n  "prompt_token_ids": [\n    5,\n    6\n  ],\n  "choices": []\n}'
    rest, text = cut_prompt_ids(pretty) or (b"", b"")
    assert orjson.loads(rest) == {"prompt_token_ids": None, "choices": []}
    assert PromptIdsCache().pack(text) == pack_int32([5, 6])
    # Every vLLM 0.32 capture with prompt ids: the cut and the cache give the ids the whole
    # parse gives.
    captures = sorted(VLLM_WIRE.glob("*.response.txt"))
    assert len(captures) == 5
    checked = 0
    for capture in captures:
        for payload in _payloads(capture.read_bytes()):
            whole = orjson.loads(payload)
            expected = whole.get("prompt_token_ids") or (whole.get("choices") or [{}])[0].get(
                "prompt_token_ids"
            )
            cut = cut_prompt_ids(payload)
            if not expected:
                assert cut is None or not orjson.loads(cut[1].join((b"[", b"]")))
                continue
            assert cut is not None, capture.name
            assert PromptIdsCache().pack(cut[1]) == pack_int32(expected), capture.name
            checked += 1
    assert checked == 5


def _variants(rng: random.Random, base: list[int]) -> list[list[int]]:
    """Prompts that overlap `base` in every way a next turn can: the same, extended, cut
    short, changed inside a number (12 → 123, 123 → 12), changed at a boundary, unrelated."""
    k = rng.randrange(1, len(base) - 1)
    grown_digit = [*base[:k], base[k] * 10 + 3, *base[k + 1 :]]
    shrunk_digit = [*base[:k], base[k] // 10, *base[k + 1 :]]
    return [
        list(base),
        [*base, *(rng.randrange(1, 150_000) for _ in range(rng.randrange(1, 40)))],
        base[:k],
        grown_digit,
        shrunk_digit,
        [*base[:k], rng.randrange(1, 150_000), *base[k:]],
        [*base[:k], *base[k + 1 :]],
        [rng.randrange(1, 150_000) for _ in range(len(base))],
        [*base[:1], 0, -5, 2**31 - 1, -(2**31)],
    ]


def test_every_overlap_packs_exactly_what_a_whole_parse_packs() -> None:
    rng = random.Random(13)
    cache = PromptIdsCache(key_bytes=8)
    for _ in range(60):
        base = [rng.randrange(1, 150_000) for _ in range(rng.randrange(3, 300))]
        sequence = [base]
        for variant in _variants(rng, base):
            sequence += [variant, base]
        for ids in sequence:
            for separator in (b",", b", "):
                text = _text(ids, separator)
                assert cache.pack(text) == _whole(text) == pack_int32(ids)
    assert cache.reused > cache.parsed  # most ids came from an earlier prompt


def test_a_follow_up_prompt_parses_only_what_it_added() -> None:
    cache = PromptIdsCache()
    first = list(range(1000, 13_000))
    assert cache.pack(_text(first)) == pack_int32(first)
    assert (cache.reused, cache.parsed) == (0, len(first))
    second = [*first, 7, 8, 9]
    assert cache.pack(_text(second)) == pack_int32(second)
    # The last id of the shared text is read again (a number may go on past it).
    assert cache.reused == len(first) - 1
    assert cache.parsed == len(first) + 4
    assert cache.pack(_text(second)) == pack_int32(second)  # the same prompt: nothing parsed
    assert cache.parsed == len(first) + 4


@pytest.mark.parametrize(
    "tail",
    [b",x", b",1.5", b"," + str(2**31).encode(), b",", b",true,[1"],
    ids=["not-a-number", "float", "over-int32", "trailing-comma", "not-a-list"],
)
def test_what_a_whole_parse_refuses_is_refused_after_a_shared_prefix_too(tail: bytes) -> None:
    cache = PromptIdsCache()
    base = _text(list(range(100, 400)))
    cache.pack(base)
    with pytest.raises(UpstreamError, match="token ids"):
        cache.pack(base + tail)
    with pytest.raises(UpstreamError, match="token ids"):
        PromptIdsCache().pack(base + tail)


def test_the_cache_is_bounded_in_prompts_and_bytes() -> None:
    cache = PromptIdsCache(key_bytes=4, max_entries=2)
    prompts = [_text(list(range(start, start + 50))) for start in (1000, 2000, 3000)]
    for text in prompts:
        cache.pack(text)
    parsed = cache.parsed
    cache.pack(prompts[0])  # evicted by the third: parsed whole again
    assert cache.parsed == parsed + 50
    small = PromptIdsCache(key_bytes=4, max_bytes=600)
    small.pack(prompts[0])  # 50 ids: 199 bytes of text + 200 packed
    small.pack(prompts[1])  # over 600 bytes together: the first goes
    parsed = small.parsed
    small.pack(prompts[1])
    assert small.parsed == parsed
    small.pack(prompts[0])
    assert small.parsed == parsed + 50


async def _streamed_record(stub: Any, messages: list[dict[str, str]], **fields: Any) -> Any:
    body = orjson.dumps({"model": "rollgate-mock", "messages": messages, "stream": True, **fields})
    record = None
    chunks: list[bytes] = []
    async for message in stub.Generate(worker_pb2.GenerateRequest(body_json=body), timeout=10):
        if message.HasField("chunks"):
            chunks += message.chunks.chunks
        if message.HasField("record"):
            record = message.record
            chunks += message.chunks.chunks
    assert record is not None
    return unpacked(record), [orjson.loads(c) for c in chunks]


async def test_a_streamed_turn_records_the_prompt_ids_and_the_next_turn_reuses_them() -> None:
    system = {"role": "system", "content": "You are an agent. " * 400}
    first = [system, {"role": "user", "content": "list the files"}]
    async with mock_and_worker(kind="vllm") as (_, worker):
        record, chunks = await _streamed_record(worker.stub, first)
        cache = worker.runner.prompt_ids
        assert record.prompt_token_ids == prompt_token_ids(first)
        assert (cache.reused, cache.parsed) == (0, len(record.prompt_token_ids))
        # The client asked for no ids: its chunks carry none.
        assert not any("prompt_token_ids" in c for c in chunks)
        answer = "".join(
            (c["choices"] or [{}])[0].get("delta", {}).get("content") or "" for c in chunks
        )
        second = [
            *first,
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "ok"},
        ]
        record, _ = await _streamed_record(worker.stub, second)
        assert record.prompt_token_ids == prompt_token_ids(second)
        assert cache.reused >= len(prompt_token_ids(first)) - 2
        assert cache.parsed < len(prompt_token_ids(first)) + 64
        # A client that asks for the ids gets them in its chunk, read as before.
        record, chunks = await _streamed_record(worker.stub, second, return_token_ids=True)
        assert chunks[0]["prompt_token_ids"] == record.prompt_token_ids == prompt_token_ids(second)


async def test_a_unary_turn_reads_its_prompt_ids_through_the_cache_too() -> None:
    messages = [
        {"role": "system", "content": "Be brief. " * 300},
        {"role": "user", "content": "hi"},
    ]
    body = orjson.dumps({"model": "rollgate-mock", "messages": messages})
    async with mock_and_worker(kind="vllm") as (_, worker):
        for turn in range(2):
            answer = await worker.stub.Complete(
                worker_pb2.GenerateRequest(body_json=body), timeout=10
            )
            assert unpacked(answer.record).prompt_token_ids == prompt_token_ids(messages)
            assert "prompt_token_ids" not in orjson.loads(answer.body_json)
            cache = worker.runner.prompt_ids
            assert cache.reused == turn * len(prompt_token_ids(messages))
        assert cache.parsed == len(prompt_token_ids(messages))


async def test_the_workers_metrics_count_the_prompt_ids_reused_and_parsed() -> None:
    messages = [
        {"role": "system", "content": "Be brief. " * 300},
        {"role": "user", "content": "hi"},
    ]
    async with mock_and_worker(kind="vllm") as (_, worker):
        service = ServiceMetrics("worker")
        WorkerMetrics(service, worker.runner)
        for _ in range(2):
            await _streamed_record(worker.stub, messages)

    def sample(source: str) -> float | None:
        return service.registry.get_sample_value(
            "rollgate_worker_prompt_token_ids_total", {"source": source}
        )

    ids = len(prompt_token_ids(messages))
    assert (sample("reused"), sample("parsed")) == (ids, ids)
