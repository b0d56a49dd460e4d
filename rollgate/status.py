"""`rollgate status`: the console's live summary in one terminal screen.

Reads the gateway's `GET /console/api/overview` with the admin key from `ROLLGATE_ADMIN_KEY`
(never a command-line flag: other users of the machine can read command lines). The gateway
is `--gateway URL`, else `$ROLLGATE_GATEWAY_URL`, else the one `rollgate up` wrote into
`<state dir>/stack.json`, else http://127.0.0.1:8080.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from rollgate.keys import current_key

DEFAULT_GATEWAY = "http://127.0.0.1:8080"
TIMEOUT_S = 10.0
# Mean reward over the trajectories published this long ago at most.
REWARD_WINDOW_S = 300.0
MAX_ROWS = 10


class StatusError(Exception):
    """Why the summary could not be read; the message says what to do."""


def gateway_url(args: argparse.Namespace, environ: dict[str, str]) -> str:
    """--gateway, $ROLLGATE_GATEWAY_URL, stack.json of `rollgate up`, or the default."""
    if args.gateway:
        return str(args.gateway).rstrip("/")
    if environ.get("ROLLGATE_GATEWAY_URL"):
        return environ["ROLLGATE_GATEWAY_URL"].rstrip("/")
    try:
        state = json.loads((Path(args.state_dir) / "stack.json").read_text())
        return str(state["gateway_url"]).rstrip("/")
    except (OSError, ValueError, KeyError):
        return DEFAULT_GATEWAY


def fetch(url: str, admin_key: str) -> dict[str, Any]:
    """The overview JSON, or StatusError naming the problem."""
    request = urllib.request.Request(
        url + "/console/api/overview", headers={"Authorization": f"Bearer {admin_key}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as resp:
            data: dict[str, Any] = json.loads(resp.read())
            return data
    except urllib.error.HTTPError as err:
        try:
            message = json.loads(err.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = err.reason
        raise StatusError(f"{url} answered {err.code}: {message}") from None
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        raise StatusError(f"cannot reach the gateway at {url} ({reason}); is it running?") from None


def _age(seconds: float) -> str:
    if seconds <= 0:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _clock(unix: float) -> str:
    return datetime.fromtimestamp(unix).strftime("%H:%M:%S") if unix else "-"


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    cells = [list(map(str, header)), *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
            for row in cells]  # fmt: skip


def _last(series: Sequence[Any]) -> float | None:
    values = [v for v in series if v is not None]
    return float(values[-1]) if values else None


def render(data: dict[str, Any], url: str) -> str:
    """One screen: traffic, trainer, tokens, stream, workers, sessions, errors."""
    c = data["counters"]
    now = float(data.get("now") or time.time())
    workers = data.get("workers")
    live = None if workers is None else sum(1 for w in workers if w.get("live"))
    history = data.get("history") or {}
    tokens_s = _last(history.get("tokens_per_s", []))
    recent_rewards = [
        r["reward"] for r in data.get("rewards", []) if now - r["t"] <= REWARD_WINDOW_S
    ]
    paused = (
        f"PAUSED for {_age(now - float(c['paused_since_unix']))}" if c["paused"] else "submitting"
    )
    capacity = "unlimited" if int(c["capacity_left"]) < 0 else f"{c['capacity_left']} left"
    if int(c.get("capacity_bound", -1)) >= 0:
        capacity += f" (bound {c['capacity_bound']}, used {c['capacity_used']})"
    exact = f"{100 * float(c['exact_token_ratio']):.1f} %" if int(c["interactions"]) else "-"
    worker_text = "router unreachable" if live is None else f"{live}/{len(workers or [])} live"
    lines = [
        f"rollgate @ {url} — {_clock(now)}",
        f"traffic  turns in flight {c['in_flight']} · sessions {data['sessions_total']} "
        f"({c['open_episodes']} open, {c['awaiting_reward']} awaiting reward) · workers {worker_text}",
        f"trainer  weight version {c['weight_version']} · {paused} · published {c['published']} "
        f"· acked {c['consumed']} · empty {c['empty_episodes']} · capacity {capacity}",
        f"tokens   exact ids {exact} · length mismatches {c['length_mismatches']} "
        f"· prefix join {100 * float(c['join_rate']):.0f} % · "
        + (
            f"{tokens_s:.1f} output tokens/s"
            if tokens_s is not None
            else "tokens/s: no history yet"
        )
        + (
            f" · mean reward {sum(recent_rewards) / len(recent_rewards):.3f} "
            f"(last {len(recent_rewards)} in {REWARD_WINDOW_S / 60:.0f} min)"
            if recent_rewards
            else ""
        ),
        f"stream   {c['stream_length']} entries on the stream",
    ]
    groups = data.get("groups") or []
    if groups:
        lines += _table(
            ["group", "consumers", "backlog", "pending", "oldest undelivered", "oldest pending"],
            [
                [g["name"], g["consumers"], g["backlog"], g["pending"],
                 _age(g["oldest_undelivered_age_s"]), _age(g["oldest_pending_age_s"])]
                for g in groups
            ],
        )  # fmt: skip
    else:
        lines.append("  no consumer group yet (no trainer has pulled)")
    lines.append("workers")
    if workers:
        lines += _table(
            ["worker", "state", "in flight", "affinities", "heartbeat", "models"],
            [
                [w["worker_id"], "live" if w["live"] else "stale", w["in_flight"],
                 w["sessions"], _age(w["last_heartbeat_age_s"]) + " ago",
                 ",".join(w.get("models") or []) or "any"]
                for w in workers
            ],
        )  # fmt: skip
    else:
        lines.append("  " + ("the router did not answer" if workers is None else "none registered"))
    sessions = data.get("sessions") or []
    lines.append(f"sessions ({data['sessions_total']})")
    if sessions:
        lines += _table(
            ["session", "task", "state", "turns", "last active", "ends"],
            [
                [s["session_id"], s["task_id"], s["state"], s["turns"],
                 _clock(s["last_active_at_unix"]), _clock(s["deadline_unix"])]
                for s in sessions[:MAX_ROWS]
            ],
        )  # fmt: skip
        if len(sessions) > MAX_ROWS:
            lines.append(f"  … {data['sessions_total'] - MAX_ROWS} more (see /console)")
    errors = data.get("errors") or []
    lines.append(f"errors (last {min(len(errors), 5)} of {c['errors']} recorded)")
    if errors:
        lines += _table(
            ["when", "call", "code", "message"],
            [[_clock(e["t_unix"]), e["method"], e["code"], e["message"][:80]] for e in errors[:5]],
        )
    else:
        lines.append("  none")
    return "\n".join(lines)


def status_main(argv: Sequence[str], environ: dict[str, str] | None = None) -> int:
    """`rollgate status [--gateway URL] [--watch] [--json]`."""
    environ = dict(os.environ if environ is None else environ)
    parser = argparse.ArgumentParser(prog="rollgate status", description=__doc__.split("\n")[0])
    parser.add_argument("--gateway", default=None, help="gateway URL (default: see below)")
    parser.add_argument(
        "--state-dir",
        default=environ.get("ROLLGATE_STATE_DIR", str(Path.home() / ".rollgate")),
        help="where `rollgate up` wrote stack.json (default ~/.rollgate)",
    )
    parser.add_argument("--json", action="store_true", help="print the overview JSON as is")
    parser.add_argument(
        "--watch", type=float, nargs="?", const=2.0, default=None, metavar="SECONDS",
        help="redraw every SECONDS (default 2) until Ctrl-C",
    )  # fmt: skip
    args = parser.parse_args(argv)
    admin_key = current_key(environ.get("ROLLGATE_ADMIN_KEY", ""))
    if not admin_key:
        print(
            "rollgate status: set ROLLGATE_ADMIN_KEY to an admin key (rollgate up prints one)",
            file=sys.stderr,
        )
        return 2
    url = gateway_url(args, environ)
    try:
        while True:
            try:
                data = fetch(url, admin_key)
            except StatusError as err:
                print(f"rollgate status: {err}", file=sys.stderr)
                if args.watch is None:
                    return 1
            else:
                text = json.dumps(data, indent=2) if args.json else render(data, url)
                if args.watch is not None:
                    print("\033[H\033[2J", end="")  # clear the screen, cursor home
                print(text, flush=True)
            if args.watch is None:
                return 0
            time.sleep(max(0.5, args.watch))
    except KeyboardInterrupt:
        return 0
