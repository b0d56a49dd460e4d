#!/usr/bin/env python3
"""Agent episodes against a running rollgate gateway, as an agent runtime makes them.

    python examples/agent_traffic.py --episodes 4            # after `make run`

Each episode: `start_session` (admin key; retried while rollgate has no capacity: a trainer
grants it) → a chat turn that calls a tool → the tool's result sent back → the answer →
`set_reward` → `end_session`, which publishes the trajectory. With `--group-size G` the
episodes of one task start together (`start_session(group_size=G)`), GRPO-style. Group
sampling (n samples per call) is the server's choice (`ROLLGATE_N_SAMPLES=3 make run`);
agents do not change. Standard library only. Prints one line per episode.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STACK_FILE = Path(os.environ.get("ROLLGATE_STATE_DIR") or Path.home() / ".rollgate") / "stack.json"
MODEL = "rollgate-mock"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a fact up.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}},
                "required": ["query"],
            },
        },
    }
]
# The mock LLM answers with a tool call when the last user message contains "/tool".
TOOL_PROMPT = "/tool what is the capital of France?"
TIMEOUT_S = 60.0


class TrafficError(RuntimeError):
    """The gateway refused a request; the message has its status and body."""


@dataclass(frozen=True, slots=True)
class EpisodeDone:
    """What one episode sent: its session, its completion ids and its reward."""

    session_id: str
    completion_ids: tuple[str, ...]
    reward: float
    group_id: str | None


def post(
    gateway: str, path: str, key: str, body: Mapping[str, Any], *, deadline_s: float = 120.0
) -> dict[str, Any]:
    """POSTs JSON; retries 429/503 (no capacity yet, paused for a weight update) until the
    deadline, honouring Retry-After."""
    deadline = time.monotonic() + deadline_s
    while True:
        request = urllib.request.Request(
            gateway.rstrip("/") + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
                reply: dict[str, Any] = json.loads(response.read() or b"{}")
                return reply
        except urllib.error.HTTPError as err:
            text = err.read().decode(errors="replace")
            if err.code not in (429, 503) or time.monotonic() > deadline:
                raise TrafficError(f"POST {path}: HTTP {err.code}: {text}") from None
            wait_s = min(float(err.headers.get("Retry-After") or 1.0), 1.0)
            time.sleep(max(0.05, min(wait_s, deadline - time.monotonic())))


def run_member(gateway: str, key: str, session_id: str, reward: float) -> EpisodeDone:
    """One episode on a started session: tool call, tool result, answer, reward, end."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You answer with the help of tools."},
        {"role": "user", "content": TOOL_PROMPT},
    ]
    first = post(
        gateway,
        "/v1/chat/completions",
        key,
        {"model": MODEL, "messages": messages, "tools": TOOLS},
    )
    message = first["choices"][0]["message"]
    calls = message.get("tool_calls") or []
    if not calls:
        raise TrafficError(f"expected a tool call, got {message!r}")
    messages.append({k: v for k, v in message.items() if v is not None})
    messages.append({"role": "tool", "tool_call_id": calls[0]["id"], "content": "Paris"})
    second = post(
        gateway,
        "/v1/chat/completions",
        key,
        {"model": MODEL, "messages": messages, "tools": TOOLS, "stream": False},
    )
    post(gateway, "/rl/set_reward", key, {"reward": reward})
    post(gateway, "/rl/end_session", key, {})
    return EpisodeDone(
        session_id=session_id,
        completion_ids=(first["id"], second["id"]),
        reward=reward,
        group_id=None,
    )


def run_episodes(
    gateway: str,
    admin_key: str,
    *,
    episodes: int,
    group_size: int = 1,
    task_id: str = "traffic",
    rewards: Sequence[float] = (1.0, 0.0, 0.5),
) -> list[EpisodeDone]:
    """`episodes` episodes (in groups of `group_size`), rewards cycling through `rewards`."""
    done: list[EpisodeDone] = []
    while len(done) < episodes:
        body: dict[str, Any] = {"task_id": task_id}
        if group_size > 1:
            body["group_size"] = group_size
        started = post(gateway, "/rl/start_session", admin_key, body)
        members = started.get("members") or [
            {"session_id": started["session_id"], "api_key": started["api_key"]}
        ]
        for member in members:
            reward = rewards[len(done) % len(rewards)]
            result = run_member(gateway, member["api_key"], member["session_id"], reward)
            done.append(
                EpisodeDone(
                    session_id=result.session_id,
                    completion_ids=result.completion_ids,
                    reward=reward,
                    group_id=started.get("group_id"),
                )
            )
    return done


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the episodes and prints one line each."""
    stack = _stack_state()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gateway", default=stack.get("gateway_url") or "http://127.0.0.1:8080")
    parser.add_argument(
        "--admin-key", default=os.environ.get("ROLLGATE_ADMIN_KEY", "").split(",", 1)[0].strip()
    )
    parser.add_argument("--episodes", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=1)
    parser.add_argument("--task-id", default="traffic")
    args = parser.parse_args(argv)
    if not args.admin_key:
        parser.error("no admin key: pass --admin-key or set ROLLGATE_ADMIN_KEY")
    try:
        done = run_episodes(
            args.gateway,
            args.admin_key,
            episodes=args.episodes,
            group_size=args.group_size,
            task_id=args.task_id,
        )
    except (TrafficError, OSError) as err:
        print(f"agent_traffic: {err}", file=sys.stderr)
        return 1
    for episode in done:
        group = f"  group={episode.group_id}" if episode.group_id else ""
        print(
            f"episode {episode.session_id}: {len(episode.completion_ids)} turns "
            f"(tool call, answer), reward {episode.reward:g}{group}",
            flush=True,
        )
    return 0


def _stack_state() -> dict[str, Any]:
    try:
        state = json.loads(STACK_FILE.read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


if __name__ == "__main__":
    sys.exit(main())
