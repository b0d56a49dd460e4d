"""examples/areal/demo.py and examples/slime/demo.py as a user runs them, one after the other
against one real stack (processes, real Redis, mock LLM): neither breaks the other, and the
slime demo replays the file it dumped."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollgate.stack import Stack
from rollgate.trainer_client import TrainerClient
from tests.end_to_end.adapters import N_SAMPLES, ROOT, grouped_stack

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from grouped_stack(redis_url, tmp_path_factory, "rgexamples")


async def run_demo(stack: Stack, example: str, *args: str) -> str:
    demo = await asyncio.create_subprocess_exec(
        sys.executable,
        str(ROOT / "examples" / example / "demo.py"),
        *args,
        cwd=ROOT,
        env={
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "ROLLGATE_STATE_DIR": str(stack.state_dir),  # stack.json: Trainer and gateway
            "ROLLGATE_ADMIN_KEY": stack.config.admin_key,
        },
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(demo.communicate(), 300)
    assert demo.returncode == 0, f"{example} demo failed:\n{out.decode()}\n{err.decode()}"
    assert "Traceback" not in err.decode()
    return out.decode()


def check_areal_demo(text: str) -> None:
    assert text.count("  episode traj-") == 4
    # Two episodes x two calls x N_SAMPLES rows per step, padded to one batch.
    assert text.count(f"trained on a padded batch of {2 * 2 * N_SAMPLES} x") == 2
    assert text.count("#1 ") == 2 * 2 * 2  # every call's second sample is its own row
    assert "areal: weights updated to version 1" in text
    assert text.index("areal: rollout paused") < text.index("areal: rollout resumed")


async def test_the_areal_and_slime_demos_run_one_after_the_other_on_one_stack(
    stack: Stack, tmp_path: Path
) -> None:
    areal = await run_demo(stack, "areal", "--batch-size", "2", "--steps", "2")
    check_areal_demo(areal)
    async with TrainerClient(stack.trainer_address, stack.config.admin_key) as tc:
        assert (await tc.stats()).capacity >= 0  # AReaL's grants made capacity limited

    dump = tmp_path / "slime.jsonl"
    slime = await run_demo(
        stack,
        "slime",
        *("--rollouts", "2", "--episodes", "2", "--first-rollout-id", "20", "--dump", str(dump)),
    )
    assert "capacity is limited here: granted 2" in slime  # (slime itself never grants)
    assert "rollout 20: 4 groups" in slime and "rollout 21: 4 groups" in slime
    assert slime.count(f": {N_SAMPLES} samples of ") == 8
    assert "versions=['21']" in slime  # rollout 21 trains from version 21
    assert slime.count("exact_token_ratio=1") == 2
    assert "training over, submission resumed" in slime
    async with TrainerClient(stack.trainer_address, stack.config.admin_key) as tc:
        stats = await tc.stats()
    assert not stats.paused and stats.weight_version == 21

    # AReaL again after slime: its group existed, so it would go on with slime's 4 episodes
    # published since; the demo starts from now (skips them), and its first version update
    # goes back from slime's 21 to 1.
    again = await run_demo(stack, "areal", "--batch-size", "2", "--steps", "2")
    check_areal_demo(again)
    assert "skipped 4 episodes published since this group's last run" in again
    episodes = [line for line in again.splitlines() if line.startswith("  episode traj-")]
    assert len(episodes) == 4 and all("(demo-step-" in line for line in episodes)
    async with TrainerClient(stack.trainer_address, stack.config.admin_key) as tc:
        assert (await tc.stats()).weight_version == 2

    # slime's dump replayed offline: the same groups, then the end of the file, no traceback.
    replayed = await run_demo(stack, "slime", "--replay", str(dump), "--rollouts", "3")
    assert "rollout 1: 4 groups" in replayed and "rollout 2: 4 groups" in replayed
    assert "replay finished" in replayed
    assert replayed.count(f": {N_SAMPLES} samples of ") == 8
