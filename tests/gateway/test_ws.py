"""The OpenClaw gateway WebSocket protocol on `/ws`, replaying what the real OpenClaw 2026.9.6
clients send (reference/openclaw_wire/ws_*.txt) with aiohttp's WebSocket client, against the
real router, dataproxy and worker (in-process, port 0), the mock LLM and a real Redis."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import msgpack  # type: ignore[import-untyped]
import orjson
import pytest
import redis.asyncio as aioredis
from aiohttp import web

from rollgate.trajectory import inline_content
from services.gateway.app import build_app
from services.gateway.ws import WS_CONFIG
from services.gateway.ws_protocol import WsConfig
from tests.gateway.conftest import gateway_settings
from tests.gateway.test_full_chain import Stack, _auth, _start, stack
from tests.harness.poll import eventually

__all__ = ["stack"]

DEADLINE_S = 15.0
SYSTEM_PROMPT = "You are rollgate's test agent."


async def _serve(stack: Stack, config: WsConfig) -> tuple[web.AppRunner, str]:
    settings = gateway_settings(router_addr=stack.router_addr, dataproxy_addr=stack.dataproxy_addr)
    app = build_app(settings)
    app[WS_CONFIG] = config
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"ws://127.0.0.1:{runner.addresses[0][1]}/ws"


def _config(**overrides: Any) -> WsConfig:
    return WsConfig(
        system_prompt=SYSTEM_PROMPT, tick_interval_ms=300, run_timeout_s=20.0, **overrides
    )


@pytest.fixture
async def ws_url(stack: Stack) -> AsyncIterator[str]:
    runner, url = await _serve(stack, _config())
    yield url
    await runner.cleanup()


def connect_params(token: str, **overrides: Any) -> dict[str, Any]:
    """The CLI's connect params, as in ws_agent.txt."""
    return {
        "minProtocol": 4,
        "maxProtocol": 4,
        "client": {
            "id": "cli",
            "version": "2026.9.6",
            "platform": "linux",
            "deviceFamily": "Linux",
            "mode": "cli",
            "instanceId": str(uuid.uuid4()),
        },
        "caps": [],
        "auth": {"token": token},
        "role": "operator",
        "scopes": ["operator.write"],
    } | overrides


class Client:
    """A protocol client over one socket: numbered request ids like the real CLI."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.n = 0
        self.frames: list[dict[str, Any]] = []

    async def send(self, method: str, params: dict[str, Any]) -> str:
        self.n += 1
        frame_id = f"{self.n}:{uuid.uuid4()}"
        await self.ws.send_str(
            orjson.dumps(
                {"type": "req", "id": frame_id, "method": method, "params": params}
            ).decode()
        )
        return frame_id

    async def next(self) -> dict[str, Any]:
        msg = await self.ws.receive(timeout=DEADLINE_S)
        assert msg.type == aiohttp.WSMsgType.TEXT, msg
        frame: dict[str, Any] = orjson.loads(msg.data)
        self.frames.append(frame)
        return frame

    async def until(self, match: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        async def matching() -> dict[str, Any] | None:
            frame = await self.next()
            return frame if match(frame) else None

        found: dict[str, Any] = await eventually(
            matching, timeout_s=DEADLINE_S, interval_s=0, what="a matching frame"
        )
        return found

    async def res(self, frame_id: str) -> dict[str, Any]:
        return await self.until(lambda f: f["type"] == "res" and f["id"] == frame_id)

    async def call(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        return await self.res(await self.send(method, params))

    async def chat_end(self, run_id: str) -> dict[str, Any]:
        return await self.until(
            lambda f: (
                f.get("event") == "chat"
                and f["payload"]["runId"] == run_id
                and f["payload"]["state"] in ("final", "aborted", "error")
            )
        )


async def open_client(http: aiohttp.ClientSession, url: str, token: str) -> Client:
    ws = await http.ws_connect(url)
    client = Client(ws)
    challenge = await client.next()
    assert challenge["type"] == "event" and challenge["event"] == "connect.challenge"
    assert challenge["payload"]["nonce"] and challenge["payload"]["ts"] > 0
    hello = await client.call("connect", connect_params(token))
    assert hello["ok"], hello
    assert hello["payload"]["type"] == "hello-ok"
    return client


async def published(stack: Stack, redis: aioredis.Redis, key: str) -> dict[str, Any]:
    """Refreshes the key (publishing its episode) and returns the new trajectory."""
    before = await redis.xlen(f"{stack.prefix}trajectories")
    await _start(stack, api_key=key)
    entries = await redis.xrange(f"{stack.prefix}trajectories")
    assert len(entries) == before + 1
    trajectory: dict[str, Any] = inline_content(msgpack.unpackb(entries[-1][1][b"data"], raw=False))
    return trajectory


async def test_the_cli_agent_sequence_gets_accepted_then_ok_and_is_recorded(
    stack: Stack, ws_url: str, redis_client: aioredis.Redis
) -> None:
    key = (await _start(stack))["api_key"]
    client = await open_client(stack.http, ws_url, key)
    hello = client.frames[-1]["payload"]
    assert hello["protocol"] == 4
    assert {"chat.send", "agent", "chat.history", "chat.abort"} <= set(hello["features"]["methods"])
    assert hello["policy"]["tickIntervalMs"] == 300
    run_id = str(uuid.uuid4())
    frame_id = await client.send(
        "agent",
        {
            "message": "hello via openclaw agent",
            "agentId": "main",
            "deliver": False,
            "timeout": 180,
            "idempotencyKey": run_id,
        },
    )
    accepted = await client.res(frame_id)
    assert accepted["ok"] and accepted["payload"]["status"] == "accepted"
    assert accepted["payload"]["runId"] == run_id
    assert accepted["payload"]["sessionKey"] == "agent:main:main"
    final = await client.res(frame_id)
    assert final["ok"] and final["payload"]["status"] == "ok"
    assert final["payload"]["summary"] == "completed"
    [payload] = final["payload"]["result"]["payloads"]
    assert payload["text"].startswith("Mock reply")
    # The run is the interaction the client saw: recorded under its runId.
    assert final["payload"]["result"]["meta"]["interactionId"] == run_id
    await client.ws.close()
    trajectory = await published(stack, redis_client, key)
    [interaction] = trajectory["interactions"]
    assert interaction["interaction_id"] == run_id
    assert interaction["messages"] == [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "hello via openclaw agent"},
    ]
    assert interaction["output"]["content"] == payload["text"]
    assert interaction["tools"] is None


async def test_the_tui_sequence_streams_chat_events_and_keeps_history(
    stack: Stack, ws_url: str
) -> None:
    # Tokens a few ms apart arrive in separate batches: the run streams several deltas.
    stack.mock.token_interval_s = 0.005
    key = (await _start(stack))["api_key"]
    ws = await stack.http.ws_connect(ws_url)
    client = Client(ws)
    await client.next()
    device = {
        "id": "ab" * 32,
        "publicKey": "k" * 43,
        "signature": "s" * 86,
        "signedAt": 1795942937263,
        "nonce": "n",
    }
    params = connect_params(key, device=device, caps=["tool-events"])
    params["client"] |= {"id": "openclaw-tui", "displayName": "openclaw-tui", "mode": "ui"}
    assert (await client.call("connect", params))["ok"]
    session = "agent:main:rc-ws-1795942933"
    assert (await client.call("sessions.subscribe", {}))["payload"] == {"subscribed": True}
    agents = await client.call("agents.list", {})
    assert agents["payload"]["defaultId"] == "main"
    assert (await client.call("question.list", {}))["payload"] == {"questions": []}
    assert (await client.call("plugin.approval.list", {}))["payload"] == []
    assert (await client.call("taskSuggestions.list", {}))["ok"]
    history = await client.call("chat.history", {"sessionKey": session, "limit": 200})
    assert history["payload"]["messages"] == []
    run_id = str(uuid.uuid4())
    send_id = await client.send(
        "chat.send",
        {
            "sessionKey": session,
            "message": "hello from the tui",
            "deliver": False,
            "idempotencyKey": run_id,
        },
    )
    await client.send("commands.list", {"agentId": "main", "scope": "text", "includeArgs": False})
    started = await client.res(send_id)
    assert started["payload"] == {"runId": run_id, "status": "started"}
    final = await client.chat_end(run_id)
    assert final["payload"]["state"] == "final"
    text = final["payload"]["message"]["content"][0]["text"]
    assert text.startswith("Mock reply") and "hello from the tui" in text
    run_frames = [
        f
        for f in client.frames
        if isinstance(f.get("payload"), dict) and f["payload"].get("runId") == run_id
    ]
    phases = [
        f["payload"]["data"]["phase"]
        for f in run_frames
        if f.get("event") == "agent" and f["payload"]["stream"] == "lifecycle"
    ]
    assert phases == ["start", "end"]
    deltas = [
        f["payload"]["data"]["delta"]
        for f in run_frames
        if f.get("event") == "agent" and f["payload"]["stream"] == "assistant"
    ]
    assert "".join(deltas) == text and len(deltas) > 1
    chat_deltas = [
        f["payload"]
        for f in run_frames
        if f.get("event") == "chat" and f["payload"]["state"] == "delta"
    ]
    assert chat_deltas and chat_deltas[-1]["message"]["content"][0]["text"] == text
    assert "".join(d["deltaText"] for d in chat_deltas) == text
    # Every event but the challenge carries the connection's rising `seq`.
    seqs = [f["seq"] for f in client.frames if f["type"] == "event" and "seq" in f]
    assert seqs == sorted(seqs)
    for method, params in (
        ("commands.list", {}),
        ("sessions.describe", {"key": session}),
        ("sessions.list", {"agentId": "main", "limit": 1}),
    ):
        assert (await client.call(method, params))["ok"], method
    await ws.close()
    # A second connection (the TUI reconnecting) reads the conversation back.
    again = await open_client(stack.http, ws_url, key)
    history = await again.call("chat.history", {"sessionKey": session, "limit": 20})
    messages = history["payload"]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert messages[0]["content"][0]["text"] == "hello from the tui"
    assert messages[1]["content"][0]["text"] == text
    await again.ws.close()


async def test_the_gateway_call_chat_send_and_health(stack: Stack, ws_url: str) -> None:
    key = (await _start(stack))["api_key"]
    client = await open_client(stack.http, ws_url, key)
    assert (await client.call("health", {}))["payload"]["ok"] is True
    sent = await client.call(
        "chat.send",
        {
            "sessionKey": "main",
            "message": "hello via gateway call chat.send",
            "idempotencyKey": "rc-capture-0001",
        },
    )
    assert sent["payload"] == {"runId": "rc-capture-0001", "status": "started"}
    await client.chat_end("rc-capture-0001")
    await client.ws.close()


@pytest.mark.parametrize("token", ["wrong-token", "sk-sess-" + "x" * 43])
async def test_a_bad_token_is_auth_token_mismatch_then_close_1008(
    stack: Stack, ws_url: str, token: str
) -> None:
    ws = await stack.http.ws_connect(ws_url)
    client = Client(ws)
    await client.next()
    answer = await client.call("connect", connect_params(token))
    assert answer["ok"] is False
    assert answer["error"]["code"] == "INVALID_REQUEST"
    assert answer["error"]["details"]["code"] == "AUTH_TOKEN_MISMATCH"
    closing = await ws.receive(timeout=DEADLINE_S)
    assert closing.type == aiohttp.WSMsgType.CLOSE
    assert ws.close_code == 1008
    # The server stays up.
    key = (await _start(stack))["api_key"]
    await (await open_client(stack.http, ws_url, key)).ws.close()


async def _first_frame_closes(stack: Stack, url: str, text: str) -> tuple[list[Any], int | None]:
    ws = await stack.http.ws_connect(url)
    await ws.receive(timeout=DEADLINE_S)
    await ws.send_str(text)
    frames = []
    while True:
        msg = await ws.receive(timeout=DEADLINE_S)
        if msg.type != aiohttp.WSMsgType.TEXT:
            break
        frames.append(orjson.loads(msg.data))
    return frames, ws.close_code


async def test_handshake_violations_get_the_protocols_errors_and_close_codes(
    stack: Stack, ws_url: str
) -> None:
    key = (await _start(stack))["api_key"]
    wrong_protocol = orjson.dumps(
        {
            "type": "req",
            "id": "1",
            "method": "connect",
            "params": connect_params(key, minProtocol=5, maxProtocol=6),
        }
    ).decode()
    frames, code = await _first_frame_closes(stack, ws_url, wrong_protocol)
    assert frames[0]["error"]["message"] == "protocol mismatch"
    assert code == 1002
    not_connect = orjson.dumps({"type": "req", "id": "1", "method": "health"}).decode()
    frames, code = await _first_frame_closes(stack, ws_url, not_connect)
    assert frames[0]["ok"] is False and frames[0]["id"] == "1"
    assert code == 1008
    frames, code = await _first_frame_closes(stack, ws_url, "{not json")
    assert (frames, code) == ([], 1008)
    frames, code = await _first_frame_closes(stack, ws_url, "x" * (70 * 1024))
    assert code == 1009
    # Protocol 3 is still spoken.
    v3 = orjson.dumps(
        {
            "type": "req",
            "id": "1",
            "method": "connect",
            "params": connect_params(key, minProtocol=3, maxProtocol=3),
        }
    ).decode()
    ws = await stack.http.ws_connect(ws_url)
    await ws.receive(timeout=DEADLINE_S)
    await ws.send_str(v3)
    hello = orjson.loads((await ws.receive(timeout=DEADLINE_S)).data)
    assert hello["payload"]["protocol"] == 3
    await ws.close()


async def test_after_connect_bad_frames_and_unknown_methods_get_errors_and_the_socket_stays(
    stack: Stack,
) -> None:
    runner, url = await _serve(stack, _config(max_payload_bytes=100_000))
    try:
        key = (await _start(stack))["api_key"]
        client = await open_client(stack.http, url, key)
        await client.ws.send_str("{broken")
        broken = await client.until(lambda f: f["type"] == "res")
        assert broken["ok"] is False and broken["error"]["code"] == "INVALID_REQUEST"
        unknown = await client.call("no.such.method", {})
        assert unknown["ok"] is False
        assert "unknown method" in unknown["error"]["message"]
        missing = await client.call("chat.send", {"sessionKey": "main"})
        assert missing["ok"] is False
        # What an answer echoes is bounded: an over-long id is refused without echoing it,
        # an over-long method (or anything else a message names) is cut.
        await client.ws.send_str(
            orjson.dumps({"type": "req", "id": "i" * 50_000, "method": "health"}).decode()
        )
        long_id = await client.until(lambda f: f["type"] == "res")
        assert long_id["ok"] is False and long_id["id"] == ""
        assert long_id["error"]["message"] == "`id` is 50000 characters long; the limit is 256"
        long_method = await client.call("m" * 50_000, {})
        assert long_method["ok"] is False and len(orjson.dumps(long_method)) < 2_000
        assert "limit is 256" in long_method["error"]["message"]
        assert (await client.call("health", {}))["ok"]
        await client.ws.send_str("x" * 200_000)
        closing = await client.ws.receive(timeout=DEADLINE_S)
        assert closing.type == aiohttp.WSMsgType.CLOSE
        assert client.ws.close_code == 1009
    finally:
        await runner.cleanup()


async def test_plain_http_on_ws_is_426_with_the_ws_hint(stack: Stack, ws_url: str) -> None:
    async with stack.http.get(ws_url.replace("ws://", "http://")) as resp:
        assert resp.status == 426
        body = await resp.json()
    assert "ws://" in body["error"]["message"]


async def test_ticks_arrive_at_the_policy_interval(stack: Stack, ws_url: str) -> None:
    key = (await _start(stack))["api_key"]
    client = await open_client(stack.http, ws_url, key)
    first = await client.until(lambda f: f.get("event") == "tick")
    second = await client.until(lambda f: f.get("event") == "tick")
    assert second["seq"] > first["seq"]
    assert second["payload"]["ts"] >= first["payload"]["ts"]
    await client.ws.close()


async def test_a_repeated_idempotency_key_starts_no_second_run(stack: Stack, ws_url: str) -> None:
    key = (await _start(stack))["api_key"]
    client = await open_client(stack.http, ws_url, key)
    before = stack.mock.stats.requests
    params = {"sessionKey": "main", "message": "once", "idempotencyKey": "dup-1"}
    assert (await client.call("chat.send", params))["payload"]["status"] == "started"
    again = await client.call("chat.send", params)
    assert again["payload"]["runId"] == "dup-1"
    assert again["payload"]["status"] in ("in_flight", "ok")
    await client.chat_end("dup-1")
    assert stack.mock.stats.requests == before + 1
    await client.ws.close()


async def _queued(client: Client, mode: str, texts: list[str]) -> list[str]:
    run_ids = []
    for text in texts:
        run_id = str(uuid.uuid4())
        params = {"sessionKey": f"q-{mode}", "message": text, "idempotencyKey": run_id}
        assert (await client.call("chat.send", params | {"queueMode": mode}))["ok"]
        run_ids.append(run_id)
    for run_id in run_ids:
        await client.chat_end(run_id)
    return run_ids


@pytest.mark.parametrize(("mode", "upstream_calls"), [("collect", 2), ("followup", 3)])
async def test_queue_modes_merge_or_serialize_queued_messages(
    stack: Stack, ws_url: str, mode: str, upstream_calls: int
) -> None:
    key = (await _start(stack))["api_key"]
    client = await open_client(stack.http, ws_url, key)
    stack.mock.token_interval_s = 0.05
    before = stack.mock.stats.requests
    await _queued(client, mode, ["first", "second", "third"])
    assert stack.mock.stats.requests == before + upstream_calls
    history = await client.call("chat.history", {"sessionKey": f"q-{mode}"})
    users = [m["content"][0]["text"] for m in history["payload"]["messages"] if m["role"] == "user"]
    expected = ["first", "second\n\nthird"] if mode == "collect" else ["first", "second", "third"]
    assert users == expected
    await client.ws.close()


async def test_chat_abort_stops_the_generation_and_records_the_partial_turn(
    stack: Stack, ws_url: str, redis_client: aioredis.Redis
) -> None:
    key = (await _start(stack))["api_key"]
    client = await open_client(stack.http, ws_url, key)
    stack.mock.token_interval_s = 0.3
    disconnects = stack.mock.stats.disconnects
    run_id = str(uuid.uuid4())
    params = {
        "sessionKey": "abortable",
        "message": "a long answer please",
        "idempotencyKey": run_id,
    }
    assert (await client.call("chat.send", params))["ok"]
    await client.until(
        lambda f: f.get("event") == "agent" and f["payload"]["stream"] == "assistant"
    )
    aborted = await client.call("chat.abort", {"sessionKey": "abortable", "runId": run_id})
    assert aborted["payload"] == {"ok": True, "aborted": True, "runIds": [run_id]}
    end = await client.chat_end(run_id)
    assert end["payload"]["state"] == "aborted"
    partial = end["payload"]["message"]["content"][0]["text"]
    assert partial
    await eventually(
        lambda: stack.mock.stats.disconnects > disconnects,
        timeout_s=DEADLINE_S,
        what="the upstream generation cancelled",
    )
    history = await client.call("chat.history", {"sessionKey": "abortable"})
    assistant = history["payload"]["messages"][-1]
    assert assistant["aborted"] is True
    assert assistant["content"][0]["text"] == partial
    await client.ws.close()
    assert stack.mock.stats.streams_finished == 0
    # The worker ended the turn with the tokens so far; it is recorded under the runId.
    [interaction] = (await published(stack, redis_client, key))["interactions"]
    assert interaction["interaction_id"] == run_id
    assert interaction["finish_reason"] == "abort"
    assert interaction["output"]["content"] == partial
    # This stack's worker is of the `openai` kind: logprobs, no ids (tests/dataproxy/
    # test_abort_turn.py checks the ids of an aborted vllm turn).
    n_logprobs = len(interaction["output_logprobs"]) // 4
    assert 0 < n_logprobs < 200
    assert interaction["output_token_ids"] == b""


async def test_a_refresh_keeps_the_socket_and_the_next_turn_joins_the_new_episode(
    stack: Stack, ws_url: str, redis_client: aioredis.Redis
) -> None:
    key = (await _start(stack))["api_key"]
    client = await open_client(stack.http, ws_url, key)
    first = await client.call(
        "chat.send", {"sessionKey": "main", "message": "turn one", "idempotencyKey": "r-1"}
    )
    assert first["ok"]
    await client.chat_end("r-1")
    episode_one = await published(stack, redis_client, key)
    assert len(episode_one["interactions"]) == 1
    assert (
        await client.call(
            "chat.send", {"sessionKey": "main", "message": "turn two", "idempotencyKey": "r-2"}
        )
    )["ok"]
    await client.chat_end("r-2")
    async with stack.http.post(stack.url + "/rl/end_session", headers=_auth(key)) as resp:
        assert resp.status == 200
    entries = await redis_client.xrange(f"{stack.prefix}trajectories")
    episode_two = inline_content(msgpack.unpackb(entries[-1][1][b"data"], raw=False))
    assert episode_two["session_id"] != episode_one["session_id"]
    [interaction] = episode_two["interactions"]
    # The conversation belongs to the key: turn one is still in the history.
    contents = [m["content"] for m in interaction["messages"]]
    assert contents[1] == "turn one" and contents[-1] == "turn two"
    # Between episodes: an error with the retry hint, and the socket stays.
    refused = await client.call(
        "chat.send", {"sessionKey": "main", "message": "turn three", "idempotencyKey": "r-3"}
    )
    assert refused["ok"] is False
    assert refused["error"]["code"] == "UNAVAILABLE"
    assert refused["error"]["retryable"] is True and refused["error"]["retryAfterMs"] >= 1
    assert (await client.call("health", {}))["ok"]
    await client.ws.close()


async def test_sessions_reset_starts_the_conversation_afresh(stack: Stack, ws_url: str) -> None:
    key = (await _start(stack))["api_key"]
    client = await open_client(stack.http, ws_url, key)
    assert (
        await client.call(
            "chat.send", {"sessionKey": "s", "message": "remember", "idempotencyKey": "s-1"}
        )
    )["ok"]
    await client.chat_end("s-1")
    reset = await client.call("sessions.reset", {"key": "s"})
    assert reset["payload"]["ok"] is True and reset["payload"]["droppedMessages"] == 2
    history = await client.call("chat.history", {"sessionKey": "s"})
    assert history["payload"]["messages"] == []
    await client.ws.close()


async def test_turns_of_one_conversation_never_overlap_across_gateway_replicas(
    stack: Stack, ws_url: str
) -> None:
    runner, other_url = await _serve(stack, _config())
    try:
        key = (await _start(stack))["api_key"]
        one = await open_client(stack.http, ws_url, key)
        two = await open_client(stack.http, other_url, key)
        stack.mock.token_interval_s = 0.05
        before = stack.mock.stats.requests
        params = {"sessionKey": "shared"}
        assert (
            await one.call("chat.send", params | {"message": "from one", "idempotencyKey": "x-1"})
        )["ok"]
        assert (
            await two.call("chat.send", params | {"message": "from two", "idempotencyKey": "x-2"})
        )["ok"]
        await one.chat_end("x-1")
        await two.chat_end("x-2")
        assert stack.mock.stats.requests == before + 2
        history = await one.call("chat.history", {"sessionKey": "shared"})
        messages = history["payload"]["messages"]
        roles = [m["role"] for m in messages]
        # Serialized: each user message is followed by its own answer.
        assert roles == ["user", "assistant", "user", "assistant"]
        # ... and the second run started after the first ended: its upstream prompt holds the
        # first run's answer (overlapping runs would both read the empty history).
        first_user, first_answer, second_user = (m["content"][0]["text"] for m in messages[:3])
        assert stack.mock.stats.last_body is not None
        prompt = stack.mock.stats.last_body["messages"]
        assert prompt == [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": first_user},
            {"role": "assistant", "content": first_answer},
            {"role": "user", "content": second_user},
        ]
        await one.ws.close()
        await two.ws.close()
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("trigger", ["please /fail-500", "please /fail-midstream now"])
async def test_a_failed_run_ends_with_chat_error_and_its_seq_keeps_rising(
    stack: Stack, ws_url: str, trigger: str
) -> None:
    key = (await _start(stack))["api_key"]
    client = await open_client(stack.http, ws_url, key)
    run_id = str(uuid.uuid4())
    params = {"sessionKey": "failing", "message": trigger, "idempotencyKey": run_id}
    assert (await client.call("chat.send", params))["payload"]["status"] == "started"
    end = await client.chat_end(run_id)
    assert end["payload"]["state"] == "error"
    assert end["payload"]["errorMessage"] and end["payload"]["errorCode"]
    run_events = [
        f
        for f in client.frames
        if f["type"] == "event"
        and isinstance(f.get("payload"), dict)
        and f["payload"].get("runId") == run_id
    ]
    phases = [
        f["payload"]["data"]["phase"]
        for f in run_events
        if f["event"] == "agent" and f["payload"]["stream"] == "lifecycle"
    ]
    assert phases == ["start", "error"]
    if "midstream" in trigger:
        assert any(f["payload"].get("stream") == "assistant" for f in run_events)
    # One per-run `seq` over all of the run's events, never restarting.
    seqs = [f["payload"]["seq"] for f in run_events]
    assert seqs == list(range(1, len(seqs) + 1)), seqs
    # The socket stays usable.
    assert (await client.call("health", {}))["ok"]
    await client.ws.close()


async def test_a_frame_over_the_default_25_mib_max_payload_closes_1009_not_a_dropped_connection(
    stack: Stack, ws_url: str
) -> None:
    key = (await _start(stack))["api_key"]
    client = await open_client(stack.http, ws_url, key)
    max_payload = client.frames[-1]["payload"]["policy"]["maxPayload"]
    assert max_payload == 25 * 1024 * 1024
    # The whole frame is sent (the server drains it) and the close frame is read.
    await client.ws.send_str("x" * (max_payload + 1))

    async def not_a_tick() -> aiohttp.WSMessage | None:
        message = await client.ws.receive(timeout=DEADLINE_S)
        return None if message.type == aiohttp.WSMsgType.TEXT else message  # ticks come first

    closing = await eventually(not_a_tick, timeout_s=DEADLINE_S, interval_s=0)
    assert closing.type == aiohttp.WSMsgType.CLOSE, closing
    assert closing.data == 1009
    assert client.ws.close_code == 1009
    # The server stays up.
    await (await open_client(stack.http, ws_url, key)).ws.close()
