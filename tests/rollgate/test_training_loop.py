"""examples/training_loop.py as a real process against a real Trainer server."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from rollgate.trainer_client import TrainerClient
from tests.dataproxy.test_trajectory_consumers import ADMIN_KEY, Trainer, trainer

REPO = Path(__file__).resolve().parents[2]
__all__ = ["trainer"]  # the fixture, shared with the consumer tests


async def run_loop(*args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(REPO / "examples" / "training_loop.py"),
        *args,
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(60):
        out, err = await process.communicate()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_the_loop_trains_on_batches_bumps_the_version_and_acks(trainer: Trainer) -> None:
    for n in range(4):
        await trainer.publish(f"t{n}")

    code, out, err = await run_loop(
        "--trainer-addr",
        trainer.address,
        "--admin-key",
        ADMIN_KEY,
        "--batch-size",
        "2",
        "--steps",
        "2",
        "--batch-timeout-s",
        "20",
        "--include-history",  # published before the loop's group existed
    )

    assert code == 0, err
    assert "step 1: 2 trajectories (individual)" in out
    assert "input_ids=[1, 3]" in out  # one row per interaction: 2 prompt + 1 output tokens
    assert "weight_version=2, acked 2" in out
    async with TrainerClient(trainer.address, ADMIN_KEY) as tc:
        stats = await tc.stats()
    assert (stats.weight_version, stats.consumed, stats.pending) == (2, 4, 0)
    assert not stats.paused


async def test_the_loop_reports_a_batch_that_never_fills(trainer: Trainer) -> None:
    await trainer.publish("t0")

    code, _, err = await run_loop(
        "--trainer-addr",
        trainer.address,
        "--admin-key",
        ADMIN_KEY,
        "--batch-size",
        "2",
        "--steps",
        "1",
        "--batch-timeout-s",
        "1",
        "--include-history",
    )

    assert code == 1
    assert "only 1 of 2 trajectories arrived" in err


async def test_a_wrong_key_is_reported_with_the_servers_reason(trainer: Trainer) -> None:
    code, _, err = await run_loop(
        "--trainer-addr", trainer.address, "--admin-key", "wrong", "--steps", "1"
    )

    assert code == 1
    assert "needs the admin key" in err
