"""The one trajectory schema: what the worker's TurnRecord carries reaches a reader unchanged,
through the dataproxy's turn record, builder and the msgpack blob, for every field it lists."""

from __future__ import annotations

import orjson

from protos import common_pb2
from rollgate.trajectory import decode_trajectory, trajectory_from_json, trajectory_to_json
from schema.packing import pack_float32, pack_int32, unpack_float32, unpack_int32
from schema.trajectory import (
    INTERACTION_SPECS,
    SAMPLE_SPECS,
    TURN_RECORD_FIELDS,
    TURN_SAMPLE_FIELDS,
    Interaction,
    Sample,
)
from services.dataproxy.trajectory import EpisodeInfo, build_trajectory, encode_trajectory
from services.dataproxy.turns import encode_turn

INFO = EpisodeInfo(
    trajectory_id="traj-1",
    session_id="s-1",
    task_id="t",
    key_id="k",
    episode="s-1",
    started_at=1.0,
    ended_at=2.0,
    end_reason="end_session",
)


def test_every_copied_field_is_a_field_of_the_worker_messages() -> None:
    assert set(TURN_RECORD_FIELDS) <= set(common_pb2.TurnRecord.DESCRIPTOR.fields_by_name)
    assert set(TURN_SAMPLE_FIELDS) <= set(common_pb2.TurnSample.DESCRIPTOR.fields_by_name)


def _distinct(message: type[common_pb2.TurnRecord] | type[common_pb2.TurnSample], names: tuple[str, ...]) -> dict[str, object]:  # fmt: skip
    """A value per field that no default could be mistaken for."""
    values: dict[str, object] = {}
    for name in names:
        kind = message.DESCRIPTOR.fields_by_name[name].type
        if name == "output_token_ids":
            values[name] = pack_int32([11, 12, 13])
        elif name == "output_logprobs":
            values[name] = pack_float32([-0.5, -0.25, -0.125])
        elif kind == 8:  # bool
            values[name] = True
        elif kind in (1, 2):  # double, float
            values[name] = 0.75
        else:
            values[name] = f"{name}-value"
    return values


def test_each_field_the_schema_copies_arrives_at_the_reader_as_the_worker_sent_it() -> None:
    record_fields = _distinct(common_pb2.TurnRecord, TURN_RECORD_FIELDS)
    sample_fields = _distinct(common_pb2.TurnSample, TURN_SAMPLE_FIELDS)
    record = common_pb2.TurnRecord(
        **record_fields,
        prompt_token_ids=pack_int32([1, 2]),
        assistant_message_json=orjson.dumps({"role": "assistant", "content": "hi"}),
        extra_samples=[common_pb2.TurnSample(**sample_fields, assistant_message_json=b"{}")],
    )
    request = orjson.dumps({"messages": [{"role": "user", "content": "hi"}]})
    stored = encode_turn(record, request_json=request, weight_version=3, now=5.0)
    blob = encode_trajectory(build_trajectory(INFO, [stored], {}))
    (interaction,) = decode_trajectory(blob).interactions

    for attribute, spec in INTERACTION_SPECS.items():
        if spec.proto:
            assert getattr(interaction, attribute) == record_fields[spec.turn or ""], attribute
    (sample,) = interaction.samples
    for attribute, spec in SAMPLE_SPECS.items():
        if spec.proto:
            assert getattr(sample, attribute) == sample_fields[spec.turn or ""], attribute
    assert interaction.output_token_ids == [11, 12, 13]
    assert interaction.output_versions == [3, 3, 3]
    assert sample.output_versions == [3, 3, 3]
    assert interaction.prompt_token_ids == [1, 2]


def test_a_map_without_the_fields_reads_as_the_defaults() -> None:
    blob = encode_trajectory({"schema_version": 2, "interactions": [{"samples": [{}]}]})
    trajectory = decode_trajectory(blob)
    (interaction,) = trajectory.interactions
    assert interaction == Interaction(samples=(Sample(),))
    assert interaction.turn_type == "main"
    assert interaction.output_versions_source == "admission"
    assert trajectory_from_json(trajectory_to_json(trajectory)) == trajectory


def test_packed_arrays_are_little_endian_int32_and_float32() -> None:
    assert pack_int32([1, -2]) == b"\x01\x00\x00\x00\xfe\xff\xff\xff"
    assert pack_float32([1.0]) == b"\x00\x00\x80\x3f"
    assert unpack_int32(pack_int32([7, 2**31 - 1])) == [7, 2**31 - 1]
    assert unpack_float32(pack_float32([-0.5])) == [-0.5]
