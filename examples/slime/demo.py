#!/usr/bin/env python3
"""slime's side of online RL on rollgate, runnable on a laptop against `make run`.

    ROLLGATE_N_SAMPLES=2 make run                 # terminal 1: the stack, mock LLM, 2 samples/call
    export ROLLGATE_ADMIN_KEY=…                   # terminal 2 (make run prints it)
    python examples/slime/demo.py --rollouts 2 --episodes 2

Plays slime's part without GPUs: for each rollout id it calls
`rollgate.slime_rollout.generate_rollout(args, rollout_id, None)` — the function slime runs with
`--rollout-function-path rollgate.slime_rollout.generate_rollout` — while agents
(examples/agent_traffic.py: a tool call, its result, an answer, a reward) run `--episodes`
episodes through the gateway. Each episode has two calls, so a batch is 2 x episodes groups of
n samples. Prints every group and the rollout metrics. `--replay FILE` reads an export (or a
`--dump` file) instead of the live stream, until the file ends.

It shares a stack with examples/areal/demo.py (run one after the other): its own consumer group
(`slime-demo`) and task ids; each run starts from now (what was published since its group's
last run, e.g. the AReaL demo's episodes, is skipped: acked unread); when a grant-based trainer (AReaL) made the stack's capacity
limited, it grants what its own agents need (slime itself does not grant); and as its training
ends it resumes submission, which each rollout paused for slime's weight sync.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
from argparse import Namespace
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import agent_traffic

from rollgate.adapter_settings import resolve
from rollgate.episodes import ReplayFinished
from rollgate.keys import current_key
from rollgate.slime_rollout import close_rollouts, generate_rollout
from rollgate.trainer_client import TrainerClient, TrainerControl, TrainerError

GROUP = "slime-demo"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rollouts", type=int, default=2, help="rollout ids to run")
    parser.add_argument("--first-rollout-id", type=int, default=1)
    parser.add_argument("--episodes", type=int, default=2, help="agent episodes per rollout")
    parser.add_argument("--gateway", default=None, help="default: ~/.rollgate/stack.json")
    parser.add_argument(
        "--admin-key", default=current_key(os.environ.get("ROLLGATE_ADMIN_KEY", ""))
    )
    parser.add_argument("--replay", default=None, help="an export file to train on instead")
    parser.add_argument("--dump", default=None, help="append what was trained on to this file")
    parser.add_argument("--group-by", choices=("call", "episode"), default="call")
    options = parser.parse_args(argv)
    if not options.admin_key and not options.replay:
        parser.error("no admin key: pass --admin-key or set ROLLGATE_ADMIN_KEY")
    if options.replay and not Path(options.replay).is_file():
        parser.error(f"--replay {options.replay}: no such file")
    gateway = options.gateway or agent_traffic._stack_state().get("gateway_url") or ""
    per_episode = 2 if options.group_by == "call" else 1
    # What slime's argparse gives the rollout function (plus rollgate_* settings).
    args = Namespace(
        rollout_batch_size=options.episodes * per_episode,
        reward_key="score",
        rollgate_admin_key=options.admin_key or "offline",
        rollgate_group=GROUP,
        rollgate_group_by=options.group_by,
        rollgate_replay=options.replay,
        rollgate_dump=options.dump,
        rollgate_wait_timeout_s=120.0,
    )
    control = None
    if not options.replay:
        address = resolve(default_group=GROUP, admin_key=options.admin_key).trainer_address
        control = TrainerControl(address, options.admin_key)
        skipped = asyncio.run(skip_to_now(address, options.admin_key, GROUP))
        if skipped:
            print(f"skipped {skipped} episodes published since this group's last run")
    try:
        for rollout_id in range(
            options.first_rollout_id, options.first_rollout_id + options.rollouts
        ):
            agents = None
            if control is not None:
                grant_if_limited(control, options.episodes)
                agents = threading.Thread(
                    target=agent_traffic.run_episodes,
                    args=(gateway, options.admin_key),
                    kwargs={"episodes": options.episodes, "task_id": f"slime-{rollout_id}"},
                    daemon=True,
                )
                agents.start()
            output = generate_rollout(args, rollout_id, None)
            if agents is not None:
                agents.join(timeout=120)
            print(f"rollout {rollout_id}: {len(output.samples)} groups", flush=True)
            for group in output.samples:
                first = group[0]
                print(
                    f"  group {first.group_index}: {len(group)} samples of "
                    f"{first.metadata['interaction_id']}  tokens={[len(s.tokens) for s in group]} "
                    f"response={[s.response_length for s in group]} reward={first.reward} "
                    f"versions={first.weight_versions} status={first.status.name}",
                    flush=True,
                )
            metrics = ", ".join(f"{k.split('/', 1)[1]}={v:g}" for k, v in output.metrics.items())
            print(f"  metrics: {metrics}", flush=True)
    except ReplayFinished as end:
        print(f"replay finished: {end}", flush=True)
    except (TimeoutError, TrainerError) as err:
        print(f"slime demo: {err}", file=sys.stderr)
        return 1
    finally:
        close_rollouts()
        if control is not None:
            # Training is over: agents need not wait for a weight sync that never comes.
            control.resume_submission()
            control.close()
            print("slime: training over, submission resumed", flush=True)
    return 0


async def skip_to_now(address: str, admin_key: str, group: str) -> int:
    """Acks, unread, what the group has not delivered yet (episodes published since its last
    run): the demo is a new trainer each run. Returns how many it skipped."""
    async with TrainerClient(address, admin_key) as tc:
        skipped = [p.stream_id async for p in tc.pull(group, "demo-skip", idle_timeout_s=0.5)]
        if skipped:
            await tc.ack(group, skipped)
    return len(skipped)


def grant_if_limited(control: TrainerControl, episodes: int) -> None:
    """On a stack whose capacity a grant-based trainer (AReaL) limited, grants `episodes`."""
    if control.stats().capacity >= 0:
        capacity = control.grant_capacity(episodes)
        print(f"slime demo: capacity is limited here: granted {episodes} ({capacity} now)")


if __name__ == "__main__":
    sys.exit(main())
