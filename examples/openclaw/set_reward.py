#!/usr/bin/env python3
"""Set the reward of the current episode's last (or a named) interaction.

set_reward.py [gateway_url] --api-key sk-sess-… [--reward 1.0] [--interaction-id chatcmpl-…]

On success, REWARD=<r> and INTERACTION_ID=<id> are written to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import _fmt

DEFAULT_REWARD = 1.0
TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Options:
    """What one set_reward run does, resolved from flags and environment."""

    gateway_url: str
    api_key: str | None
    reward: float
    interaction_id: str | None


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    parser = argparse.ArgumentParser(
        prog="set_reward.py",
        description="Set the reward of the session's last interaction (or of --interaction-id).",
        epilog="Environment: ROLLGATE_GATEWAY_URL, SESSION_API_KEY, REWARD. "
        "On success, REWARD=… and INTERACTION_ID=… are written to stderr.",
    )
    parser.add_argument(
        "gateway_url",
        nargs="?",
        default=None,
        help=f"gateway root URL (default: $ROLLGATE_GATEWAY_URL or {_fmt.DEFAULT_GATEWAY_URL})",
    )
    parser.add_argument("--api-key", default=None, help="session key (default: $SESSION_API_KEY)")
    parser.add_argument(
        "--reward", default=None, help=f"reward, a number (default: $REWARD or {DEFAULT_REWARD})"
    )
    parser.add_argument(
        "--interaction-id",
        default=None,
        help="the completion id to reward (default: the last interaction)",
    )
    return parser


def parse_reward(raw: str | None) -> float:
    """The reward as a float; raises ValueError with a readable message."""
    if raw is None or raw.strip() == "":
        return DEFAULT_REWARD
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"the reward must be a number, got {raw!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"the reward must be a finite number, got {raw!r}")
    return value


def parse_options(argv: Sequence[str], environ: Mapping[str, str]) -> Options:
    """Resolve flags, then environment, then defaults; exits on a bad reward."""
    parser = build_parser()
    args = parser.parse_args(list(argv))
    try:
        reward = parse_reward(args.reward if args.reward is not None else environ.get("REWARD"))
    except ValueError as err:
        parser.error(str(err))
    return Options(
        gateway_url=_fmt.resolve_gateway_url(args.gateway_url, environ),
        api_key=args.api_key or environ.get("SESSION_API_KEY") or None,
        reward=reward,
        interaction_id=args.interaction_id or None,
    )


def request_body(reward: float, interaction_id: str | None) -> dict[str, Any]:
    """The set_reward body."""
    body: dict[str, Any] = {"reward": reward}
    if interaction_id:
        body["interaction_id"] = interaction_id
    return body


def call_set_reward(
    gateway_url: str, api_key: str, reward: float, interaction_id: str | None
) -> _fmt.Reply:
    """POST /rl/set_reward and print the exchange."""
    url = f"{gateway_url}/rl/set_reward"
    body = request_body(reward, interaction_id)
    _fmt.show_request("POST", url, api_key)
    _fmt.info(f"Request body: {json.dumps(body)}")
    status, payload, headers = _fmt.post_json(url, body, api_key, TIMEOUT_S)
    _fmt.show_response(status, payload)
    return status, payload, headers


def failure_message(reply: _fmt.Reply) -> str:
    """The one-line error for a failed set_reward."""
    status, payload, _ = reply
    return f"set_reward failed (HTTP {status}): {_fmt.error_message(payload)}"


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """Run the script; returns the exit status."""
    env = os.environ if environ is None else environ
    options = parse_options(sys.argv[1:] if argv is None else argv, env)
    if not options.api_key:
        _fmt.die(
            "no session key given.",
            "Pass --api-key sk-sess-… or export SESSION_API_KEY (start_session.py prints it).",
        )
    _fmt.header("Set Reward")
    reply = call_set_reward(
        options.gateway_url, options.api_key, options.reward, options.interaction_id
    )
    status, payload, _ = reply
    if status != 200:
        hints = []
        if status == 400:
            hints.append("Chat with the agent first: a reward needs at least one interaction.")
        _fmt.die(failure_message(reply), *hints)
    interaction_id = payload.get("interaction_id") if isinstance(payload, dict) else None
    interaction_id = interaction_id or options.interaction_id or ""
    _fmt.success(f"Reward {options.reward} applied")
    if interaction_id:
        _fmt.arrow(f"Interaction: {interaction_id}")
    _fmt.emit_vars(REWARD=options.reward, INTERACTION_ID=interaction_id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
