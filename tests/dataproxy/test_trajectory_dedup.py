"""Schema 2: a trajectory stores each distinct message and tool list once; turn records
store their request compressed. Readers see exactly what schema 1 gave them."""

from __future__ import annotations

import zlib
from typing import Any

import msgpack  # type: ignore[import-untyped]
import orjson
import pytest

from protos import common_pb2
from rollgate.tensors import to_tensors
from rollgate.trajectory import (
    TrajectoryDecodeError,
    decode_trajectory,
    inline_content,
    trajectory_to_json,
)
from services.dataproxy.trajectory import EpisodeInfo, build_trajectory, encode_trajectory
from services.dataproxy.turns import decode_turn, encode_turn, history_entry
from tests.dataproxy.large_prompt import system_prompt, tools

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


def record(n: int, messages: list[dict[str, Any]], prompt_ids: list[int]) -> common_pb2.TurnRecord:
    return common_pb2.TurnRecord(
        interaction_id=f"c{n}",
        upstream_model="m",
        upstream_kind="vllm",
        finish_reason="stop",
        request_json=orjson.dumps({"messages": messages, "tools": tools()}),
        assistant_message_json=orjson.dumps({"role": "assistant", "content": f"answer {n}"}),
        # A short prompt id sequence that extends exactly turn by turn (the size bound below
        # is about the repeated messages; prompt ids are per interaction by design).
        prompt_token_ids=prompt_ids,
        output_token_ids=[1000 + n, 2000 + n],
        output_logprobs=[-0.5, -0.25],
        exact_tokens=True,
        started_at_unix_s=101.0 + n,
    )


def five_turns() -> tuple[list[bytes], list[list[dict[str, Any]]]]:
    """Five turn records of one conversation, each sending the same 48 KB system prompt."""
    messages: list[dict[str, Any]] = [SYSTEM]
    ids: list[int] = [1, 2, 3]
    turns, sent = [], []
    for n in range(5):
        messages = [*messages, {"role": "user", "content": f"question {n}"}]
        ids = [*ids, 50 + n]
        turns.append(encode_turn(record(n, messages, ids), weight_version=1, now=0.0))
        sent.append(messages)
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
        rec.exact_tokens = False
        turns.append(encode_turn(rec, weight_version=0, now=0.0))
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
    stored = msgpack.unpackb(encode_turn(rec, weight_version=0, now=0.0), raw=False)

    assert stored["request_codec"] == "zlib"
    assert len(stored["request_json"]) < len(rec.request_json) / 2
    assert zlib.decompress(stored["request_json"]) == rec.request_json
    turn = decode_turn(encode_turn(rec, weight_version=0, now=0.0))
    assert turn["request_json"] == rec.request_json and "request_codec" not in turn
    assert orjson.loads(history_entry(turn, None))["request"]["messages"] == messages


def test_an_uncompressed_turn_record_from_before_still_reads_and_publishes() -> None:
    stored = msgpack.unpackb(
        encode_turn(record(0, [SYSTEM], [1]), weight_version=0, now=0.0), raw=False
    )
    stored["request_json"] = zlib.decompress(stored.pop("request_json"))
    del stored["request_codec"]
    old = msgpack.packb(stored, use_bin_type=True)

    assert decode_turn(old)["request_json"] == stored["request_json"]
    (interaction,) = decode_trajectory(
        encode_trajectory(build_trajectory(INFO, [old], {}))
    ).interactions
    assert interaction.messages == [SYSTEM] and interaction.tools == tools()


def test_an_unknown_request_codec_is_an_error_not_garbage() -> None:
    stored = msgpack.unpackb(
        encode_turn(record(0, [SYSTEM], [1]), weight_version=0, now=0.0), raw=False
    )
    stored["request_codec"] = "brotli"

    with pytest.raises(ValueError, match="brotli"):
        decode_turn(msgpack.packb(stored, use_bin_type=True))


def test_a_small_request_is_stored_as_is_without_paying_for_compression() -> None:
    request = orjson.dumps({"messages": [{"role": "user", "content": "hi"}]})
    record = common_pb2.TurnRecord(interaction_id="chatcmpl-small", request_json=request)

    stored = msgpack.unpackb(encode_turn(record, weight_version=0, now=1.0), raw=False)

    assert stored["request_json"] == request
    assert "request_codec" not in stored
    assert decode_turn(encode_turn(record, weight_version=0, now=1.0))["request_json"] == request
