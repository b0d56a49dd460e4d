#!/usr/bin/env python3
"""End the session's current episode and publish its trajectory (the key stays valid).

end_session.py [gateway_url] --api-key sk-sess-…

On success, SESSION_ID=…, TRAJECTORY_ID=… (empty when nothing was published) and
INTERACTION_COUNT=… are written to stderr.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import _fmt

TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Options:
    """What one end_session run does, resolved from flags and environment."""

    gateway_url: str
    api_key: str | None


@dataclass(frozen=True)
class Ended:
    """The gateway's answer to a successful end_session."""

    session_id: str
    trajectory_id: str
    interaction_count: int


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    parser = argparse.ArgumentParser(
        prog="end_session.py",
        description="End the current episode of a session key and publish its trajectory. "
        "The key stays valid: start_session.py --api-key KEY starts its next episode.",
        epilog="Environment: ROLLGATE_GATEWAY_URL, SESSION_API_KEY. On success, SESSION_ID=…, "
        "TRAJECTORY_ID=… and INTERACTION_COUNT=… are written to stderr.",
    )
    parser.add_argument(
        "gateway_url",
        nargs="?",
        default=None,
        help=f"gateway root URL (default: $ROLLGATE_GATEWAY_URL or {_fmt.DEFAULT_GATEWAY_URL})",
    )
    parser.add_argument("--api-key", default=None, help="session key (default: $SESSION_API_KEY)")
    return parser


def parse_options(argv: Sequence[str], environ: Mapping[str, str]) -> Options:
    """Resolve flags, then environment, then defaults."""
    args = build_parser().parse_args(list(argv))
    return Options(
        gateway_url=_fmt.resolve_gateway_url(args.gateway_url, environ),
        api_key=args.api_key or environ.get("SESSION_API_KEY") or None,
    )


def parse_ended(payload: Any) -> Ended | None:
    """The end_session answer, or None when it is not one."""
    if not isinstance(payload, dict):
        return None
    count = payload.get("interaction_count", 0)
    if isinstance(count, bool) or not isinstance(count, int):
        return None
    return Ended(
        session_id=str(payload.get("session_id") or ""),
        trajectory_id=str(payload.get("trajectory_id") or ""),
        interaction_count=count,
    )


def call_end_session(gateway_url: str, api_key: str) -> _fmt.Reply:
    """POST /rl/end_session and print the exchange."""
    url = f"{gateway_url}/rl/end_session"
    _fmt.show_request("POST", url, api_key)
    status, payload, headers = _fmt.post_json(url, {}, api_key, TIMEOUT_S)
    _fmt.show_response(status, payload)
    return status, payload, headers


def print_ended(ended: Ended) -> None:
    """The success block."""
    if ended.trajectory_id:
        _fmt.success("Episode ended and its trajectory published")
    else:
        _fmt.success("Episode ended (no interactions, so nothing was published)")
    if ended.session_id:
        _fmt.arrow(f"Session ID        : {ended.session_id}")
    _fmt.arrow(f"Trajectory ID     : {ended.trajectory_id or '(none)'}")
    _fmt.arrow(f"Interaction count : {ended.interaction_count}")
    _fmt.info("The key stays valid: start_session.py --api-key KEY starts its next episode.")


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """Run the script; returns the exit status."""
    env = os.environ if environ is None else environ
    options = parse_options(sys.argv[1:] if argv is None else argv, env)
    if not options.api_key:
        _fmt.die(
            "no session key given.",
            "Pass --api-key sk-sess-… or export SESSION_API_KEY (start_session.py prints it).",
        )
    _fmt.header("End Session")
    status, payload, _ = call_end_session(options.gateway_url, options.api_key)
    ended = parse_ended(payload) if status == 200 else None
    if ended is None:
        _fmt.die(f"end_session failed (HTTP {status}): {_fmt.error_message(payload)}")
    print_ended(ended)
    _fmt.emit_vars(
        SESSION_ID=ended.session_id,
        TRAJECTORY_ID=ended.trajectory_id,
        INTERACTION_COUNT=ended.interaction_count,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
