"""Turn records → trajectory: rewards, parent linking, packing, and the round trip."""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Sequence
from typing import Any

import msgpack  # type: ignore[import-untyped]
import orjson
import pytest

from rollgate.trajectory import decode_trajectory, inline_content
from schema.trajectory import CODEC, SCHEMA_VERSION
from services.dataproxy.trajectory import EpisodeInfo, build_trajectory, encode_trajectory

INFO = EpisodeInfo(
    trajectory_id="traj-1",
    session_id="task-7",
    task_id="task",
    key_id="k1",
    episode="task-7",
    started_at=100.0,
    ended_at=160.5,
    end_reason="end_session",
)

SYSTEM = {"role": "system", "content": "be brief"}


def ints(values: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(values)}i", *values)


def floats(values: Sequence[float]) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def turn(
    interaction_id: str,
    *,
    messages: list[dict[str, Any]],
    output: dict[str, Any] | None = None,
    prompt_ids: Sequence[int] = (),
    output_ids: Sequence[int] = (),
    logprobs: Sequence[float] | None = None,
    exact: bool = True,
    version: int = 0,
    tools: list[dict[str, Any]] | None = None,
) -> bytes:
    """A turn record as the dataproxy stores it (docs/internals.md "Turn records")."""
    output = output or {"role": "assistant", "content": f"answer {interaction_id}"}
    logprobs = [-0.5] * len(output_ids) if logprobs is None else logprobs
    request: dict[str, Any] = {"messages": messages}
    if tools is not None:
        request["tools"] = tools
    return bytes(
        msgpack.packb(
            {
                "interaction_id": interaction_id,
                "created_at": 101.0,
                "latency_s": 0.25,
                "ttft_s": 0.05,
                "upstream_model": "m",
                "upstream_kind": "vllm",
                "finish_reason": "stop",
                "request_json": orjson.dumps(request),
                "assistant_message_json": orjson.dumps(output),
                "usage_json": orjson.dumps({"prompt_tokens": len(prompt_ids)}),
                "prompt_token_ids": ints(prompt_ids),
                "output_token_ids": ints(output_ids),
                "output_logprobs": floats(logprobs),
                "exact_tokens": exact,
                "length_mismatch": len(logprobs) != len(output_ids),
                "weight_version": version,
            },
            use_bin_type=True,
        )
    )


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(interaction_id: str) -> dict[str, Any]:
    return {"role": "assistant", "content": f"answer {interaction_id}"}


def test_trajectory_carries_identity_timing_and_schema_version() -> None:
    t = build_trajectory(INFO, [turn("c1", messages=[SYSTEM, user("hi")])], {"c1": 1.0})

    assert t["schema_version"] == SCHEMA_VERSION == 2
    assert (t["trajectory_id"], t["session_id"], t["task_id"], t["key_id"]) == (
        "traj-1",
        "task-7",
        "task",
        "k1",
    )
    assert (t["started_at"], t["ended_at"], t["end_reason"], t["group_id"]) == (
        100.0,
        160.5,
        "end_session",
        None,
    )
    first = inline_content(t)["interactions"][0]
    assert first["messages"] == [SYSTEM, user("hi")]
    assert first["output"] == assistant("c1")
    assert first["usage"] == {"prompt_tokens": 0}
    assert first["tools"] is None
    assert CODEC == "msgpack"


def test_missing_rewards_are_zero_and_marked_unset() -> None:
    turns = [
        turn("c1", messages=[user("a")]),
        turn("c2", messages=[user("a"), assistant("c1"), user("b")]),
    ]
    t = build_trajectory(INFO, turns, {"c1": 0.5})

    rewards = [(i["reward"], i["reward_set"]) for i in t["interactions"]]
    assert rewards == [(0.5, True), (0.0, False)]
    assert t["final_reward"] == 0.0


def test_final_reward_is_the_last_interactions_reward() -> None:
    turns = [
        turn("c1", messages=[user("a")]),
        turn("c2", messages=[user("a"), assistant("c1"), user("b")]),
    ]
    t = build_trajectory(INFO, turns, {"c2": 2.5})

    assert t["final_reward"] == 2.5
    assert t["interactions"][0]["reward"] == 0.0


def test_parent_is_the_longest_earlier_turn_whose_ids_extend_into_the_prompt() -> None:
    turns = [
        turn("c1", messages=[user("a")], prompt_ids=[1, 2], output_ids=[3]),
        turn("c2", messages=[user("x")], prompt_ids=[1, 2, 3, 4], output_ids=[5]),
        turn("c3", messages=[user("y")], prompt_ids=[1, 2, 3, 4, 5, 6], output_ids=[7]),
        turn("c4", messages=[user("z")], prompt_ids=[9, 9], output_ids=[1]),
    ]
    t = build_trajectory(INFO, turns, {})

    assert [i["parent"] for i in t["interactions"]] == [None, 0, 1, None]
    assert t["stats"]["joined"] == 2
    assert t["stats"]["interactions"] == 4


def test_exact_ids_that_do_not_extend_give_no_parent_even_when_messages_do() -> None:
    # A client that re-renders its system prompt keeps the message list but breaks the ids.
    turns = [
        turn("c1", messages=[user("a")], prompt_ids=[1, 2], output_ids=[3]),
        turn("c2", messages=[user("a"), assistant("c1"), user("b")], prompt_ids=[1, 8, 3, 4]),
    ]
    t = build_trajectory(INFO, turns, {})

    assert t["interactions"][1]["parent"] is None
    assert t["stats"]["joined"] == 0


def test_without_exact_ids_the_parent_is_found_by_message_prefix() -> None:
    first = [SYSTEM, user("a")]
    second = [*first, assistant("c1"), user("b")]
    turns = [
        turn("c1", messages=first, prompt_ids=[1, 2], output_ids=[3], exact=False),
        turn("c2", messages=[SYSTEM, user("other")], exact=False),
        turn("c3", messages=second, prompt_ids=[7, 7, 7], output_ids=[4], exact=False),
        turn("c4", messages=[*second, assistant("c3"), user("c")], exact=False),
    ]
    t = build_trajectory(INFO, turns, {})

    assert [i["parent"] for i in t["interactions"]] == [None, None, 0, 2]


def test_message_prefix_ignores_null_extras_the_client_echoes_back() -> None:
    output = {"role": "assistant", "content": "", "tool_calls": [{"id": "t1"}]}
    echoed = {**output, "content": None, "refusal": None}
    turns = [
        turn("c1", messages=[user("a")], output=output, exact=False),
        turn("c2", messages=[user("a"), echoed, {"role": "tool", "content": "ok"}], exact=False),
    ]
    t = build_trajectory(INFO, turns, {})

    assert t["interactions"][1]["parent"] == 0


def test_a_length_mismatch_is_flagged_and_not_padded() -> None:
    turns = [
        turn("c1", messages=[user("a")], output_ids=[5, 6, 7], logprobs=[-0.1, -0.2], version=3)
    ]
    t = decode_trajectory(encode_trajectory(build_trajectory(INFO, turns, {})))

    only = t.interactions[0]
    assert only.length_mismatch is True
    assert only.output_token_ids == [5, 6, 7]
    assert len(only.output_logprobs) == 2
    assert only.output_versions == [3, 3, 3]
    assert t.stats["length_mismatches"] == 1


def test_packed_arrays_round_trip_through_decode_trajectory() -> None:
    prompt = [0, 1, 151_643, 2**31 - 1, -1]
    logprobs = [-0.0, -1.25, -17.5]
    turns = [
        turn(
            "c1",
            messages=[user("a")],
            prompt_ids=prompt,
            output_ids=[42, 43, 44],
            logprobs=logprobs,
            version=7,
        ),
        turn("c2", messages=[user("b")], prompt_ids=[1], output_ids=[2], version=2),
    ]
    raw = build_trajectory(INFO, turns, {"c2": 1.0})
    assert isinstance(raw["interactions"][0]["prompt_token_ids"], bytes)

    t = decode_trajectory(encode_trajectory(raw), CODEC)

    first = t.interactions[0]
    assert first.prompt_token_ids == prompt
    assert first.output_token_ids == [42, 43, 44]
    assert first.output_logprobs == pytest.approx(logprobs)
    assert first.output_versions == [7, 7, 7]
    assert first.exact_tokens is True and first.length_mismatch is False
    assert t.weight_versions == [2, 7]
    assert t.final_reward == 1.0
    assert [i.interaction_id for i in t.interactions] == ["c1", "c2"]
    assert t.interactions[1].index == 1


def test_an_episode_without_turns_builds_an_empty_trajectory() -> None:
    t = build_trajectory(INFO, [], {})

    assert t["interactions"] == []
    assert t["final_reward"] == 0.0
    assert t["stats"] == {
        "interactions": 0,
        "joined": 0,
        "exact_joined": 0,
        "retries": 0,
        "length_mismatches": 0,
    }


def test_tools_and_group_id_are_carried() -> None:
    tools = [{"type": "function", "function": {"name": "ls"}}]
    info = dataclasses.replace(INFO, group_id="g1")
    t = build_trajectory(info, [turn("c1", messages=[user("a")], tools=tools)], {})

    assert t["group_id"] == "g1"
    assert t["tools_table"] == [tools] and t["interactions"][0]["tools_ref"] == 0
    assert inline_content(t)["interactions"][0]["tools"] == tools


def test_group_size_is_carried_and_absent_without_a_group() -> None:
    grouped = build_trajectory(dataclasses.replace(INFO, group_id="g", group_size=4), [], {})
    alone = build_trajectory(INFO, [], {})

    assert (grouped["group_id"], grouped["group_size"]) == ("g", 4)
    assert (alone["group_id"], alone["group_size"]) == (None, None)


def test_per_token_versions_recorded_by_the_turn_are_kept() -> None:
    raw = msgpack.unpackb(turn("c1", messages=[user("a")], output_ids=[5, 6, 7]), raw=False)
    raw["output_versions"] = ints([3, 3, 4])  # the weights changed mid-generation
    raw["weight_version"] = 3
    t = build_trajectory(INFO, [msgpack.packb(raw, use_bin_type=True)], {})

    assert t["interactions"][0]["output_versions"] == ints([3, 3, 4])
    assert t["weight_versions"] == [3, 4]


def test_without_per_token_versions_the_turn_version_is_repeated() -> None:
    t = build_trajectory(INFO, [turn("c1", messages=[user("a")], output_ids=[5, 6], version=2)], {})

    assert t["interactions"][0]["output_versions"] == ints([2, 2])


def test_stats_tell_exact_joins_from_message_joins_and_count_retries() -> None:
    first = [SYSTEM, user("q")]
    second = [*first, assistant("c1"), user("r")]
    turns = [
        turn("c1", messages=first, prompt_ids=[1, 2], output_ids=[3]),
        turn("c1-retry", messages=first, prompt_ids=[1, 2], output_ids=[4]),
        turn("c2", messages=second, prompt_ids=[1, 2, 3, 9], output_ids=[5]),
        turn("c3", messages=[*second, assistant("c2"), user("s")], exact=False),
    ]

    t = build_trajectory(INFO, turns, {})

    assert [i["parent"] for i in t["interactions"]] == [None, None, 0, 2]
    assert t["stats"] == {
        "interactions": 4,
        "joined": 2,
        "exact_joined": 1,
        "retries": 1,
        "length_mismatches": 0,
    }
