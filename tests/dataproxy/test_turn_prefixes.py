"""An open episode stores what each turn adds: the request and prompt ids a turn shares with
the episode's previous turn are a prefix reference, resolved to the exact bytes on read."""

from __future__ import annotations

import random
from typing import Any

import msgpack  # type: ignore[import-untyped]
import orjson
import pytest

from services.dataproxy.trajectory import EpisodeInfo, build_trajectory
from services.dataproxy.turns import PriorTurn, PriorTurns, decode_turn, decode_turns
from services.runtime.prefix import common_prefix
from tests.dataproxy.large_prompt import prompt_ids, system_prompt, tools
from tests.dataproxy.turn_records import WithRequest, turn_record

SYSTEM = {"role": "system", "content": system_prompt()}
SYSTEM_IDS = prompt_ids(SYSTEM["content"])


def record(n: int, messages: list[Any], ids: list[int]) -> WithRequest:
    rec = turn_record(
        interaction_id=f"c{n}",
        finish_reason="stop",
        assistant_message_json=orjson.dumps({"role": "assistant", "content": f"answer {n}"}),
        prompt_token_ids=ids,
        output_token_ids=[9000 + n, 9100 + n],
        output_logprobs=[-0.5, -0.25],
        exact_tokens=True,
    )
    return WithRequest(rec, orjson.dumps({"tools": tools(), "messages": messages}))


def conversation(turns: int) -> list[WithRequest]:
    """Turns of one agent: each resends everything so far plus one user message."""
    messages: list[Any] = [SYSTEM]
    ids = list(SYSTEM_IDS)
    out = []
    for n in range(turns):
        messages = [*messages, {"role": "user", "content": f"question {n} " * 20}]
        # The template's last id (the assistant header) is not part of the next prompt.
        ids = [*ids, 50 + n, 7]
        out.append(record(n, messages, ids))
        messages = [*messages, {"role": "assistant", "content": f"answer {n}"}]
        ids = [*ids[:-1], 9000 + n, 9100 + n]
    return out


def recorded(records: list[WithRequest]) -> list[bytes]:
    """The stored records, as a dataproxy that remembers each episode's last turn writes them."""
    memory = PriorTurns()
    stored = []
    for index, rec in enumerate(records):
        encoder = rec.encoder(memory.get("episode"))
        stored.append(encoder.encode(weight_version=0, now=0.0))
        memory.put("episode", encoder.recorded_at(index))
    return stored


def test_later_turns_store_only_what_they_add_and_read_back_exactly() -> None:
    records = conversation(6)
    stored = recorded(records)

    # The first turn of an episode is stored whole (its request compressed).
    assert len(stored[0]) > len(records[0].record.prompt_token_ids) + 10_000
    added = [len(records[n].request_json) - len(records[n - 1].request_json) for n in range(1, 6)]
    for n in range(1, 6):
        # Its new messages, about ten new ids, its output and the fixed fields: under 2 KB.
        assert len(stored[n]) < added[n - 1] + 1200, (n, len(stored[n]), added[n - 1])
        raw = msgpack.unpackb(stored[n], raw=False)
        assert raw["request_prefix"][0] == raw["prompt_prefix_ids"][0] == n - 1
    decoded = decode_turns(stored)
    for rec, turn in zip(records, decoded, strict=True):
        assert turn["request_json"] == rec.request_json
        assert turn["prompt_token_ids"] == rec.record.prompt_token_ids
        assert "request_prefix" not in turn and "prompt_prefix_ids" not in turn


def test_a_trajectory_built_from_shared_records_equals_one_built_from_whole_ones() -> None:
    records = conversation(4)
    info = EpisodeInfo(
        trajectory_id="t",
        session_id="s",
        task_id="task",
        key_id="k",
        episode="s",
        started_at=1.0,
        ended_at=2.0,
        end_reason="end_session",
    )
    whole = [rec.encode(weight_version=0, now=0.0) for rec in records]

    assert build_trajectory(info, recorded(records), {"c3": 1.0}) == build_trajectory(
        info, whole, {"c3": 1.0}
    )


def test_a_turn_that_shares_nothing_is_stored_whole() -> None:
    first, second = conversation(2)
    other = WithRequest(
        record(5, [], [1, 2, 3]).record,
        orjson.dumps({"messages": [{"role": "user", "content": "another"}]}),
    )
    prior = first.encoder().recorded_at(0)

    raw = msgpack.unpackb(other.encoder(prior).encode(weight_version=0, now=0.0))
    shared = msgpack.unpackb(second.encoder(prior).encode(weight_version=0, now=0.0))

    assert "request_prefix" not in raw and "prompt_prefix_ids" not in raw
    assert "request_prefix" in shared and "prompt_prefix_ids" in shared


def test_a_prefixed_record_read_alone_or_pointing_forward_is_refused() -> None:
    stored = recorded(conversation(2))
    with pytest.raises(ValueError, match="decode_turns"):
        decode_turn(stored[1])
    with pytest.raises(ValueError, match="not an earlier one"):
        decode_turns([stored[1], stored[0]])


def test_prior_turns_keep_the_latest_index_and_stay_within_their_bounds() -> None:
    memory = PriorTurns(max_episodes=2, max_bytes=100)
    memory.put("a", PriorTurn(index=3, request_json=b"x" * 10, token_ids=b""))
    memory.put("a", PriorTurn(index=2, request_json=b"y" * 10, token_ids=b""))
    assert memory.get("a") == PriorTurn(index=3, request_json=b"x" * 10, token_ids=b"")
    memory.put("b", PriorTurn(index=0, request_json=b"b" * 10, token_ids=b""))
    memory.put("c", PriorTurn(index=0, request_json=b"c" * 10, token_ids=b""))
    assert memory.get("a") is None  # more than two episodes: the least recent goes
    memory.put("d", PriorTurn(index=0, request_json=b"d" * 95, token_ids=b""))
    assert memory.get("b") is None and memory.get("c") is None  # over 100 bytes
    assert memory.get("d") is not None


def test_common_prefix_counts_the_shared_leading_bytes() -> None:
    rng = random.Random(7)
    for _ in range(3000):
        a = bytes(rng.choice(b"ab") for _ in range(rng.randint(0, 200)))
        b = a[: rng.randint(0, len(a))] + bytes(rng.choice(b"ab") for _ in range(rng.randint(0, 9)))
        expected = 0
        while expected < min(len(a), len(b)) and a[expected] == b[expected]:
            expected += 1
        assert common_prefix(a, b) == common_prefix(b, a) == expected
