#!/usr/bin/env python3
"""Start an RL session on the rollgate gateway, or refresh one (same key, next episode).

New session:  start_session.py [gateway_url] --admin-key K
Refresh:      start_session.py [gateway_url] --admin-key K --api-key sk-sess-…
              (ends and publishes the current episode, then binds a new one to the same key)

Human-readable output goes to stdout; on success two machine-readable lines go to stderr:
SESSION_API_KEY=<key> and SESSION_ID=<session id>.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import _fmt

DEFAULT_TASK_ID = "demo-task"
# A start or refresh may wait up to the gateway's refresh timeout (ROLLGATE_REFRESH_TIMEOUT_S,
# 120 s by default) for capacity; the client waits that long plus this margin.
REFRESH_TIMEOUT_MARGIN_S = 10.0
DEFAULT_TIMEOUT_S = 130.0
SCRIPT_PATH = "examples/openclaw/start_session.py"


@dataclass(frozen=True)
class Options:
    """What one start_session run does, resolved from flags and environment."""

    gateway_url: str
    admin_key: str | None
    task_id: str
    api_key: str | None
    api_key_from_env: bool = False
    timeout_s: float = DEFAULT_TIMEOUT_S

    @property
    def is_refresh(self) -> bool:
        """A run with an existing key refreshes that key's session."""
        return bool(self.api_key)


@dataclass(frozen=True)
class Session:
    """The gateway's answer to a successful start_session."""

    session_id: str
    api_key: str


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    parser = argparse.ArgumentParser(
        prog="start_session.py",
        description="Start a new RL session on the rollgate gateway, or refresh one "
        "(--api-key): the current episode is ended and published, the key keeps working.",
        epilog="Environment: ROLLGATE_GATEWAY_URL, ROLLGATE_ADMIN_KEY (or ADMIN_KEY), TASK_ID, "
        "SESSION_API_KEY, ROLLGATE_REFRESH_TIMEOUT_S. On success, SESSION_API_KEY=… and "
        "SESSION_ID=… are written to stderr.",
    )
    parser.add_argument(
        "gateway_url",
        nargs="?",
        default=None,
        help=f"gateway root URL (default: $ROLLGATE_GATEWAY_URL or {_fmt.DEFAULT_GATEWAY_URL})",
    )
    parser.add_argument(
        "--admin-key", default=None, help="admin key (default: $ROLLGATE_ADMIN_KEY, $ADMIN_KEY)"
    )
    parser.add_argument(
        "--task-id", default=None, help=f"task id (default: $TASK_ID or {DEFAULT_TASK_ID!r})"
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="an existing session key to refresh (default: $SESSION_API_KEY)",
    )
    parser.add_argument(
        "--new",
        action="store_true",
        help="start a new session even if $SESSION_API_KEY is set",
    )
    parser.add_argument(
        "--timeout-s",
        type=_positive_seconds,
        default=None,
        help="how long to wait for the answer; a start or refresh may wait for capacity "
        "(default: $ROLLGATE_REFRESH_TIMEOUT_S + 10, else "
        f"{DEFAULT_TIMEOUT_S:g})",
    )
    return parser


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number of seconds")
    return value


def resolve_timeout_s(flag: float | None, environ: Mapping[str, str]) -> float:
    """--timeout-s, else the gateway's refresh timeout ($ROLLGATE_REFRESH_TIMEOUT_S) + 10 s,
    else 130 s; ValueError for an unusable $ROLLGATE_REFRESH_TIMEOUT_S."""
    if flag is not None:
        return flag
    raw = environ.get("ROLLGATE_REFRESH_TIMEOUT_S", "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        refresh_timeout_s = _positive_seconds(raw)
    except argparse.ArgumentTypeError as err:
        raise ValueError(f"ROLLGATE_REFRESH_TIMEOUT_S: {err}") from None
    return refresh_timeout_s + REFRESH_TIMEOUT_MARGIN_S


def parse_options(argv: Sequence[str], environ: Mapping[str, str]) -> Options:
    """Resolve flags, then environment, then defaults."""
    parser = build_parser()
    args = parser.parse_args(list(argv))
    try:
        timeout = resolve_timeout_s(args.timeout_s, environ)
    except ValueError as err:
        parser.error(str(err))
    api_key: str | None = args.api_key
    from_env = False
    if not api_key and not args.new:
        api_key = environ.get("SESSION_API_KEY") or None
        from_env = api_key is not None
    return Options(
        gateway_url=_fmt.resolve_gateway_url(args.gateway_url, environ),
        admin_key=_fmt.resolve_admin_key(args.admin_key, environ),
        task_id=args.task_id or environ.get("TASK_ID") or DEFAULT_TASK_ID,
        api_key=api_key or None,
        api_key_from_env=from_env,
        timeout_s=timeout,
    )


def request_body(task_id: str, api_key: str | None) -> dict[str, Any]:
    """The start_session body; the key is sent only for a refresh."""
    body: dict[str, Any] = {"task_id": task_id}
    if api_key:
        body["api_key"] = api_key
    return body


def refresh_command(gateway_url: str, api_key: str) -> str:
    """The command line that refreshes this key."""
    return f"python3 {SCRIPT_PATH} {gateway_url} --api-key {api_key}"


def openai_exports(gateway_url: str, api_key: str) -> list[str]:
    """Shell lines that point an OpenAI SDK client at the gateway."""
    return [f"export OPENAI_API_KEY={api_key}", f"export OPENAI_BASE_URL={gateway_url}/v1"]


def call_start_session(
    gateway_url: str,
    admin_key: str,
    task_id: str,
    api_key: str | None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> tuple[Session | None, _fmt.Reply]:
    """POST /rl/start_session (waiting up to `timeout_s`) and print the exchange; the session
    is None on failure."""
    url = f"{gateway_url}/rl/start_session"
    body = request_body(task_id, api_key)
    _fmt.show_request("POST", url, admin_key)
    reply = _fmt.post_json(url, body, admin_key, timeout_s)
    status, payload, _ = reply
    _fmt.show_response(status, payload)
    if status != 200 or not isinstance(payload, dict):
        return None, reply
    sid, key = payload.get("session_id"), payload.get("api_key")
    if not isinstance(sid, str) or not isinstance(key, str):
        return None, reply
    return Session(session_id=sid, api_key=key), reply


def explain_failure(reply: _fmt.Reply, is_refresh: bool) -> list[str]:
    """The error line first, then hints, for a failed start_session."""
    status, payload, headers = reply
    message = _fmt.error_message(payload)
    lines: list[str] = []
    if status == 429 and is_refresh:
        lines.append(
            "Refresh timed out — the training pipeline hasn't cycled yet. Retry in a few "
            "seconds with the same --api-key (the key stays valid)."
        )
    elif status == 429:
        lines.append(
            "No capacity for a new session — the trainer hasn't granted capacity yet. "
            "Retry in a few seconds."
        )
    else:
        lines.append(f"start_session failed (HTTP {status}): {message}")
    if status == 429:
        lines.append(f"Gateway says: {message}")
    wait = _fmt.retry_after_s(headers)
    if wait is not None:
        lines.append(f"Retry-After: {wait:g} s")
    if status == 401:
        lines.extend(_fmt.ADMIN_KEY_HINTS)
    if status == 200:
        lines.append("the answer has no session_id/api_key: is this URL a rollgate gateway?")
    return lines


def print_success(options: Options, session: Session) -> None:
    """The AReaL-style success block."""
    if options.is_refresh:
        _fmt.success("Session started! (refresh: the previous episode was ended and published)")
        if session.api_key != options.api_key:
            _fmt.warn(
                "The gateway issued a NEW key (the old one was unknown to it): reconfigure "
                "your agent with the key below."
            )
    else:
        _fmt.success("Session started!")
    _fmt.arrow(f"Session ID : {session.session_id}")
    _fmt.arrow(f"API Key    : {session.api_key}")
    print(flush=True)
    _fmt.info(
        "Use this API key as your Bearer token for /v1/chat/completions "
        "(OpenClaw/ZeroClaw: the provider's api key; base URL "
        f"{options.gateway_url}/v1)."
    )
    if not options.is_refresh:
        _fmt.info("For OpenAI SDK clients:")
        for line in openai_exports(options.gateway_url, session.api_key):
            print(f"    {line}", flush=True)
    _fmt.info("To end this episode and start the next one with the same key (refresh):")
    print(f"    {refresh_command(options.gateway_url, session.api_key)}", flush=True)


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """Run the script; returns the exit status."""
    env = os.environ if environ is None else environ
    options = parse_options(sys.argv[1:] if argv is None else argv, env)
    if not options.admin_key:
        _fmt.die("no admin key given.", *_fmt.ADMIN_KEY_HINTS)
    if options.is_refresh:
        _fmt.header("Refresh Session")
        _fmt.info("Refreshing: end old episode → publish trajectory → start new episode (same key)")
        if options.api_key_from_env:
            _fmt.info("(the key comes from $SESSION_API_KEY; pass --new for a new session)")
    else:
        _fmt.header("Start Session")
        _fmt.info("Requesting a new RL session (admin auth → gateway binds a new session key)")
    session, reply = call_start_session(
        options.gateway_url,
        options.admin_key,
        options.task_id,
        options.api_key,
        timeout_s=options.timeout_s,
    )
    if session is None:
        first, *hints = explain_failure(reply, options.is_refresh)
        _fmt.die(first, *hints)
    print_success(options, session)
    _fmt.emit_vars(SESSION_API_KEY=session.api_key, SESSION_ID=session.session_id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
