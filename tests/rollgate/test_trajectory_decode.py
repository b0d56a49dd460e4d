"""rollgate.trajectory: typed views over the msgpack schema, tolerant of additions."""

from __future__ import annotations

import struct

import msgpack  # type: ignore[import-untyped]
import orjson
import pytest

from rollgate.trajectory import TrajectoryDecodeError, decode_trajectory, trajectory_to_json


def blob(**overrides: object) -> bytes:
    interaction = {
        "interaction_id": "c1",
        "index": 0,
        "parent": None,
        "messages": [{"role": "user", "content": "hi"}],
        "tools": None,
        "output": {"role": "assistant", "content": "yo"},
        "prompt_token_ids": struct.pack("<3i", 7, -2, 2**31 - 1),
        "output_token_ids": struct.pack("<2i", 4, 5),
        "output_logprobs": struct.pack("<2f", -0.5, -1.5),
        "output_versions": struct.pack("<2i", 9, 9),
        "exact_tokens": True,
        "reward": 1.5,
        "reward_set": True,
        "a_field_from_a_later_version": {"x": 1},
    }
    trajectory = {
        "schema_version": 1,
        "trajectory_id": "t1",
        "session_id": "s",
        "final_reward": 1.5,
        "weight_versions": [9],
        "stats": {"interactions": 1, "joined": 0, "length_mismatches": 0},
        "interactions": [interaction],
        "another_new_field": [1, 2],
        **overrides,
    }
    return bytes(msgpack.packb(trajectory, use_bin_type=True))


def test_unknown_fields_are_ignored_and_missing_optional_ones_default() -> None:
    t = decode_trajectory(blob())

    assert t.trajectory_id == "t1"
    assert t.group_id is None and t.end_reason == ""
    only = t.interactions[0]
    assert only.prompt_token_ids == [7, -2, 2**31 - 1]
    assert only.output_logprobs == [-0.5, -1.5]
    assert only.output_versions == [9, 9]
    assert only.length_mismatch is False
    assert (t.prompt_tokens, t.output_tokens) == (3, 2)


def test_a_newer_schema_version_is_refused_with_advice() -> None:
    with pytest.raises(TrajectoryDecodeError, match="upgrade rollgate"):
        decode_trajectory(blob(schema_version=3))


def test_an_unknown_codec_is_refused() -> None:
    with pytest.raises(TrajectoryDecodeError, match="codec 'zstd'"):
        decode_trajectory(blob(), "zstd")


def test_garbage_is_refused() -> None:
    with pytest.raises(TrajectoryDecodeError):
        decode_trajectory(b"\xc1 not msgpack")
    misaligned = blob(interactions=[{"prompt_token_ids": b"\x01\x02\x03"}])
    interaction = decode_trajectory(misaligned).interactions[0]
    with pytest.raises(TrajectoryDecodeError, match="not 4-byte aligned"):
        _ = interaction.prompt_token_ids


def test_json_view_turns_packed_arrays_into_lists() -> None:
    data = trajectory_to_json(decode_trajectory(blob()))

    only = data["interactions"][0]
    assert only["prompt_token_ids"] == [7, -2, 2**31 - 1]
    assert only["output_versions"] == [9, 9]
    assert "prompt_token_ids_bytes" not in only
    assert data["weight_versions"] == [9]
    assert orjson.loads(orjson.dumps(data))["interactions"][0]["reward"] == 1.5
