"""score_fn: the trainer side's reward per row, through both adapters (replaying a file)."""

from __future__ import annotations

import asyncio
import json
from argparse import Namespace
from pathlib import Path
from typing import Any

import pytest

from rollgate.areal_workflow import RollgateWorkflow
from rollgate.scoring import ScoreFnError, ScoreRequest, load_score_fn
from rollgate.slime_rollout import close_rollouts, generate_rollout

# What a verifier says about each output's text (rewards were never set on the episode).
SCORES = {"a0": 0.1, "s0": 0.2, "a1": 1.0, "s1": 0.5}
SEEN: list[tuple[str, int, float | None]] = []


def table_score(request: ScoreRequest) -> float | None:
    """The verifier: by the output's text; records what it was asked."""
    SEEN.append((request.interaction.interaction_id, request.sample_index, request.reward))
    return SCORES[request.output["content"]]


async def async_table_score(request: ScoreRequest) -> float | None:
    await asyncio.sleep(0)  # no wait: a real await, so the scorer is truly asynchronous
    return table_score(request)


def _interaction(index: int, text: str, sample_text: str) -> dict[str, Any]:
    prompt = [1, 2, 3] if index == 0 else [1, 2, 3, 7, 8, 4]
    return {
        "interaction_id": f"c-{index}",
        "index": index,
        "parent": index - 1 if index else None,
        "messages": [{"role": "user", "content": f"turn {index}"}],
        "output": {"role": "assistant", "content": text},
        "finish_reason": "stop",
        "prompt_token_ids": prompt,
        "output_token_ids": [7, 8],
        "output_logprobs": [-0.5, -0.25],
        "output_versions": [2, 2],
        "exact_tokens": True,
        "samples": [
            {
                "sample_index": 1,
                "output": {"role": "assistant", "content": sample_text},
                "finish_reason": "stop",
                "output_token_ids": [9],
                "output_logprobs": [-1.5],
                "output_versions": [2],
                "exact_tokens": True,
            }
        ],
    }


@pytest.fixture
def unrewarded(tmp_path: Path) -> Path:
    """One episode of two calls (each sampled twice) whose agent never set a reward."""
    line = {
        "stream_id": "1-0",
        "schema_version": 2,
        "trajectory_id": "traj-unrewarded",
        "session_id": "t-1",
        "task_id": "t",
        "interactions": [_interaction(0, "a0", "s0"), _interaction(1, "a1", "s1")],
    }
    path = tmp_path / "unrewarded.jsonl"
    path.write_text(json.dumps(line) + "\n")
    SEEN.clear()
    return path


# gamma = 0.5: r(turn 1) = its score; r(turn 0) = its score + 0.5 * r(turn 1), where a
# sample of turn 0 adds the return of the turn the agent continued with (turn 1, sample 0).
EXPECTED = {"c-0": 0.1 + 0.5 * 1.0, "c-0#1": 0.2 + 0.5 * 1.0, "c-1": 1.0, "c-1#1": 0.5}


async def test_the_areal_workflow_trains_on_score_fns_rewards_after_the_discount(
    unrewarded: Path,
) -> None:
    wf = RollgateWorkflow(
        replay=str(unrewarded),
        admin_key="offline",
        check_staleness=False,
        discount=0.5,
        score_fn=table_score,
    )
    result = await wf.arun_episode(None, {})
    await wf.aclose()
    assert result is not None
    assert {k: v.reward for k, v in result.items()} == pytest.approx(EXPECTED)
    for key, item in result.items():
        assert item.to_tensor_dict()["rewards"].tolist() == pytest.approx([EXPECTED[key]])
    # Every row was scored, each on its own output; none had a reward to start from.
    assert sorted(SEEN) == [("c-0", 0, None), ("c-0", 1, None), ("c-1", 0, None), ("c-1", 1, None)]


def test_slimes_rollout_takes_score_fn_as_an_import_path_sync_or_async(
    unrewarded: Path,
) -> None:
    args = Namespace(
        rollout_batch_size=2,
        reward_key="score",
        rollgate_replay=str(unrewarded),
        rollgate_admin_key="offline",
        rollgate_turn_discount=0.5,
        rollgate_score_fn="tests.rollgate.test_scoring:async_table_score",
    )
    try:
        output = generate_rollout(args, 1, None)
    finally:
        close_rollouts()
    rewards = {
        f"{s.metadata['interaction_id']}"
        + (f"#{k}" if (k := s.metadata["sample_index"]) else ""): s.reward
        for group in output.samples
        for s in group
    }
    assert rewards == {key: {"score": pytest.approx(value)} for key, value in EXPECTED.items()}
    assert output.metrics["rollgate/reward_mean"] == pytest.approx(sum(EXPECTED.values()) / 4)


async def test_a_score_fn_that_keeps_every_reward_changes_nothing(tmp_path: Path) -> None:
    line: dict[str, Any] = {
        "stream_id": "1-0",
        "schema_version": 2,
        "trajectory_id": "traj-rewarded",
        "session_id": "t-2",
        "task_id": "t",
        "interactions": [_interaction(0, "a0", "s0"), _interaction(1, "a1", "s1")],
    }
    line["interactions"][1]["reward"] = 1.0
    line["interactions"][1]["reward_set"] = True
    path = tmp_path / "rewarded.jsonl"
    path.write_text(json.dumps(line) + "\n")
    asked: list[float | None] = []

    def keep(request: ScoreRequest) -> None:
        asked.append(request.reward)

    rows = {}
    for score_fn in (None, keep):
        wf = RollgateWorkflow(
            replay=str(path),
            admin_key="offline",
            check_staleness=False,
            discount=0.5,
            score_fn=score_fn,
        )
        # (The first pass's aclose closed the file: the second reads it from its start.)
        result = await wf.arun_episode(None, {})
        await wf.aclose()
        assert result is not None
        rows[score_fn is None] = {k: v.reward for k, v in result.items()}
    assert rows[True] == rows[False] == {"c-0": 0.5, "c-0#1": 0.5, "c-1": 1.0, "c-1#1": 1.0}
    assert asked == [None, None, 1.0, 1.0]  # turn 1's reward was set; its sample has the call's


def test_a_score_fn_that_cannot_be_loaded_or_returns_no_number_says_so() -> None:
    with pytest.raises(ScoreFnError, match="cannot be imported"):
        load_score_fn("tests.rollgate.test_scoring:no_such_function")
    with pytest.raises(ScoreFnError, match="not an import path"):
        load_score_fn("nodots")
    assert load_score_fn("tests.rollgate.test_scoring.table_score") is table_score


async def test_a_score_fn_that_returns_no_number_fails_the_call_and_loses_nothing(
    unrewarded: Path,
) -> None:
    wf = RollgateWorkflow(
        replay=str(unrewarded),
        admin_key="offline",
        check_staleness=False,
        score_fn=lambda request: "good",
    )
    with pytest.raises(ScoreFnError, match=r"returned 'good' for c-0#0: return a number"):
        await wf.arun_episode(None, {})
    wf.score_fn = table_score
    result = await wf.arun_episode(None, {})  # the episode was given back, not lost
    await wf.aclose()
    assert result is not None and set(result) == set(EXPECTED)
