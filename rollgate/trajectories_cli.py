"""`rollgate trajectories tail`: watch published trajectories without consuming them."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import redis

from rollgate.trajectory import (
    Trajectory,
    TrajectoryDecodeError,
    decode_trajectory,
    trajectory_to_json,
)

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
STACK_FILE = Path.home() / ".rollgate" / "stack.json"
# One XREAD blocks at most this long, well under the socket timeout (redis-py#2807).
_BLOCK_MS = 1000
_SOCKET_TIMEOUT_S = 5.0
_BATCH = 100


@dataclass(frozen=True, slots=True, kw_only=True)
class TailOptions:
    """What to show, from where, and when to stop."""

    redis_url: str
    prefix: str
    json_lines: bool
    start_id: str  # "0-0": from the start; "$": only entries published from now on
    count: int | None
    timeout_s: float | None


def tail_main(argv: list[str]) -> int:
    """Runs `rollgate trajectories tail`; 0 on a normal end (count, timeout, Ctrl-C)."""
    options = parse_args(argv, os.environ, STACK_FILE)
    client = redis.Redis.from_url(
        options.redis_url, socket_timeout=_SOCKET_TIMEOUT_S, socket_connect_timeout=5.0
    )
    try:
        tail(client, options)
    except KeyboardInterrupt:
        return 0
    except redis.RedisError as err:
        print(f"rollgate trajectories tail: {options.redis_url}: {err}", file=sys.stderr)
        return 1
    finally:
        client.close()
    return 0


def parse_args(argv: list[str], environ: Mapping[str, str], stack_file: Path) -> TailOptions:
    """Options from the command line, the environment and `rollgate up`'s state file."""
    stack = _stack_state(stack_file)
    parser = argparse.ArgumentParser(
        prog="rollgate trajectories tail",
        description="Print published trajectories. Only observes (XREAD/XRANGE): it never "
        "joins a consumer group, so it is safe next to a trainer. With no position or "
        "count it shows the stream from the start and keeps following.",
    )
    parser.add_argument(
        "--redis-url",
        default=environ.get("ROLLGATE_REDIS_URL")
        or environ.get("REDIS_URL")
        or stack.get("redis_url")
        or DEFAULT_REDIS_URL,
        help="default: ROLLGATE_REDIS_URL, REDIS_URL, ~/.rollgate/stack.json, local 6379",
    )
    parser.add_argument(
        "--prefix",
        default=environ.get("ROLLGATE_REDIS_PREFIX") or stack.get("redis_prefix") or "rg:",
        help="Redis key prefix (default: ROLLGATE_REDIS_PREFIX, the stack's, or rg:)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per trajectory")
    position = parser.add_mutually_exclusive_group()
    position.add_argument("--from-start", action="store_true", help="read the whole stream")
    position.add_argument("--from-now", action="store_true", help="only new trajectories")
    parser.add_argument("--count", type=int, default=None, help="exit after N trajectories")
    parser.add_argument(
        "--timeout-s", type=float, default=None, help="exit after S seconds with nothing new"
    )
    args = parser.parse_args(argv)
    # Plain `tail` shows what is there and follows; scripted use (--count) starts now.
    from_start = args.from_start or (not args.from_now and args.count is None)
    return TailOptions(
        redis_url=str(args.redis_url),
        prefix=str(args.prefix),
        json_lines=bool(args.json),
        start_id="0-0" if from_start else "$",
        count=args.count,
        timeout_s=args.timeout_s,
    )


def tail(client: redis.Redis, options: TailOptions) -> None:
    """Prints trajectories until the count or the idle timeout is reached."""
    stream = f"{options.prefix}trajectories"
    cursor = options.start_id if options.start_id != "$" else _last_id(client, stream)
    print(f"# following {stream} after {cursor}", file=sys.stderr, flush=True)
    shown = 0
    last_new = time.monotonic()
    while options.count is None or shown < options.count:
        wait_ms = _BLOCK_MS
        if options.timeout_s is not None:
            left_s = options.timeout_s - (time.monotonic() - last_new)
            if left_s <= 0:
                return
            wait_ms = max(1, min(_BLOCK_MS, int(left_s * 1000)))
        reply: Any = client.xread({stream: cursor}, count=_BATCH, block=wait_ms)
        for _name, entries in reply or ():
            for stream_id, fields in entries:
                cursor = _text(stream_id)
                print(_render(cursor, fields, json_lines=options.json_lines), flush=True)
                shown += 1
                last_new = time.monotonic()
                if options.count is not None and shown >= options.count:
                    return


def summary_line(stream_id: str, trajectory: Trajectory) -> str:
    """One readable line: ids, session, turns, reward, tokens."""
    return (
        f"{stream_id}  {trajectory.trajectory_id}  session={trajectory.session_id}  "
        f"turns={len(trajectory.interactions)}  reward={trajectory.final_reward:g}  "
        f"tokens={trajectory.prompt_tokens}+{trajectory.output_tokens}  "
        f"end={trajectory.end_reason}"
    )


def _render(stream_id: str, fields: Mapping[bytes, bytes], *, json_lines: bool) -> str:
    values = {_text(k): v for k, v in fields.items()}
    codec = _text(values.get("codec", b"msgpack"))
    try:
        trajectory = decode_trajectory(bytes(values.get("data", b"")), codec)
    except TrajectoryDecodeError as err:
        if json_lines:
            return json.dumps({"stream_id": stream_id, "error": str(err)})
        return f"{stream_id}  (cannot decode: {err})"
    if json_lines:
        return orjson.dumps({"stream_id": stream_id, **trajectory_to_json(trajectory)}).decode()
    return summary_line(stream_id, trajectory)


def _last_id(client: redis.Redis, stream: str) -> str:
    # Resolving `$` once means nothing published after start-up is missed between reads.
    last: Any = client.xrevrange(stream, count=1)
    return _text(last[0][0]) if last else "0-0"


def _stack_state(path: Path) -> dict[str, Any]:
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


if __name__ == "__main__":
    sys.exit(tail_main(sys.argv[1:]))
