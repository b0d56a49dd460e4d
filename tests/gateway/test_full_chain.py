"""The gateway over HTTP in front of the real router, dataproxy and worker (in-process, port 0),
the mock LLM upstream and a real Redis."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
import pytest
import redis.asyncio as aioredis

from protos import router_pb2, router_pb2_grpc
from rollgate.mock_llm import MockLLM
from services.gateway import chat
from services.gateway.app import GatewayServer
from services.runtime.grpc_client import open_channel
from services.runtime.keys import key_digest, new_session_key
from tests.gateway.conftest import ADMIN_KEY, gateway_settings
from tests.harness.inprocess import MOCK_MODEL, Upstream, running_full_chain
from tests.harness.poll import eventually

MODEL = MOCK_MODEL
READY_DEADLINE_S = 15.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Stack:
    """A running chain and an HTTP client for its gateway."""

    url: str
    http: aiohttp.ClientSession
    router_addr: str
    dataproxy_addr: str
    prefix: str
    mock: MockLLM


@pytest.fixture
async def stack(
    redis_url: str, key_prefix: str, redis_client: aioredis.Redis
) -> AsyncIterator[Stack]:
    """Router, dataproxy, one worker on the mock LLM, and a gateway; ready when yielded."""
    # Depends on redis_client so that its flush happens before the stack writes anything.
    del redis_client
    async with running_full_chain(
        redis_url, key_prefix, admin_key=ADMIN_KEY, upstreams=[Upstream(worker_id="w-live")]
    ) as chain:
        yield Stack(
            url=chain.url,
            http=chain.http,
            router_addr=chain.router_addr,
            dataproxy_addr=chain.dataproxy_addr,
            prefix=key_prefix,
            mock=chain.mocks[0],
        )


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _chat_body(text: str, *, stream: bool) -> dict[str, Any]:
    return {"model": MODEL, "stream": stream, "messages": [{"role": "user", "content": text}]}


async def _start(stack: Stack, **body: Any) -> dict[str, Any]:
    async with stack.http.post(
        stack.url + "/rl/start_session", json=body, headers=_auth(ADMIN_KEY)
    ) as resp:
        payload: dict[str, Any] = await resp.json()
        assert resp.status == 200, payload
        return payload


async def _sse_events(resp: aiohttp.ClientResponse) -> list[bytes]:
    raw = await resp.read()
    assert raw.endswith(b"\n\n")
    events = raw.split(b"\n\n")[:-1]
    assert all(event.startswith(b"data: ") for event in events), raw
    return [event[len(b"data: ") :] for event in events]


async def test_session_lifecycle_through_the_gateway(
    stack: Stack, redis_client: aioredis.Redis
) -> None:
    started = await _start(stack, task_id="task-a")
    key = started["api_key"]
    assert key.startswith("sk-sess-")
    assert started["session_id"]

    async with stack.http.post(
        stack.url + "/v1/chat/completions", json=_chat_body("hi", stream=False), headers=_auth(key)
    ) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.content_type == "application/json"
        completion = await resp.json()
    assert completion["object"] == "chat.completion"
    assert completion["choices"][0]["message"]["role"] == "assistant"

    async with stack.http.post(
        stack.url + "/chat/completions", json=_chat_body("again", stream=True), headers=_auth(key)
    ) as resp:
        assert resp.status == 200
        assert resp.content_type == "text/event-stream"
        assert resp.headers["Cache-Control"] == "no-cache"
        assert resp.headers["X-Accel-Buffering"] == "no"
        events = await _sse_events(resp)
    assert events[-1] == b"[DONE]"
    chunks = [orjson.loads(event) for event in events[:-1]]
    assert len(chunks) >= 2
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    stream_id = chunks[0]["id"]

    async with stack.http.post(
        stack.url + "/rl/set_reward", json={"reward": 1.5}, headers=_auth(key)
    ) as resp:
        assert resp.status == 200
        assert await resp.json() == {"message": "success", "interaction_id": stream_id}

    async with stack.http.get(stack.url + "/v1/models", headers=_auth(key)) as resp:
        assert resp.status == 200
        models = await resp.json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["default", MODEL]
    assert models["data"][0]["owned_by"] == "rollgate"

    refreshed = await _start(stack, task_id="task-a", api_key=key)
    assert refreshed["api_key"] == key
    assert refreshed["session_id"] != started["session_id"]
    assert await redis_client.xlen(f"{stack.prefix}trajectories") == 1

    async with stack.http.post(stack.url + "/rl/end_session", headers=_auth(key)) as resp:
        assert resp.status == 200
        ended = await resp.json()
    assert ended == {
        "message": "success",
        "session_id": refreshed["session_id"],
        "trajectory_id": "",
        "interaction_count": 0,
    }
    # The empty second episode is not published.
    assert await redis_client.xlen(f"{stack.prefix}trajectories") == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_between_episodes_is_503_with_retry_after(stack: Stack, stream: bool) -> None:
    key = (await _start(stack))["api_key"]
    async with stack.http.post(stack.url + "/rl/end_session", headers=_auth(key)) as resp:
        assert resp.status == 200
    async with stack.http.post(
        stack.url + "/v1/chat/completions", json=_chat_body("hi", stream=stream), headers=_auth(key)
    ) as resp:
        assert resp.status == 503
        assert resp.content_type == "application/json"
        assert int(resp.headers["Retry-After"]) >= 1
        body = await resp.json()
    assert body["error"]["type"] == "service_unavailable"


@pytest.mark.parametrize("stream", [False, True])
async def test_unknown_session_key_is_401_and_leaves_nothing_in_redis(
    stack: Stack, redis_client: aioredis.Redis, stream: bool
) -> None:
    before = sorted(await redis_client.keys(f"{stack.prefix}*"))
    key = new_session_key()
    async with stack.http.post(
        stack.url + "/v1/chat/completions", json=_chat_body("hi", stream=stream), headers=_auth(key)
    ) as resp:
        assert resp.status == 401
        assert resp.content_type == "application/json"
        body = await resp.json()
    assert body["error"]["type"] == "authentication_error"
    async with stack.http.get(stack.url + "/v1/models", headers=_auth(key)) as resp:
        assert resp.status == 401
    # Refused at admission, before the router: no affinity, nothing per key; only the bounded
    # global counters and error list (the console's) may be new.
    after = sorted(await redis_client.keys(f"{stack.prefix}*"))
    new = {k.decode().removeprefix(stack.prefix) for k in after if k not in before}
    assert new <= {"stats", "errors"}
    assert not await redis_client.keys(f"{stack.prefix}aff:*")


async def test_models_with_the_admin_key_lists_live_models(stack: Stack) -> None:
    async with stack.http.get(stack.url + "/models", headers=_auth(ADMIN_KEY)) as resp:
        assert resp.status == 200
        assert [m["id"] for m in (await resp.json())["data"]] == ["default", MODEL]


async def test_default_is_an_alias_of_the_first_served_model(stack: Stack) -> None:
    key = (await _start(stack))["api_key"]
    for stream in (False, True):
        body = _chat_body("hi", stream=stream) | {"model": "default"}
        async with stack.http.post(
            stack.url + "/v1/chat/completions", json=body, headers=_auth(key)
        ) as resp:
            assert resp.status == 200, await resp.text()
            raw = await resp.read()
        first = orjson.loads(raw.split(b"data: ", 1)[1].split(b"\n", 1)[0] if stream else raw)
        assert first["model"] == MODEL
    # The upstream got the served id, never the alias.
    assert stack.mock.stats.models == {MODEL: 2}


async def test_health_reports_the_live_workers_without_asking_the_router(stack: Stack) -> None:

    async def health() -> dict[str, Any]:
        async with stack.http.get(stack.url + "/health") as resp:
            assert resp.status == 200
            body: dict[str, Any] = await resp.json()
            return body

    await eventually(
        health, want={"status": "ok", "workers": 1}, timeout_s=READY_DEADLINE_S, interval_s=0.05
    )


async def test_a_stale_health_count_is_refreshed_for_the_next_health(
    stack: Stack, dead_address: str
) -> None:
    # The background refresh runs every 10 s; a worker registered now is counted within the
    # poll because a /health that finds the count older than 2 s refreshes it (its lease, 6 s,
    # keeps it live meanwhile; nothing here calls /ready, which would count it too).
    channel = open_channel(stack.router_addr)
    try:
        await router_pb2_grpc.RouterStub(channel).RegisterWorker(
            router_pb2.RegisterWorkerRequest(worker_id="a-new", address=dead_address),
            timeout=5,
        )

        async def counted() -> int:
            async with stack.http.get(stack.url + "/health") as resp:
                assert resp.status == 200
                workers: int = (await resp.json())["workers"]
                return workers

        await eventually(counted, want=2, timeout_s=5.0, interval_s=0.05)
    finally:
        await channel.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_unknown_model_is_404_from_the_router_and_releases_the_admitted_turn(
    stack: Stack, redis_client: aioredis.Redis, stream: bool
) -> None:
    key = (await _start(stack))["api_key"]
    body = _chat_body("hi", stream=stream) | {"model": "no-such-model"}
    async with stack.http.post(
        stack.url + "/v1/chat/completions", json=body, headers=_auth(key)
    ) as resp:
        assert resp.status == 404
        assert MODEL in (await resp.json())["error"]["message"]
    # Admitted before it was routed, so the failed route gave its in-flight lease back.
    assert await redis_client.zcard(f"{stack.prefix}inflight") == 0
    assert not await redis_client.hlen(f"{stack.prefix}epturns")


@pytest.mark.parametrize("stream", [False, True])
async def test_an_unreachable_worker_is_avoided_on_a_second_route(
    stack: Stack, dead_address: str, stream: bool
) -> None:
    # "a-dead" sorts before "w-live": the router places a new session on it first.
    channel = open_channel(stack.router_addr)
    try:
        router = router_pb2_grpc.RouterStub(channel)
        await router.RegisterWorker(
            router_pb2.RegisterWorkerRequest(
                worker_id="a-dead", address=dead_address, models=[MODEL]
            ),
            timeout=5,
        )
        key = (await _start(stack))["api_key"]
        async with stack.http.post(
            stack.url + "/v1/chat/completions",
            json=_chat_body("hi", stream=stream),
            headers=_auth(key),
        ) as resp:
            assert resp.status == 200, await resp.text()
            if stream:
                assert (await _sse_events(resp))[-1] == b"[DONE]"
        route = await router.Route(
            router_pb2.RouteRequest(session=key_digest(key), model=MODEL), timeout=5
        )
        assert route.worker_id == "w-live"
    finally:
        await channel.close()


async def test_chat_when_the_dataproxy_is_unreachable_is_503_with_retry_after(
    stack: Stack, dead_address: str
) -> None:
    key = (await _start(stack))["api_key"]
    settings = gateway_settings(router_addr=stack.router_addr, dataproxy_addr=dead_address)
    async with GatewayServer(settings) as server:
        url = f"http://127.0.0.1:{server.port}"
        for stream in (False, True):
            async with stack.http.post(
                url + "/v1/chat/completions",
                json=_chat_body("hi", stream=stream),
                headers=_auth(key),
            ) as resp:
                assert resp.status == 503
                assert resp.content_type == "application/json"
                assert resp.headers["Retry-After"] == "1"
                assert (await resp.json())["error"]["code"] == "dataproxy_unavailable"
        async with stack.http.get(url + "/ready") as resp:
            assert resp.status == 503
            assert (await resp.json())["missing"] == ["dataproxy"]


async def test_chat_when_the_router_is_unreachable_is_503_and_releases_the_admitted_turn(
    stack: Stack, redis_client: aioredis.Redis, dead_address: str
) -> None:
    key = (await _start(stack))["api_key"]
    settings = gateway_settings(router_addr=dead_address, dataproxy_addr=stack.dataproxy_addr)
    async with GatewayServer(settings) as server:
        url = f"http://127.0.0.1:{server.port}"
        for stream in (False, True):
            async with stack.http.post(
                url + "/v1/chat/completions",
                json=_chat_body("hi", stream=stream),
                headers=_auth(key),
            ) as resp:
                assert resp.status == 503
                assert resp.content_type == "application/json"
                assert int(resp.headers["Retry-After"]) >= 1
                assert (await resp.json())["error"]["code"] == "router_unavailable"
    # Admitted, then not routed: the lease is given back, so the episode is not held open.
    assert await redis_client.zcard(f"{stack.prefix}inflight") == 0
    assert not await redis_client.hlen(f"{stack.prefix}epturns")


async def _wait_for_disconnects(mock: MockLLM, count: int) -> None:
    await eventually(
        lambda: mock.stats.disconnects >= count,
        timeout_s=READY_DEADLINE_S,
        what="the upstream call cancelled",
    )


async def test_upstream_failure_before_the_first_chunk_is_a_json_error(stack: Stack) -> None:
    key = (await _start(stack))["api_key"]
    async with stack.http.post(
        stack.url + "/v1/chat/completions",
        json=_chat_body("please /fail-500", stream=True),
        headers=_auth(key),
    ) as resp:
        assert resp.status == 502
        assert resp.content_type == "application/json"
        assert (await resp.json())["error"]["type"] == "upstream_error"


async def test_failure_after_the_first_chunk_ends_the_stream_with_an_error_event(
    stack: Stack,
) -> None:
    key = (await _start(stack))["api_key"]
    async with stack.http.post(
        stack.url + "/v1/chat/completions",
        json=_chat_body("please /fail-midstream", stream=True),
        headers=_auth(key),
    ) as resp:
        assert resp.status == 200
        assert resp.content_type == "text/event-stream"
        events = await _sse_events(resp)
    assert b"[DONE]" not in events
    assert len(events) >= 2
    assert orjson.loads(events[0])["object"] == "chat.completion.chunk"
    last = orjson.loads(events[-1])
    assert set(last) == {"error"}
    assert set(last["error"]) == {"message", "type", "code"}


async def test_client_gone_before_the_first_chunk_cancels_the_upstream_call(stack: Stack) -> None:
    key = (await _start(stack))["api_key"]
    before = stack.mock.stats.disconnects
    with pytest.raises(TimeoutError):
        async with stack.http.post(
            stack.url + "/v1/chat/completions",
            json=_chat_body("please /hang", stream=True),
            headers=_auth(key),
            timeout=aiohttp.ClientTimeout(total=0.5),
        ) as resp:
            await resp.read()
    await _wait_for_disconnects(stack.mock, before + 1)


async def test_client_gone_mid_stream_cancels_the_upstream_call(stack: Stack) -> None:
    key = (await _start(stack))["api_key"]
    before = stack.mock.stats.disconnects
    stack.mock.token_interval_s = 0.5
    async with stack.http.post(
        stack.url + "/v1/chat/completions",
        json=_chat_body("a long enough question for many tokens", stream=True),
        headers=_auth(key),
    ) as resp:
        assert resp.status == 200
        first = await resp.content.readuntil(b"\n\n")
        assert first.startswith(b"data: {")
        resp.close()
    await _wait_for_disconnects(stack.mock, before + 1)
    assert stack.mock.stats.streams_finished == 0


async def test_the_client_sees_the_first_token_before_the_model_generates_the_last(
    stack: Stack,
) -> None:
    """Streaming is end to end: gateway, dataproxy and worker relay each chunk as it comes,
    proven by the mock's own progress counters when the first content chunk arrives."""
    key = (await _start(stack))["api_key"]
    # Each token after the first waits for this interval at the mock: a chain that buffered
    # the stream would deliver its first chunk only after the last token was generated.
    stack.mock.token_interval_s = 0.05
    streamed_before = stack.mock.stats.tokens_streamed
    finished_before = stack.mock.stats.streams_finished
    at_first_content: tuple[int, int] | None = None
    contents: list[str] = []
    async with stack.http.post(
        stack.url + "/v1/chat/completions",
        json=_chat_body("tell me something long enough for many tokens", stream=True),
        headers=_auth(key),
    ) as resp:
        assert resp.status == 200
        while (event := await resp.content.readuntil(b"\n\n")) != b"data: [DONE]\n\n":
            assert event.startswith(b"data: "), event
            choices = orjson.loads(event[len(b"data: ") :])["choices"]
            content = choices[0]["delta"].get("content") if choices else None
            if content and at_first_content is None:
                at_first_content = (
                    stack.mock.stats.tokens_streamed - streamed_before,
                    stack.mock.stats.streams_finished - finished_before,
                )
            if content:
                contents.append(content)
    generated = stack.mock.stats.tokens_streamed - streamed_before
    assert stack.mock.stats.streams_finished - finished_before == 1
    # Every token but the last (EOS, sampled but with no text, as vLLM sends it) has content.
    assert len(contents) + 1 == generated > 3
    assert at_first_content is not None
    tokens_then, finished_then = at_first_content
    assert finished_then == 0  # the upstream stream was still open
    assert 1 <= tokens_then < generated  # and later tokens were not generated yet


def _count_pushes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The bytes of each write chat, Responses or Messages pushed from the worker stream's
    read callback, counted around the real pusher."""
    pushed: list[int] = []
    original = chat.Pusher.write

    def counted(self: chat.Pusher, data: bytes) -> None:
        pushed.append(len(data))
        original(self, data)

    monkeypatch.setattr(chat.Pusher, "write", counted)
    return pushed


def _content(events: list[bytes]) -> str:
    assert events[-1] == b"[DONE]"
    return "".join(
        (choice.get("delta") or {}).get("content") or ""
        for event in events[:-1]
        for choice in orjson.loads(event)["choices"]
    )


async def test_a_streamed_answer_after_its_first_chunks_is_pushed_whole_and_in_order(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = (await _start(stack))["api_key"]
    question = "tell me something long enough for many tokens"
    async with stack.http.post(
        stack.url + "/v1/chat/completions",
        json=_chat_body(question, stream=False),
        headers=_auth(key),
    ) as resp:
        whole = (await resp.json())["choices"][0]["message"]["content"]
    pushed = _count_pushes(monkeypatch)
    stack.mock.token_interval_s = 0.005  # each token its own read: its own event
    async with stack.http.post(
        stack.url + "/v1/chat/completions", json=_chat_body(question, stream=True),
        headers=_auth(key),
    ) as resp:  # fmt: skip
        assert resp.status == 200
        streamed = _content(await _sse_events(resp))
    assert streamed == whole and len(whole) > 20
    assert len(pushed) >= 3


async def test_an_http_1_0_client_gets_pushed_chunks_unframed(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = (await _start(stack))["api_key"]
    pushed = _count_pushes(monkeypatch)
    stack.mock.token_interval_s = 0.005
    body = orjson.dumps(_chat_body("tell me something long enough for many tokens", stream=True))
    host, port = stack.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(
            b"POST /v1/chat/completions HTTP/1.0\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer %s\r\nContent-Length: %d\r\n\r\n%s"
            % (key.encode(), len(body), body)
        )
        await writer.drain()
        async with asyncio.timeout(30):
            raw = await reader.read()  # an HTTP/1.0 answer ends when the connection closes
    finally:
        writer.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200") and b"Transfer-Encoding" not in head
    events = payload.split(b"\n\n")
    assert events[-1] == b""
    assert all(event.startswith(b"data: ") for event in events[:-1]), payload
    assert "you said" in _content([event[len(b"data: ") :] for event in events[:-1]])
    assert len(pushed) >= 3
