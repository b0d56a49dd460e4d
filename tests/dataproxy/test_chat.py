"""The chat path through a real dataproxy, a real worker and the mock LLM."""

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
from services.dataproxy.turns import unpack_float32, unpack_int32
from services.runtime.errors import (
    RollgateError,
    UpstreamError,
    UpstreamTimeout,
    from_rpc_error,
)
from services.runtime.keys import key_digest
from tests.harness.inprocess import (
    ADMIN_KEY,
    RPC_TIMEOUT_S,
    DataproxyChain,
    collect,
    eventually,
    running_dataproxy_chain,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Stack(DataproxyChain):
    """A dataproxy and a worker (over the mock LLM) on port 0, and what tests look at."""

    async def start(self) -> tuple[str, str]:
        """A new session: (api key, key digest)."""
        started = await self.dataproxy.StartSession(
            dataproxy_pb2.StartSessionRequest(task_id="chat"), timeout=RPC_TIMEOUT_S
        )
        return started.api_key, key_digest(started.api_key)

    def chat_request(self, digest: str, text: str, **body: Any) -> dataproxy_pb2.ChatRequest:
        return self.make_chat_request(digest, text, request_id="req-1", **body)


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


async def test_complete_records_the_turn_with_ids_and_logprobs_before_returning(
    stack: Stack,
) -> None:
    _, digest = await stack.start()

    response = await stack.dataproxy.Complete(
        stack.chat_request(digest, "hello there mock"), timeout=RPC_TIMEOUT_S
    )

    body = orjson.loads(response.body_json)
    assert body["id"] == response.interaction_id
    assert "logprobs" not in body["choices"][0] or body["choices"][0]["logprobs"] is None
    (turn,) = await stack.turns(digest)
    assert turn["interaction_id"] == response.interaction_id
    assert turn["upstream_kind"] == "vllm"
    assert turn["exact_tokens"] is True
    output_ids = unpack_int32(turn["output_token_ids"])
    logprobs = unpack_float32(turn["output_logprobs"])
    assert output_ids
    assert len(logprobs) == len(output_ids)
    assert all(lp <= 0.0 for lp in logprobs)
    assert unpack_int32(turn["prompt_token_ids"])
    assert (
        orjson.loads(turn["assistant_message_json"])["content"]
        == (body["choices"][0]["message"]["content"])
    )
    assert orjson.loads(turn["request_json"])["messages"][0]["content"] == "hello there mock"
    assert turn["weight_version"] == 0
    session = await stack.dataproxy.ResolveKey(
        dataproxy_pb2.ResolveKeyRequest(key_digest=digest), timeout=RPC_TIMEOUT_S
    )
    assert response.session_id == session.session_id
    assert session.mode == "key"


async def test_chat_streams_chunks_before_done_and_records_the_turn(stack: Stack) -> None:
    _, digest = await stack.start()

    messages = await collect(
        stack.dataproxy.Chat(
            stack.chat_request(digest, "stream me a few words", stream=True),
            timeout=RPC_TIMEOUT_S,
        )
    )

    kinds = [m.WhichOneof("kind") for m in messages]
    assert kinds[-1] == "done"
    assert kinds[:-1] and set(kinds[:-1]) == {"chunks"}
    done = messages[-1].done
    payloads = [c for m in messages[:-1] for c in m.chunks.chunks]
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
        if p != b"[DONE]"
    )
    assert orjson.loads(turn["assistant_message_json"])["content"] == streamed_text


async def test_rewarded_turns_are_published_by_end_session(stack: Stack) -> None:
    _, digest = await stack.start()
    first = await stack.dataproxy.Complete(
        stack.chat_request(digest, "first"), timeout=RPC_TIMEOUT_S
    )
    second = await collect(
        stack.dataproxy.Chat(
            stack.chat_request(digest, "second", stream=True), timeout=RPC_TIMEOUT_S
        )
    )
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
    assert [e.interaction_id for e in history.entries] == [
        first.interaction_id,
        second[-1].done.interaction_id,
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

    err = await rpc_error(
        collect(stack.dataproxy.Chat(stack.chat_request(digest, "hi"), timeout=RPC_TIMEOUT_S))
    )

    assert err.http_status == 503
    assert err.code == "episode_not_active"
    assert err.retry_after_s == 1.0
    assert "call /rl/start_session with this key" in err.message
    assert stack.mock.stats.requests == 0


async def test_chat_with_an_unknown_key_is_unauthenticated(stack: Stack) -> None:
    err = await rpc_error(
        stack.dataproxy.Complete(
            stack.chat_request(key_digest("sk-sess-" + "z" * 43), "hi"), timeout=RPC_TIMEOUT_S
        )
    )

    assert err.http_status == 401
    assert "unknown session key" in err.message


async def test_unreachable_worker_is_unavailable_so_the_gateway_can_reroute(
    stack: Stack,
) -> None:
    _, digest = await stack.start()
    request = stack.chat_request(digest, "hi")
    request.worker_address = f"127.0.0.1:{free_port()}"

    err = await rpc_error(stack.dataproxy.Complete(request, timeout=RPC_TIMEOUT_S))

    assert err.http_status == 503
    assert err.code == "worker_unavailable"
    assert await stack.turns(digest) == []


async def test_upstream_failure_is_relayed_and_nothing_is_recorded(stack: Stack) -> None:
    _, digest = await stack.start()

    err = await rpc_error(
        collect(
            stack.dataproxy.Chat(
                stack.chat_request(digest, "/fail-500", stream=True), timeout=RPC_TIMEOUT_S
            )
        )
    )

    assert isinstance(err, UpstreamError)
    assert await stack.turns(digest) == []


async def test_turn_that_outlives_its_episode_is_refused_and_not_recorded(
    redis_url: str, key_prefix: str
) -> None:
    async with running_stack(redis_url, key_prefix, token_interval_ms=40) as stack:
        api_key, digest = await stack.start()
        call = stack.dataproxy.Chat(
            stack.chat_request(digest, "one two three four five six seven eight", stream=True),
            timeout=RPC_TIMEOUT_S,
        )
        first = await call.read()
        assert first.WhichOneof("kind") == "chunks"
        refreshed = await stack.dataproxy.StartSession(
            dataproxy_pb2.StartSessionRequest(task_id="chat", api_key=api_key),
            timeout=RPC_TIMEOUT_S,
        )

        err = await rpc_error(collect(call))

        assert refreshed.refreshed
        assert err.code == "episode_ended"
        assert "the turn was not recorded" in err.message
        assert await stack.turns(digest) == []
        assert await stack.redis.xlen(stack.keys.trajectories) == 0


async def test_client_cancel_cancels_the_worker_call(stack: Stack) -> None:
    _, digest = await stack.start()
    call = stack.dataproxy.Chat(
        stack.chat_request(digest, "/hang", stream=True), timeout=RPC_TIMEOUT_S
    )
    await eventually(lambda: stack.mock.stats.requests == 1)

    call.cancel()

    await eventually(lambda: stack.mock.stats.disconnects == 1)
    assert await stack.turns(digest) == []


async def test_turn_past_its_deadline_times_out_and_is_not_recorded(
    redis_url: str, key_prefix: str
) -> None:
    async with running_stack(redis_url, key_prefix, turn_timeout_s=0.5) as stack:
        _, digest = await stack.start()

        err = await rpc_error(
            stack.dataproxy.Complete(stack.chat_request(digest, "/hang"), timeout=RPC_TIMEOUT_S)
        )

        assert isinstance(err, UpstreamTimeout)
        assert await stack.turns(digest) == []
        await eventually(lambda: stack.mock.stats.disconnects == 1)


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
        call = stack.dataproxy.Chat(
            stack.chat_request(digest, "one two three four five six", stream=True),
            timeout=RPC_TIMEOUT_S,
        )
        first = await call.read()
        assert first.WhichOneof("kind") == "chunks"

        stopping = asyncio.create_task(stack.dataproxy_server.stop())
        rest = await collect(call)
        await stopping

        assert [m.WhichOneof("kind") for m in rest][-2:] == ["chunks", "done"]
        (turn,) = await stack.turns(digest)
        assert turn["interaction_id"] == rest[-1].done.interaction_id
        err = await rpc_error(stack.start())
        assert err.http_status == 503
