"""Header mode across real processes: one admin-issued key, OpenClaw-RL's headers, several
episodes with no start_session or refresh, each published exactly once (by X-Session-Done,
by body session_done, or by the idle reaper)."""

from __future__ import annotations

import dataclasses
import http.client
import json
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from rollgate.stack import Stack
from services.dataproxy.redis_keys import RedisKeys
from services.runtime.keys import key_digest
from tests.end_to_end.test_lifecycle import _stack, published
from tests.end_to_end.test_walkthrough import chat_body
from tests.examples import zeroclaw_facts as zeroclaw
from tests.examples.conftest import EXAMPLES_DIR
from tests.harness.poll import eventually_sync


@pytest.fixture(scope="module")
def claw_stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A stack whose episodes go idle after 1.5 s, swept every 0.2 s."""
    env = {"ROLLGATE_SESSION_IDLE_TIMEOUT_S": "1.5", "ROLLGATE_REAPER_INTERVAL_S": "0.2"}
    with _stack(redis_url, Path(tmp_path_factory.mktemp("claw")), **env) as running:
        yield running


def post(
    stack: Stack, path: str, body: Any, key: str, headers: dict[str, str]
) -> tuple[int, bytes]:
    url = urllib.parse.urlsplit(stack.gateway_url)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=60)
    all_headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}", **headers}
    conn.request("POST", path, body=json.dumps(body), headers=all_headers)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, data


def waiting_episodes(stack: Stack, key: str) -> list[bytes]:
    """The key's episodes the reaper could still end and publish (`P idle`, `P awaiting_reward`)."""
    keys = RedisKeys(stack.config.redis_prefix)
    client = redis.Redis.from_url(stack.redis_url)
    try:
        members: list[bytes] = [
            *client.zrange(keys.idle, 0, -1),  # type: ignore[misc]
            *client.zrange(keys.awaiting_reward, 0, -1),  # type: ignore[misc]
        ]
    finally:
        client.close()
    return [m for m in members if m.startswith(f"{key_digest(key)}/".encode())]


def test_several_header_mode_episodes_are_published_exactly_once_each(claw_stack: Stack) -> None:
    before = len(published(claw_stack))
    status, raw = post(claw_stack, "/rl/keys", {"task_id": "claw"}, claw_stack.config.admin_key, {})
    assert status == 200, raw
    key = json.loads(raw)["api_key"]
    chat = "/v1/chat/completions"

    for n in range(3):  # ended by X-Session-Done
        sid = f"done-{n}"
        main = {"X-Session-Id": sid, "X-Turn-Type": "main"}
        assert post(claw_stack, chat, chat_body("hi", stream=True), key, main)[0] == 200
        side = {"X-Session-Id": sid, "X-Turn-Type": "side"}
        assert post(claw_stack, chat, chat_body("HEARTBEAT"), key, side)[0] == 200
        done = {**main, "X-Session-Done": "true"}
        assert post(claw_stack, chat, chat_body("bye"), key, done)[0] == 200
    body = chat_body("all in the body", session_id="body-0", turn_type="main", session_done=True)
    assert post(claw_stack, chat, body, key, {})[0] == 200
    # Never ended by the client: the idle reaper publishes it.
    assert post(claw_stack, chat, chat_body("left"), key, {"X-Session-Id": "idle-0"})[0] == 200
    status, raw = post(claw_stack, chat, chat_body("no id"), key, {})
    assert status == 400 and b"X-Session-Id" in raw

    eventually_sync(
        lambda: len(published(claw_stack)) - before >= 5,
        timeout_s=20,
        interval_s=0.1,
        what="the idle session published",
    )
    # Nothing of this key can be published again: the reaper publishes only what `P idle` or
    # `P awaiting_reward` holds, and no client call is left.
    assert waiting_episodes(claw_stack, key) == []
    trajectories = published(claw_stack)[before:]
    by_session = {t["session_id"]: t for t in trajectories}
    assert len(trajectories) == 5 and len(by_session) == 5
    for n in range(3):
        t = by_session[f"done-{n}"]
        assert t["end_reason"] == "session_done"
        assert [i["turn_type"] for i in t["interactions"]] == ["main", "side", "main"]
    assert by_session["body-0"]["end_reason"] == "session_done"
    assert by_session["idle-0"]["end_reason"] == "idle"
    assert {t["task_id"] for t in trajectories} == {"claw"}


def _zeroclaw_call(stack: Stack, provider: zeroclaw.Provider, text: str, **headers: str) -> bytes:
    url, all_headers, body = zeroclaw.chat_request(provider, text)
    # The files point at the default gateway address; this stack listens elsewhere.
    path = urllib.parse.urlsplit(url).path
    assert url == "http://127.0.0.1:8080" + path and path == "/v1/chat/completions"
    target = urllib.parse.urlsplit(stack.gateway_url)
    conn = http.client.HTTPConnection(target.hostname or "127.0.0.1", target.port, timeout=60)
    conn.request("POST", path, body=json.dumps(body), headers={**all_headers, **headers})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    assert resp.status == 200, data
    assert data.rstrip().endswith(b"data: [DONE]")
    return data


def test_zeroclaw_requests_built_from_both_example_files_are_recorded(claw_stack: Stack) -> None:
    admin = claw_stack.config.admin_key
    status, raw = post(claw_stack, "/rl/start_session", {"task_id": "zc"}, admin, {})
    assert status == 200, raw
    episode_key = json.loads(raw)["api_key"]
    status, raw = post(claw_stack, "/rl/keys", {"task_id": "zc-header"}, admin, {})
    assert status == 200, raw
    header_key = json.loads(raw)["api_key"]

    v3 = zeroclaw.load(EXAMPLES_DIR / "zeroclaw.config.toml")
    legacy = zeroclaw.migrate_legacy(zeroclaw.load(EXAMPLES_DIR / "zeroclaw.legacy.config.toml"))
    main, from_legacy = zeroclaw.agent_provider(v3), zeroclaw.agent_provider(legacy)
    assert main is not None and from_legacy is not None
    header = zeroclaw.providers(v3)["custom.rollgate-header"]
    _zeroclaw_call(claw_stack, dataclasses.replace(main, api_key=episode_key), "v3 file")
    _zeroclaw_call(claw_stack, dataclasses.replace(from_legacy, api_key=episode_key), "legacy")
    with_key = dataclasses.replace(header, api_key=header_key)
    _zeroclaw_call(claw_stack, with_key, "header one")
    _zeroclaw_call(claw_stack, with_key, "header two", **{"X-Session-Done": "true"})
    status, raw = post(claw_stack, "/rl/end_session", {}, episode_key, {})
    assert status == 200, raw
    trajectory_id = json.loads(raw)["trajectory_id"]

    session = header.extra_headers["X-Session-Id"]

    def both_published() -> bool:
        found = {t["trajectory_id"]: t for t in published(claw_stack)}
        by_session = {t["session_id"]: t for t in found.values() if t["task_id"] == "zc-header"}
        return trajectory_id in found and session in by_session

    eventually_sync(
        both_published, timeout_s=20, interval_s=0.1, what="the ZeroClaw episodes published"
    )
    found = {t["trajectory_id"]: t for t in published(claw_stack)}
    by_session = {t["session_id"]: t for t in found.values() if t["task_id"] == "zc-header"}
    assert len(found[trajectory_id]["interactions"]) == 2
    assert by_session[session]["end_reason"] == "session_done"
    assert len(by_session[session]["interactions"]) == 2
