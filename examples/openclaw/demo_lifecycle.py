#!/usr/bin/env python3
"""Walk the whole online-RL lifecycle against a running rollgate gateway.

health check → for each episode: start (first) or refresh (same key) → chat → set_reward
→ summary (→ end_session with --end, so the last episode is published too).

On success, SESSION_API_KEY=…, SESSION_ID=… (the last episode's) and EPISODES=… are written to
stderr, plus TRAJECTORY_ID=… with --end.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import _fmt
import end_session
import set_reward
import start_session

DEFAULT_PROMPT = "Solve step by step: What is 12 * 15 + 3?"
SYSTEM_PROMPT = "You are a helpful math tutor. Show your work step by step."
CHAT_TIMEOUT_S = 60.0
REFRESH_ATTEMPTS = 3
MAX_RETRY_WAIT_S = 30.0
MAX_SHOWN_CHARS = 600


@dataclass(frozen=True)
class Options:
    """What one demo run does, resolved from flags and environment."""

    gateway_url: str
    admin_key: str | None
    task_id: str
    reward: float
    model: str | None
    prompt: str
    episodes: int
    end: bool


@dataclass(frozen=True)
class EpisodeResult:
    """What one episode of the demo produced."""

    index: int
    session_id: str
    completion_id: str
    reward: float


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    parser = argparse.ArgumentParser(
        prog="demo_lifecycle.py",
        description="Run start → chat → set_reward for a few episodes on one session key "
        "(refreshing it between episodes), then print a summary.",
        epilog="Environment: ROLLGATE_GATEWAY_URL, ROLLGATE_ADMIN_KEY (or ADMIN_KEY), TASK_ID, "
        "REWARD, MODEL, PROMPT.",
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
    parser.add_argument("--task-id", default=None, help="task id (default: $TASK_ID or demo-task)")
    parser.add_argument("--reward", default=None, help="reward per episode (default: 1.0)")
    parser.add_argument(
        "--model",
        default=None,
        help="model to ask (default: $MODEL, else the first id from GET /v1/models)",
    )
    parser.add_argument("--prompt", default=None, help="the user message (default: $PROMPT)")
    parser.add_argument("--episodes", type=int, default=2, help="number of episodes (default: 2)")
    parser.add_argument(
        "--end",
        action="store_true",
        help="end the last episode with /rl/end_session, so it is published too",
    )
    return parser


def parse_options(argv: Sequence[str], environ: Mapping[str, str]) -> Options:
    """Resolve flags, then environment, then defaults; exits on bad values."""
    parser = build_parser()
    args = parser.parse_args(list(argv))
    try:
        reward = set_reward.parse_reward(
            args.reward if args.reward is not None else environ.get("REWARD")
        )
    except ValueError as err:
        parser.error(str(err))
    if args.episodes < 1:
        parser.error("--episodes must be at least 1")
    return Options(
        gateway_url=_fmt.resolve_gateway_url(args.gateway_url, environ),
        admin_key=_fmt.resolve_admin_key(args.admin_key, environ),
        task_id=args.task_id or environ.get("TASK_ID") or start_session.DEFAULT_TASK_ID,
        reward=reward,
        model=args.model or environ.get("MODEL") or None,
        prompt=args.prompt or environ.get("PROMPT") or DEFAULT_PROMPT,
        episodes=args.episodes,
        end=bool(args.end),
    )


def chat_body(model: str, prompt: str) -> dict[str, Any]:
    """The chat completion request the demo sends (AReaL's demo body)."""
    return {
        "model": model,
        "messages": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": prompt},
        ],
        "temperature": 0.7,
        "max_tokens": 512,
    }


def first_model_id(payload: Any) -> str | None:
    """The first model id in a GET /v1/models answer."""
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, list):
        return None
    for entry in data:
        if isinstance(entry, dict) and isinstance(entry.get("id"), str) and entry["id"]:
            return str(entry["id"])
    return None


def assistant_text(payload: Any) -> str:
    """The assistant's text in a chat completion (content parts joined)."""
    if not isinstance(payload, dict):
        return ""
    choices = payload.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return ""
    message = choices[0].get("message")
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return ""


def shorten(text: str, limit: int = MAX_SHOWN_CHARS) -> str:
    """The text cut to limit characters, with a marker when cut."""
    if len(text) <= limit:
        return text
    return text[:limit] + f" … [{len(text) - limit} more characters]"


def retry_wait_s(headers: Mapping[str, str]) -> float:
    """How long to wait before retrying a refresh that got 429."""
    wait = _fmt.retry_after_s(headers)
    return min(MAX_RETRY_WAIT_S, max(1.0, wait if wait is not None else 5.0))


def health_check(gateway_url: str) -> None:
    """GET /health (required) and /ready (advisory)."""
    _fmt.header("Health Check")
    url = f"{gateway_url}/health"
    _fmt.show_request("GET", url)
    status, payload, _ = _fmt.get_json(url)
    _fmt.show_response(status, payload)
    if status != 200:
        _fmt.die(
            f"gateway unhealthy (HTTP {status}): {_fmt.error_message(payload)}",
            "Check the gateway's log (`make run` prints it).",
        )
    workers = payload.get("workers") if isinstance(payload, dict) else None
    suffix = f" — {workers} backend worker(s)" if isinstance(workers, int) else ""
    _fmt.success(f"Gateway healthy{suffix}")
    status, payload, _ = _fmt.get_json(f"{gateway_url}/ready")
    if status == 200:
        _fmt.success("Gateway ready (Redis, router and at least one worker)")
    else:
        _fmt.warn(f"Gateway not ready yet (HTTP {status}): {_fmt.error_message(payload)}")


def start_or_refresh(
    options: Options, admin_key: str, api_key: str | None
) -> start_session.Session:
    """Start (no key) or refresh (key) a session, retrying a refresh that got 429."""
    for attempt in range(1, REFRESH_ATTEMPTS + 1):
        session, reply = start_session.call_start_session(
            options.gateway_url, admin_key, options.task_id, api_key
        )
        if session is not None:
            return session
        first, *hints = start_session.explain_failure(reply, bool(api_key))
        if reply[0] != 429 or not api_key or attempt == REFRESH_ATTEMPTS:
            _fmt.die(first, *hints)
        wait = retry_wait_s(reply[2])
        _fmt.warn(f"{first} (attempt {attempt}/{REFRESH_ATTEMPTS}; retrying in {wait:g} s)")
        time.sleep(wait)
    raise AssertionError("unreachable")


def discover_model(gateway_url: str, api_key: str) -> str:
    """The first model the gateway lists, asked with the session key."""
    url = f"{gateway_url}/v1/models"
    _fmt.show_request("GET", url, api_key)
    status, payload, _ = _fmt.get_json(url, api_key)
    model = first_model_id(payload) if status == 200 else None
    if model is None:
        _fmt.show_response(status, payload)
        _fmt.die(
            f"could not find a model (HTTP {status}): {_fmt.error_message(payload)}",
            "Pass --model NAME (or export MODEL).",
        )
    _fmt.success(f"Using model {model!r} (first of GET /v1/models)")
    return model


def chat(gateway_url: str, api_key: str, model: str, prompt: str) -> str:
    """One chat completion; returns its id (the interaction id)."""
    url = f"{gateway_url}/v1/chat/completions"
    _fmt.show_request("POST", url, api_key)
    status, payload, _ = _fmt.post_json(url, chat_body(model, prompt), api_key, CHAT_TIMEOUT_S)
    if status != 200 or not isinstance(payload, dict):
        _fmt.show_response(status, payload)
        _fmt.die(f"chat completion failed (HTTP {status}): {_fmt.error_message(payload)}")
    completion_id = str(payload.get("id") or "")
    _fmt.success(f"HTTP 200, completion_id={completion_id}")
    _fmt.info("Assistant:")
    for line in shorten(assistant_text(payload)).splitlines() or [""]:
        print(f"    {line}", flush=True)
    return completion_id


def run_episode(
    options: Options, admin_key: str, index: int, api_key: str | None
) -> tuple[start_session.Session, EpisodeResult, str]:
    """One episode: start/refresh, chat, set_reward; returns (session, result, model used)."""
    kind = "Start" if api_key is None else "Refresh"
    _fmt.header(f"Episode {index}/{options.episodes}: {kind} → Chat → Set Reward")
    session = start_or_refresh(options, admin_key, api_key)
    _fmt.arrow(f"Session ID : {session.session_id}")
    if api_key is not None and session.api_key != api_key:
        _fmt.warn("The gateway issued a NEW key on refresh; continuing with it.")
    model = options.model or discover_model(options.gateway_url, session.api_key)
    completion_id = chat(options.gateway_url, session.api_key, model, options.prompt)
    reply = set_reward.call_set_reward(options.gateway_url, session.api_key, options.reward, None)
    if reply[0] != 200:
        _fmt.die(set_reward.failure_message(reply))
    _fmt.success(f"Reward {options.reward} applied")
    result = EpisodeResult(
        index=index,
        session_id=session.session_id,
        completion_id=completion_id,
        reward=options.reward,
    )
    return session, result, model


def summary_lines(api_key: str, results: Sequence[EpisodeResult]) -> list[str]:
    """The summary: the shared key (shortened), then one line per episode."""
    lines = [f"API Key: {api_key[:12]}... (reused across all episodes)"]
    for r in results:
        lines.append(
            f"Episode {r.index}: session_id={r.session_id}, "
            f"completion_id={r.completion_id}, reward={r.reward}"
        )
    return lines


def last_episode_note(gateway_url: str, api_key: str) -> list[str]:
    """How the still-open last episode gets published."""
    return [
        "The last episode is still open: it is published on the next refresh or when you end it:",
        f"python3 {start_session.SCRIPT_PATH} {gateway_url} --api-key {api_key}",
        f"python3 examples/openclaw/end_session.py {gateway_url} --api-key {api_key}",
        "(or run this demo with --end)",
    ]


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """Run the demo; returns the exit status."""
    env = os.environ if environ is None else environ
    options = parse_options(sys.argv[1:] if argv is None else argv, env)
    if not options.admin_key:
        _fmt.die("no admin key given.", *_fmt.ADMIN_KEY_HINTS)
    admin_key = options.admin_key
    health_check(options.gateway_url)

    api_key: str | None = None
    model = options.model
    results: list[EpisodeResult] = []
    session_id = ""
    for index in range(1, options.episodes + 1):
        # The model found in episode 1 is reused, so /v1/models is asked once.
        session, result, model = run_episode(
            replace(options, model=model), admin_key, index, api_key
        )
        api_key, session_id = session.api_key, session.session_id
        results.append(result)
    assert api_key is not None  # at least one episode ran

    trajectory_id = None
    if options.end:
        _fmt.header("End Session")
        status, payload, _ = end_session.call_end_session(options.gateway_url, api_key)
        ended = end_session.parse_ended(payload) if status == 200 else None
        if ended is None:
            _fmt.die(f"end_session failed (HTTP {status}): {_fmt.error_message(payload)}")
        end_session.print_ended(ended)
        trajectory_id = ended.trajectory_id

    _fmt.header("Summary")
    first, *rest = summary_lines(api_key, results)
    _fmt.info(first)
    for line in rest:
        _fmt.arrow(line)
    print(flush=True)
    if trajectory_id is None:
        note, *commands = last_episode_note(options.gateway_url, api_key)
        _fmt.info(note)
        for command in commands:
            print(f"    {command}", flush=True)
    else:
        _fmt.success(f"Every episode is published (last trajectory: {trajectory_id or 'none'})")
    _fmt.info("Watch the trajectories arrive: rollgate trajectories tail --json")
    values: dict[str, object] = {
        "SESSION_API_KEY": api_key,
        "SESSION_ID": session_id,
        "EPISODES": len(results),
    }
    if trajectory_id is not None:
        values["TRAJECTORY_ID"] = trajectory_id
    _fmt.emit_vars(**values)
    return 0


if __name__ == "__main__":
    sys.exit(main())
