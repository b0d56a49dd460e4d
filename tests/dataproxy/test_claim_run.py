"""Conversations.ClaimRun through a real dataproxy (gRPC on port 0) and a real Redis."""

from __future__ import annotations

import grpc
import pytest

from protos import conversations_pb2 as pb
from services.runtime.keys import key_digest, key_id_of, new_session_key
from tests.dataproxy.test_conversations import Proxy, T, proxy

__all__ = ["proxy"]


def claim(
    digest: str, run_id: str, *, key: str = "idem-1", conversation: str = "c"
) -> pb.ClaimRunRequest:
    return pb.ClaimRunRequest(
        key_digest=digest,
        conversation=conversation,
        idempotency_key=key,
        run_id=run_id,
        ttl_ms=60_000,
    )


async def test_the_first_claim_wins_and_later_ones_get_its_run_id(proxy: Proxy) -> None:
    digest = await proxy.new_key()
    first = await proxy.conversations.ClaimRun(claim(digest, "run-a"), timeout=T)
    assert (first.claimed, first.run_id) == (True, "run-a")
    again = await proxy.conversations.ClaimRun(claim(digest, "run-b"), timeout=T)
    assert (again.claimed, again.run_id) == (False, "run-a")
    name = proxy.keys.conversation_run(key_id_of(digest), "c", "idem-1")
    assert name.endswith(f"convrun:{key_id_of(digest)}:c:idem-1")
    assert await proxy.redis.get(name) == b"run-a"
    assert 0 < await proxy.redis.pttl(name) <= 60_000


async def test_a_claim_is_per_conversation_and_per_key(proxy: Proxy) -> None:
    digest, other = await proxy.new_key(), await proxy.new_key()
    assert (await proxy.conversations.ClaimRun(claim(digest, "a"), timeout=T)).claimed
    elsewhere = claim(digest, "b", conversation="other")
    assert (await proxy.conversations.ClaimRun(elsewhere, timeout=T)).claimed
    assert (await proxy.conversations.ClaimRun(claim(other, "c"), timeout=T)).claimed


async def test_an_unknown_key_or_a_bad_ttl_is_refused(proxy: Proxy) -> None:
    unknown = key_digest(new_session_key())
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await proxy.conversations.ClaimRun(claim(unknown, "a"), timeout=T)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    digest = await proxy.new_key()
    bad = claim(digest, "a")
    bad.ttl_ms = 0
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await proxy.conversations.ClaimRun(bad, timeout=T)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
