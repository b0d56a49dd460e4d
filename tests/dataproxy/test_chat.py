"""The chat path through the gateway's relay, a real dataproxy (the turn ledger), a real worker
and the mock LLM."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any

import grpc
import msgpack  # type: ignore[import-untyped]
import orjson
import pytest

from protos import dataproxy_pb2
from rollgate.redis_server import free_port
from schema.packing import unpack_float32, unpack_int32
from services.gateway.relay import Chunks, Done, TurnRelay
from services.runtime.errors import (
    RollgateError,
    UpstreamError,
    UpstreamTimeout,
    from_rpc_error,
)
from services.runtime.grpc_client import ChannelPool
from services.runtime.keys import key_digest
from tests.harness.inprocess import (
    ADMIN_KEY,
    RPC_TIMEOUT_S,
    DataproxyChain,
    FixedWorker,
    chunk_payloads,
    running_dataproxy_chain,
)
from tests.harness.poll import eventually


@dataclass(frozen=True, slots=True, kw_only=True)
class Stack(DataproxyChain):
    """A dataproxy and a worker (over the mock LLM) on port 0, and what tests look at."""

    async def start(self) -> tuple[str, str]:
        """A new session: (api key, key digest)."""
        started = await self.dataproxy.StartSession(
            dataproxy_pb2.StartSessionRequest(task_id="chat"), timeout=RPC_TIMEOUT_S
        )
        return started.api_key, key_digest(started.api_key)

    async def in_flight(self) -> int:
        """Turns holding an in-flight lease."""
        return int(await self.redis.zcard(self.keys.in_flight))


def running_stack(
    redis_url: str,
    key_prefix: str,
    *,
    token_interval_ms: float = 0.0,
    turn_timeout_s: float = 30.0,
) -> contextlib.AbstractAsyncContextManager[Stack]:
    return running_dataproxy_chain(
        redis_url,
        key_prefix,
        chain_type=Stack,
        token_interval_ms=token_interval_ms,
        turn_timeout_s=turn_timeout_s,
    )


@pytest.fixture
async def stack(redis_url: str, key_prefix: str) -> AsyncIterator[Stack]:
    async with running_stack(redis_url, key_prefix) as running:
        yield running


async def rpc_error(call: Awaitable[Any]) -> RollgateError:
    """The RollgateError a call ended with, rebuilt as the gateway would."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return from_rpc_error(caught.value, hop="dataproxy")


async def relay_error(call: Awaitable[Any]) -> RollgateError:
    """The RollgateError a relayed turn ended with."""
    with pytest.raises(RollgateError) as caught:
        await call
    return caught.value


async def test_complete_records_the_turn_with_ids_and_logprobs_before_returning(
    stack: Stack,
) -> None:
    _, digest = await stack.start()

    body, done = await stack.complete(digest, "hello there mock")

    assert body["id"] == done.interaction_id
    assert "logprobs" not in body["choices"][0] or body["choices"][0]["logprobs"] is None
    (turn,) = await stack.turns(digest)
    assert turn["interaction_id"] == done.interaction_id
    assert turn["upstream_kind"] == "vllm"
    assert turn["exact_tokens"] is True
    output_ids = unpack_int32(turn["output_token_ids"])
    logprobs = unpack_float32(turn["output_logprobs"])
    assert output_ids
    assert len(logprobs) == len(output_ids)
    assert all(lp <= 0.0 for lp in logprobs)
    assert unpack_int32(turn["prompt_token_ids"])
    assert done.message == orjson.loads(turn["assistant_message_json"])
    assert done.content == body["choices"][0]["message"]["content"]
    assert orjson.loads(turn["request_json"])["messages"][0]["content"] == "hello there mock"
    assert turn["weight_version"] == 0
    session = await stack.dataproxy.ResolveKey(
        dataproxy_pb2.ResolveKeyRequest(key_digest=digest), timeout=RPC_TIMEOUT_S
    )
    assert done.session_id == session.session_id
    assert session.mode == "key"
    assert await stack.in_flight() == 0


async def test_chat_streams_chunks_before_done_and_records_the_turn(stack: Stack) -> None:
    _, digest = await stack.start()

    events = await stack.stream(digest, "stream me a few words")

    assert isinstance(events[-1], Done)
    assert events[:-1] and all(isinstance(e, Chunks) for e in events[:-1])
    done = events[-1]
    payloads = chunk_payloads(events)
    first = orjson.loads(payloads[0])
    assert first["id"] == done.interaction_id
    (turn,) = await stack.turns(digest)
    assert turn["interaction_id"] == done.interaction_id
    output_ids = unpack_int32(turn["output_token_ids"])
    assert output_ids
    assert len(unpack_float32(turn["output_logprobs"])) == len(output_ids)
    streamed_text = "".join(
        (orjson.loads(p)["choices"] or [{}])[0].get("delta", {}).get("content") or ""
        for p in payloads
    )
    assert orjson.loads(turn["assistant_message_json"])["content"] == streamed_text
    assert done.content == streamed_text and done.finish_reason == "stop"
    assert done.usage["completion_tokens"] == len(output_ids)


async def test_rewarded_turns_are_published_by_end_session(stack: Stack) -> None:
    _, digest = await stack.start()
    _, first = await stack.complete(digest, "first")
    second = await stack.stream(digest, "second")
    rewarded = await stack.dataproxy.SetReward(
        dataproxy_pb2.SetRewardRequest(
            key_digest=digest, reward=2.0, interaction_id=first.interaction_id
        ),
        timeout=RPC_TIMEOUT_S,
    )
    history = await stack.dataproxy.GetHistory(
        dataproxy_pb2.GetHistoryRequest(key_digest=digest), timeout=RPC_TIMEOUT_S
    )

    ended = await stack.dataproxy.EndSession(
        dataproxy_pb2.EndSessionRequest(key_digest=digest), timeout=RPC_TIMEOUT_S
    )

    assert rewarded.interaction_id == first.interaction_id
    last = second[-1]
    assert isinstance(last, Done)
    assert [e.interaction_id for e in history.entries] == [
        first.interaction_id,
        last.interaction_id,
    ]
    assert orjson.loads(history.entries[0].interaction_json)["reward"] == 2.0
    assert ended.interaction_count == 2
    entries: Any = await stack.redis.xrange(stack.keys.trajectories)
    ((_, fields),) = entries
    assert fields[b"trajectory_id"] == ended.trajectory_id.encode()
    trajectory = msgpack.unpackb(fields[b"data"], raw=False)
    assert [i["reward"] for i in trajectory["interactions"]] == [2.0, 0.0]


async def test_chat_between_episodes_is_unavailable_with_retry_after(stack: Stack) -> None:
    _, digest = await stack.start()
    await stack.dataproxy.EndSession(
        dataproxy_pb2.EndSessionRequest(key_digest=digest), timeout=RPC_TIMEOUT_S
    )

    err = await relay_error(stack.stream(digest, "hi"))

    assert err.http_status == 503
    assert err.code == "episode_not_active"
    assert err.retry_after_s == 1.0
    assert "call /rl/start_session with this key" in err.message
    assert stack.mock.stats.requests == 0


async def test_chat_with_an_unknown_key_is_unauthenticated(stack: Stack) -> None:
    err = await relay_error(stack.complete(key_digest("sk-sess-" + "z" * 43), "hi"))

    assert err.http_status == 401
    assert "unknown session key" in err.message


async def test_unreachable_worker_is_unavailable_and_the_lease_released(stack: Stack) -> None:
    _, digest = await stack.start()
    routes = FixedWorker(f"127.0.0.1:{free_port()}")
    relay = TurnRelay(routes=routes, ledger=stack.ledger, workers=ChannelPool(), rpc_timeout_s=5)

    err = await relay_error(relay.complete(stack.spec(digest, "hi")))

    assert err.http_status == 503
    assert err.code == "worker_unavailable"
    assert await stack.turns(digest) == []
    assert await stack.in_flight() == 0


async def test_upstream_failure_is_relayed_and_nothing_is_recorded(stack: Stack) -> None:
    _, digest = await stack.start()

    err = await relay_error(stack.stream(digest, "/fail-500"))

    assert isinstance(err, UpstreamError)
    assert await stack.turns(digest) == []
    assert await stack.in_flight() == 0


async def test_a_stream_broken_midway_is_not_recorded_and_releases_its_lease(
    stack: Stack,
) -> None:
    _, digest = await stack.start()

    err = await relay_error(stack.stream(digest, "/fail-midstream"))

    assert isinstance(err, UpstreamError)
    assert await stack.turns(digest) == []
    await eventually(stack.in_flight, want=0)


async def test_turn_that_outlives_its_episode_is_refused_and_not_recorded(
    redis_url: str, key_prefix: str
) -> None:
    async with running_stack(redis_url, key_prefix, token_interval_ms=40) as stack:
        api_key, digest = await stack.start()
        events = stack.relay.stream(
            stack.spec(digest, "one two three four five six seven eight", stream=True)
        )
        async with contextlib.aclosing(events):
            first = await anext(events)
            assert isinstance(first, Chunks)
            refreshed = await stack.dataproxy.StartSession(
                dataproxy_pb2.StartSessionRequest(task_id="chat", api_key=api_key),
                timeout=RPC_TIMEOUT_S,
            )

            err = await relay_error(_drain(events))

        assert refreshed.refreshed
        assert err.code == "episode_ended"
        assert "the turn was not recorded" in err.message
        assert await stack.turns(digest) == []
        assert await stack.redis.xlen(stack.keys.trajectories) == 0
        assert await stack.in_flight() == 0


async def _drain(events: Any) -> list[Any]:
    return [event async for event in events]


async def test_client_cancel_cancels_the_worker_call_and_releases_the_lease(
    stack: Stack,
) -> None:
    _, digest = await stack.start()
    turn = asyncio.create_task(stack.stream(digest, "/hang"))
    await eventually(lambda: stack.mock.stats.requests == 1)
    assert await stack.in_flight() == 1

    turn.cancel()

    await eventually(lambda: stack.mock.stats.disconnects == 1)
    assert await stack.turns(digest) == []
    await eventually(stack.in_flight, want=0)


async def _error_list(stack: Stack) -> list[dict[str, Any]]:
    raw: Any = await stack.redis.lrange(stack.keys.errors, 0, -1)
    return [orjson.loads(event) for event in raw]


async def test_failed_turns_reach_the_error_list_with_what_the_client_was_told(
    stack: Stack,
) -> None:
    # The gateway calls the worker itself: the failure travels with the turn's release.
    _, digest = await stack.start()
    refused = await relay_error(stack.complete(digest, "please /fail-429"))
    await eventually(stack.in_flight, want=0)
    # A client that goes away is no failure: nothing is added for it.
    hung = asyncio.create_task(stack.stream(digest, "/hang"))
    await eventually(lambda: stack.mock.stats.requests == 2)
    hung.cancel()
    await eventually(stack.in_flight, want=0)
    broken = await relay_error(stack.stream(digest, "/fail-midstream"))

    async def listed() -> list[dict[str, Any]] | None:
        events = await _error_list(stack)
        return events if len(events) >= 2 else None

    events = await eventually(listed, what="the two failed turns listed")
    assert [(e["method"], e["code"]) for e in events] == [
        ("Worker.Generate", "UNKNOWN"),
        ("Worker.Complete", "RESOURCE_EXHAUSTED"),
    ]
    assert events[0]["message"] == f"upstream_broken_stream: {broken.message}"
    assert events[1]["message"] == f"upstream_rate_limited: {refused.message}"
    assert int(await stack.redis.hget(stack.keys.stats, "errors") or 0) == 2
    assert await stack.turns(digest) == []


async def test_turn_past_its_deadline_times_out_and_is_not_recorded(stack: Stack) -> None:
    _, digest = await stack.start()

    err = await relay_error(stack.complete(digest, "/hang", timeout_s=0.5))

    assert isinstance(err, UpstreamTimeout)
    assert await stack.turns(digest) == []
    await eventually(lambda: stack.mock.stats.disconnects == 1)
    await eventually(stack.in_flight, want=0)


async def test_admin_key_cannot_start_a_session(stack: Stack) -> None:
    err = await rpc_error(
        stack.dataproxy.StartSession(
            dataproxy_pb2.StartSessionRequest(api_key=ADMIN_KEY), timeout=RPC_TIMEOUT_S
        )
    )

    assert err.http_status == 400


async def test_graceful_stop_lets_a_running_chat_finish_and_record(
    redis_url: str, key_prefix: str
) -> None:
    async with running_stack(redis_url, key_prefix, token_interval_ms=20) as stack:
        _, digest = await stack.start()
        events = stack.relay.stream(stack.spec(digest, "one two three four five six", stream=True))
        async with contextlib.aclosing(events):
            first = await anext(events)
            assert isinstance(first, Chunks)

            stopping = asyncio.create_task(stack.dataproxy_server.stop())
            rest = await _drain(events)
            await stopping

        assert isinstance(rest[-1], Done)
        (turn,) = await stack.turns(digest)
        assert turn["interaction_id"] == rest[-1].interaction_id
        err = await rpc_error(stack.start())
        assert err.http_status == 503
