"""`rollgate status` without a stack: what it needs, and what it says when it cannot read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollgate.redis_server import free_port
from rollgate.status import render, status_main

OVERVIEW = {
    "now": 1_800_000_000.0,
    "counters": {
        "open_episodes": 2, "awaiting_reward": 1, "published": 40, "consumed": 35,
        "empty_episodes": 3, "interactions": 120, "joined": 60, "output_tokens": 9000,
        "exact_interactions": 118, "length_mismatches": 2, "reward_sum": 20.0, "errors": 4,
        "weight_version": 7, "in_flight": 5, "paused": True, "paused_since_unix": 1_799_999_988.0,
        "capacity_left": 3, "capacity_granted": -1, "capacity_used": 42, "capacity_bound": 45,
        "stream_length": 12, "join_rate": 0.75, "exact_token_ratio": 118 / 120,
    },
    "groups": [{"name": "trainer-a", "consumers": 2, "pending": 4, "backlog": 1,
                "oldest_pending_age_s": 3.5, "oldest_undelivered_age_s": 1.25}],
    "sessions": [{"session_id": "math-9", "task_id": "math", "key_id": "k", "state": "active",
                  "turns": 4, "started_at_unix": 1_799_999_000.0,
                  "last_active_at_unix": 1_799_999_990.0, "deadline_unix": 1_800_003_590.0}],
    "sessions_total": 3,
    "workers": [{"worker_id": "worker-1", "address": "a:1", "models": ["m"], "in_flight": 3,
                 "sessions": 2, "last_heartbeat_age_s": 0.4, "live": True},
                {"worker_id": "worker-2", "address": "a:2", "models": [], "in_flight": 0,
                 "sessions": 0, "last_heartbeat_age_s": 9.0, "live": False}],
    "history": {"t": [1_799_999_990.0, 1_800_000_000.0], "tokens_per_s": [10.0, 123.4]},
    "rewards": [{"t": 1_799_999_900.0, "reward": 1.0, "stream_id": "1-1"},
                {"t": 1_799_999_950.0, "reward": 0.0, "stream_id": "1-2"},
                {"t": 1_700_000_000.0, "reward": 9.0, "stream_id": "0-1"}],
    "recent": [],
    "errors": [{"t_unix": 1_799_999_999.0, "method": "Chat", "code": "UNAVAILABLE",
                "message": "submission paused for weight update"}],
}  # fmt: skip


def test_one_screen_shows_traffic_trainer_tokens_stream_workers_sessions_errors() -> None:
    text = render(OVERVIEW, "http://gw:8080")
    lines = text.splitlines()
    assert lines[0].startswith("rollgate @ http://gw:8080")
    assert "turns in flight 5 · sessions 3 (2 open, 1 awaiting reward) · workers 1/2 live" in text
    assert "weight version 7 · PAUSED for 12.0 s · published 40 · acked 35" in text
    assert "capacity 3 left (bound 45, used 42)" in text
    assert (
        "exact ids 98.3 % · length mismatches 2 · prefix join 75 % · 123.4 output tokens/s" in text
    )
    # Only the rewards of the last five minutes are averaged.
    assert "mean reward 0.500 (last 2 in 5 min)" in text
    group = next(line for line in lines if line.strip().startswith("trainer-a"))
    assert group.split() == ["trainer-a", "2", "1", "4", "1.2", "s", "3.5", "s"]
    assert any(line.split()[:3] == ["worker-2", "stale", "0"] for line in lines)
    assert any(line.split()[:4] == ["math-9", "math", "active", "4"] for line in lines)
    assert "UNAVAILABLE" in text and "submission paused" in text
    assert len(lines) < 40  # one screen


def test_status_needs_the_admin_key_from_the_environment(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert status_main([], environ={}) == 2
    assert "set ROLLGATE_ADMIN_KEY" in capsys.readouterr().err


def test_status_says_when_the_gateway_cannot_be_reached(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    code = status_main(["--gateway", url], environ={"ROLLGATE_ADMIN_KEY": "k"})
    assert code == 1
    err = capsys.readouterr().err
    assert f"cannot reach the gateway at {url}" in err and "k" not in err.split(url)[0]


def test_the_gateway_comes_from_stack_json_when_not_given(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    (tmp_path / "stack.json").write_text(json.dumps({"gateway_url": url}))
    code = status_main(["--state-dir", str(tmp_path)], environ={"ROLLGATE_ADMIN_KEY": "k"})
    assert code == 1
    assert url in capsys.readouterr().err
