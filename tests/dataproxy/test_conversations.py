"""The Conversations service through a real dataproxy (gRPC on port 0) and a real Redis."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any

import grpc
import orjson
import pytest
import redis.asyncio as aioredis

from protos import conversations_pb2 as pb
from protos import conversations_pb2_grpc, dataproxy_pb2, dataproxy_pb2_grpc
from services.dataproxy.__main__ import serving
from services.dataproxy.redis_keys import RedisKeys
from services.dataproxy.settings import DataProxySettings
from services.runtime.errors import RollgateError, from_rpc_error
from services.runtime.grpc_client import open_channel
from services.runtime.keys import key_digest, key_id_of, new_session_key
from services.runtime.secret import Secret

ADMIN_KEY = "admin-test-key-0123456789"
T = 10.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Proxy:
    conversations: Any
    dataproxy: Any
    redis: aioredis.Redis
    keys: RedisKeys

    async def new_key(self) -> str:
        started = await self.dataproxy.StartSession(
            dataproxy_pb2.StartSessionRequest(task_id="conv"), timeout=T
        )
        return key_digest(started.api_key)

    async def script_calls(self) -> int:
        stats: dict[str, Any] = await self.redis.info("commandstats")
        return sum(int(stats.get(name, {}).get("calls", 0)) for name in ("cmdstat_evalsha",))


@pytest.fixture
async def proxy(redis_url: str, key_prefix: str) -> AsyncIterator[Proxy]:
    settings = DataProxySettings(
        port=0,
        redis_url=redis_url,
        redis_prefix=key_prefix,
        admin_key=Secret(ADMIN_KEY),
        grace_s=1.0,
    )
    async with contextlib.AsyncExitStack() as stack:
        server = await stack.enter_async_context(serving(settings))
        channel = open_channel(f"127.0.0.1:{server.port}")
        stack.push_async_callback(channel.close)
        redis = aioredis.Redis.from_url(redis_url)
        stack.push_async_callback(redis.aclose)
        yield Proxy(
            conversations=conversations_pb2_grpc.ConversationsStub(channel),
            dataproxy=dataproxy_pb2_grpc.DataProxyStub(channel),
            redis=redis,
            keys=RedisKeys(key_prefix),
        )


async def rpc_error(call: Awaitable[Any]) -> RollgateError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return from_rpc_error(caught.value, hop="dataproxy")


def msg(role: str, text: str) -> bytes:
    return orjson.dumps({"role": role, "content": text})


async def test_messages_append_in_order_and_the_tail_is_limited(proxy: Proxy) -> None:
    digest = await proxy.new_key()
    c = proxy.conversations
    appended = await c.AppendMessages(
        pb.AppendMessagesRequest(
            key_digest=digest, conversation="main", messages_json=[msg("user", "a")]
        ),
        timeout=T,
    )
    assert appended.total == 1
    await c.AppendMessages(
        pb.AppendMessagesRequest(
            key_digest=digest,
            conversation="main",
            messages_json=[msg("assistant", "b"), msg("user", "c")],
        ),
        timeout=T,
    )
    everything = await c.GetMessages(
        pb.GetMessagesRequest(key_digest=digest, conversation="main"), timeout=T
    )
    assert [orjson.loads(m)["content"] for m in everything.messages_json] == ["a", "b", "c"]
    tail = await c.GetMessages(
        pb.GetMessagesRequest(key_digest=digest, conversation="main", limit=2), timeout=T
    )
    assert [orjson.loads(m)["content"] for m in tail.messages_json] == ["b", "c"]
    assert tail.total == 3
    other = await c.GetMessages(
        pb.GetMessagesRequest(key_digest=digest, conversation="other"), timeout=T
    )
    assert other.total == 0


async def test_reset_drops_the_history_of_one_conversation_only(proxy: Proxy) -> None:
    digest = await proxy.new_key()
    c = proxy.conversations
    for name in ("one", "two"):
        await c.AppendMessages(
            pb.AppendMessagesRequest(
                key_digest=digest, conversation=name, messages_json=[msg("user", name)]
            ),
            timeout=T,
        )
    reset = await c.ResetConversation(
        pb.ResetConversationRequest(key_digest=digest, conversation="one"), timeout=T
    )
    assert reset.dropped == 1
    one = await c.GetMessages(pb.GetMessagesRequest(key_digest=digest, conversation="one"))
    two = await c.GetMessages(pb.GetMessagesRequest(key_digest=digest, conversation="two"))
    assert (one.total, two.total) == (0, 1)


async def test_an_unknown_key_is_unauthenticated_and_nothing_is_written(proxy: Proxy) -> None:
    digest = key_digest(new_session_key())
    err = await rpc_error(
        proxy.conversations.AppendMessages(
            pb.AppendMessagesRequest(
                key_digest=digest, conversation="main", messages_json=[msg("user", "x")]
            ),
            timeout=T,
        )
    )
    assert err.http_status == 401
    assert await proxy.redis.exists(proxy.keys.conversation(key_id_of(digest), "main")) == 0


async def test_the_turn_lease_admits_one_holder_at_a_time(proxy: Proxy) -> None:
    digest = await proxy.new_key()
    c = proxy.conversations

    def acquire(holder: str) -> Any:
        return c.AcquireTurn(
            pb.AcquireTurnRequest(
                key_digest=digest, conversation="main", holder=holder, lease_ms=30_000
            ),
            timeout=T,
        )

    assert (await acquire("run-a")).granted
    refused = await acquire("run-b")
    assert not refused.granted
    assert 0 < refused.retry_after_ms <= 30_000
    # The holder extends its own lease.
    assert (await acquire("run-a")).granted
    err = await rpc_error(
        c.AppendMessages(
            pb.AppendMessagesRequest(
                key_digest=digest,
                conversation="main",
                messages_json=[msg("user", "x")],
                holder="run-b",
            ),
            timeout=T,
        )
    )
    assert err.code == "lease_lost"
    wrong = await c.ReleaseTurn(
        pb.ReleaseTurnRequest(key_digest=digest, conversation="main", holder="run-b")
    )
    assert not wrong.released
    released = await c.ReleaseTurn(
        pb.ReleaseTurnRequest(key_digest=digest, conversation="main", holder="run-a")
    )
    assert released.released
    assert (await acquire("run-b")).granted


async def _put(proxy: Proxy, digest: str, rid: str, prev: str, *items: str) -> int:
    put = await proxy.conversations.PutResponse(
        pb.PutResponseRequest(
            key_digest=digest,
            response_id=rid,
            previous_response_id=prev,
            items_json=[orjson.dumps({"text": text}) for text in items],
            response_json=orjson.dumps({"id": rid}),
        ),
        timeout=T,
    )
    length: int = put.chain_length
    return length


async def _chain(proxy: Proxy, digest: str, rid: str) -> list[str]:
    got = await proxy.conversations.GetResponse(
        pb.GetResponseRequest(key_digest=digest, response_id=rid, include_chain=True), timeout=T
    )
    assert orjson.loads(got.response_json) == {"id": rid}
    return [orjson.loads(item)["text"] for item in got.chain_items_json]


async def test_a_chain_reads_every_earlier_item_and_stores_each_item_once(proxy: Proxy) -> None:
    digest = await proxy.new_key()
    assert await _put(proxy, digest, "r1", "", "in1", "out1") == 2
    assert await _put(proxy, digest, "r2", "r1", "in2", "out2") == 4
    assert await _put(proxy, digest, "r3", "r2", "in3", "out3") == 6
    assert await _chain(proxy, digest, "r3") == ["in1", "out1", "in2", "out2", "in3", "out3"]
    assert await _chain(proxy, digest, "r1") == ["in1", "out1"]
    chains = [key async for key in proxy.redis.scan_iter(match=f"{proxy.keys.prefix}rchain:*")]
    assert len(chains) == 1
    assert await proxy.redis.llen(chains[0]) == 6


async def test_a_fork_from_an_older_response_keeps_both_branches(proxy: Proxy) -> None:
    digest = await proxy.new_key()
    await _put(proxy, digest, "r1", "", "in1", "out1")
    await _put(proxy, digest, "r2", "r1", "in2", "out2")
    assert await _put(proxy, digest, "r2b", "r1", "alt", "alt-out") == 4
    assert await _chain(proxy, digest, "r2b") == ["in1", "out1", "alt", "alt-out"]
    assert await _chain(proxy, digest, "r2") == ["in1", "out1", "in2", "out2"]


async def test_each_turn_of_a_chain_costs_the_same_round_trips(proxy: Proxy) -> None:
    digest = await proxy.new_key()
    costs = []
    previous = ""
    for n in range(12):
        before = await proxy.script_calls()
        if previous:
            await _chain(proxy, digest, previous)
        await _put(proxy, digest, f"r{n}", previous, f"in{n}", f"out{n}")
        costs.append(await proxy.script_calls() - before)
        previous = f"r{n}"
    assert set(costs[1:]) == {2}


async def test_an_unknown_previous_response_is_previous_response_not_found(
    proxy: Proxy,
) -> None:
    digest = await proxy.new_key()
    err = await rpc_error(_put(proxy, digest, "r2", "nope", "x"))
    assert (err.http_status, err.code) == (404, "previous_response_not_found")
    err = await rpc_error(
        proxy.conversations.GetResponse(
            pb.GetResponseRequest(key_digest=digest, response_id="nope"), timeout=T
        )
    )
    assert err.http_status == 404


async def test_responses_of_one_key_are_invisible_to_another(proxy: Proxy) -> None:
    first = await proxy.new_key()
    second = await proxy.new_key()
    await _put(proxy, first, "r1", "", "x")
    err = await rpc_error(
        proxy.conversations.GetResponse(
            pb.GetResponseRequest(key_digest=second, response_id="r1"), timeout=T
        )
    )
    assert err.http_status == 404
