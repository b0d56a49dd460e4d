"""Trajectory → AReaL tensors: individual and concat rows, discount, orphans, numpy."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import msgpack  # type: ignore[import-untyped]
import orjson
import pytest

from rollgate.tensors import TENSOR_KEYS, to_tensors
from rollgate.trajectory import Trajectory, decode_trajectory
from services.dataproxy.trajectory import EpisodeInfo, build_trajectory, encode_trajectory

INFO = EpisodeInfo(
    trajectory_id="traj-1",
    session_id="task-1",
    task_id="task",
    key_id="k",
    episode="task-1",
    started_at=1.0,
    ended_at=2.0,
    end_reason="end_session",
)


def turn(
    interaction_id: str,
    *,
    prompt: Sequence[int],
    output: Sequence[int],
    messages: list[dict[str, Any]] | None = None,
    logprobs: Sequence[float] | None = None,
    exact: bool = True,
    version: int = 0,
    created_at: float = 1.0,
) -> bytes:
    logprobs = [-0.1 * (k + 1) for k in range(len(output))] if logprobs is None else logprobs
    messages = messages if messages is not None else [{"role": "user", "content": interaction_id}]
    return bytes(
        msgpack.packb(
            {
                "interaction_id": interaction_id,
                "created_at": created_at,
                "request_json": orjson.dumps({"messages": messages}),
                "assistant_message_json": orjson.dumps({"role": "assistant", "content": "a"}),
                "prompt_token_ids": struct.pack(f"<{len(prompt)}i", *prompt),
                "output_token_ids": struct.pack(f"<{len(output)}i", *output),
                "output_logprobs": struct.pack(f"<{len(logprobs)}f", *logprobs),
                "exact_tokens": exact,
                "length_mismatch": len(logprobs) != len(output),
                "weight_version": version,
            },
            use_bin_type=True,
        )
    )


def episode(turns: list[bytes], rewards: dict[str, float] | None = None) -> Trajectory:
    built = build_trajectory(INFO, turns, rewards or {})
    return decode_trajectory(encode_trajectory(built))


def three_exact_turns() -> Trajectory:
    """a → b → c, each prompt extending the previous prompt + output exactly."""
    return episode(
        [
            turn("a", prompt=[1, 2], output=[3], version=1),
            turn("b", prompt=[1, 2, 3, 4], output=[5, 6], version=2),
            turn("c", prompt=[1, 2, 3, 4, 5, 6, 7], output=[8], version=3),
        ],
        {"c": 1.0},
    )


def test_individual_rows_follow_areal_layout_one_per_interaction() -> None:
    tensors = to_tensors(three_exact_turns())

    assert tensors.interaction_ids == ("a", "b", "c")
    assert tensors.input_ids[1] == [1, 2, 3, 4, 5, 6, 0, 0]
    assert tensors.loss_mask[1] == [0, 0, 0, 0, 1, 1, 0, 0]
    assert tensors.logprobs[1][4:6] == pytest.approx([-0.1, -0.2])
    assert tensors.logprobs[1][:4] == [0.0] * 4
    assert tensors.versions[1][:6] == [-1, -1, -1, -1, 2, 2]
    assert tensors.turn_ids[1][:6] == [-1, -1, -1, -1, 0, 0]
    assert tensors.attention_mask[1] == [True] * 6 + [False] * 2
    assert set(tensors.as_dict()) == set(TENSOR_KEYS)


def test_discount_one_gives_every_turn_the_final_reward() -> None:
    tensors = to_tensors(three_exact_turns(), turn_discount=1.0)

    assert tensors.rewards == [1.0, 1.0, 1.0]
    assert tensors.original_rewards == [0.0, 0.0, 1.0]


def test_discount_accumulates_backwards_like_areal() -> None:
    trajectory = episode(
        [
            turn("a", prompt=[1], output=[2]),
            turn("b", prompt=[5], output=[6]),
            turn("c", prompt=[7], output=[8]),
        ],
        {"a": 0.5, "c": 1.0},
    )

    tensors = to_tensors(trajectory, turn_discount=0.5)

    # c = 1.0; b = 0 + 0.5 * 1.0; a = 0.5 + 0.5 * 0.5
    assert tensors.rewards == pytest.approx([0.75, 0.5, 1.0])


def test_concat_joins_an_exact_chain_into_one_row_with_turn_ids() -> None:
    tensors = to_tensors(three_exact_turns(), style="concat")

    assert tensors.interaction_ids == ("c",)
    assert tensors.input_ids == [[1, 2, 3, 4, 5, 6, 7, 8]]
    assert tensors.loss_mask == [[0, 0, 1, 0, 1, 1, 0, 1]]
    assert tensors.versions == [[-1, -1, 1, -1, 2, 2, -1, 3]]
    assert tensors.turn_ids == [[-1, -1, 0, -1, 1, 1, -1, 2]]
    assert tensors.logprobs[0][2] == pytest.approx(-0.1)
    assert tensors.rewards == [1.0]


def test_concat_keeps_turns_whose_ids_do_not_line_up_as_their_own_rows() -> None:
    # b's messages extend a's, but its ids were re-rendered: a parent, no exact join.
    a_messages = [{"role": "user", "content": "q"}]
    b_messages = [
        *a_messages,
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "r"},
    ]
    trajectory = episode(
        [
            turn("a", prompt=[1, 2], output=[3], messages=a_messages, exact=False),
            turn("b", prompt=[9, 2, 3, 4], output=[5], messages=b_messages, exact=False),
        ],
        {"b": 1.0},
    )
    assert trajectory.interactions[1].parent == 0

    tensors = to_tensors(trajectory, style="concat")

    assert tensors.interaction_ids == ("a", "b")
    assert tensors.input_ids == [[1, 2, 3, 0, 0], [9, 2, 3, 4, 5]]


def test_concat_branches_share_their_common_prefix() -> None:
    trajectory = episode(
        [
            turn("root", prompt=[1], output=[2]),
            turn("left", prompt=[1, 2, 3], output=[4]),
            turn("right", prompt=[1, 2, 5], output=[6]),
        ]
    )

    tensors = to_tensors(trajectory, style="concat")

    assert tensors.interaction_ids == ("left", "right")
    assert tensors.loss_mask == [[0, 1, 0, 1], [0, 1, 0, 1]]


def test_retry_orphans_are_dropped_keeping_the_continued_call() -> None:
    same = [{"role": "user", "content": "q"}]
    follow = [*same, {"role": "assistant", "content": "a"}, {"role": "user", "content": "r"}]
    trajectory = episode(
        [
            turn("first", prompt=[1], output=[2], messages=same, created_at=1.0),
            turn("retry", prompt=[1], output=[3], messages=same, created_at=2.0),
            turn("next", prompt=[1, 2, 4], output=[5], messages=follow, created_at=3.0),
        ]
    )
    assert trajectory.interactions[2].parent == 0  # the ids extend "first", not the retry
    assert trajectory.stats["retries"] == 1

    kept = to_tensors(trajectory, drop_retry_orphans=True)
    everything = to_tensors(trajectory)

    assert kept.interaction_ids == ("first", "next")
    assert kept.dropped_orphans == ("retry",)
    assert everything.interaction_ids == ("first", "retry", "next")


def test_among_uncontinued_retries_the_latest_is_kept() -> None:
    same = [{"role": "user", "content": "q"}]
    trajectory = episode(
        [
            turn("old", prompt=[1], output=[2], messages=same, created_at=5.0),
            turn("new", prompt=[1], output=[3], messages=same, created_at=6.0),
        ]
    )

    tensors = to_tensors(trajectory, drop_retry_orphans=True)

    assert tensors.interaction_ids == ("new",)


def test_interactions_without_usable_tokens_are_skipped_and_named() -> None:
    trajectory = episode(
        [
            turn("ok", prompt=[1], output=[2]),
            turn("mismatch", prompt=[1], output=[2, 3], logprobs=[-0.5]),
            turn("no-ids", prompt=[], output=[], logprobs=[-0.5], exact=False),
        ]
    )

    tensors = to_tensors(trajectory)

    assert tensors.interaction_ids == ("ok",)
    assert tensors.skipped == ("mismatch", "no-ids")


def test_numpy_arrays_have_a_batch_dimension_and_areal_dtypes() -> None:
    tensors = to_tensors(three_exact_turns(), as_numpy=True)

    assert tensors.input_ids.shape == (3, 8)
    # AReaL's dtypes, as ../shared/reference/trainers.md lists them (to_tensor_dict's).
    dtypes = {key: str(value.dtype) for key, value in tensors.as_dict().items()}
    assert dtypes == {
        "input_ids": "int64",
        "loss_mask": "int64",
        "logprobs": "float32",
        "versions": "int64",
        "turn_ids": "int32",
        "attention_mask": "bool",
        "rewards": "float32",
        "original_rewards": "float32",
    }
    assert tensors.rewards.shape == (3,)
    assert int(tensors.loss_mask.sum()) == 4
    assert tensors.attention_mask.sum(axis=1).tolist() == [3, 6, 8]


def test_an_empty_trajectory_gives_zero_rows() -> None:
    tensors = to_tensors(episode([]), as_numpy=True)

    assert tensors.input_ids.shape == (0, 0)
    assert tensors.rewards.shape == (0,)


def test_an_unknown_style_is_refused() -> None:
    with pytest.raises(ValueError, match="individual"):
        to_tensors(three_exact_turns(), style="packed")  # type: ignore[arg-type]
