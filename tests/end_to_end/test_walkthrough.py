"""The README walkthrough against the real processes: start, chat, reward, refresh, tail."""

from __future__ import annotations

import http.client
import json
import math
import subprocess
import sys
import time
import urllib.parse
import uuid
from pathlib import Path
from typing import Any

import msgpack  # type: ignore[import-untyped]
import redis

from rollgate.stack import Stack
from rollgate.trajectory import inline_content
from tests.harness.poll import eventually_sync

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "openclaw"
MODEL = "rollgate-mock"


def run_example(stack: Stack, script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Runs an example script with the system's python3, as a user would."""
    env = {"PATH": "/usr/bin:/bin", "ROLLGATE_ADMIN_KEY": stack.config.admin_key, "NO_COLOR": "1"}
    return subprocess.run(
        ["python3", str(EXAMPLES / script), stack.gateway_url, *args],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        check=False,
    )


def stderr_vars(proc: subprocess.CompletedProcess[str]) -> dict[str, str]:
    """The KEY=VALUE lines a script writes to stderr."""
    pairs = (line.split("=", 1) for line in proc.stderr.splitlines() if "=" in line)
    return {k.strip(): v.strip() for k, v in pairs}


def request(
    stack: Stack, method: str, path: str, body: Any = None, key: str | None = None
) -> tuple[int, dict[str, str], bytes]:
    """One HTTP request to the gateway; returns status, headers, raw body."""
    url = urllib.parse.urlsplit(stack.gateway_url)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=60)
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    conn.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data


def sse_events(raw: bytes) -> list[str]:
    """The `data:` payloads of an SSE body, in order."""
    return [line[len("data: ") :] for line in raw.decode().split("\n") if line.startswith("data: ")]


def chat_body(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], **extra}


def tail_json(stack: Stack, count: int) -> list[dict[str, Any]]:
    """`rollgate trajectories tail --json` as a subprocess."""
    proc = subprocess.run(
        [
            str(Path(sys.executable).parent / "rollgate"),
            "trajectories",
            "tail",
            "--json",
            "--from-start",
            "--count",
            str(count),
            "--timeout-s",
            "20",
            "--redis-url",
            stack.redis_url,
            "--prefix",
            stack.config.redis_prefix,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


def stream_len(stack: Stack) -> int:
    client = redis.Redis.from_url(stack.redis_url)
    try:
        return int(client.xlen(f"{stack.config.redis_prefix}trajectories"))
    finally:
        client.close()


def wait_for_stream_len(stack: Stack, expected: int, timeout_s: float = 20.0) -> int:
    eventually_sync(
        lambda: stream_len(stack) >= expected, timeout_s=timeout_s, what=f"{expected} published"
    )
    return stream_len(stack)


def test_walkthrough_publishes_episode_one_with_tokens_logprobs_and_reward(stack: Stack) -> None:
    started = run_example(stack, "start_session.py")
    assert started.returncode == 0, started.stdout + started.stderr
    first = stderr_vars(started)
    key, session_1 = first["SESSION_API_KEY"], first["SESSION_ID"]
    assert key.startswith("sk-sess-") and len(key) == len("sk-sess-") + 43

    status, headers, raw = request(
        stack, "POST", "/v1/chat/completions", chat_body("hi", stream=True), key
    )
    assert status == 200, raw
    assert headers["content-type"].startswith("text/event-stream")
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    streamed_text = "".join(
        c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices")
    )
    assert streamed_text
    # The client did not ask for logprobs, so it gets none.
    assert all(c["choices"][0].get("logprobs") is None for c in chunks if c.get("choices"))

    status, _, raw = request(
        stack, "POST", "/chat/completions", chat_body("and again", logprobs=True), key
    )
    assert status == 200, raw
    second = json.loads(raw)
    assert second["choices"][0]["logprobs"]["content"], "asked for logprobs, got none"

    rewarded = run_example(stack, "set_reward.py", "--api-key", key, "--reward", "1.0")
    assert rewarded.returncode == 0, rewarded.stdout + rewarded.stderr

    assert stream_len(stack) == 0, "nothing may be published before the episode ends"
    refreshed = run_example(stack, "start_session.py", "--api-key", key)
    assert refreshed.returncode == 0, refreshed.stdout + refreshed.stderr
    after = stderr_vars(refreshed)
    assert after["SESSION_API_KEY"] == key, "a refresh keeps the key"
    assert after["SESSION_ID"] != session_1

    assert wait_for_stream_len(stack, 1) == 1
    [trajectory] = tail_json(stack, 1)
    assert trajectory["session_id"] == session_1
    assert trajectory["final_reward"] == 1.0
    interactions = trajectory["interactions"]
    assert len(interactions) == 2
    assert interactions[1]["interaction_id"] == second["id"]
    assert interactions[0]["output"]["content"] == streamed_text
    assert interactions[1]["reward"] == 1.0
    for turn in interactions:
        assert turn["exact_tokens"] is True
        assert turn["prompt_token_ids"] and turn["output_token_ids"]
        assert len(turn["output_logprobs"]) == len(turn["output_token_ids"])
        assert all(math.isfinite(lp) and lp <= 0 for lp in turn["output_logprobs"])
    returned = [e["logprob"] for e in second["choices"][0]["logprobs"]["content"]]
    assert [round(x, 4) for x in interactions[1]["output_logprobs"]] == [
        round(x, 4) for x in returned
    ]
    assert trajectory["key_id"] and key not in json.dumps(trajectory)

    # Episode 2 has no completed interaction: a refresh publishes nothing for it.
    again = run_example(stack, "start_session.py", "--api-key", key)
    assert again.returncode == 0, again.stdout + again.stderr
    assert stream_len(stack) == 1


def test_wrong_keys_get_401_saying_which_key_to_use(stack: Stack) -> None:
    for key, hint in [
        (stack.config.admin_key, "admin key"),
        ("sk-proj-abcdefghijklmnopqrstuvwxyz0123456789", "not a rollgate session key"),
        ("sk-sess-" + "A" * 43, "start_session"),
        (None, "Authorization"),
    ]:
        status, headers, raw = request(stack, "POST", "/v1/chat/completions", chat_body("x"), key)
        assert status == 401, (key, raw)
        assert headers["content-type"].startswith("application/json")
        error = json.loads(raw)["error"]
        assert hint in error["message"], error
        assert error["type"] and error["code"]


def test_chat_between_episodes_gets_503_with_retry_after_not_401(stack: Stack) -> None:
    started = run_example(stack, "start_session.py")
    key = stderr_vars(started)["SESSION_API_KEY"]
    status, _, raw = request(stack, "POST", "/v1/chat/completions", chat_body("one turn"), key)
    assert status == 200, raw
    status, _, raw = request(stack, "POST", "/rl/end_session", {}, key)
    assert status == 200, raw
    ended = json.loads(raw)
    assert ended["interaction_count"] == 1 and ended["trajectory_id"]

    for stream in (False, True):
        status, headers, raw = request(
            stack, "POST", "/v1/chat/completions", chat_body("too late", stream=stream), key
        )
        assert status == 503, raw
        assert int(headers["retry-after"]) >= 1
        assert "start_session" in json.loads(raw)["error"]["message"]


def test_models_lists_the_mock_model(stack: Stack) -> None:
    status, _, raw = request(stack, "GET", "/v1/models", key=stack.config.admin_key)
    assert status == 200, raw
    assert MODEL in [m["id"] for m in json.loads(raw)["data"]]


def test_areals_demo_lifecycle_requests_work_unchanged(stack: Stack) -> None:
    """The requests AReaL's examples/openclaw/demo_lifecycle.py sends with its defaults (no
    --model, so `"model": "default"`), in its order, and the fields it reads back."""

    def workers() -> object:
        status, _, raw = request(stack, "GET", "/health")
        assert status == 200
        return json.loads(raw).get("workers", "?")

    eventually_sync(workers, want=stack.config.workers, timeout_s=20, interval_s=0.1)
    admin = stack.config.admin_key
    chat = {
        "model": "default",
        "messages": [
            {
                "role": "system",
                "content": "You are a helpful math tutor. Show your work step by step.",
            },
            {"role": "user", "content": "Solve step by step: What is 12 * 15 + 3?"},
        ],
        "temperature": 0.7,
        "max_tokens": 512,
    }
    key: str | None = None
    completion_ids = []
    for _ in range(2):
        start: dict[str, Any] = {
            "task_id": "demo-task",
            "request_id": f"openclaw-demo-{uuid.uuid4()}",
            "request_expires_at": time.time() + 300.0,
        }
        if key is not None:
            start["api_key"] = key
        status, _, raw = request(stack, "POST", "/rl/start_session", start, admin)
        assert status == 200, raw
        started = json.loads(raw)
        assert started["session_id"] and (key is None or started["api_key"] == key)
        key = started["api_key"]
        status, _, raw = request(stack, "POST", "/chat/completions", chat, key)
        assert status == 200, raw
        completion = json.loads(raw)
        assert completion["choices"][0]["message"]["content"]
        assert completion["model"] == MODEL
        completion_ids.append(completion["id"])
        status, _, raw = request(stack, "POST", "/rl/set_reward", {"reward": 1.0}, key)
        assert status == 200, raw
    # The refresh published episode 1; it records the real model, not the alias.
    client = redis.Redis.from_url(stack.redis_url)
    try:
        entries: Any = client.xrange(f"{stack.config.redis_prefix}trajectories")
    finally:
        client.close()
    episodes = [
        inline_content(msgpack.unpackb(fields[b"data"], raw=False)) for _, fields in entries
    ]
    [first] = [t for t in episodes if t["interactions"][0]["interaction_id"] == completion_ids[0]]
    assert first["interactions"][0]["model"] == MODEL
    assert first["interactions"][0]["reward"] == 1.0
