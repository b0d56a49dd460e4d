"""Lifecycle across real processes: a SIGKILLed dataproxy restarts with the same keys, loses
nothing and doubles nothing; the idle reaper of a restarted replica publishes idle episodes."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
import redis

from rollgate.stack import Stack
from rollgate.trajectory import inline_content
from tests.end_to_end.test_walkthrough import chat_body, request
from tests.harness.poll import eventually_sync
from tests.harness.processes import stack_config

RETRY_DEADLINE_S = 30.0


def _stack(redis_url: str, state_dir: Path, **env: str) -> Stack:
    return Stack(stack_config(redis_url, state_dir, prefix="rgcycle", workers=1, extra_env=env))


@pytest.fixture(scope="module")
def life_stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A stack with the default lifecycle settings."""
    with _stack(redis_url, Path(tmp_path_factory.mktemp("life"))) as running:
        yield running


@pytest.fixture(scope="module")
def idle_stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A stack whose episodes go idle after 1.5 s, swept every 0.2 s."""
    env = {"ROLLGATE_SESSION_IDLE_TIMEOUT_S": "1.5", "ROLLGATE_REAPER_INTERVAL_S": "0.2"}
    with _stack(redis_url, Path(tmp_path_factory.mktemp("idle")), **env) as running:
        yield running


def call(stack: Stack, path: str, body: Any, key: str, *, ok: tuple[int, ...] = (200,)) -> Any:
    """POSTs until the status is one of `ok`; 503s (a restarting dataproxy) are retried."""

    def answered() -> tuple[int, bytes] | None:
        status, _, raw = request(stack, "POST", path, body, key)
        if status in ok:
            return status, raw
        assert status == 503, (status, raw)
        return None

    return eventually_sync(answered, timeout_s=RETRY_DEADLINE_S, interval_s=0.1, what=path)


def start(stack: Stack, api_key: str = "") -> dict[str, Any]:
    body = {"task_id": "life", **({"api_key": api_key} if api_key else {})}
    _, raw = call(stack, "/rl/start_session", body, stack.config.admin_key)
    started: dict[str, Any] = json.loads(raw)
    return started


def chat(stack: Stack, key: str, text: str) -> None:
    call(stack, "/v1/chat/completions", chat_body(text), key)


def published(stack: Stack) -> list[dict[str, Any]]:
    client = redis.Redis.from_url(stack.redis_url)
    try:
        entries: Any = client.xrange(f"{stack.config.redis_prefix}trajectories")
        return [
            inline_content(msgpack.unpackb(fields[b"data"], raw=False)) for _id, fields in entries
        ]
    finally:
        client.close()


def open_episodes(stack: Stack) -> int:
    client = redis.Redis.from_url(stack.redis_url)
    try:
        return int(client.hget(f"{stack.config.redis_prefix}stats", "open_episodes") or 0)
    finally:
        client.close()


def kill_and_restart_dataproxy(stack: Stack) -> None:
    assert stack.stop_service("dataproxy", kill=True) == -9
    stack.restart_service("dataproxy")


def test_a_sigkilled_dataproxy_carries_on_with_the_same_keys_and_loses_nothing(
    life_stack: Stack,
) -> None:
    before = len(published(life_stack))
    keys = [start(life_stack)["api_key"] for _ in range(4)]
    for key in keys:
        chat(life_stack, key, "one")
        chat(life_stack, key, "two")
    for key in keys[:2]:
        call(life_stack, "/rl/end_session", {}, key)

    kill_and_restart_dataproxy(life_stack)

    for key in keys[2:]:
        chat(life_stack, key, "three")  # the open episodes carry on
        call(life_stack, "/rl/end_session", {}, key)
    for key in keys[:2]:
        assert start(life_stack, key)["api_key"] == key  # ended keys start their next episode
        chat(life_stack, key, "again")
        call(life_stack, "/rl/end_session", {}, key)

    trajectories = published(life_stack)[before:]
    counts = sorted(len(t["interactions"]) for t in trajectories)
    assert counts == [1, 1, 2, 2, 3, 3]
    assert len({t["trajectory_id"] for t in trajectories}) == 6
    assert len({t["session_id"] for t in trajectories}) == 6


def test_a_dataproxy_killed_while_ending_episodes_publishes_each_exactly_once(
    life_stack: Stack,
) -> None:
    before = len(published(life_stack))
    starts = [start(life_stack) for _ in range(12)]
    for started in starts:
        chat(life_stack, started["api_key"], "only")

    threads = [
        threading.Thread(
            target=request,
            args=(life_stack, "POST", "/rl/end_session", {}, s["api_key"]),
            daemon=True,
        )
        for s in starts
    ]
    for thread in threads:
        thread.start()
    kill_and_restart_dataproxy(life_stack)  # some ends landed, some did not, some mid-way
    for thread in threads:
        thread.join(60)

    # The client retries every end whose answer it lost: 409 means it had already ended.
    for started in starts:
        call(life_stack, "/rl/end_session", {}, started["api_key"], ok=(200, 409))

    trajectories = published(life_stack)[before:]
    sessions = sorted(t["session_id"] for t in trajectories)
    assert sessions == sorted(s["session_id"] for s in starts)  # each once, none lost
    assert all(len(t["interactions"]) == 1 for t in trajectories)
    assert open_episodes(life_stack) == 0


def test_a_restarted_replicas_reaper_publishes_the_idle_episode_and_the_key_stays_valid(
    idle_stack: Stack,
) -> None:
    started = start(idle_stack)
    key = started["api_key"]
    chat(idle_stack, key, "then silence")
    kill_and_restart_dataproxy(idle_stack)

    eventually_sync(lambda: published(idle_stack), timeout_s=20, what="the idle episode published")
    (trajectory,) = published(idle_stack)
    assert trajectory["session_id"] == started["session_id"]
    assert trajectory["end_reason"] == "idle"

    status, _, raw = request(idle_stack, "POST", "/v1/chat/completions", chat_body("x"), key)
    assert status == 503, raw  # between episodes, never 401
    assert start(idle_stack, key)["api_key"] == key
    chat(idle_stack, key, "back")
