"""Schema 2: a trajectory stores each distinct message and tool list once, and each prompt's
ids as a prefix shared with an earlier interaction plus its own suffix; turn records store
their request compressed. Readers see exactly what schema 1 gave them."""

from __future__ import annotations

import struct
import zlib
from typing import Any

import msgpack  # type: ignore[import-untyped]
import orjson
import pytest

from rollgate.tensors import to_tensors
from rollgate.trajectory import (
    TrajectoryDecodeError,
    decode_trajectory,
    inline_content,
    trajectory_to_json,
)
from services.dataproxy.trajectory import EpisodeInfo, build_trajectory, encode_trajectory
from services.dataproxy.turns import decode_turn, history_entry
from tests.dataproxy.large_prompt import prompt_ids, system_prompt, tools
from tests.dataproxy.turn_records import WithRequest, turn_record

INFO = EpisodeInfo(
    trajectory_id="traj-big",
    session_id="s-1",
    task_id="task",
    key_id="k1",
    episode="s-1",
    started_at=100.0,
    ended_at=160.0,
    end_reason="end_session",
)
SYSTEM = {"role": "system", "content": system_prompt()}
PROMPT_BYTES = len(orjson.dumps(SYSTEM["content"]))
SYSTEM_IDS = prompt_ids(SYSTEM["content"])  # ~12k ids, as a real tokenizer gives for 48 KB


def record(n: int, messages: list[dict[str, Any]], prompt_ids: list[int]) -> WithRequest:
    rec = turn_record(
        interaction_id=f"c{n}",
        upstream_model="m",
        upstream_kind="vllm",
        finish_reason="stop",
        assistant_message_json=orjson.dumps({"role": "assistant", "content": f"answer {n}"}),
        # Prompt ids that extend exactly turn by turn.
        prompt_token_ids=prompt_ids,
        output_token_ids=[1000 + n, 2000 + n],
        output_logprobs=[-0.5, -0.25],
        exact_tokens=True,
        started_at_unix_s=101.0 + n,
    )
    return WithRequest(rec, orjson.dumps({"messages": messages, "tools": tools()}))


def five_turns(
    first_ids: list[int] | None = None, sent_ids: list[list[int]] | None = None
) -> tuple[list[bytes], list[list[dict[str, Any]]]]:
    """Five turn records of one conversation, each sending the same 48 KB system prompt;
    its prompt ids start with `first_ids` (default: 3 ids) and are appended to `sent_ids`."""
    messages: list[dict[str, Any]] = [SYSTEM]
    ids: list[int] = [1, 2, 3] if first_ids is None else first_ids
    turns, sent = [], []
    for n in range(5):
        messages = [*messages, {"role": "user", "content": f"question {n}"}]
        ids = [*ids, 50 + n]
        turns.append(record(n, messages, ids).encode(weight_version=1, now=0.0))
        sent.append(messages)
        if sent_ids is not None:
            sent_ids.append(ids)
        messages = [*messages, {"role": "assistant", "content": f"answer {n}"}]
        ids = [*ids, 1000 + n, 2000 + n]
    return turns, sent


def as_v1(trajectory: dict[str, Any]) -> bytes:
    """The same trajectory in the schema 1 layout (messages and tools inline)."""
    return encode_trajectory({**inline_content(trajectory), "schema_version": 1})


def test_five_turns_of_a_48_kb_prompt_publish_less_than_two_prompts() -> None:
    turns, _ = five_turns()
    built = build_trajectory(INFO, turns, {"c4": 1.0})
    blob = encode_trajectory(built)
    v1 = as_v1(built)

    assert PROMPT_BYTES >= 48 * 1024
    assert len(blob) < 2 * PROMPT_BYTES, (len(blob), PROMPT_BYTES)
    assert len(v1) > 5 * PROMPT_BYTES  # what schema 1 stored: the prompt once per turn
    assert built["schema_version"] == 2
    # The system prompt and the tool list are stored once, shared by every interaction.
    assert [m["role"] for m in built["messages_table"]].count("system") == 1
    assert len(built["tools_table"]) == 1
    assert [i["tools_ref"] for i in built["interactions"]] == [0] * 5
    assert all(i["messages_ref"][0] == 0 for i in built["interactions"])
    assert all("messages" not in i for i in built["interactions"])


def test_v2_decodes_to_the_messages_each_turn_sent_and_same_tensors_as_v1() -> None:
    turns, sent = five_turns()
    built = build_trajectory(INFO, turns, {"c4": 1.0})
    v2 = decode_trajectory(encode_trajectory(built))
    v1 = decode_trajectory(as_v1(built))

    assert [i.messages for i in v2.interactions] == sent
    assert all(i.tools == tools() for i in v2.interactions)
    assert v2.interactions == v1.interactions
    assert [i.parent for i in v2.interactions] == [None, 0, 1, 2, 3]
    assert v2.stats == v1.stats and v2.stats["joined"] == v2.stats["exact_joined"] == 4
    for style in ("individual", "concat"):
        assert to_tensors(v2, style=style).as_dict() == to_tensors(v1, style=style).as_dict()
    assert len(to_tensors(v2, style="concat").input_ids) == 1


def test_message_linking_works_through_the_tables_without_token_ids() -> None:
    turns = []
    messages: list[dict[str, Any]] = [SYSTEM]
    for n in range(3):
        messages = [*messages, {"role": "user", "content": f"q{n}"}]
        rec = record(n, messages, [])
        rec.record.exact_tokens = False
        turns.append(rec.encode(weight_version=0, now=0.0))
        messages = [*messages, {"role": "assistant", "content": f"answer {n}"}]

    t = decode_trajectory(encode_trajectory(build_trajectory(INFO, turns, {})))

    assert [i.parent for i in t.interactions] == [None, 0, 1]
    assert t.interactions[2].messages[-1] == {"role": "user", "content": "q2"}


def test_json_view_prints_expanded_messages_not_references() -> None:
    turns, sent = five_turns()
    out = trajectory_to_json(
        decode_trajectory(encode_trajectory(build_trajectory(INFO, turns, {})))
    )

    assert [i["messages"] for i in out["interactions"]] == sent
    assert out["interactions"][0]["tools"] == tools()
    assert "messages_table" not in out and "messages_ref" not in out["interactions"][0]


def test_a_reference_outside_its_table_is_refused() -> None:
    turns, _ = five_turns()
    built = build_trajectory(INFO, turns[:1], {})
    for bad in ({"messages_ref": [0, 99]}, {"messages_ref": [-1]}, {"tools_ref": 3}):
        broken = {**built, "interactions": [{**built["interactions"][0], **bad}]}
        with pytest.raises(TrajectoryDecodeError, match="outside its table"):
            decode_trajectory(encode_trajectory(broken))


def test_a_turn_record_stores_its_request_compressed_and_reads_it_back() -> None:
    messages = [SYSTEM, {"role": "user", "content": "hi"}]
    rec = record(0, messages, [1, 2])
    stored = msgpack.unpackb(rec.encode(weight_version=0, now=0.0), raw=False)

    assert stored["request_codec"] == "zlib"
    assert len(stored["request_json"]) < len(rec.request_json) / 2
    assert zlib.decompress(stored["request_json"]) == rec.request_json
    turn = decode_turn(rec.encode(weight_version=0, now=0.0))
    assert turn["request_json"] == rec.request_json and "request_codec" not in turn
    assert orjson.loads(history_entry(turn, None))["request"]["messages"] == messages


def test_an_uncompressed_turn_record_from_before_still_reads_and_publishes() -> None:
    stored = msgpack.unpackb(record(0, [SYSTEM], [1]).encode(weight_version=0, now=0.0), raw=False)
    stored["request_json"] = zlib.decompress(stored.pop("request_json"))
    del stored["request_codec"]
    old = msgpack.packb(stored, use_bin_type=True)

    assert decode_turn(old)["request_json"] == stored["request_json"]
    (interaction,) = decode_trajectory(
        encode_trajectory(build_trajectory(INFO, [old], {}))
    ).interactions
    assert interaction.messages == [SYSTEM] and interaction.tools == tools()


def test_an_unknown_request_codec_is_an_error_not_garbage() -> None:
    stored = msgpack.unpackb(record(0, [SYSTEM], [1]).encode(weight_version=0, now=0.0), raw=False)
    stored["request_codec"] = "brotli"

    with pytest.raises(ValueError, match="brotli"):
        decode_turn(msgpack.packb(stored, use_bin_type=True))


def test_a_small_request_is_stored_as_is_without_paying_for_compression() -> None:
    request = orjson.dumps({"messages": [{"role": "user", "content": "hi"}]})
    small = WithRequest(turn_record(interaction_id="chatcmpl-small"), request)

    stored = msgpack.unpackb(small.encode(weight_version=0, now=1.0), raw=False)

    assert stored["request_json"] == request
    assert "request_codec" not in stored
    assert decode_turn(small.encode(weight_version=0, now=1.0))["request_json"] == request


# --- Prompt ids: a prefix shared with an earlier interaction, plus the interaction's own ids


def ids_bytes(ids: list[int]) -> bytes:
    return struct.pack(f"<{len(ids)}i", *ids)


def undeduplicated(built: dict[str, Any], sent_ids: list[list[int]]) -> dict[str, Any]:
    """The same trajectory in the earlier version 2 layout: whole prompt ids, no prefixes."""
    interactions = [
        {
            **{k: v for k, v in item.items() if k != "prompt_prefix"},
            "prompt_token_ids": ids_bytes(ids),
        }
        for item, ids in zip(built["interactions"], sent_ids, strict=True)
    ]
    return {**built, "interactions": interactions}


def test_five_turns_of_a_48_kb_prompt_and_its_ids_publish_about_one_prompt() -> None:
    sent_ids: list[list[int]] = []
    turns, _ = five_turns(SYSTEM_IDS, sent_ids)
    built = build_trajectory(INFO, turns, {"c4": 1.0})
    blob = encode_trajectory(built)
    before = encode_trajectory(undeduplicated(built, sent_ids))
    one_prompt = PROMPT_BYTES + 4 * len(SYSTEM_IDS)

    # One copy of the prompt's text, of its ids and of the tool list, plus under 1 KB of
    # fields per interaction: measured 104.5 KB for 100 KB of text + ids (1.05x).
    assert len(blob) < one_prompt + len(orjson.dumps(tools())) + 5 * 1024, (len(blob), one_prompt)
    assert len(blob) < 1.1 * one_prompt
    assert len(before) > 3 * one_prompt  # the ids once per turn: measured 301 KB
    first, *rest = built["interactions"]
    assert "prompt_prefix" not in first and first["prompt_token_ids"] == ids_bytes(sent_ids[0])
    for index, item in enumerate(rest, start=1):
        # Each prompt is the previous prompt + its output ids + one new user id.
        assert item["prompt_prefix"] == {
            "from": index - 1,
            "source": "prompt+output",
            "length": len(sent_ids[index]) - 1,
        }
        assert item["prompt_token_ids"] == ids_bytes(sent_ids[index][-1:])


def test_shared_prompt_ids_decode_exactly_with_the_same_tensors_as_whole_ones() -> None:
    sent_ids: list[list[int]] = []
    turns, _ = five_turns(SYSTEM_IDS, sent_ids)
    built = build_trajectory(INFO, turns, {"c4": 1.0})
    shared = decode_trajectory(encode_trajectory(built))
    whole = decode_trajectory(encode_trajectory(undeduplicated(built, sent_ids)))
    v1 = decode_trajectory(as_v1(undeduplicated(built, sent_ids)))

    assert [i.prompt_token_ids for i in shared.interactions] == sent_ids
    assert shared.interactions == whole.interactions == v1.interactions
    assert [i.parent for i in shared.interactions] == [None, 0, 1, 2, 3]
    assert shared.stats == whole.stats and shared.stats["exact_joined"] == 4
    assert shared.prompt_tokens == sum(len(ids) for ids in sent_ids)
    for style in ("individual", "concat"):
        assert to_tensors(shared, style=style).as_dict() == to_tensors(whole, style=style).as_dict()
    json_view = trajectory_to_json(shared)["interactions"]
    assert [i["prompt_token_ids"] for i in json_view] == sent_ids
    assert all("prompt_prefix" not in i for i in inline_content(built)["interactions"])


def test_a_prefix_may_be_an_earlier_prompt_alone_and_chains_of_prefixes_resolve() -> None:
    # Turn 1 continues turn 0; turn 2 retries turn 0's question differently: it shares the
    # system prompt and first question with turn 1's prompt, which itself points at turn 0.
    q0 = [*SYSTEM_IDS, 50]
    sent_ids = [q0, [*q0, 1000, 2000, 51], [*q0, 7, 8]]
    turns = [
        record(n, [SYSTEM], ids).encode(weight_version=1, now=0.0) for n, ids in enumerate(sent_ids)
    ]
    built = build_trajectory(INFO, turns, {})

    prefixes = [i.get("prompt_prefix") for i in built["interactions"]]
    assert prefixes == [
        None,
        {"from": 0, "source": "prompt+output", "length": len(q0) + 2},
        {"from": 1, "source": "prompt", "length": len(q0)},
    ]
    decoded = decode_trajectory(encode_trajectory(built))
    assert [i.prompt_token_ids for i in decoded.interactions] == sent_ids
    assert [i.parent for i in decoded.interactions] == [None, 0, None]


def test_prompts_that_diverge_early_keep_their_whole_ids() -> None:
    # A client that re-renders the top of its system prompt every turn (a timestamp first).
    sent_ids = [[900 + n, *SYSTEM_IDS] for n in range(3)]
    turns = [
        record(n, [SYSTEM], ids).encode(weight_version=1, now=0.0) for n, ids in enumerate(sent_ids)
    ]
    built = build_trajectory(INFO, turns, {})

    assert all("prompt_prefix" not in i for i in built["interactions"])
    assert [i["prompt_token_ids"] for i in built["interactions"]] == [
        ids_bytes(ids) for ids in sent_ids
    ]
    decoded = decode_trajectory(encode_trajectory(built))
    assert [i.prompt_token_ids for i in decoded.interactions] == sent_ids


def test_a_prefix_of_64_ids_is_shared_and_one_of_63_is_not() -> None:
    head = SYSTEM_IDS[:64]
    sent_ids = [[*head, 1], [*head, 2], [*head[:63], 3]]
    turns = [
        record(n, [SYSTEM], ids).encode(weight_version=1, now=0.0) for n, ids in enumerate(sent_ids)
    ]
    built = build_trajectory(INFO, turns, {})

    prefixes = [i.get("prompt_prefix") for i in built["interactions"]]
    assert prefixes == [None, {"from": 0, "source": "prompt", "length": 64}, None]
    decoded = decode_trajectory(encode_trajectory(built))
    assert [i.prompt_token_ids for i in decoded.interactions] == sent_ids


@pytest.mark.parametrize(
    ("prefix", "error"),
    [
        ({"from": 1, "source": "prompt", "length": 64}, "not one of the 1 interactions"),
        ({"from": -1, "source": "prompt", "length": 64}, "not one of the 1 interactions"),
        ({"from": 0, "source": "prompt", "length": 10**6}, "longer than its source"),
        ({"from": 0, "source": "output", "length": 64}, "source 'output' is not known"),
        ([0, "prompt", 64], "is not a map"),
    ],
)
def test_a_broken_prompt_prefix_is_refused(prefix: Any, error: str) -> None:
    sent_ids: list[list[int]] = []
    turns, _ = five_turns(SYSTEM_IDS, sent_ids)
    built = build_trajectory(INFO, turns[:2], {})
    second = {**built["interactions"][1], "prompt_prefix": prefix}
    broken = {**built, "interactions": [built["interactions"][0], second]}

    with pytest.raises(TrajectoryDecodeError, match=error):
        decode_trajectory(encode_trajectory(broken))
