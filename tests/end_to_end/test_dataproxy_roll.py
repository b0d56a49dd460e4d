"""A rolling restart of the dataproxies is invisible to clients (real processes: one gateway,
two dataproxies on one Redis, one worker, the mock). Agents start sessions, chat (streamed and
not) and end them while each dataproxy in turn is SIGTERMed — it refuses new turns while its
running ones finish — and started again: the gateway takes each refused turn to the other
dataproxy, so no turn fails, and every answered turn is in its episode."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from rollgate.stack import Stack
from tests.harness.processes import log_level_env, stack_config

pytestmark = pytest.mark.e2e

MODEL = "rollgate-mock"
DATAPROXIES = ("dataproxy", "dataproxy-2")
AGENTS = 8
TURNS_PER_EPISODE = 3
# Sixteen words: a turn streams for about half a second, so a stopping dataproxy drains
# running turns while new ones arrive.
PROMPT = "tell me one short thing about rolling restarts of the services behind a gateway please"
RETRIED = "ledger_begin_refused_retrying_elsewhere"


@pytest.fixture(scope="module")
def two_dataproxies(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    config = stack_config(
        redis_url,
        Path(tmp_path_factory.mktemp("dataproxy-roll")),
        prefix="rgroll",
        workers=1,
        replicas={"dataproxy": 2},
        mock_token_interval_ms=30.0,
        extra_env=log_level_env(),
        start_timeout_s=180.0,
    )
    with Stack(config) as running:
        yield running


class Agents:
    """Agents in a loop (start_session, three chats, end_session) and what they saw."""

    def __init__(self, stack: Stack, http: aiohttp.ClientSession) -> None:
        self.url = f"http://{stack.services['gateway'].address}"
        self.admin_key = stack.config.admin_key
        self.http = http
        self.answered = 0
        self.episodes = 0
        self.failures: list[str] = []
        # start_session / end_session are unary RPCs on the shared round-robin channel, not
        # ledger turns: they go only to a replica whose health is SERVING and wait for one
        # when none is (never 503 dataproxy_unavailable); one sent in the moment between a
        # replica's NOT_SERVING and the channel seeing it is still served, as a stopping
        # replica serves until its clients went quiet (never 503 dataproxy_cancelled).
        self.session_failures: list[tuple[int, str]] = []
        self.stop = asyncio.Event()
        self.progress = asyncio.Event()

    async def post(self, path: str, key: str, body: dict[str, Any]) -> tuple[int, bytes]:
        headers = {"Authorization": f"Bearer {key}"}
        async with self.http.post(self.url + path, json=body, headers=headers) as resp:
            return resp.status, await resp.read()

    async def chat(self, key: str, stream: bool) -> str | None:
        """The turn's answer text, or None (the failure noted)."""
        body = {"model": MODEL, "stream": stream, "messages": [{"role": "user", "content": PROMPT}]}
        status, raw = await self.post("/v1/chat/completions", key, body)
        if status != 200:
            return self.fail(f"chat {status} {raw[:300]!r}")
        if not stream:
            return str(orjson.loads(raw)["choices"][0]["message"]["content"])
        lines = [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: ")]
        if lines[-1:] != [b"[DONE]"] or any(b'"error"' in line for line in lines):
            return self.fail(f"stream {raw[-300:]!r}")
        chunks = [orjson.loads(line) for line in lines[:-1]]
        return "".join(
            (choice.get("delta") or {}).get("content") or ""
            for chunk in chunks
            for choice in chunk["choices"]
        )

    def fail(self, what: str) -> None:
        self.failures.append(what)
        self.progress.set()

    async def run(self, n: int) -> None:
        while not self.stop.is_set():
            status, raw = await self.post("/rl/start_session", self.admin_key, {"task_id": "roll"})
            if status != 200:
                self.session_failures.append((status, f"start_session {raw[:300]!r}"))
                await asyncio.sleep(1.0)  # as Retry-After asks
                continue
            key = orjson.loads(raw)["api_key"]
            answered = 0
            for turn in range(TURNS_PER_EPISODE):
                if await self.chat(key, stream=(n + turn) % 2 == 0) is not None:
                    answered += 1
                    self.answered += 1
                    self.progress.set()
            status, raw = await self.post("/rl/end_session", key, {})
            if status != 200:
                self.session_failures.append((status, f"end_session {raw[:300]!r}"))
            elif orjson.loads(raw)["interaction_count"] != answered:
                self.fail(f"end_session counted {raw[:300]!r}, {answered} answered")
            else:
                self.episodes += 1

    async def until(self, turns: int) -> None:
        """Waits until `turns` more turns were answered."""
        target = self.answered + turns
        async with asyncio.timeout(120):
            while self.answered < target:
                self.progress.clear()
                await self.progress.wait()


async def test_a_rolling_restart_of_the_dataproxies_fails_no_request(
    two_dataproxies: Stack,
) -> None:
    stack = two_dataproxies
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        agents = Agents(stack, http)
        tasks = [asyncio.create_task(agents.run(n)) for n in range(AGENTS)]
        try:
            await agents.until(2 * AGENTS)
            # Twice round, so each one stops soon after its peer came back (while the
            # gateway may still be reconnecting to it) and after taking its peer's sessions.
            for name in (*DATAPROXIES, *DATAPROXIES):
                # SIGTERM: it refuses new begins and drains its running turns, then exits.
                assert await asyncio.to_thread(stack.stop_service, name) == 0
                await asyncio.to_thread(stack.restart_service, name)
                await agents.until(2 * AGENTS)
        finally:
            agents.stop.set()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*tasks)

    assert agents.failures == [], agents.failures[:10]
    # Neither turns nor session calls fail in a roll.
    assert agents.session_failures == [], agents.session_failures[:10]
    assert agents.episodes >= AGENTS
    # The rolls did overlap new turns: refused begins were taken elsewhere (else this test
    # proved nothing).
    log = (stack.log_dir / "gateway.log").read_text()
    assert log.count(RETRIED) >= 2, "no begin reached a stopping dataproxy"
