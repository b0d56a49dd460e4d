"""What the trainer-adapter tests share: a stack with group sampling, traffic, the export."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollgate.stack import Stack
from rollgate.trainer_client import TrainerClient
from tests.harness.processes import log_level_env, stack_config

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
import agent_traffic  # noqa: E402

# Every call is sampled G times (rollgate's group sampling).
N_SAMPLES = 2


def grouped_stack(
    redis_url: str, tmp_path_factory: pytest.TempPathFactory, prefix: str
) -> Iterator[Stack]:
    """The whole stack as processes, the mock upstream sampled N_SAMPLES times per call."""
    config = stack_config(
        redis_url,
        Path(tmp_path_factory.mktemp("stack")),
        prefix=prefix,
        mock_token_interval_ms=1.0,
        extra_env={**log_level_env(), "ROLLGATE_N_SAMPLES": str(N_SAMPLES)},
    )
    with Stack(config) as running:
        yield running


async def traffic(
    stack: Stack, episodes: int, *, group_size: int = 1, task_id: str = "t"
) -> list[agent_traffic.EpisodeDone]:
    """Agent episodes (tool call, tool result, answer, reward, end) in a thread."""
    return await asyncio.to_thread(
        agent_traffic.run_episodes,
        stack.gateway_url,
        stack.config.admin_key,
        episodes=episodes,
        group_size=group_size,
        task_id=task_id,
    )


def export(stack: Stack, out: Path) -> dict[str, dict[str, Any]]:
    """`rollgate trajectories export --all` as a user runs it: trajectory id → JSON line."""
    subprocess.run(
        [
            str(Path(sys.executable).parent / "rollgate"),
            "trajectories",
            "export",
            "--all",
            "--out",
            str(out),
            "--redis-url",
            stack.redis_url,
            "--prefix",
            stack.config.redis_prefix,
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    lines = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    return {line["trajectory_id"]: line for line in lines}


async def drained(stack: Stack, group: str) -> None:
    """Creates `group` before the test's agents run (a new group reads from now on; this
    also acks anything a group of that name already held)."""
    async with TrainerClient(stack.trainer_address, stack.config.admin_key) as tc:
        items = [p async for p in tc.pull(group, "drain", idle_timeout_s=0.5)]
        if items:
            await tc.ack(group, [p.stream_id for p in items])


def expected_row(
    interaction: dict[str, Any], sample: dict[str, Any] | None, reward: float
) -> dict[str, list[Any]]:
    """trainers.md's row for an interaction (or one of its samples) of an export line."""
    prompt = interaction["prompt_token_ids"]
    source = sample or interaction
    output = source["output_token_ids"]
    return {
        "input_ids": prompt + output,
        "loss_mask": [0] * len(prompt) + [1] * len(output),
        "logprobs": [0.0] * len(prompt) + source["output_logprobs"],
        "versions": [-1] * len(prompt) + source["output_versions"],
        "attention_mask": [True] * (len(prompt) + len(output)),
        "rewards": [reward],
    }


def discounted(interactions: list[dict[str, Any]], gamma: float) -> list[float]:
    """AReaL's backward discount r_i += gamma * r_{i+1} over an export line's interactions."""
    out = [0.0] * len(interactions)
    following = 0.0
    for position in range(len(interactions) - 1, -1, -1):
        following = interactions[position]["reward"] + gamma * following
        out[position] = following
    return out
