#!/usr/bin/env python3
"""A training loop against a running rollgate: pull a batch, "train", sync weights, repeat.

    rollgate up                      # in another terminal; drive some agent episodes too
    python examples/training_loop.py --batch-size 4 --steps 3 --include-history

A new consumer group reads what is published from now on; `--include-history` makes it start
at the beginning of the stream (the episodes driven before the loop's first run).

Each step pulls `--batch-size` trajectories through a consumer group, turns them into AReaL's
tensors (no torch), stands in for an optimizer step, then brackets a weight update the way a
real trainer does: PauseSubmission (running turns finish, new ones wait), SetWeightVersion
(later tokens are stamped with it), ResumeSubmission, and only then acks the batch. A crash
before the ack loses nothing: the entries are delivered again (to this consumer on restart,
or to another after the reclaim idle time), and the client drops duplicates by trajectory id.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollgate.keys import current_key
from rollgate.tensors import Style, TrainingTensors, to_tensors
from rollgate.trainer_client import PulledTrajectory, TrainerClient, TrainerError

STACK_FILE = Path(os.environ.get("ROLLGATE_STATE_DIR") or Path.home() / ".rollgate") / "stack.json"
DEFAULT_TRAINER_ADDR = "127.0.0.1:50052"


@dataclass(frozen=True, slots=True, kw_only=True)
class Options:
    """What the loop does, from flags, the environment and `rollgate up`'s state file."""

    trainer_addr: str
    admin_key: str
    batch_size: int
    steps: int
    group: str
    consumer: str
    style: Style
    turn_discount: float
    batch_timeout_s: float
    pause_timeout_s: float
    include_history: bool = False


def parse_args(argv: Sequence[str], environ: Mapping[str, str], stack_file: Path) -> Options:
    """The command line, with defaults from ROLLGATE_ADMIN_KEY and ~/.rollgate/stack.json."""
    stack = _stack_state(stack_file)
    parser = argparse.ArgumentParser(prog="training_loop.py", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--trainer-addr",
        default=stack.get("trainer_address") or DEFAULT_TRAINER_ADDR,
        help="the Trainer service (default: ~/.rollgate/stack.json, else 127.0.0.1:50052)",
    )
    parser.add_argument(
        "--admin-key",
        default=current_key(environ.get("ROLLGATE_ADMIN_KEY", "")),
        help="admin or trainer key (default: $ROLLGATE_ADMIN_KEY)",
    )
    parser.add_argument("--batch-size", type=int, default=4, help="trajectories per step")
    parser.add_argument("--steps", type=int, default=3, help="training steps, then exit")
    parser.add_argument("--group", default="training-loop", help="consumer group")
    parser.add_argument("--consumer", default="trainer-0", help="stable consumer name")
    parser.add_argument("--style", choices=("individual", "concat"), default="individual")
    parser.add_argument(
        "--turn-discount", type=float, default=1.0, help="AReaL turn discount (gamma)"
    )
    parser.add_argument(
        "--batch-timeout-s",
        type=float,
        default=600.0,
        help="give up on a step when a full batch has not arrived in this long",
    )
    parser.add_argument("--pause-timeout-s", type=float, default=30.0)
    parser.add_argument(
        "--include-history",
        action="store_true",
        help="a new consumer group starts at the beginning of the stream, not now",
    )
    args = parser.parse_args(list(argv))
    if not args.admin_key:
        parser.error("no admin key: pass --admin-key or set ROLLGATE_ADMIN_KEY")
    if args.batch_size < 1 or args.steps < 1:
        parser.error("--batch-size and --steps must be at least 1")
    return Options(
        trainer_addr=args.trainer_addr,
        admin_key=args.admin_key,
        batch_size=args.batch_size,
        steps=args.steps,
        group=args.group,
        consumer=args.consumer,
        style=args.style,
        turn_discount=args.turn_discount,
        batch_timeout_s=args.batch_timeout_s,
        pause_timeout_s=args.pause_timeout_s,
        include_history=args.include_history,
    )


async def pull_batch(
    tc: TrainerClient, options: Options, *, timeout_s: float
) -> list[PulledTrajectory]:
    """Exactly `batch_size` new trajectories, waiting up to `timeout_s` for them.

    Pulls in rounds of at most 5 s so an idle stack is reported; what a round already
    handed out stays pending (unacked) and is not shown twice by the client.
    """
    batch: list[PulledTrajectory] = []
    deadline = time.monotonic() + timeout_s
    while len(batch) < options.batch_size:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(
                f"only {len(batch)} of {options.batch_size} trajectories arrived in "
                f"{timeout_s:g} s: are agents running episodes against the gateway?"
            )
        async for item in tc.pull(
            options.group,
            options.consumer,
            max_count=options.batch_size - len(batch),
            idle_timeout_s=min(left, 5.0),
            include_history=options.include_history,
        ):
            batch.append(item)
    return batch


def train_step(tensors: Sequence[TrainingTensors]) -> dict[str, float]:
    """Stands in for the optimizer: the numbers a PPO step would start from."""
    tokens = sum(sum(sum(row) for row in t.loss_mask) for t in tensors)
    logprob = sum(
        lp * m
        for t in tensors
        for lp_row, m_row in zip(t.logprobs, t.loss_mask, strict=True)
        for lp, m in zip(lp_row, m_row, strict=True)
    )
    rewards = [r for t in tensors for r in t.rewards]
    return {
        "trained_tokens": float(tokens),
        "mean_logprob": logprob / tokens if tokens else 0.0,
        "mean_reward": sum(rewards) / len(rewards) if rewards else 0.0,
    }


def describe(item: PulledTrajectory, tensors: TrainingTensors) -> str:
    """One line per trajectory: ids, rows x length, rewards, skipped interactions."""
    rows = len(tensors.input_ids)
    width = len(tensors.input_ids[0]) if rows else 0
    rewards = ", ".join(f"{r:g}" for r in tensors.rewards)
    text = (
        f"  {item.trajectory.trajectory_id}  session={item.trajectory.session_id}  "
        f"turns={len(item.trajectory.interactions)}  "
        f"joined={item.trajectory.stats.get('joined', 0)}  "
        f"input_ids=[{rows}, {width}]  rewards=[{rewards}]"
    )
    if tensors.skipped:
        text += f"  skipped={len(tensors.skipped)}"
    return text


async def run(options: Options) -> int:
    """The loop; 0 after `steps` steps, 1 when the Trainer service refuses or times out."""
    async with TrainerClient(options.trainer_addr, options.admin_key) as tc:
        stats = await tc.stats()
        print(
            f"trainer at {options.trainer_addr}: published={stats.published} "
            f"pending={stats.pending} weight_version={stats.weight_version}",
            flush=True,
        )
        version = stats.weight_version
        for step in range(1, options.steps + 1):
            batch = await pull_batch(tc, options, timeout_s=options.batch_timeout_s)
            tensors = [
                to_tensors(
                    item.trajectory, style=options.style, turn_discount=options.turn_discount
                )
                for item in batch
            ]
            print(f"step {step}: {len(batch)} trajectories ({options.style})", flush=True)
            for item, t in zip(batch, tensors, strict=True):
                print(describe(item, t), flush=True)
            numbers = train_step(tensors)
            pause = await tc.pause_submission(options.pause_timeout_s)
            try:
                # A real trainer pushes its new weights to the inference servers here.
                version = await tc.set_weight_version(version + 1)
            finally:
                await tc.resume_submission()
            acked = await tc.ack(options.group, [item.stream_id for item in batch])
            print(
                f"step {step}: trained on {numbers['trained_tokens']:.0f} tokens, "
                f"mean logprob {numbers['mean_logprob']:.3f}, "
                f"mean reward {numbers['mean_reward']:.3f}; paused (drained={pause.drained}, "
                f"in flight {pause.in_flight}), weight_version={version}, acked {acked}",
                flush=True,
            )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Parses the flags and runs the loop."""
    options = parse_args(sys.argv[1:] if argv is None else argv, os.environ, STACK_FILE)
    try:
        return asyncio.run(run(options))
    except TrainerError as err:
        print(f"training_loop: {err.code}: {err.message}", file=sys.stderr)
        return 1
    except TimeoutError as err:
        print(f"training_loop: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _stack_state(path: Path) -> dict[str, Any]:
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


if __name__ == "__main__":
    sys.exit(main())
