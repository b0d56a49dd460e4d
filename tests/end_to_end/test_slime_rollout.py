"""slime's rollout function on rollgate against the real stack (processes, real Redis, mock LLM).

Every Sample field is checked against docs/training.md (slime's Sample, from
../shared/reference/trainers.md), computed here from `rollgate trajectories export` lines.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from argparse import Namespace
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollgate.episodes import Episode
from rollgate.slime_rollout import (
    SAMPLE_CLASS,
    SLIME_INSTALLED,
    FallbackSample,
    close_rollouts,
    generate_rollout,
    make_groups,
    without_aborted,
)
from rollgate.stack import Stack
from rollgate.trainer_client import TrainerClient, TrainerError
from rollgate.trajectory import trajectory_from_json
from tests.end_to_end.adapters import (
    N_SAMPLES,
    drained,
    export,
    grouped_stack,
    traffic,
)
from tests.harness.poll import eventually

pytestmark = pytest.mark.e2e

# slime's Sample fields as trainers.md lists them (OpenClaw-RL's bundled slime).
TRAINERS_MD_SAMPLE_FIELDS = [
    "group_index",
    "index",
    "prompt",
    "tokens",
    "multimodal_inputs",
    "multimodal_train_inputs",
    "response",
    "response_length",
    "label",
    "reward",
    "loss_mask",
    "weight_versions",
    "rollout_log_probs",
    "rollout_routed_experts",
    "remove_sample",
    "status",
    "metadata",
    "generate_function_path",
    "train_metadata",
    "non_generation_time",
    "spec_info",
    "prefix_cache_info",
]


@pytest.fixture(scope="module")
def stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from grouped_stack(redis_url, tmp_path_factory, "rgslime")


@pytest.fixture(autouse=True)
def _fresh_rollouts() -> Iterator[None]:
    yield
    close_rollouts()


def slime_args(stack: Stack, group: str, **extra: Any) -> Namespace:
    return Namespace(
        rollout_batch_size=extra.pop("rollout_batch_size", 4),
        reward_key="score",
        rollgate_trainer_address=stack.trainer_address,
        rollgate_admin_key=stack.config.admin_key,
        rollgate_group=group,
        rollgate_consumer="slime-0",
        **extra,
    )


async def rollout(args: Namespace, rollout_id: int) -> Any:
    return await asyncio.to_thread(generate_rollout, args, rollout_id, None, False)


def test_without_slime_the_sample_has_exactly_trainers_md_fields() -> None:
    assert not SLIME_INSTALLED  # slime is not on PyPI (the PyPI `slime` is another package)
    assert SAMPLE_CLASS is FallbackSample
    assert [f.name for f in dataclasses.fields(FallbackSample)] == TRAINERS_MD_SAMPLE_FIELDS
    assert [s.name for s in FallbackSample.Status] == [
        "PENDING",
        "COMPLETED",
        "TRUNCATED",
        "ABORTED",
        "FAILED",
    ]


async def test_a_rollout_versions_resumes_pulls_a_batch_of_call_groups_and_pauses(
    stack: Stack, tmp_path: Path
) -> None:
    await drained(stack, "batch")
    args = slime_args(stack, "batch", rollout_batch_size=4)
    async with TrainerClient(stack.trainer_address, stack.config.admin_key) as tc:
        await tc.pause_submission(1.0)  # where the previous rollout left it
        running = asyncio.create_task(rollout(args, 3))
        await eventually(lambda: _stats(stack, lambda s: not s.paused), timeout_s=20)  # resumed
        assert (await tc.stats()).weight_version == 3  # the version slime trains from
        sent = await traffic(stack, 2, task_id="batch")
        async with asyncio.timeout(60):
            output = await running
        stats = await tc.stats()
    assert stats.paused  # slime syncs weights next: agents wait
    # Every episode's groups reached slime: acked (in the background, just after).
    await eventually(lambda: _stats(stack, lambda s: s.pending == 0), timeout_s=20)
    lines = export(stack, tmp_path / "all.jsonl")
    groups = output.samples
    # Two episodes x two calls = four groups of N_SAMPLES, in arrival order.
    assert len(groups) == 4 and all(len(g) == N_SAMPLES for g in groups)
    assert [g[0].index for g in groups] == sorted(g[0].index for g in groups)
    assert [g[0].group_index for g in groups] == [0, 1, 2, 3]
    indices = [s.index for g in groups for s in g]
    assert indices == list(range(indices[0], indices[0] + len(indices)))
    by_session = {lines[t]["session_id"]: lines[t] for t in lines}
    expected_lines = [by_session[e.session_id] for e in sent]
    position = 0
    for line in expected_lines:
        for interaction in line["interactions"]:
            group = groups[position]
            position += 1
            for sample, source in zip(group, [interaction, *interaction["samples"]], strict=True):
                check_sample(sample, interaction, source, line, reward=line["final_reward"])
            assert {s.group_index for s in group} == {group[0].group_index}
    rewards = [line["final_reward"] for line in expected_lines]
    samples = [s for g in groups for s in g]
    assert output.metrics["rollgate/reward_mean"] == pytest.approx(
        sum(rewards[0 if k < 2 * N_SAMPLES else 1] for k in range(len(samples))) / len(samples)
    )
    assert output.metrics["rollgate/exact_token_ratio"] == 1.0
    assert output.metrics["rollgate/staleness_mean"] == 0.0  # sampled at version 3, trains 3
    assert output.metrics["rollgate/groups"] == 4
    assert output.metrics["rollgate/groups_dropped_aborted"] == 0


def check_sample(
    sample: Any,
    interaction: dict[str, Any],
    source: dict[str, Any],
    line: dict[str, Any],
    *,
    reward: float,
) -> None:
    prompt, output = interaction["prompt_token_ids"], source["output_token_ids"]
    assert sample.tokens == prompt + output
    assert sample.response_length == len(output)
    assert sample.loss_mask == [1] * len(output)
    assert sample.rollout_log_probs == source["output_logprobs"]
    assert len(sample.rollout_log_probs) == sample.response_length
    assert sample.weight_versions == [str(v) for v in dict.fromkeys(source["output_versions"])]
    assert sample.reward == {"score": reward}
    assert sample.status == SAMPLE_CLASS.Status.COMPLETED  # stop and tool_calls
    assert sample.prompt == interaction["messages"]
    assert sample.response == (source["output"].get("content") or "")
    assert sample.metadata["trajectory_id"] == line["trajectory_id"]
    assert sample.metadata["interaction_id"] == interaction["interaction_id"]
    assert sample.metadata["sample_index"] == source.get("sample_index", 0)


async def test_a_batch_that_ends_inside_an_episode_acks_it_only_with_its_last_group(
    stack: Stack,
) -> None:
    await drained(stack, "split")
    args = slime_args(stack, "split", rollout_batch_size=3)
    running = asyncio.create_task(rollout(args, 5))
    await eventually(lambda: _stats(stack, lambda s: not s.paused), timeout_s=20)
    await traffic(stack, 2, task_id="split")
    async with asyncio.timeout(60):
        first = await running
    assert len(first.samples) == 3
    # The second episode gave one of its two groups: it is not acked yet. The first one's ack
    # is sent in the background (LiveSource.taken), so the count settles at one.
    await eventually(
        lambda: _stats(stack, lambda s: s.pending == 1), timeout_s=10,
        what="only the second episode pending",
    )  # fmt: skip
    args.rollout_batch_size = 1
    async with asyncio.timeout(30):
        second = await rollout(args, 6)
    assert len(second.samples) == 1
    assert second.samples[0][0].index > first.samples[-1][0].index
    assert (
        second.samples[0][0].metadata["trajectory_id"]
        == (first.samples[-1][0].metadata["trajectory_id"])
    )
    await eventually(lambda: _stats(stack, lambda s: s.pending == 0), timeout_s=20)


async def test_one_episode_one_group_and_a_timeout_still_pauses(stack: Stack) -> None:
    await drained(stack, "episodes")
    args = slime_args(stack, "episodes", rollout_batch_size=1, rollgate_group_by="episode")
    running = asyncio.create_task(rollout(args, 7))
    await eventually(lambda: _stats(stack, lambda s: not s.paused), timeout_s=20)
    await traffic(stack, 1, task_id="episodes")
    async with asyncio.timeout(60):
        output = await running
    [group] = output.samples
    assert len(group) == 2 * N_SAMPLES  # both turns, every sample
    assert len({s.metadata["trajectory_id"] for s in group}) == 1
    waiting = slime_args(stack, "episodes", rollout_batch_size=1, rollgate_wait_timeout_s=1.0)
    with pytest.raises(TimeoutError, match="only 0 groups arrived"):
        await rollout(waiting, 8)
    assert await _stats(stack, lambda s: s.paused)  # paused on the way out all the same


async def test_replaying_an_export_gives_the_same_samples(stack: Stack, tmp_path: Path) -> None:
    await drained(stack, "replay")
    dump = tmp_path / "dump.jsonl"
    live_args = slime_args(stack, "replay", rollout_batch_size=2, rollgate_dump=str(dump))
    running = asyncio.create_task(rollout(live_args, 9))
    await eventually(lambda: _stats(stack, lambda s: not s.paused), timeout_s=20)
    await traffic(stack, 1, task_id="replay")
    async with asyncio.timeout(60):
        live = await running
    replay_args = Namespace(
        rollout_batch_size=2, reward_key="score", rollgate_replay=str(dump), rollgate_admin_key="k"
    )
    replayed = await rollout(replay_args, 9)
    assert _plain(replayed.samples) == _plain(live.samples)
    # An export of the whole stream holds the same episode, as the same line.
    lines = export(stack, tmp_path / "all.jsonl")
    [dumped] = [json.loads(line) for line in dump.read_text().splitlines()]
    assert lines[dumped["trajectory_id"]] == dumped


def test_groups_with_an_aborted_sample_are_dropped_and_side_turns_masked() -> None:
    def interaction(index: int, finish: str, turn_type: str = "main") -> dict[str, Any]:
        return {
            "interaction_id": f"c{index}",
            "index": index,
            "messages": [{"role": "user", "content": f"turn {index}"}],
            "output": {"role": "assistant", "content": "x"},
            "finish_reason": finish,
            "prompt_token_ids": [1, 2],
            "output_token_ids": [5, 6, 7],
            "output_logprobs": [-0.1, -0.2, -0.3],
            "output_versions": [2, 2, 3],
            "exact_tokens": True,
            "reward": 1.0 if index == 2 else 0.0,
            "turn_type": turn_type,
        }

    line = {
        "schema_version": 2,
        "trajectory_id": "traj-x",
        "interactions": [
            interaction(0, "abort"),
            interaction(1, "length", "side"),
            interaction(2, "stop"),
        ],
    }
    unit = (Episode(trajectory=trajectory_from_json(line), stream_id="1-0"),)
    groups = make_groups(unit, include_side_turns=True)
    statuses = [g[0].status for g in groups]
    assert statuses == [
        SAMPLE_CLASS.Status.ABORTED,
        SAMPLE_CLASS.Status.TRUNCATED,
        SAMPLE_CLASS.Status.COMPLETED,
    ]
    assert groups[1][0].loss_mask == [0, 0, 0]  # a side turn, included: not trained on
    assert groups[2][0].loss_mask == [1, 1, 1]
    assert groups[2][0].weight_versions == ["2", "3"]
    assert [g[0].reward for g in groups] == [{"score": 1.0}] * 3  # discount 1: every turn
    assert without_aborted(groups) == groups[1:]  # the aborted call's group is dropped
    assert len(make_groups(unit)) == 2  # side turns are left out by default


def _plain(groups: list[list[Any]]) -> list[list[dict[str, Any]]]:
    out = []
    for group in groups:
        rows = []
        for sample in group:
            data = dataclasses.asdict(sample)
            data["metadata"] = {k: v for k, v in data["metadata"].items() if k != "stream_id"}
            rows.append(data)
        out.append(rows)
    return out


async def _stats(stack: Stack, check: Any) -> bool:
    async with TrainerClient(stack.trainer_address, stack.config.admin_key) as tc:
        return bool(check(await tc.stats()))


async def test_slime_restarted_from_an_older_checkpoint_sets_the_older_version(
    stack: Stack,
) -> None:
    await drained(stack, "checkpoint")
    args = slime_args(stack, "checkpoint", rollout_batch_size=2)
    for life, rollout_id in enumerate((40, 35)):  # trained up to 40; restarts from 35's
        running = asyncio.create_task(rollout(args, rollout_id))
        await eventually(lambda v=rollout_id: _resumed_at(stack, v), timeout_s=20)
        await traffic(stack, 1, task_id=f"checkpoint-{life}")
        async with asyncio.timeout(60):
            output = await running
        assert {v for g in output.samples for s in g for v in s.weight_versions} == {
            str(rollout_id)
        }
        close_rollouts()  # the process ends: the next rollout is a new life
    # Within one life a lower version is a mistake, and refused.
    await rollout(slime_args(stack, "checkpoint", rollout_batch_size=0), 36)
    with pytest.raises(TrainerError, match="allow_rollback"):
        await rollout(slime_args(stack, "checkpoint", rollout_batch_size=0), 30)
    assert await _stats(stack, lambda s: s.weight_version == 36)


async def _resumed_at(stack: Stack, version: int) -> bool:
    return await _stats(stack, lambda s: not s.paused and s.weight_version == version)
