#!/usr/bin/env python3
"""AReaL's side of online RL on rollgate, runnable on a laptop against `make run`.

    ROLLGATE_N_SAMPLES=3 make run                 # terminal 1: the stack, mock LLM, 3 samples/call
    export ROLLGATE_ADMIN_KEY=…                   # terminal 2 (make run prints it)
    python examples/areal/demo.py --batch-size 2 --steps 2

Plays AReaL's part without GPUs: per step it runs `--batch-size` concurrent
`RollgateWorkflow.arun_episode` calls (as AReaL's executor does once its staleness manager
allows them; each grants rollgate one episode) while agents (examples/agent_traffic.py: a tool
call, its result, an answer, a reward) run that many episodes through the gateway; prints every
row AReaL would train on; pads the batch (with AReaL's own concat_padded_tensors when areal is
installed); then does PPOTrainer's weight update through the hook: pause, set_version, resume.
`--replay FILE` reads an export (or `--dump` file) instead of the live stream.

It shares a stack with examples/slime/demo.py (run one after the other): its own consumer group
(`--group`, default `areal-demo`) and task ids; each run starts from now (what was published
since its group's last run, e.g. the slime demo's episodes, is skipped: acked unread); its first
weight update may set a version lower than the one a slime run left (a WeightSync's first
set_version may go back, as a restarted AReaL's does).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import agent_traffic

from rollgate.areal_workflow import (
    AREAL_INSTALLED,
    RollgateWorkflow,
    WeightSync,
    attach_weight_sync,
)
from rollgate.episodes import ReplayFinished
from rollgate.trainer_client import TrainerClient


class StandInRollout:
    """The three methods of AReaL's RolloutController that PPOTrainer calls around an update."""

    def __init__(self) -> None:
        self.version = 0

    def pause(self) -> None:
        print("  areal: rollout paused", flush=True)

    def set_version(self, version: int) -> None:
        self.version = version
        print(f"  areal: weights updated to version {version}", flush=True)

    def resume(self) -> None:
        print("  areal: rollout resumed", flush=True)


def describe(key: str, item: Any) -> str:
    """One line per row: key, group, length, where the loss is, versions and reward."""
    t = item.to_tensor_dict()
    mask = t["loss_mask"][0].tolist()
    versions = sorted({v for v, m in zip(t["versions"][0].tolist(), mask, strict=True) if m})
    return (
        f"    {key:<44} group={item.rollgate.group_id[-10:]} L={len(mask)} "
        f"prompt={mask.count(0)} output={mask.count(1)} versions={versions} "
        f"reward={t['rewards'].tolist()[0]:g}"
    )


def padded(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """What AReaL's WorkflowExecutor does with the dict: right-pad with 0 and stack."""
    if AREAL_INSTALLED:
        from areal.utils.data import concat_padded_tensors

        return dict(concat_padded_tensors(rows))
    width = max(r["input_ids"].shape[1] for r in rows)
    out: dict[str, Any] = {}
    for key in rows[0]:
        if key in ("rewards", "original_rewards"):
            out[key] = [r[key].tolist()[0] for r in rows]
        else:
            out[key] = [r[key][0].tolist() + [0] * (width - r[key].shape[1]) for r in rows]
    return out


async def step(wf: RollgateWorkflow, args: argparse.Namespace, number: int) -> int:
    """One AReaL step: a batch of episodes, printed, padded; returns the rows trained on."""
    calls = [asyncio.create_task(wf.arun_episode(None, {})) for _ in range(args.batch_size)]
    agents: threading.Thread | None = None
    if not args.replay:
        agents = threading.Thread(
            target=agent_traffic.run_episodes,
            args=(wf_gateway(args), wf.settings.admin_key),
            kwargs={"episodes": args.batch_size, "task_id": f"demo-step-{number}"},
            daemon=True,
        )
        agents.start()
    results = await asyncio.wait_for(asyncio.gather(*calls), timeout=args.timeout_s)
    if agents is not None:
        agents.join(timeout=args.timeout_s)
    rows: list[dict[str, Any]] = []
    for result in results:
        if result is None:
            print("  an episode ended empty: AReaL rejects it and starts another call")
            continue
        first = next(iter(result.values()))
        print(f"  episode {first.rollgate.trajectory_id} ({first.rollgate.session_id}):")
        for key, item in result.items():
            print(describe(key, item), flush=True)
            rows.append(item.to_tensor_dict())
    batch = padded(rows)
    shape = (len(batch["input_ids"]), len(batch["input_ids"][0]))
    print(f"  step {number}: trained on a padded batch of {shape[0]} x {shape[1]}", flush=True)
    return len(rows)


def wf_gateway(args: argparse.Namespace) -> str:
    return (
        args.gateway or agent_traffic._stack_state().get("gateway_url") or "http://127.0.0.1:8080"
    )


async def skip_to_now(address: str, admin_key: str, group: str) -> int:
    """Acks, unread, what the group has not delivered yet (episodes published since its last
    run): the demo is a new trainer each run. Returns how many it skipped."""
    async with TrainerClient(address, admin_key) as tc:
        skipped = [p.stream_id async for p in tc.pull(group, "demo-skip", idle_timeout_s=0.5)]
        if skipped:
            await tc.ack(group, skipped)
    return len(skipped)


async def run(args: argparse.Namespace) -> int:
    wf = RollgateWorkflow(
        trainer_address=args.trainer_addr,
        group=args.group,
        replay=args.replay,
        dump=args.dump,
        check_staleness=not args.replay,
        admin_key=args.admin_key or ("offline" if args.replay else None),
    )
    rollout = StandInRollout()
    sync = None
    if not args.replay:
        sync = WeightSync(wf.settings.trainer_address, wf.settings.admin_key)
        attach_weight_sync(rollout, sync)
        print(f"rollgate Trainer at {wf.settings.trainer_address}, group {wf.settings.group!r}")
        skipped = await skip_to_now(wf.settings.trainer_address, wf.settings.admin_key, args.group)
        if skipped:
            print(f"skipped {skipped} episodes published since this group's last run")
    try:
        for number in range(1, args.steps + 1):
            try:
                await step(wf, args, number)
            except ReplayFinished as end:
                print(f"replay finished: {end}")
                break
            if sync is not None:
                rollout.pause()
                rollout.set_version(rollout.version + 1)
                rollout.resume()
    finally:
        await wf.aclose()
        if sync is not None:
            sync.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-size", type=int, default=2, help="episodes per step")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--trainer-addr", default=None, help="default: ~/.rollgate/stack.json")
    parser.add_argument("--gateway", default=None, help="default: ~/.rollgate/stack.json")
    parser.add_argument("--admin-key", default=None, help="default: $ROLLGATE_ADMIN_KEY")
    parser.add_argument("--replay", default=None, help="an export file to train on instead")
    parser.add_argument("--dump", default=None, help="append what was trained on to this file")
    parser.add_argument("--group", default="areal-demo", help="the consumer group")
    parser.add_argument("--timeout-s", type=float, default=120.0)
    args = parser.parse_args(argv)
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
