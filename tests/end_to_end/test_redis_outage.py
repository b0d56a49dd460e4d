"""Redis stopped and restarted under load: 503 + Retry-After while it is down, recovery after,
and no answered turn lost."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from rollgate.redis_server import RedisServer
from rollgate.stack import Stack
from tests.end_to_end.test_lifecycle import published
from tests.harness.poll import eventually
from tests.harness.processes import log_level_env, stack_config

pytestmark = pytest.mark.e2e

MODEL = "rollgate-mock"
CLIENTS = 6
CALL_TIMEOUT_S = 60.0
PHASE_DEADLINE_S = 90.0


@dataclass(slots=True)
class Load:
    """What the clients saw: answered turns, and every answer that was not a 200."""

    answered: list[str] = field(default_factory=list)
    refused: list[tuple[int, str, str, str | None]] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    def refused_with(self, code: str) -> int:
        return sum(1 for _, got, _, _ in self.refused if got == code)


@pytest.fixture
def redis_and_stack(tmp_path: Path) -> Iterator[tuple[RedisServer, Stack]]:
    """A Redis of this test's own (it is stopped and restarted) and a stack on it."""
    (tmp_path / "redis").mkdir()
    redis = RedisServer(appendonly=True, data_dir=str(tmp_path / "redis")).start()
    config = stack_config(
        redis.url, tmp_path / "stack", prefix="rgoutage", workers=2, extra_env=log_level_env()
    )
    try:
        with Stack(config) as stack:
            yield redis, stack
    finally:
        redis.close()


async def _post(
    http: aiohttp.ClientSession, stack: Stack, path: str, key: str, body: Any
) -> tuple[int, dict[str, str], bytes]:
    async with http.post(
        stack.gateway_url + path,
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=aiohttp.ClientTimeout(total=CALL_TIMEOUT_S),
    ) as resp:
        return resp.status, dict(resp.headers), await resp.read()


async def _client(
    http: aiohttp.ClientSession, stack: Stack, key: str, stream: bool, load: Load
) -> None:
    """Chats in a loop until told to stop, recording what each call got."""
    turn = 0
    while not load.stop.is_set():
        turn += 1
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"turn {turn}"}],
            "stream": stream,
        }
        status, headers, raw = await _post(http, stack, "/v1/chat/completions", key, body)
        if status == 200 and not stream:
            load.answered.append(orjson.loads(raw)["id"])
        elif status == 200:
            events = [line[6:] for line in raw.decode().split("\n") if line.startswith("data: ")]
            if events and events[-1] == "[DONE]":
                load.answered.append(orjson.loads(events[0])["id"])
            else:
                error = orjson.loads(events[-1])["error"]
                load.refused.append((200, error["code"], error["message"], None))
        else:
            error = orjson.loads(raw)["error"]
            load.refused.append(
                (status, error["code"], error["message"], headers.get("Retry-After"))
            )
            await asyncio.sleep(0.05)  # a client backing off, as Retry-After asks


async def _until(check: Any, what: str) -> None:
    await eventually(check, timeout_s=PHASE_DEADLINE_S, interval_s=0.05, what=what)


async def _run(redis: RedisServer, stack: Stack) -> Load:
    load = Load()
    admin = stack.config.admin_key
    async with aiohttp.ClientSession() as http:
        keys = []
        for _ in range(CLIENTS):
            status, _, raw = await _post(http, stack, "/rl/start_session", admin, {})
            assert status == 200, raw
            keys.append(orjson.loads(raw)["api_key"])
        clients = [
            asyncio.create_task(_client(http, stack, key, i % 2 == 1, load))
            for i, key in enumerate(keys)
        ]
        await _until(lambda: len(load.answered) >= 20, "turns before the outage")

        await asyncio.to_thread(redis.stop)
        await _until(lambda: load.refused_with("state_store_unavailable") >= 3, "503s while down")
        async with http.get(stack.gateway_url + "/ready") as resp:
            assert resp.status == 503
        answered_while_down = len(load.answered)

        await asyncio.to_thread(redis.restart)
        await _until(lambda: len(load.answered) >= answered_while_down + 20, "recovery")
        load.stop.set()
        await asyncio.gather(*clients)

        # End every episode (retrying the transient 503s of a just-restarted stack).
        for key in keys:

            async def ended(key: str = key) -> bytes | None:
                status, _, raw = await _post(http, stack, "/rl/end_session", key, {})
                return raw if status == 200 else None

            await eventually(ended, timeout_s=PHASE_DEADLINE_S, interval_s=0.1, what="end_session")
    return load


def test_a_redis_outage_is_503_with_retry_after_and_loses_no_answered_turn(
    redis_and_stack: tuple[RedisServer, Stack],
) -> None:
    redis, stack = redis_and_stack
    load = asyncio.run(_run(redis, stack))

    # While Redis was down: 503 + Retry-After saying so, never a 500 or an internal detail.
    for status, code, message, retry_after in load.refused:
        if status == 200:
            # A stream that had started ends with an error event instead of [DONE].
            assert code == "state_store_unavailable", (code, message)
        else:
            assert status == 503 and retry_after is not None, (status, code, message)
        assert "127.0.0.1" not in message and "Error" not in message, message
    down = [m for _, c, m, _ in load.refused if c == "state_store_unavailable"]
    assert down and all("state store unavailable" in m for m in down)

    # Every answered turn is in exactly one published trajectory.
    recorded = [
        interaction["interaction_id"]
        for trajectory in published(stack)
        for interaction in trajectory["interactions"]
    ]
    missing = set(load.answered) - set(recorded)
    assert not missing, f"{len(missing)} of {len(load.answered)} answered turns were lost"
    assert len(recorded) == len(set(recorded)), "a turn was recorded twice"


# A Redis that hangs (SIGSTOP: a partition, a stuck fork) rather than refusing connections.
HUNG_ROUTES: list[tuple[str, str, str, Any]] = [
    ("POST", "/v1/chat/completions", "session", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/v1/chat/completions", "session", {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/v1/responses", "session", {"model": MODEL, "input": "hi"}),
    ("POST", "/v1/messages", "session", {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/rl/set_reward", "session", {"reward": 1.0}),
    ("POST", "/rl/end_session", "session", {}),
    ("POST", "/rl/start_session", "admin", {}),
    ("POST", "/rl/keys", "admin", {"mode": "header"}),
    ("GET", "/rl/keys", "admin", None),
    ("GET", "/v1/models", "session", None),
    ("GET", "/console/api/overview", "admin", None),
]  # fmt: skip
# The gateway's own deadline for an RPC (GatewaySettings.rpc_timeout_s): the dataproxy must
# name the hung store before it, not leave the gateway to time out on the dataproxy.
RPC_DEADLINE_S = 5.0


async def _hung_answers(stack: Stack, session_key: str) -> list[tuple[str, int, str, Any, float]]:
    keys = {"session": session_key, "admin": stack.config.admin_key}
    answers = []
    async with aiohttp.ClientSession() as http:
        for method, path, who, body in HUNG_ROUTES:
            started = asyncio.get_running_loop().time()
            async with http.request(
                method,
                stack.gateway_url + path,
                json=body,
                headers={"Authorization": f"Bearer {keys[who]}"},
                timeout=aiohttp.ClientTimeout(total=CALL_TIMEOUT_S),
            ) as resp:
                raw = await resp.read()
                took = asyncio.get_running_loop().time() - started
                answers.append((path, resp.status, resp.headers.get("Retry-After", ""), raw, took))
    return answers


def test_a_hung_redis_is_503_state_store_unavailable_on_every_route_within_the_rpc_deadline(
    redis_and_stack: tuple[RedisServer, Stack],
) -> None:
    redis, stack = redis_and_stack
    assert redis.process is not None

    async def start() -> str:
        async with aiohttp.ClientSession() as http:
            status, _, raw = await _post(
                http, stack, "/rl/start_session", stack.config.admin_key, {}
            )
            assert status == 200, raw
            return str(orjson.loads(raw)["api_key"])

    key = asyncio.run(start())
    redis.process.send_signal(signal.SIGSTOP)
    try:
        answers = asyncio.run(_hung_answers(stack, key))
    finally:
        redis.process.send_signal(signal.SIGCONT)
    for path, status, retry_after, raw, took in answers:
        error = orjson.loads(raw)["error"]
        assert (status, error["code"]) == (503, "state_store_unavailable"), (path, status, raw)
        assert retry_after and "state store unavailable" in error["message"], (path, raw)
        assert took < RPC_DEADLINE_S, (path, took)

    async def recovered() -> bool:
        async with aiohttp.ClientSession() as http:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "back?"}]}
            status, _, _ = await _post(http, stack, "/v1/chat/completions", key, body)
            return status == 200

    asyncio.run(eventually(recovered, timeout_s=PHASE_DEADLINE_S, what="a chat after SIGCONT"))
