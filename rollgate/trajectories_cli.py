"""`rollgate trajectories tail|export`: watch or dump published trajectories, never consuming."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
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


def stack_file(environ: Mapping[str, str]) -> Path:
    """Where `rollgate up` wrote its stack.json: ROLLGATE_STATE_DIR, else ~/.rollgate."""
    return Path(environ.get("ROLLGATE_STATE_DIR") or Path.home() / ".rollgate") / "stack.json"


# One XREAD blocks at most this long, well under the socket timeout (redis-py#2807).
_BLOCK_MS = 1000
_SOCKET_TIMEOUT_S = 5.0
_BATCH = 100
DEFAULT_EXPORT_NAME = "default"


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
    options = parse_args(argv, os.environ, stack_file(os.environ))
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
    parser = argparse.ArgumentParser(
        prog="rollgate trajectories tail",
        description="Print published trajectories. Only observes (XREAD/XRANGE): it never "
        "joins a consumer group, so it is safe next to a trainer. With no position or "
        "count it shows the stream from the start and keeps following.",
    )
    _add_redis_args(parser, environ, stack_file)
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


def _add_redis_args(
    parser: argparse.ArgumentParser, environ: Mapping[str, str], stack_file: Path
) -> None:
    stack = _stack_state(stack_file)
    parser.add_argument(
        "--redis-url",
        default=environ.get("ROLLGATE_REDIS_URL")
        or environ.get("REDIS_URL")
        or stack.get("redis_url")
        or DEFAULT_REDIS_URL,
        help="default: ROLLGATE_REDIS_URL, REDIS_URL, $ROLLGATE_STATE_DIR/stack.json (~/.rollgate), local 6379",
    )
    parser.add_argument(
        "--prefix",
        default=environ.get("ROLLGATE_REDIS_PREFIX") or stack.get("redis_prefix") or "rg:",
        help="Redis key prefix (default: ROLLGATE_REDIS_PREFIX, the stack's, or rg:)",
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


# --- export ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ExportOptions:
    """Where to write, which entries, and which cursor remembers what was exported."""

    redis_url: str
    prefix: str
    out: str  # a path, or "-" for stdout
    append: bool
    from_id: str | None
    to_id: str | None
    everything: bool
    name: str

    @property
    def uses_cursor(self) -> bool:
        """Only the default mode (no range, no --all) reads and moves the cursor."""
        return not (self.everything or self.from_id or self.to_id)


@dataclass(frozen=True, slots=True, kw_only=True)
class ExportResult:
    """What an export wrote: entries, the first and last stream ids, undecodable ones."""

    exported: int
    first_id: str
    last_id: str
    undecodable: int
    trimmed_before_export: bool


def export_main(argv: list[str]) -> int:
    """Runs `rollgate trajectories export`; 0 when the file was written (even if empty)."""
    options = parse_export_args(argv, os.environ, stack_file(os.environ))
    client = redis.Redis.from_url(
        options.redis_url, socket_timeout=_SOCKET_TIMEOUT_S, socket_connect_timeout=5.0
    )
    try:
        result = export(client, options)
    except redis.RedisError as err:
        print(f"rollgate trajectories export: {options.redis_url}: {err}", file=sys.stderr)
        return 1
    except OSError as err:
        print(f"rollgate trajectories export: {options.out}: {err}", file=sys.stderr)
        return 1
    finally:
        client.close()
    print(_export_summary(result, options), file=sys.stderr)
    return 0


def parse_export_args(
    argv: list[str], environ: Mapping[str, str], stack_file: Path
) -> ExportOptions:
    """Options of `rollgate trajectories export`."""
    parser = argparse.ArgumentParser(
        prog="rollgate trajectories export",
        description="Write published trajectories to JSON Lines (one trajectory per line, "
        "packed arrays as lists). Reads with XRANGE only: nothing is consumed or acked. "
        "By default writes everything not yet exported under --name, remembered in Redis "
        "(hash <prefix>export_cursors); --all or a range exports without the cursor. "
        "The trainer adapters replay such a file in place of the live stream "
        "(docs/training.md, Offline).",
    )
    _add_redis_args(parser, environ, stack_file)
    parser.add_argument("--out", required=True, help="output file ('-': standard output)")
    parser.add_argument("--append", action="store_true", help="append instead of replacing")
    parser.add_argument("--from-id", default=None, help="first stream id (inclusive)")
    parser.add_argument("--to-id", default=None, help="last stream id (inclusive)")
    parser.add_argument("--all", dest="everything", action="store_true", help="whole stream")
    parser.add_argument(
        "--name",
        default=DEFAULT_EXPORT_NAME,
        help="the cursor remembering what was exported (default: default)",
    )
    args = parser.parse_args(argv)
    if args.everything and (args.from_id or args.to_id):
        parser.error("--all and --from-id/--to-id exclude each other")
    return ExportOptions(
        redis_url=str(args.redis_url),
        prefix=str(args.prefix),
        out=str(args.out),
        append=bool(args.append),
        from_id=args.from_id,
        to_id=args.to_id,
        everything=bool(args.everything),
        name=str(args.name),
    )


def export(client: redis.Redis, options: ExportOptions) -> ExportResult:
    """Writes the selected entries, then (default mode) moves the cursor past them."""
    stream = f"{options.prefix}trajectories"
    cursors = f"{options.prefix}export_cursors"
    cursor = ""
    if options.uses_cursor:
        stored: Any = client.hget(cursors, options.name)
        cursor = _text(stored) if stored else ""
    start = f"({cursor}" if cursor else (options.from_id or "-")
    # Fixed before reading: entries published meanwhile wait for the next export.
    end = options.to_id or _last_id(client, stream)
    trimmed = _trimmed_since(client, stream, cursor) if options.uses_cursor else False
    counts = {"exported": 0, "undecodable": 0}
    ids: list[str] = []
    with _output(options.out, append=options.append) as out:
        if end != "0-0":
            for stream_id, fields in _entries(client, stream, start, end):
                line, ok = _export_line(stream_id, fields)
                if not ok:
                    counts["undecodable"] += 1
                    print(f"# {stream_id}: {line}", file=sys.stderr)
                    continue
                out.write(line + "\n")
                counts["exported"] += 1
                ids.append(stream_id)
    if options.uses_cursor and ids:
        client.hset(cursors, options.name, ids[-1])
    return ExportResult(
        exported=counts["exported"],
        first_id=ids[0] if ids else "",
        last_id=ids[-1] if ids else "",
        undecodable=counts["undecodable"],
        trimmed_before_export=trimmed,
    )


def _entries(
    client: redis.Redis, stream: str, start: str, end: str
) -> Iterator[tuple[str, Mapping[bytes, bytes]]]:
    while True:
        batch: Any = client.xrange(stream, min=start, max=end, count=_BATCH)
        for stream_id, fields in batch:
            yield _text(stream_id), fields
        if len(batch) < _BATCH:
            return
        start = f"({_text(batch[-1][0])}"


def _export_line(stream_id: str, fields: Mapping[bytes, bytes]) -> tuple[str, bool]:
    values = {_text(k): v for k, v in fields.items()}
    try:
        trajectory = decode_trajectory(
            bytes(values.get("data", b"")), _text(values.get("codec", b"msgpack"))
        )
    except TrajectoryDecodeError as err:
        return f"cannot decode: {err}", False
    return export_line(stream_id, trajectory), True


def export_line(stream_id: str, trajectory: Trajectory) -> str:
    """One line of the JSON Lines export (no newline): `stream_id` and the trajectory as JSON.

    The one offline format: `export` writes it, the trainer adapters' dumps write it, and
    `rollgate.episodes.read_export` (replay) reads it back into the same trajectory.
    """
    return orjson.dumps({"stream_id": stream_id, **trajectory_to_json(trajectory)}).decode()


def _trimmed_since(client: redis.Redis, stream: str, cursor: str) -> bool:
    """Whether entries newer than the cursor were trimmed or deleted before this export."""
    try:
        info: Any = client.xinfo_stream(stream)
    except redis.ResponseError:
        return False
    if "max-deleted-entry-id" in info:  # Redis 7: exact
        deleted = _text(info["max-deleted-entry-id"] or b"0-0")
        return _id_key(deleted) > _id_key(cursor or "0-0")
    # Redis 6.2 keeps no trace of trimmed ids: when even the cursor's own entry is gone, the
    # entries after it may have gone too, so warn.
    first = info.get("first-entry")
    if not first or not cursor or cursor == "0-0":
        return False
    return _id_key(_text(first[0])) > _id_key(cursor)


def _id_key(stream_id: str) -> tuple[int, int]:
    ms, _, seq = stream_id.partition("-")
    return int(ms or 0), int(seq or 0)


@contextlib.contextmanager
def _output(path: str, *, append: bool) -> Iterator[Any]:
    """stdout, an appended file, or a temp file renamed into place once complete."""
    if path == "-":
        yield sys.stdout
        sys.stdout.flush()
        return
    if append:
        with open(path, "a", encoding="utf-8") as out:
            yield out
            out.flush()
            os.fsync(out.fileno())
        return
    target = Path(path)
    fd, temp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent or ".")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            yield out
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def _export_summary(result: ExportResult, options: ExportOptions) -> str:
    where = "standard output" if options.out == "-" else options.out
    text = f"rollgate: exported {result.exported} trajectories to {where}"
    if result.exported:
        text += f" ({result.first_id} … {result.last_id})"
    if options.uses_cursor:
        text += f"; cursor {options.name!r} at {result.last_id or 'unchanged'}"
    if result.undecodable:
        text += f"; {result.undecodable} undecodable entries skipped"
    if result.trimmed_before_export:
        text += (
            "\nwarning: some trajectories after the last export were trimmed from the stream "
            "(acked by every consumer group) before this export; export more often"
        )
    return text


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
        return export_line(stream_id, trajectory)
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
    _COMMANDS = {"tail": tail_main, "export": export_main}
    if len(sys.argv) < 2 or sys.argv[1] not in _COMMANDS:
        sys.exit("usage: python -m rollgate.trajectories_cli tail|export [options]")
    sys.exit(_COMMANDS[sys.argv[1]](sys.argv[2:]))
