"""Scale-out on one machine: every service replicated on one Redis, one replica of each killed.

Two gateways, two routers, two dataproxies and three workers run as real processes. Agents
chat through both gateways (streaming and not) and refresh through the other one, while one
replica of each service is SIGKILLed mid-run. Afterwards every episode is on the stream once,
every answered turn is in exactly one trajectory, and no session left a worker that lived.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import aiohttp
import orjson
import pytest
import redis.asyncio as aioredis

from rollgate.stack import Stack
from rollgate.trajectory import Trajectory, decode_trajectory
from services.runtime.keys import key_digest, key_id_of
from tests.harness.poll import eventually
from tests.harness.processes import log_level_env, stack_config

pytestmark = pytest.mark.e2e

MODEL = "rollgate-mock"
GATEWAYS = ("gateway", "gateway-2")
AGENTS = 24
TURNS_PER_EPISODE = 3
# Every third agent refreshes its key while its last turn of the episode is still streaming.
RACING_EVERY = 3
# Answered turns between two steps of the disruption (warm-up, each kill, the restarts).
TURNS_PER_STEP = 100
STEP_DEADLINE_S = 240.0
REQUEST_TIMEOUT_S = 120.0
# How long one operation is retried. A refresh whose dataproxy died mid-way leaves the key's
# refresh marker behind until it expires (10 s: a live holder keeps renewing it, a dead one
# cannot), and a killed worker keeps its sessions until its router lease lapses (6 s):
# meanwhile those operations fail (refreshes of that key get 429). An operation outlasts
# either several times over, on a loaded machine.
OP_DEADLINE_S = 60.0
# Failures that certainly changed nothing: no connection, or "a refresh is already running".
NEVER_SERVED = ("ClientConnectorError", "http_429")
FILLER = "please tell me something short about distributed systems and their failure modes"


@pytest.fixture(scope="module")
def scaled_stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Two gateways, two routers, two dataproxies, three workers and the mock, on one Redis."""
    config = stack_config(
        redis_url,
        Path(tmp_path_factory.mktemp("scale-stack")),
        prefix="rgscale",
        workers=3,
        replicas={"gateway": 2, "router": 2, "dataproxy": 2},
        mock_latency_ms=40.0,
        mock_token_interval_ms=15.0,
        extra_env=log_level_env(),
        start_timeout_s=180.0,
    )
    with Stack(config) as running:
        yield running


class Failed(Exception):
    """A request that did not get a complete answer; `kind` says how it failed."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


@dataclass(frozen=True, slots=True, kw_only=True)
class Answer:
    """A complete chat answer: 200 with a full body, or a stream that ended in [DONE]."""

    completion_id: str
    content: str


@dataclass(frozen=True, slots=True, kw_only=True)
class AnsweredTurn:
    """What the client saw, and the episode that must hold it."""

    agent: int
    completion_id: str
    gateway: str
    stream: bool
    answered_at: float
    session_id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Ended:
    """An /rl/end_session answer."""

    session_id: str
    trajectory_id: str
    interaction_count: int


@dataclass(slots=True, kw_only=True)
class Agent:
    """One session key, driven by one coroutine."""

    index: int
    key: str
    sessions: list[str]
    messages: list[dict[str, str]] = field(default_factory=list)
    # Refresh and end attempts that failed without an answer: each may have ended an episode
    # whose session id the agent never learned.
    unsure_endings: int = 0
    ended: Ended | None = None

    @property
    def chat_gateway(self) -> int:
        """Agents chat through alternating gateways and refresh through the other one."""
        return self.index % 2

    @property
    def digest(self) -> str:
        """The key's digest: the router's session and the source of the key id."""
        return key_digest(self.key)


@dataclass(slots=True)
class Ledger:
    """Everything the clients saw, for the checks and the failure summary."""

    started_at: float = field(default_factory=time.monotonic)
    answered: list[AnsweredTurn] = field(default_factory=list)
    failures: Counter[str] = field(default_factory=Counter)
    refreshes: int = 0
    events: list[str] = field(default_factory=list)
    killed_at: dict[str, float] = field(default_factory=dict)
    restarted_at: dict[str, float] = field(default_factory=dict)

    def note(self, event: str) -> None:
        """Records a disruption step with its time into the run."""
        self.events.append(f"{time.monotonic() - self.started_at:7.2f}s {event}")

    def summary(self, extra: str = "") -> str:
        """Turns answered, failures by kind, and the disruption timeline."""
        streamed = sum(t.stream for t in self.answered)
        by_gateway = Counter(t.gateway for t in self.answered)
        lines = [
            f"run time {time.monotonic() - self.started_at:.1f}s; turns answered "
            f"{len(self.answered)} ({streamed} streamed) by gateway {dict(by_gateway)}; "
            f"refreshes {self.refreshes}",
            "failures by kind: "
            + (", ".join(f"{k}={n}" for k, n in sorted(self.failures.items())) or "none"),
            *self.events,
        ]
        return "\n".join(lines + ([extra] if extra else []))


class Client:
    """HTTP to both gateways; every failed request raises Failed with a kind, and is counted."""

    def __init__(self, http: aiohttp.ClientSession, stack: Stack, ledger: Ledger) -> None:
        self.http = http
        self.urls = [f"http://{stack.services[name].address}" for name in GATEWAYS]
        self.admin_key = stack.config.admin_key
        self.ledger = ledger

    def _fail(self, kind: str, gateway: int, label: str) -> Failed:
        self.ledger.failures[f"{label}@{GATEWAYS[gateway]}:{kind}"] += 1
        return Failed(kind)

    async def post(self, gateway: int, path: str, body: Any, key: str, label: str) -> Any:
        """POST a JSON body; the JSON answer when it is 200."""
        try:
            async with self.http.post(
                self.urls[gateway] + path,
                data=orjson.dumps(body),
                headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
            ) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    raise self._fail(_http_kind(resp.status, raw), gateway, label)
                return orjson.loads(raw)
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as err:
            raise self._fail(type(err).__name__, gateway, label) from None

    async def chat(
        self,
        gateway: int,
        key: str,
        messages: list[dict[str, str]],
        *,
        stream: bool,
        first_chunk: asyncio.Event | None = None,
        label: str = "chat",
    ) -> Answer:
        """One chat completion; an Answer only when it is complete."""
        body = {"model": MODEL, "messages": messages, "stream": stream}
        if not stream:
            reply = await self.post(gateway, "/v1/chat/completions", body, key, label)
            try:
                return Answer(
                    completion_id=reply["id"], content=reply["choices"][0]["message"]["content"]
                )
            except (KeyError, IndexError, TypeError):
                raise self._fail("incomplete_body", gateway, label) from None
        try:
            return await self._stream(gateway, key, body, first_chunk, label)
        except (aiohttp.ClientError, TimeoutError) as err:
            raise self._fail(f"stream_{type(err).__name__}", gateway, label) from None
        finally:
            if first_chunk is not None:
                first_chunk.set()

    async def _stream(
        self,
        gateway: int,
        key: str,
        body: dict[str, Any],
        first_chunk: asyncio.Event | None,
        label: str,
    ) -> Answer:
        async with self.http.post(
            self.urls[gateway] + "/v1/chat/completions",
            data=orjson.dumps(body),
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        ) as resp:
            if resp.status != 200:
                raise self._fail(_http_kind(resp.status, await resp.read()), gateway, label)
            ids: set[str] = set()
            text: list[str] = []
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                data = line[len(b"data: ") :].strip()
                if data == b"[DONE]":
                    if len(ids) != 1:
                        raise self._fail(f"stream_ids_{len(ids)}", gateway, label)
                    return Answer(completion_id=ids.pop(), content="".join(text))
                event = orjson.loads(data)
                if "error" in event:
                    raise self._fail(f"sse_error_{event['error'].get('code')}", gateway, label)
                if first_chunk is not None:
                    first_chunk.set()
                ids.add(event["id"])
                for choice in event.get("choices") or ():
                    text.append((choice.get("delta") or {}).get("content") or "")
            raise self._fail("stream_ended_without_done", gateway, label)


def _http_kind(status: int, raw: bytes) -> str:
    with contextlib.suppress(orjson.JSONDecodeError, AttributeError, TypeError):
        return f"http_{status}_{orjson.loads(raw)['error']['code']}"
    return f"http_{status}"


class Attempts:
    """Attempt numbers until a deadline, each failure remembered for the error message."""

    def __init__(self, what: str, ledger: Ledger) -> None:
        self.what = what
        self.ledger = ledger
        self.began = time.monotonic()
        self.failures: list[tuple[float, str]] = []

    def __iter__(self) -> Iterator[int]:
        attempt = 0
        while attempt == 0 or time.monotonic() - self.began < OP_DEADLINE_S:
            yield attempt
            attempt += 1

    async def failed(self, attempt: int, failed: Failed) -> None:
        """Remembers the failure and pauses before the next attempt (client backoff)."""
        self.failures.append((time.monotonic() - self.began, failed.kind))
        await asyncio.sleep(min(2.0, 0.1 * (attempt + 1)))  # an interval: the client's backoff

    def blocked_s(self, kind: str) -> float:
        """How long attempts kept failing with `kind` (0 when none did)."""
        times = [at for at, k in self.failures if k.startswith(kind)]
        return times[-1] - times[0] if times else 0.0

    def give_up(self) -> AssertionError:
        """The error for an operation that never succeeded."""
        tail = ", ".join(f"{at:.1f}s {kind}" for at, kind in self.failures[-8:])
        return AssertionError(
            f"{self.what}: {len(self.failures)} failures in {OP_DEADLINE_S:.0f}s, "
            f"last ones: {tail}\n{self.ledger.summary()}"
        )


class Run:
    """The agents, the disruption and the affinity watch, over one scaled stack."""

    def __init__(self, stack: Stack, client: Client, ledger: Ledger) -> None:
        self.stack = stack
        self.client = client
        self.ledger = ledger
        self.agents: list[Agent] = []
        self.stop = asyncio.Event()
        # digest → [(monotonic time first seen, worker id)], one entry per change.
        self.affinity: dict[str, list[tuple[float, str]]] = {}

    # -- agents ---------------------------------------------------------------------------

    async def start_agents(self) -> None:
        """Starts every session, alternating gateways."""
        for index in range(AGENTS):
            reply = await self._retry(
                index % 2,
                "start",
                lambda gw: self.client.post(
                    gw, "/rl/start_session", {"task_id": "scale"}, self.client.admin_key, "start"
                ),
            )
            self.agents.append(
                Agent(index=index, key=reply["api_key"], sessions=[reply["session_id"]])
            )

    async def _retry(self, gateway: int, what: str, call: Any) -> Any:
        attempts = Attempts(what, self.ledger)
        for attempt in attempts:
            try:
                return await call((gateway + attempt) % 2)
            except Failed as failed:
                await attempts.failed(attempt, failed)
        raise attempts.give_up()

    async def drive(self, agent: Agent) -> None:
        """Episodes of a few turns, each ended by a refresh, until told to stop; then end."""
        episode = 0
        while not self.stop.is_set():
            for turn in range(TURNS_PER_EPISODE - 1):
                await self.sequential_turn(agent, f"episode {episode} turn {turn}", turn % 2 == 0)
            if agent.index % RACING_EVERY == 0:
                await self.racing_turn_and_refresh(agent, f"episode {episode} last turn")
            else:
                await self.sequential_turn(agent, f"episode {episode} last turn", False)
                await self.refresh(agent)
            episode += 1
        await self.end(agent)

    def _ask(self, agent: Agent, text: str) -> list[dict[str, str]]:
        return [
            *agent.messages,
            {"role": "user", "content": f"agent {agent.index} {text}: {FILLER}"},
        ]

    def _record(
        self, agent: Agent, answer: Answer, gateway: int, *, stream: bool, session_id: str
    ) -> None:
        self.ledger.answered.append(
            AnsweredTurn(
                agent=agent.index,
                completion_id=answer.completion_id,
                gateway=GATEWAYS[gateway],
                stream=stream,
                answered_at=time.monotonic(),
                session_id=session_id,
            )
        )

    async def sequential_turn(self, agent: Agent, text: str, stream: bool) -> None:
        """One turn, retried through the other gateway until it is answered."""
        messages = self._ask(agent, text)
        attempts = Attempts(f"agent {agent.index}: {text}", self.ledger)
        for attempt in attempts:
            gateway = (agent.chat_gateway + attempt) % 2
            try:
                answer = await self.client.chat(gateway, agent.key, messages, stream=stream)
            except Failed as failed:
                await attempts.failed(attempt, failed)
                continue
            # Nothing else touches this key meanwhile: the turn is in the current episode.
            self._record(agent, answer, gateway, stream=stream, session_id=agent.sessions[-1])
            agent.messages = [*messages, {"role": "assistant", "content": answer.content}]
            return
        raise attempts.give_up()

    async def racing_turn_and_refresh(self, agent: Agent, text: str) -> None:
        """A streamed turn with a refresh of the same key, through the other gateway, mid-stream."""
        old = agent.sessions[-1]
        first_chunk = asyncio.Event()
        gateway = agent.chat_gateway
        chat = asyncio.create_task(
            self.client.chat(
                gateway,
                agent.key,
                self._ask(agent, text),
                stream=True,
                first_chunk=first_chunk,
                label="raced_chat",
            )
        )
        await asyncio.wait_for(first_chunk.wait(), REQUEST_TIMEOUT_S)
        await self.refresh(agent)
        try:
            answer = await chat
        except Failed:
            # Ended by the refresh (503, not recorded) or by a killed replica: not answered.
            return
        # The turn began in the old episode; if that ended first, it must have failed.
        self._record(agent, answer, gateway, stream=True, session_id=old)

    async def refresh(self, agent: Agent) -> None:
        """Ends the episode and starts the next on the same key, through the other gateway."""
        body = {"task_id": "scale", "api_key": agent.key}
        attempts = Attempts(f"agent {agent.index}: refresh", self.ledger)
        for attempt in attempts:
            gateway = (1 - agent.chat_gateway + attempt) % 2
            try:
                reply = await self.client.post(
                    gateway, "/rl/start_session", body, self.client.admin_key, "refresh"
                )
            except Failed as failed:
                if not failed.kind.startswith(NEVER_SERVED):
                    agent.unsure_endings += 1
                await attempts.failed(attempt, failed)
                continue
            if (blocked := attempts.blocked_s("http_429")) > 5.0:
                self.ledger.note(f"agent {agent.index}: refreshes got 429 for {blocked:.1f}s")
            assert reply["api_key"] == agent.key, "a refresh keeps the key"
            agent.sessions.append(reply["session_id"])
            agent.messages = []
            self.ledger.refreshes += 1
            return
        raise attempts.give_up()

    async def end(self, agent: Agent) -> None:
        """Ends the last episode; a 409 after a failed attempt means that attempt ended it."""
        unsure = False
        attempts = Attempts(f"agent {agent.index}: end", self.ledger)
        for attempt in attempts:
            gateway = (agent.chat_gateway + attempt) % 2
            try:
                reply = await self.client.post(gateway, "/rl/end_session", {}, agent.key, "end")
            except Failed as failed:
                if failed.kind.startswith("http_409"):
                    assert unsure, f"agent {agent.index}: no active episode to end"
                    return
                if not failed.kind.startswith(NEVER_SERVED):
                    agent.unsure_endings += 1
                    unsure = True
                await attempts.failed(attempt, failed)
                continue
            agent.ended = Ended(
                session_id=reply["session_id"],
                trajectory_id=reply["trajectory_id"],
                interaction_count=int(reply["interaction_count"]),
            )
            return
        raise attempts.give_up()

    # -- disruption -----------------------------------------------------------------------

    async def progress(self, turns: int, what: str) -> None:
        """Polls until `turns` more turns were answered, within the step deadline."""
        target = len(self.ledger.answered) + turns
        try:
            await eventually(
                lambda: len(self.ledger.answered) >= target,
                timeout_s=STEP_DEADLINE_S,
                interval_s=0.05,
                what=f"progress {what}",
            )
        except AssertionError as err:
            raise AssertionError(f"{err}\n{self.ledger.summary()}") from None

    async def kill(self, name: str) -> None:
        """SIGKILLs one replica while turns are in flight."""
        self.ledger.killed_at[name] = time.monotonic()
        self.ledger.note(f"kill {name} (answered so far {len(self.ledger.answered)})")
        await asyncio.to_thread(self.stack.stop_service, name, kill=True)

    async def restart(self, name: str) -> None:
        """Starts a killed replica again and waits until it is healthy."""
        await asyncio.to_thread(self.stack.restart_service, name)
        self.ledger.restarted_at[name] = time.monotonic()
        self.ledger.note(f"restarted {name}")

    def busiest_worker(self) -> str:
        """The worker most sessions are pinned to right now."""
        pinned = Counter(changes[-1][1] for changes in self.affinity.values() if changes)
        return pinned.most_common(1)[0][0]

    async def disrupt(self) -> None:
        """Kills a gateway, a router, a dataproxy and a worker; restarts all but the worker."""
        try:
            await self.progress(TURNS_PER_STEP * 2, "while warming up")
            for name in ("gateway-2", "router-2", "dataproxy-2"):
                await self.kill(name)
                await self.progress(TURNS_PER_STEP, f"after killing {name}")
            await self.kill(self.busiest_worker())
            await self.progress(TURNS_PER_STEP, "after killing a worker")
            for name in ("gateway-2", "router-2", "dataproxy-2"):
                await self.restart(name)
            await self.progress(TURNS_PER_STEP * 2, "after the restarts")
        finally:
            self.stop.set()
            self.ledger.note("stop: agents end their episodes")

    # -- affinity watch -------------------------------------------------------------------

    async def watch_affinity(self, redis: aioredis.Redis) -> None:
        """Reads every key's affinity record, recording each change, until cancelled."""
        prefix = self.stack.config.redis_prefix
        while True:
            await self.read_affinity(redis, prefix)
            await asyncio.sleep(0.05)  # an interval: the watcher's sampling period

    async def read_affinity(self, redis: aioredis.Redis, prefix: str) -> None:
        """One read of every key's `aff:{digest}:{model}` record."""
        digests = [agent.digest for agent in self.agents]
        if not digests:
            return
        keys = [f"{prefix}aff:{d}:{MODEL}" for d in digests]
        values = cast(list[bytes | None], await redis.mget(keys))
        seen_at = time.monotonic()
        for digest, value in zip(digests, values, strict=True):
            if value is None:
                continue
            changes = self.affinity.setdefault(digest, [])
            worker = value.decode()
            if not changes or changes[-1][1] != worker:
                changes.append((seen_at, worker))


async def read_stream(redis: aioredis.Redis, prefix: str) -> list[Trajectory]:
    """Every trajectory on the stream, decoded."""
    entries = cast(
        list[tuple[bytes, dict[bytes, bytes]]], await redis.xrange(f"{prefix}trajectories")
    )
    return [
        decode_trajectory(fields[b"data"], fields.get(b"codec", b"msgpack").decode())
        for _, fields in entries
    ]


def check_stream(run: Run, trajectories: list[Trajectory]) -> list[str]:
    """Episodes once each, answered turns in exactly one trajectory of the right episode."""
    problems: list[str] = []
    for what, values in (
        ("trajectory id", [t.trajectory_id for t in trajectories]),
        ("session id", [t.session_id for t in trajectories]),
        ("interaction id", [i.interaction_id for t in trajectories for i in t.interactions]),
    ):
        doubled = [v for v, n in Counter(values).items() if n > 1]
        if doubled:
            problems.append(f"{len(doubled)} {what}s on the stream more than once: {doubled[:5]}")
    holder = {i.interaction_id: t for t in trajectories for i in t.interactions}
    for turn in run.ledger.answered:
        agent = run.agents[turn.agent]
        found = holder.get(turn.completion_id)
        if found is None:
            problems.append(f"answered turn {turn.completion_id} ({turn}) is in no trajectory")
        elif found.key_id != key_id_of(agent.digest):
            problems.append(f"answered turn {turn.completion_id} is in another key's trajectory")
        elif found.session_id != turn.session_id:
            problems.append(
                f"answered turn {turn.completion_id} is in {found.session_id}, "
                f"not in {turn.session_id} where it was answered"
            )
    by_session = {t.session_id: t for t in trajectories}
    for agent in run.agents:
        ended = agent.ended
        if ended is not None and ended.interaction_count:
            published = by_session.get(ended.session_id)
            if published is None or published.trajectory_id != ended.trajectory_id:
                problems.append(f"agent {agent.index}: ended {ended} is not on the stream as said")
            elif len(published.interactions) != ended.interaction_count:
                problems.append(f"agent {agent.index}: {ended} has {len(published.interactions)}")
        mine = [t for t in trajectories if t.key_id == key_id_of(agent.digest)]
        unknown = [t.session_id for t in mine if t.session_id not in agent.sessions]
        if len(unknown) > agent.unsure_endings:
            problems.append(
                f"agent {agent.index}: episodes {unknown} on the stream were never started "
                f"(only {agent.unsure_endings} endings were unsure)"
            )
    return problems


def check_affinity(run: Run) -> list[str]:
    """A session changes worker only after its worker was killed, and at most once."""
    problems: list[str] = []
    for agent in run.agents:
        changes = run.affinity.get(agent.digest, [])
        if not changes:
            problems.append(f"agent {agent.index}: never saw its affinity record")
        for (_, before), (seen_at, after) in itertools.pairwise(changes):
            killed_at = run.ledger.killed_at.get(before)
            if killed_at is None or killed_at > seen_at:
                problems.append(
                    f"agent {agent.index} moved from {before} to {after} while {before} lived"
                )
        if len(changes) > 2:
            problems.append(f"agent {agent.index} moved more than once: {changes}")
    for name, killed_at in run.ledger.killed_at.items():
        for turn in run.ledger.answered:
            changes = run.affinity.get(run.agents[turn.agent].digest, [])
            if turn.answered_at > killed_at + 1.0 and changes and changes[-1][1] == name:
                problems.append(f"agent {turn.agent} is still pinned to {name}, killed")
                break
    return problems


@pytest.mark.timeout(1200)
async def test_replicas_survive_killing_one_of_each_without_losing_or_doubling_a_turn(
    scaled_stack: Stack,
) -> None:
    stack = scaled_stack
    ledger = Ledger()
    redis = aioredis.Redis.from_url(stack.redis_url)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        run = Run(stack, Client(http, stack, ledger), ledger)
        await run.start_agents()
        watcher = asyncio.create_task(run.watch_affinity(redis))
        try:
            agents = [asyncio.create_task(run.drive(agent)) for agent in run.agents]
            disruption = asyncio.create_task(run.disrupt())
            done = await asyncio.wait_for(
                asyncio.gather(disruption, *agents, return_exceptions=True), STEP_DEADLINE_S * 8
            )
            errors = [r for r in done if isinstance(r, BaseException)]
            assert not errors, f"{errors[0]!r}\n{ledger.summary()}"
            await run.read_affinity(redis, stack.config.redis_prefix)
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
    trajectories = await read_stream(redis, stack.config.redis_prefix)
    await redis.aclose()

    summary = ledger.summary(f"{len(trajectories)} trajectories on the stream")
    problems = check_stream(run, trajectories) + check_affinity(run)
    assert not problems, "\n".join(problems[:30]) + "\n" + summary
    killed_worker = next(name for name in ledger.killed_at if name.startswith("worker-"))
    moved = [a for a in run.agents if len(run.affinity[a.digest]) == 2]
    assert moved, f"no session was pinned to {killed_worker} and moved\n{summary}"
    assert all(run.affinity[a.digest][-1][1] != killed_worker for a in moved), summary
    back = ledger.restarted_at["gateway-2"]
    assert any(t.gateway == "gateway-2" and t.answered_at > back for t in ledger.answered), (
        "the restarted gateway answered nothing\n" + summary
    )
    assert stack.dead_services() == [killed_worker], summary
    print(summary)
