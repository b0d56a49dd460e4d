"""RollgateWorkflow as AReaL runs it, against the real stack (processes, real Redis, mock LLM).

Every tensor value is checked against docs/training.md (what AReaL consumes, from
../shared/reference/trainers.md), computed here from `rollgate trajectories export` lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as redis

from rollgate.areal_workflow import (
    AREAL_INSTALLED,
    RollgateWorkflow,
    StalenessConflict,
    WeightSync,
    attach_weight_sync,
)
from rollgate.episodes import LiveOptions, LiveSource, ReplayFinished
from rollgate.stack import Stack
from rollgate.trainer_client import TrainerClient, TrainerError
from services.dataproxy.settings import DataProxySettings
from services.dataproxy.trainer_servicer import TrainerServicer
from services.runtime.secret import Secret
from tests.end_to_end.adapters import (
    N_SAMPLES,
    ROOT,
    discounted,
    drained,
    expected_row,
    export,
    grouped_stack,
    traffic,
)
from tests.harness.inprocess import serving_trainer
from tests.harness.poll import eventually

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from grouped_stack(redis_url, tmp_path_factory, "rgareal")


def workflow(stack: Stack, group: str, **kwargs: Any) -> RollgateWorkflow:
    return RollgateWorkflow(
        trainer_address=stack.trainer_address,
        admin_key=stack.config.admin_key,
        group=group,
        consumer=kwargs.pop("consumer", "trainer-0"),
        **kwargs,
    )


async def episodes_from(
    wf: RollgateWorkflow, stack: Stack, count: int, **traffic_args: Any
) -> list[dict[str, Any] | None]:
    """`count` concurrent arun_episode calls (they grant capacity) while agents run."""
    async with TrainerClient(stack.trainer_address, stack.config.admin_key) as tc:
        before = max(0, (await tc.stats()).capacity)  # -1 (unlimited) until a first grant
    calls = [asyncio.create_task(wf.arun_episode(None, {})) for _ in range(count)]
    # Agents start once the calls granted them capacity (as AReaL's executor runs them).
    await eventually(lambda: _capacity_is(stack, before + count), timeout_s=20)
    sent = await traffic(stack, count, **traffic_args)
    assert len(sent) == count
    async with asyncio.timeout(60):
        return list(await asyncio.gather(*calls))


def as_lists(tensors: dict[str, Any]) -> dict[str, list[Any]]:
    """A [1, L] (rewards: [1]) tensor dict as plain lists of its one row."""
    out = {}
    for key, value in tensors.items():
        listed = value.tolist()
        out[key] = listed[0] if key not in ("rewards", "original_rewards") else listed
    return out


def check_episode(
    result: dict[str, Any], line: dict[str, Any], gamma: float, group_id: str | None = None
) -> None:
    """Every row of one episode, value by value, against its export line; `group_id`: the
    episode group every row carries (else each call's rows share `<trajectory>/<index>`)."""
    interactions = line["interactions"]
    rewards = discounted(interactions, gamma)
    expected_keys = []
    for interaction in interactions:
        expected_keys.append(interaction["interaction_id"])
        expected_keys += [
            f"{interaction['interaction_id']}#{s['sample_index']}" for s in interaction["samples"]
        ]
    # Rows in interaction order, each call's G samples consecutive.
    assert list(result) == expected_keys
    for position, interaction in enumerate(interactions):
        assert len(interaction["samples"]) == N_SAMPLES - 1
        group_ids = set()
        for sample in [None, *interaction["samples"]]:
            key = interaction["interaction_id"] + (f"#{sample['sample_index']}" if sample else "")
            item = result[key]
            tensors = item.to_tensor_dict()
            assert str(tensors["input_ids"].dtype).endswith("int64")
            assert str(tensors["loss_mask"].dtype).endswith("int64")
            assert str(tensors["logprobs"].dtype).endswith("float32")
            assert str(tensors["versions"].dtype).endswith("int64")
            assert str(tensors["attention_mask"].dtype).endswith("bool")
            assert str(tensors["rewards"].dtype).endswith("float32")
            length = len(interaction["prompt_token_ids"]) + len(
                (sample or interaction)["output_token_ids"]
            )
            assert tuple(tensors["input_ids"].shape) == (1, length)
            assert tuple(tensors["rewards"].shape) == (1,)
            values = as_lists(tensors)
            want = expected_row(interaction, sample, rewards[position])
            for name, expected in want.items():
                assert values[name] == expected, (key, name)
            if "turn_ids" in values:
                n_prompt = len(interaction["prompt_token_ids"])
                assert values["turn_ids"] == [-1] * n_prompt + [0] * (length - n_prompt)
                assert values["original_rewards"] == [interaction["reward"]]
            assert item.reward == pytest.approx(rewards[position])
            assert item.interaction_id == key
            assert item.messages == interaction["messages"]
            assert item.output_message_list == [(sample or interaction)["output"]]
            assert item.rollgate.sample_index == (sample["sample_index"] if sample else 0)
            assert item.rollgate.trajectory_id == line["trajectory_id"]
            group_ids.add(item.rollgate.group_id)
        assert group_ids == {group_id or f"{line['trajectory_id']}/{interaction['index']}"}


async def test_arun_episode_returns_one_areal_row_per_interaction_and_sample(
    stack: Stack, tmp_path: Path
) -> None:
    await drained(stack, "rows")
    wf = workflow(stack, "rows")
    try:
        results = await episodes_from(wf, stack, 3)
    finally:
        await wf.aclose()
    lines = export(stack, tmp_path / "all.jsonl")
    seen = []
    for result in results:
        assert result is not None
        first = next(iter(result.values()))
        line = lines[first.rollgate.trajectory_id]
        assert len(line["interactions"]) == 2  # the tool call, then the answer
        assert line["interactions"][0]["finish_reason"] == "tool_calls"
        assert line["interactions"][0]["tools"]
        check_episode(result, line, gamma=1.0)
        seen.append(line["trajectory_id"])
    # Handed in publication order, each once.
    order = [tid for tid in lines if tid in seen]
    assert seen == order and len(set(seen)) == 3
    rewards = [lines[t]["final_reward"] for t in seen]
    assert rewards == [1.0, 0.0, 0.5]
    async with TrainerClient(stack.trainer_address, stack.config.admin_key) as tc:
        stats = await tc.stats()
    # Three calls granted three episodes, and the three agents used them up.
    assert stats.capacity == 0
    assert stats.pending == 0  # the three were acked once handed over


async def test_the_turn_discount_and_areal2_keys_follow_areal(stack: Stack, tmp_path: Path) -> None:
    await drained(stack, "discount")
    wf = workflow(stack, "discount", discount=0.5, tensor_keys="areal2")
    try:
        [result] = await episodes_from(wf, stack, 1)
    finally:
        await wf.aclose()
    assert result is not None
    first = next(iter(result.values()))
    line = export(stack, tmp_path / "all.jsonl")[first.rollgate.trajectory_id]
    final = line["interactions"][-1]["reward"]
    assert final == 1.0
    check_episode(result, line, gamma=0.5)
    # The tool-call turn gets the answer's reward times the discount.
    assert first.to_tensor_dict()["rewards"].tolist() == [0.5]
    assert set(first.to_tensor_dict()) >= {"turn_ids", "original_rewards"}


async def test_the_values_are_areals_own_classes_and_its_executor_pads_them(
    stack: Stack,
) -> None:
    # `make test` installs areal==1.0.4 (with --no-deps, and what its import needs).
    assert AREAL_INSTALLED, "areal is not importable: run `make test` (it installs areal)"
    from areal.api.workflow_api import RolloutWorkflow
    from areal.experimental.openai.types import InteractionWithTokenLogpReward
    from areal.utils.data import concat_padded_tensors

    await drained(stack, "classes")
    wf = workflow(stack, "classes")
    try:
        [result] = await episodes_from(wf, stack, 1)
    finally:
        await wf.aclose()
    assert isinstance(wf, RolloutWorkflow)
    assert result is not None
    assert all(isinstance(v, InteractionWithTokenLogpReward) for v in result.values())
    assert wf.tensor_keys == "areal1"  # areal 1.0.4 builds no turn_ids / original_rewards
    rows = [v.to_tensor_dict() for v in result.values()]
    batch = concat_padded_tensors(rows)  # what WorkflowExecutor does with the dict
    width = max(r["input_ids"].shape[1] for r in rows)
    assert tuple(batch["input_ids"].shape) == (len(rows), width)
    for position, row in enumerate(rows):
        length = row["input_ids"].shape[1]
        for key in ("input_ids", "loss_mask", "logprobs", "versions", "attention_mask"):
            padded = batch[key][position].tolist()
            assert padded[:length] == row[key][0].tolist()
            assert padded[length:] == [0] * (width - length)  # 0 / False / 0.0
    assert batch["rewards"].tolist() == [r["rewards"].item() for r in rows]


async def test_an_episode_that_ended_empty_returns_none(stack: Stack) -> None:
    await drained(stack, "empty")
    wf = workflow(stack, "empty")
    try:
        call = asyncio.create_task(wf.arun_episode(None, {}))
        await eventually(lambda: _capacity_is(stack, 1), timeout_s=20)
        started = await asyncio.to_thread(
            _post, stack, "/rl/start_session", stack.config.admin_key, {"task_id": "quiet"}
        )
        await asyncio.to_thread(_post, stack, "/rl/end_session", started["api_key"], {})
        async with asyncio.timeout(20):
            assert await call is None
    finally:
        await wf.aclose()


async def test_episode_groups_are_granted_whole_and_returned_as_consecutive_rows(
    stack: Stack, tmp_path: Path
) -> None:
    await drained(stack, "groups")
    wf = workflow(stack, "groups", episode_group_size=2)
    try:
        call = asyncio.create_task(wf.arun_episode(None, {}))
        await eventually(
            lambda: _capacity_is(stack, 2), timeout_s=20
        )  # one grant of two: all or none
        sent = await traffic(stack, 2, group_size=2)
        async with asyncio.timeout(30):
            result = await call
    finally:
        await wf.aclose()
    assert result is not None
    lines = export(stack, tmp_path / "all.jsonl")
    group_id = sent[0].group_id
    assert group_id and sent[1].group_id == group_id
    members = [line for line in lines.values() if line["group_id"] == group_id]
    assert len(members) == 2
    trajectories = [item.rollgate.trajectory_id for item in result.values()]
    # Each member's rows together, members in publication order; every row has the group id.
    order = [m["trajectory_id"] for m in members]
    assert trajectories == sorted(trajectories, key=order.index)
    for member in members:
        rows = {
            k: v for k, v in result.items() if v.rollgate.trajectory_id == member["trajectory_id"]
        }
        check_episode(rows, member, gamma=1.0, group_id=group_id)


async def test_a_restarted_trainer_gets_back_what_it_had_not_taken_and_not_what_it_took(
    stack: Stack, tmp_path: Path
) -> None:
    await drained(stack, "restart")
    script = tmp_path / "trainer.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import asyncio, sys, time
            from rollgate.areal_workflow import RollgateWorkflow
            async def main():
                wf = RollgateWorkflow(trainer_address={stack.trainer_address!r},
                    admin_key={stack.config.admin_key!r}, group="restart", consumer="pod-0")
                result = await wf.arun_episode(None, {{}})
                print(next(iter(result.values())).rollgate.trajectory_id, flush=True)
                await asyncio.sleep(3600)  # the next episode reaches it, unasked for
            asyncio.run(main())
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    trainer = await asyncio.create_subprocess_exec(
        sys.executable, str(script), stdout=asyncio.subprocess.PIPE, env=env
    )
    try:
        # The trainer's one call granted (once it imported AReaL and torch: seconds).
        await eventually(lambda: _capacity_is(stack, 1), timeout_s=180)
        async with TrainerClient(stack.trainer_address, stack.config.admin_key) as tc:
            await tc.grant_capacity(1)  # an agent that starts without a call waiting
        await traffic(stack, 2, task_id="restart")
        assert trainer.stdout is not None
        taken = (await asyncio.wait_for(trainer.stdout.readline(), 60)).decode().strip()
        assert taken.startswith("traj-")
        # The episode it took is acked; the second was delivered to it and is pending.
        await eventually(lambda: _stats_match(stack, "restart", pending=1), timeout_s=20)
    finally:
        trainer.send_signal(signal.SIGKILL)  # a crash: nothing is flushed
        await trainer.wait()
    lines = export(stack, tmp_path / "all.jsonl")
    restart_ids = [t for t, line in lines.items() if line["task_id"] == "restart"]
    assert taken in restart_ids
    [other] = [t for t in restart_ids if t != taken]
    # The restarted trainer (same consumer name) gets the second one first, and only it.
    wf = workflow(stack, "restart", consumer="pod-0")
    try:
        async with asyncio.timeout(30):
            result = await wf.arun_episode(None, {})
        assert result is not None
        assert {v.rollgate.trajectory_id for v in result.values()} == {other}
        check_episode(result, lines[other], gamma=1.0)
        await eventually(lambda: _stats_match(stack, "restart", pending=0), timeout_s=20)
    finally:
        await _return_grant(stack)  # this call granted one episode no agent will use
        await wf.aclose()


async def test_what_was_pulled_but_not_taken_comes_back_to_the_next_life_only(
    stack: Stack,
) -> None:
    await drained(stack, "life")
    async with TrainerClient(stack.trainer_address, stack.config.admin_key) as granting:
        await granting.grant_capacity(1)
    [sent] = await traffic(stack, 1, task_id="life")
    ids = []
    for _life in range(2):
        async with TrainerClient(stack.trainer_address, stack.config.admin_key) as tc:
            source = await LiveSource(tc, LiveOptions(group="life", consumer="c")).start()
            async with asyncio.timeout(20):
                unit = await source.take()
            assert unit is not None
            ids.append(unit[0].trajectory.trajectory_id)
            # Not taken: no ack; the next life (same consumer) gets it again.
            await source.aclose()
    assert ids[0] == ids[1]
    assert sent.session_id  # one episode was sent, delivered twice (two lives)
    # Within one life a given-back unit is handed out again, never a second copy of it.
    async with TrainerClient(stack.trainer_address, stack.config.admin_key) as tc:
        source = await LiveSource(tc, LiveOptions(group="life", consumer="c")).start()
        async with asyncio.timeout(20):
            unit = await source.take()
        assert unit is not None
        source.give_back(unit)
        async with asyncio.timeout(20):
            again = await source.take()
        assert again == unit
        source.taken(again)
        # No second copy queued: a take() that finds a unit is answered before it first waits.
        later = asyncio.create_task(source.take())
        await asyncio.sleep(0)  # one loop step: the take() runs until it waits
        assert not later.done()
        # Nor one to come: everything delivered, and (once acked) nothing pending.
        await eventually(lambda: _stats_match(stack, "life", pending=0), timeout_s=20)
        assert await _undelivered(stack, "life") == []
        later.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await later
        assert source.duplicates_dropped == 0
        await source.aclose()


async def test_a_dataproxy_restart_neither_loses_nor_repeats_an_episode(stack: Stack) -> None:
    await drained(stack, "reconnect")
    wf = workflow(stack, "reconnect", consumer="pod-r")
    try:
        calls = [asyncio.create_task(wf.arun_episode(None, {})) for _ in range(2)]
        await eventually(lambda: _capacity_is(stack, 2), timeout_s=20)
        await traffic(stack, 1, task_id="reconnect")
        async with asyncio.timeout(30):
            first = await calls[0]
        await asyncio.to_thread(stack.stop_service, "dataproxy")
        await asyncio.to_thread(stack.restart_service, "dataproxy")
        await traffic(stack, 1, task_id="reconnect")
        async with asyncio.timeout(60):
            second = await calls[1]
        assert first is not None and second is not None
        got = [next(iter(r.values())).rollgate.trajectory_id for r in (first, second)]
        assert len(set(got)) == 2
        # Not repeated: each is on the stream once, and nothing else is left to deliver
        # (every entry delivered to the group, every delivered one acked).
        assert sorted(await _stream_trajectory_ids(stack, set(got))) == sorted(got)
        await eventually(lambda: _stats_match(stack, "reconnect", pending=0), timeout_s=20)
        assert await _undelivered(stack, "reconnect") == []
    finally:
        await _return_grant(stack)
        await wf.aclose()


async def test_weight_sync_reaches_rollgate_and_stamps_later_tokens(
    stack: Stack, tmp_path: Path
) -> None:
    calls: list[str] = []

    class Rollout:  # AReaL's RolloutController methods PPOTrainer calls around an update
        def pause(self) -> None:
            calls.append("areal.pause")

        def resume(self) -> None:
            calls.append("areal.resume")

        def set_version(self, version: int) -> None:
            calls.append(f"areal.set_version({version})")

    sync = WeightSync(stack.trainer_address, stack.config.admin_key, pause_timeout_s=5)
    rollout = attach_weight_sync(Rollout(), sync)
    async with TrainerClient(stack.trainer_address, stack.config.admin_key) as tc:
        version = (await tc.stats()).weight_version + 1
        await asyncio.to_thread(rollout.pause)
        assert (await tc.stats()).paused
        await asyncio.to_thread(rollout.set_version, version)
        assert (await tc.stats()).weight_version == version
        await asyncio.to_thread(rollout.resume)
        assert not (await tc.stats()).paused
    sync.close()
    assert calls == ["areal.pause", f"areal.set_version({version})", "areal.resume"]
    await drained(stack, "versions")
    wf = workflow(stack, "versions")
    try:
        [result] = await episodes_from(wf, stack, 1)
    finally:
        await wf.aclose()
    assert result is not None
    for item in result.values():
        values = as_lists(item.to_tensor_dict())
        mask = values["loss_mask"]
        assert [v for v, m in zip(values["versions"], mask, strict=True) if m] == [version] * sum(
            mask
        )
        assert [v for v, m in zip(values["versions"], mask, strict=True) if not m] == [-1] * (
            len(mask) - sum(mask)
        )


async def test_rollgates_own_staleness_bound_makes_the_workflow_refuse_to_start(
    redis_url: str, key_prefix: str
) -> None:
    admin_key = "admin-" + "x" * 30
    settings = DataProxySettings(
        admin_key=Secret(admin_key), max_head_offpolicyness=2, batch_size=8
    )
    servicer = TrainerServicer(redis=_redis(redis_url), keys=_keys(key_prefix), settings=settings)
    async with serving_trainer(servicer) as address:
        with pytest.raises(StalenessConflict) as refused:
            await asyncio.to_thread(RollgateWorkflow, trainer_address=address, admin_key=admin_key)
    message = str(refused.value)
    assert "max_head_offpolicyness=2, batch_size=8" in message
    assert "AReaL's staleness manager is the one authority" in message
    assert "ROLLGATE_MAX_HEAD_OFFPOLICYNESS" in message


async def test_replaying_the_export_gives_the_same_rows_as_the_live_stream(
    stack: Stack, tmp_path: Path
) -> None:
    await drained(stack, "replay")
    dump = tmp_path / "dump.jsonl"
    live_wf = workflow(stack, "replay", dump=str(dump))
    try:
        live = await episodes_from(live_wf, stack, 2, task_id="replay")
    finally:
        await live_wf.aclose()
    live_ids = [next(iter(r.values())).rollgate.trajectory_id for r in live if r]
    everything = tmp_path / "all.jsonl"
    export(stack, everything)
    # The export holds every test's episodes; keep this test's, as a user would select a run.
    run = tmp_path / "run.jsonl"
    # In the order the live workflow consumed them (two episodes may be published, and so
    # exported, in the other order).
    lines = everything.read_text().splitlines()
    run.write_text("".join(line + "\n" for tid in live_ids for line in lines if tid in line))
    for path in (run, dump):
        replay_wf = RollgateWorkflow(
            replay=str(path), admin_key="unused-offline", check_staleness=False
        )
        replayed = [await replay_wf.arun_episode(None, {}) for _ in live]
        with pytest.raises(ReplayFinished):
            await replay_wf.arun_episode(None, {})
        for a, b in zip(live, replayed, strict=True):
            assert a is not None and b is not None
            assert list(a) == list(b)
            for key in a:
                assert as_lists(a[key].to_tensor_dict()) == as_lists(b[key].to_tensor_dict())
                assert a[key].reward == b[key].reward
                assert a[key].rollgate == b[key].rollgate


def test_without_areal_or_torch_the_same_rows_come_as_duck_typed_numpy(tmp_path: Path) -> None:
    line = _offline_line()
    path = tmp_path / "one.jsonl"
    path.write_text(line + "\n")
    code = textwrap.dedent(
        f"""
        import asyncio, json, sys
        sys.modules["areal"] = None  # not installed
        sys.modules["torch"] = None
        from rollgate import areal_workflow as aw
        assert not aw.AREAL_INSTALLED and aw.INTERACTION_CLASS is aw.DuckInteraction
        wf = aw.RollgateWorkflow(replay={str(path)!r}, admin_key="k", check_staleness=False)
        assert wf.tensor_backend == "numpy" and wf.tensor_keys == "areal2"
        result = asyncio.run(wf.arun_episode(None, {{}}))
        out = {{}}
        for key, item in result.items():
            t = item.to_tensor_dict()
            out[key] = {{k: [str(v.dtype), list(v.shape), v.tolist()] for k, v in t.items()}}
        print(json.dumps(out))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    import json

    out = json.loads(proc.stdout)
    assert list(out) == ["c-0", "c-0#1"]
    row = out["c-0"]
    assert row["input_ids"] == ["int64", [1, 5], [[1, 2, 3, 7, 8]]]
    assert row["loss_mask"] == ["int64", [1, 5], [[0, 0, 0, 1, 1]]]
    assert row["logprobs"] == ["float32", [1, 5], [[0.0, 0.0, 0.0, -0.5, -0.25]]]
    assert row["versions"] == ["int64", [1, 5], [[-1, -1, -1, 4, 4]]]
    assert row["attention_mask"] == ["bool", [1, 5], [[True] * 5]]
    assert row["rewards"] == ["float32", [1], [1.0]]
    assert row["turn_ids"] == ["int32", [1, 5], [[-1, -1, -1, 0, 0]]]
    assert row["original_rewards"] == ["float32", [1], [1.0]]
    sample = out["c-0#1"]
    assert sample["input_ids"][2] == [[1, 2, 3, 9]]
    assert sample["logprobs"][2] == [[0.0, 0.0, 0.0, -1.5]]
    assert sample["rewards"][2] == [1.0]


# -- helpers --------------------------------------------------------------------------------


def _offline_line() -> str:
    import json

    interaction = {
        "interaction_id": "c-0",
        "index": 0,
        "parent": None,
        "messages": [{"role": "user", "content": "hi"}],
        "tools": None,
        "output": {"role": "assistant", "content": "yo"},
        "finish_reason": "stop",
        "prompt_token_ids": [1, 2, 3],
        "output_token_ids": [7, 8],
        "output_logprobs": [-0.5, -0.25],
        "output_versions": [4, 4],
        "exact_tokens": True,
        "reward": 1.0,
        "reward_set": True,
        "samples": [
            {
                "sample_index": 1,
                "output": {"role": "assistant", "content": "no"},
                "finish_reason": "stop",
                "output_token_ids": [9],
                "output_logprobs": [-1.5],
                "output_versions": [4],
                "exact_tokens": True,
                "length_mismatch": False,
                "reward": 1.0,
                "reward_set": True,
            }
        ],
    }
    return json.dumps(
        {
            "stream_id": "1-0",
            "schema_version": 2,
            "trajectory_id": "traj-offline",
            "session_id": "t-1",
            "task_id": "t",
            "interactions": [interaction],
        }
    )


def _post(stack: Stack, path: str, key: str, body: dict[str, Any]) -> dict[str, Any]:
    from tests.end_to_end.adapters import agent_traffic

    return agent_traffic.post(stack.gateway_url, path, key, body)


async def _capacity_is(stack: Stack, capacity: int) -> bool:
    async with TrainerClient(stack.trainer_address, stack.config.admin_key) as tc:
        return (await tc.stats()).capacity == capacity


async def _stats_match(stack: Stack, group: str, *, pending: int) -> bool:
    """Whether `group` has `pending` delivered, unacked entries (Redis XPENDING)."""
    client = redis.Redis.from_url(stack.redis_url)
    try:
        summary = await client.xpending(f"{stack.config.redis_prefix}trajectories", group)
    finally:
        await client.aclose()
    return int(summary["pending"]) == pending


async def _undelivered(stack: Stack, group: str) -> list[Any]:
    """The stream's entries after `group`'s last delivered one (XINFO GROUPS)."""
    stream = f"{stack.config.redis_prefix}trajectories"
    client = redis.Redis.from_url(stack.redis_url)
    try:
        groups = await client.xinfo_groups(stream)
        last = next(g["last-delivered-id"] for g in groups if g["name"] == group.encode())
        return list(await client.xrange(stream, min=f"({last.decode()}"))
    finally:
        await client.aclose()


async def _stream_trajectory_ids(stack: Stack, wanted: set[str]) -> list[str]:
    """The trajectory ids of the stream's entries that are among `wanted`, one per entry."""
    client = redis.Redis.from_url(stack.redis_url)
    try:
        entries = await client.xrange(f"{stack.config.redis_prefix}trajectories")
    finally:
        await client.aclose()
    found = [fields[b"trajectory_id"].decode() for _, fields in entries]
    return [t for t in found if t in wanted]


async def _return_grant(stack: Stack) -> None:
    """Uses up grants a test left (a call that waits for an episode no agent sends)."""
    async with TrainerClient(stack.trainer_address, stack.config.admin_key) as tc:
        left = (await tc.stats()).capacity
    for _ in range(max(0, left)):
        started = await asyncio.to_thread(
            _post, stack, "/rl/start_session", stack.config.admin_key, {"task_id": "sink"}
        )
        await asyncio.to_thread(_post, stack, "/rl/end_session", started["api_key"], {})


def _redis(url: str) -> Any:
    import redis.asyncio as aioredis

    return aioredis.Redis.from_url(url)


def _keys(prefix: str) -> Any:
    from services.dataproxy.redis_keys import RedisKeys

    return RedisKeys(prefix=prefix + uuid.uuid4().hex[:6] + ":")


# -- AReaL builds a workflow object per task ------------------------------------------------


def _areal_resolve(workflow_kwargs: dict[str, Any], *, group_size: int = 1) -> Any:
    """A workflow as AReaL's RemoteInfEngine.submit gets one for each task: its own
    `_resolve_workflow` turns the import path and kwargs into a new instance every time."""
    import logging
    from types import SimpleNamespace

    from areal.infra.remote_inf_engine import RemoteInfEngine

    engine = SimpleNamespace(
        config=SimpleNamespace(agent=None), logger=logging.getLogger("areal-test")
    )
    return RemoteInfEngine._resolve_workflow(
        engine,  # type: ignore[arg-type]
        "rollgate.areal_workflow.RollgateWorkflow",
        dict(workflow_kwargs),
        group_size,
    )


async def test_the_instances_areal_makes_per_task_share_one_source_no_episode_twice_or_lost(
    stack: Stack, tmp_path: Path
) -> None:
    assert AREAL_INSTALLED
    await drained(stack, "per-task")
    kwargs = {
        "trainer_address": stack.trainer_address,
        "admin_key": stack.config.admin_key,
        "group": "per-task",
        "consumer": "pod-t",
    }
    tasks = 4
    workflows = [_areal_resolve(kwargs) for _ in range(tasks)]
    assert len({id(w) for w in workflows}) == tasks  # AReaL's own path: one object per task
    assert all(isinstance(w, RollgateWorkflow) for w in workflows)
    try:
        async with TrainerClient(stack.trainer_address, stack.config.admin_key) as tc:
            before = max(0, (await tc.stats()).capacity)
        calls = [asyncio.create_task(w.arun_episode(None, {})) for w in workflows]
        await eventually(lambda: _capacity_is(stack, before + tasks), timeout_s=20)
        sent = await traffic(stack, tasks, task_id="per-task")
        async with asyncio.timeout(60):
            results = await asyncio.gather(*calls)
        # A later task's new instance gets the next episode, not one handed out already.
        late = _areal_resolve(kwargs)
        call = asyncio.create_task(late.arun_episode(None, {}))
        await traffic(stack, 1, task_id="per-task")
        async with asyncio.timeout(60):
            results.append(await call)
    finally:
        for w in workflows:
            await w.aclose()
        await late.aclose()
    lines = export(stack, tmp_path / "all.jsonl")
    by_session = {line["session_id"]: tid for tid, line in lines.items()}
    got = [next(iter(r.values())).rollgate.trajectory_id for r in results if r]
    assert len(got) == tasks + 1
    assert len(set(got)) == len(got)  # none handed twice
    sent_ids = {by_session[e.session_id] for e in sent}
    assert sent_ids <= set(got)  # none lost
    await eventually(lambda: _stats_match(stack, "per-task", pending=0), timeout_s=20)


async def test_replay_through_areals_per_task_instances_reads_the_file_once(
    tmp_path: Path,
) -> None:
    assert AREAL_INSTALLED
    import json

    path = tmp_path / "three.jsonl"
    lines = []
    for number in range(3):
        data = json.loads(_offline_line())
        data["trajectory_id"] = f"traj-offline-{number}"
        data["stream_id"] = f"{number + 1}-0"
        # Completion ids are unique (AReaL's GroupedRolloutWorkflow merges the dicts by key).
        data["interactions"][0]["interaction_id"] = f"c-{number}"
        lines.append(json.dumps(data))
    path.write_text("\n".join(lines) + "\n")
    kwargs = {"replay": str(path), "admin_key": "offline", "check_staleness": False}
    # group_size=2: AReaL's GroupedRolloutWorkflow runs the new instance twice per task.
    first = _areal_resolve(kwargs, group_size=2)
    second = _areal_resolve(kwargs)
    try:
        grouped = await first.arun_episode(None, {})
        single = await second.arun_episode(None, {})
        with pytest.raises(ReplayFinished):
            await _areal_resolve(kwargs).arun_episode(None, {})
    finally:
        await first.workflow.aclose()
        await second.aclose()
    ids = sorted({v.rollgate.trajectory_id for r in (grouped, single) for v in r.values()})
    assert ids == ["traj-offline-0", "traj-offline-1", "traj-offline-2"]


async def test_a_restarted_areal_sets_its_checkpoints_older_version_then_only_moves_forward(
    stack: Stack,
) -> None:
    async with TrainerClient(stack.trainer_address, stack.config.admin_key) as tc:
        version = (await tc.stats()).weight_version + 10
    before_crash = WeightSync(stack.trainer_address, stack.config.admin_key)
    await asyncio.to_thread(before_crash.set_version, version)
    before_crash.close()
    # AReaL restarted from an older checkpoint: its first set_version goes back.
    restarted = WeightSync(stack.trainer_address, stack.config.admin_key)
    try:
        await asyncio.to_thread(restarted.set_version, version - 5)
        async with TrainerClient(stack.trainer_address, stack.config.admin_key) as tc:
            assert (await tc.stats()).weight_version == version - 5
        await asyncio.to_thread(restarted.set_version, version - 4)
        with pytest.raises(TrainerError, match="allow_rollback"):
            await asyncio.to_thread(restarted.set_version, version - 6)
        # The trainer may still say so explicitly.
        await asyncio.to_thread(restarted.set_version, version - 6, allow_rollback=True)
    finally:
        restarted.close()
    async with TrainerClient(stack.trainer_address, stack.config.admin_key) as tc:
        assert (await tc.stats()).weight_version == version - 6


async def test_a_fresh_trainer_reads_from_now_unless_it_asks_for_the_history(
    stack: Stack, tmp_path: Path
) -> None:
    async with TrainerClient(stack.trainer_address, stack.config.admin_key) as tc:
        await tc.grant_capacity(1)  # an episode of an earlier run, before any trainer
    [earlier] = await traffic(stack, 1, task_id="history")
    fresh = workflow(stack, "history-fresh", consumer="pod-h")
    full = workflow(stack, "history-full", consumer="pod-h", include_history=True)
    try:
        calls = [asyncio.create_task(w.arun_episode(None, {})) for w in (fresh, full)]
        async with asyncio.timeout(30):
            # The history reader gets the earlier episode first (without an agent running).
            with_history = await calls[1]
        assert with_history is not None
        # (Its own call's grant is used by the next agent, which the fresh trainer reads.)
        [later] = await traffic(stack, 1, task_id="history")
        async with asyncio.timeout(60):
            from_now = await calls[0]
    finally:
        await _return_grant(stack)
        await fresh.aclose()
        await full.aclose()
    assert from_now is not None
    # The history reader starts at the stream's first entry (this module's first episode, or
    # the earlier one when this test runs alone); the fresh one gets the agent after it.
    oldest = next(iter(export(stack, tmp_path / "all.jsonl").values()))
    assert earlier.session_id
    assert next(iter(with_history.values())).rollgate.trajectory_id == oldest["trajectory_id"]
    assert next(iter(from_now.values())).rollgate.session_id == later.session_id


async def test_two_trainer_processes_with_default_names_never_get_each_others_episodes(
    stack: Stack, tmp_path: Path
) -> None:
    script = tmp_path / "reader.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import asyncio, sys
            from rollgate.adapter_settings import resolve
            from rollgate.episodes import LiveOptions, LiveSource
            from rollgate.trainer_client import TrainerClient
            async def main():
                settings = resolve(default_group="two-procs",
                    trainer_address={stack.trainer_address!r}, admin_key={stack.config.admin_key!r})
                async with TrainerClient(settings.trainer_address, settings.admin_key) as tc:
                    options = LiveOptions(group=settings.group, consumer=settings.consumer)
                    source = await LiveSource(tc, options).start()
                    print(settings.consumer, flush=True)
                    try:
                        async with asyncio.timeout(float(sys.argv[1])):
                            unit = await source.take()
                        print(unit[0].trajectory.trajectory_id, flush=True)
                    except TimeoutError:
                        print("nothing", flush=True)
                    await asyncio.sleep(3600)  # holds what it pulled, unacked
            asyncio.run(main())
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if k != "RANK"}
    env["PYTHONPATH"] = str(ROOT)

    async def reader(wait_s: float) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            sys.executable, str(script), str(wait_s), stdout=asyncio.subprocess.PIPE, env=env
        )

    async def line(process: asyncio.subprocess.Process) -> str:
        assert process.stdout is not None
        return (await asyncio.wait_for(process.stdout.readline(), 120)).decode().strip()

    first = await reader(60)
    second: asyncio.subprocess.Process | None = None
    try:
        first_name = await line(first)  # printed once its group exists
        async with TrainerClient(stack.trainer_address, stack.config.admin_key) as tc:
            await tc.grant_capacity(2)
        await traffic(stack, 2, task_id="two-procs")
        taken = await line(first)
        assert taken.startswith("traj-")
        # The first process pulled both: one taken, one waiting in its queue, both pending.
        await eventually(lambda: _stats_match(stack, "two-procs", pending=2), timeout_s=20)
        second = await reader(3)
        second_name = await line(second)
        # Not handed the first process's pending entries (a shared name would be).
        assert await line(second) == "nothing"
        assert second_name != first_name
    finally:
        for process in (first, second):
            if process is not None:
                process.kill()
                await process.wait()


def expected_concat_rows(line: dict[str, Any], gamma: float) -> dict[str, dict[str, list[Any]]]:
    """trainers.md's `concat` rows of an export line, key → values, in row order: the turns of
    a chain whose prompt extends the previous turn's exact prompt + output ids joined into one
    row (loss_mask 0 on the re-fed parts); each leaf call's other samples as their own rows."""
    interactions = line["interactions"]
    by_index = {i["index"]: i for i in interactions}
    indices = [i["index"] for i in interactions]
    rewards = dict(zip(indices, discounted(interactions, gamma), strict=True))

    def extends(parent: dict[str, Any], child: dict[str, Any]) -> bool:
        joined = parent["prompt_token_ids"] + parent["output_token_ids"]
        exact = parent["exact_tokens"] and child["exact_tokens"]
        return exact and child["prompt_token_ids"][: len(joined)] == joined

    parent_of = {
        i["index"]: i["parent"]
        for i in interactions
        if i["parent"] in by_index and extends(by_index[i["parent"]], i)
    }
    rows: dict[str, dict[str, list[Any]]] = {}
    for leaf in interactions:
        if leaf["index"] in parent_of.values():
            continue  # a later turn extends it: its tokens are in that turn's row
        chain = [leaf["index"]]
        while chain[-1] in parent_of:
            chain.append(parent_of[chain[-1]])
        chain.reverse()
        ids = leaf["prompt_token_ids"] + leaf["output_token_ids"]
        row = {
            "input_ids": ids,
            "loss_mask": [0] * len(ids),
            "logprobs": [0.0] * len(ids),
            "versions": [-1] * len(ids),
            "turn_ids": [-1] * len(ids),
        }
        for turn, index in enumerate(chain):
            part = by_index[index]
            start = len(part["prompt_token_ids"])
            for offset in range(len(part["output_token_ids"])):
                row["loss_mask"][start + offset] = 1
                row["logprobs"][start + offset] = part["output_logprobs"][offset]
                row["versions"][start + offset] = part["output_versions"][offset]
                row["turn_ids"][start + offset] = turn
        row["attention_mask"] = [True] * len(ids)
        row["rewards"] = [rewards[leaf["index"]]]
        row["original_rewards"] = [leaf["reward"]]
        rows[leaf["interaction_id"]] = row
        for sample in leaf["samples"]:
            single = expected_row(leaf, sample, rewards[leaf["index"]])
            n_prompt = len(leaf["prompt_token_ids"])
            single["turn_ids"] = [-1] * n_prompt + [0] * len(sample["output_token_ids"])
            single["original_rewards"] = [sample["reward"]]
            rows[f"{leaf['interaction_id']}#{sample['sample_index']}"] = single
    return rows


async def test_concat_rows_join_each_chain_value_by_value(stack: Stack, tmp_path: Path) -> None:
    wf = workflow(stack, "concat", style="concat", discount=0.5, tensor_keys="areal2")
    try:
        results = await episodes_from(wf, stack, 2, task_id="concat")
    finally:
        await wf.aclose()
    lines = export(stack, tmp_path / "all.jsonl")
    joined = 0
    for result in results:
        assert result is not None
        first = next(iter(result.values()))
        line = lines[first.rollgate.trajectory_id]
        want = expected_concat_rows(line, gamma=0.5)
        assert list(result) == list(want)  # row order: leaf calls, each with its samples
        for key, item in result.items():
            tensors = item.to_tensor_dict()
            assert str(tensors["loss_mask"].dtype).endswith("int64")
            assert str(tensors["turn_ids"].dtype).endswith("int32")
            values = as_lists(tensors)
            for name, expected in want[key].items():
                if name in ("rewards", "original_rewards", "logprobs"):
                    assert values[name] == pytest.approx(expected), (key, name)
                else:
                    assert values[name] == expected, (key, name)
            assert item.reward == pytest.approx(want[key]["rewards"][0])
            joined += max(values["turn_ids"]) >= 1
    # The mock's template renders an assistant turn back as text whose ids never equal the
    # ids it sampled (a tool call's arguments are not in its content, and "\n" + the answer's
    # first word is one piece), so no chain forms here: every turn is its own row, as
    # trainers.md's rule says. Chains are checked value by value in the next test.
    assert joined == 0


def _chain_line() -> dict[str, Any]:
    """Three turns whose ids extend each other exactly (as a real chat template's do), the
    last sampled twice and the middle one too, reward 1.0 on the last turn only."""

    def turn(index: int, prompt: list[int], output: list[int], **extra: Any) -> dict[str, Any]:
        return {
            "interaction_id": f"k-{index}",
            "index": index,
            "parent": index - 1 if index else None,
            "messages": [{"role": "user", "content": f"turn {index}"}],
            "output": {"role": "assistant", "content": f"answer {index}"},
            "finish_reason": "stop",
            "prompt_token_ids": prompt,
            "output_token_ids": output,
            "output_logprobs": [-0.1 * (index + 1) - 0.01 * k for k in range(len(output))],
            "output_versions": [index + 3] * len(output),
            "exact_tokens": True,
            "reward": 0.0,
            "samples": [],
            **extra,
        }

    def sample(output: list[int]) -> dict[str, Any]:
        return {
            "sample_index": 1,
            "output": {"role": "assistant", "content": "other"},
            "finish_reason": "stop",
            "output_token_ids": output,
            "output_logprobs": [-2.0] * len(output),
            "output_versions": [9] * len(output),
            "exact_tokens": True,
            "reward": 0.0,
        }

    first = turn(0, [1, 2], [10, 11])
    # The tool result (30, 31) is re-fed after the first answer: loss 0 there.
    second = turn(1, [1, 2, 10, 11, 30, 31], [12], samples=[sample([50])])
    third = turn(
        2,
        [1, 2, 10, 11, 30, 31, 12, 40],
        [13, 14],
        reward=1.0,
        reward_set=True,
        samples=[sample([60, 61, 62])],
    )
    return {
        "stream_id": "7-0",
        "schema_version": 2,
        "trajectory_id": "traj-chain",
        "session_id": "t-9",
        "task_id": "t",
        "interactions": [first, second, third],
    }


async def test_concat_joins_an_exact_chain_into_one_row_value_by_value(tmp_path: Path) -> None:
    import json

    line = _chain_line()
    path = tmp_path / "chain.jsonl"
    path.write_text(json.dumps(line) + "\n")
    wf = RollgateWorkflow(
        replay=str(path),
        admin_key="offline",
        check_staleness=False,
        style="concat",
        discount=0.5,
        tensor_keys="areal2",
    )
    result = await wf.arun_episode(None, {})
    await wf.aclose()
    assert result is not None
    want = expected_concat_rows(line, gamma=0.5)
    # One row for the chain (its leaf's key), one for the leaf's other sample; the middle
    # call's group is left out whole (its own row is inside the chain's).
    assert list(want) == ["k-2", "k-2#1"]
    assert list(result) == list(want)
    chain = as_lists(result["k-2"].to_tensor_dict())
    assert chain["input_ids"] == [1, 2, 10, 11, 30, 31, 12, 40, 13, 14]
    assert chain["loss_mask"] == [0, 0, 1, 1, 0, 0, 1, 0, 1, 1]
    assert chain["turn_ids"] == [-1, -1, 0, 0, -1, -1, 1, -1, 2, 2]
    assert chain["versions"] == [-1, -1, 3, 3, -1, -1, 4, -1, 5, 5]
    assert chain["rewards"] == [1.0]  # the leaf's: gamma^0 * 1.0
    for key, item in result.items():
        values = as_lists(item.to_tensor_dict())
        for name, expected in want[key].items():
            if name in ("rewards", "original_rewards", "logprobs"):
                assert values[name] == pytest.approx(expected), (key, name)
            else:
                assert values[name] == expected, (key, name)
