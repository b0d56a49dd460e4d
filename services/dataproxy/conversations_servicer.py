"""The Conversations gRPC service: glue between protobuf and the conversation store."""

from __future__ import annotations

from typing import Any, TypeAlias

import grpc
import redis.asyncio as aioredis

from protos import conversations_pb2 as pb
from protos import conversations_pb2_grpc
from protos.conversations_pb2_grpc import add_ConversationsServicer_to_server
from services.dataproxy.conversations import ConversationStore
from services.dataproxy.redis_keys import RedisKeys

Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"


class ConversationsServicer(conversations_pb2_grpc.ConversationsServicer):
    """Conversation histories, turn leases and stored responses over gRPC."""

    def __init__(self, *, store: ConversationStore) -> None:
        self._store = store

    async def GetMessages(
        self, request: pb.GetMessagesRequest, context: Context
    ) -> pb.GetMessagesResponse:
        got = await self._store.messages(
            request.key_digest, request.conversation, limit=request.limit
        )
        return pb.GetMessagesResponse(messages_json=got.messages, total=got.total)

    async def AppendMessages(
        self, request: pb.AppendMessagesRequest, context: Context
    ) -> pb.AppendMessagesResponse:
        total = await self._store.append(
            request.key_digest,
            request.conversation,
            messages=list(request.messages_json),
            holder=request.holder,
        )
        return pb.AppendMessagesResponse(total=total)

    async def ResetConversation(
        self, request: pb.ResetConversationRequest, context: Context
    ) -> pb.ResetConversationResponse:
        dropped = await self._store.reset(request.key_digest, request.conversation)
        return pb.ResetConversationResponse(dropped=dropped)

    async def AcquireTurn(
        self, request: pb.AcquireTurnRequest, context: Context
    ) -> pb.AcquireTurnResponse:
        lease = await self._store.acquire(
            request.key_digest,
            request.conversation,
            holder=request.holder,
            lease_ms=request.lease_ms,
        )
        return pb.AcquireTurnResponse(granted=lease.granted, retry_after_ms=lease.retry_after_ms)

    async def ReleaseTurn(
        self, request: pb.ReleaseTurnRequest, context: Context
    ) -> pb.ReleaseTurnResponse:
        released = await self._store.release(
            request.key_digest, request.conversation, holder=request.holder
        )
        return pb.ReleaseTurnResponse(released=released)

    async def PutResponse(
        self, request: pb.PutResponseRequest, context: Context
    ) -> pb.PutResponseResponse:
        length = await self._store.put_response(
            request.key_digest,
            response_id=request.response_id,
            previous_response_id=request.previous_response_id,
            items=list(request.items_json),
            response_json=request.response_json,
        )
        return pb.PutResponseResponse(chain_length=length)

    async def GetResponse(
        self, request: pb.GetResponseRequest, context: Context
    ) -> pb.GetResponseResponse:
        stored = await self._store.get_response(
            request.key_digest, request.response_id, include_chain=request.include_chain
        )
        return pb.GetResponseResponse(
            found=True, response_json=stored.response_json, chain_items_json=stored.chain_items
        )

    async def ClaimRun(self, request: pb.ClaimRunRequest, context: Context) -> pb.ClaimRunResponse:
        claim = await self._store.claim_run(
            request.key_digest,
            request.conversation,
            idempotency_key=request.idempotency_key,
            run_id=request.run_id,
            ttl_ms=request.ttl_ms,
        )
        return pb.ClaimRunResponse(claimed=claim.claimed, run_id=claim.run_id)


def build_conversations(*, redis: aioredis.Redis, prefix: str) -> ConversationsServicer:
    """The Conversations servicer over one Redis client, under the dataproxy's key prefix."""
    return ConversationsServicer(store=ConversationStore(redis=redis, keys=RedisKeys(prefix)))


__all__ = ["ConversationsServicer", "add_ConversationsServicer_to_server", "build_conversations"]
