"""The gateway's client of the dataproxy's Conversations service (histories, leases, responses)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable
from typing import TYPE_CHECKING, Any, TypeVar, cast

import grpc
from aiohttp import web

from protos import conversations_pb2 as pb
from protos import conversations_pb2_grpc
from services.gateway.backends import SETTINGS
from services.runtime.errors import from_rpc_error
from services.runtime.grpc_client import open_channel
from services.runtime.logs import get_logger

if TYPE_CHECKING:
    from protos.conversations_pb2_grpc import ConversationsAsyncStub

log = get_logger(__name__)

R = TypeVar("R")


class ConversationsClient:
    """Typed calls on `rollgate.v1.Conversations`; gRPC errors become RollgateErrors."""

    def __init__(self, stub: ConversationsAsyncStub, *, timeout_s: float) -> None:
        self._stub = stub
        self._timeout_s = timeout_s

    async def _call(self, call: Awaitable[R]) -> R:
        try:
            return await call
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err, hop="dataproxy") from None

    async def messages(
        self, digest: str, conversation: str, *, limit: int = 0
    ) -> tuple[list[bytes], int]:
        """(the last `limit` messages (all when 0) oldest first, the total count)."""
        got = await self._call(
            self._stub.GetMessages(
                pb.GetMessagesRequest(key_digest=digest, conversation=conversation, limit=limit),
                timeout=self._timeout_s,
            )
        )
        return list(got.messages_json), int(got.total)

    async def append(
        self, digest: str, conversation: str, messages: list[bytes], *, holder: str
    ) -> int:
        """Appends messages while `holder` holds the lease; the new total."""
        got = await self._call(
            self._stub.AppendMessages(
                pb.AppendMessagesRequest(
                    key_digest=digest,
                    conversation=conversation,
                    messages_json=messages,
                    holder=holder,
                ),
                timeout=self._timeout_s,
            )
        )
        return int(got.total)

    async def reset(self, digest: str, conversation: str) -> int:
        """Drops the history; how many messages it held."""
        got = await self._call(
            self._stub.ResetConversation(
                pb.ResetConversationRequest(key_digest=digest, conversation=conversation),
                timeout=self._timeout_s,
            )
        )
        return int(got.dropped)

    async def acquire(
        self, digest: str, conversation: str, *, holder: str, lease_ms: int
    ) -> tuple[bool, int]:
        """(granted, retry_after_ms) for the conversation's turn lease."""
        got = await self._call(
            self._stub.AcquireTurn(
                pb.AcquireTurnRequest(
                    key_digest=digest, conversation=conversation, holder=holder, lease_ms=lease_ms
                ),
                timeout=self._timeout_s,
            )
        )
        return bool(got.granted), int(got.retry_after_ms)

    async def release(self, digest: str, conversation: str, *, holder: str) -> None:
        """Releases the lease (a no-op when it already passed on)."""
        await self._call(
            self._stub.ReleaseTurn(
                pb.ReleaseTurnRequest(key_digest=digest, conversation=conversation, holder=holder),
                timeout=self._timeout_s,
            )
        )

    async def claim_run(
        self, digest: str, conversation: str, *, idempotency_key: str, run_id: str, ttl_ms: int
    ) -> tuple[bool, str]:
        """(claimed, the first run's id) for a run's idempotency key, across replicas."""
        got = await self._call(
            self._stub.ClaimRun(
                pb.ClaimRunRequest(
                    key_digest=digest,
                    conversation=conversation,
                    idempotency_key=idempotency_key,
                    run_id=run_id,
                    ttl_ms=ttl_ms,
                ),
                timeout=self._timeout_s,
            )
        )
        return bool(got.claimed), str(got.run_id)

    async def put_response(
        self,
        digest: str,
        *,
        response_id: str,
        previous_response_id: str,
        items: list[bytes],
        response_json: bytes,
    ) -> None:
        """Stores a response after its parent."""
        await self._call(
            self._stub.PutResponse(
                pb.PutResponseRequest(
                    key_digest=digest,
                    response_id=response_id,
                    previous_response_id=previous_response_id,
                    items_json=items,
                    response_json=response_json,
                ),
                timeout=self._timeout_s,
            )
        )

    async def get_response(
        self, digest: str, response_id: str, *, include_chain: bool
    ) -> tuple[bytes, list[bytes]]:
        """(response json, chain items) of a stored response; NotFound when unknown."""
        got = await self._call(
            self._stub.GetResponse(
                pb.GetResponseRequest(
                    key_digest=digest, response_id=response_id, include_chain=include_chain
                ),
                timeout=self._timeout_s,
            )
        )
        return bytes(got.response_json), list(got.chain_items_json)


CONVERSATIONS = web.AppKey("conversations", ConversationsClient)


async def conversations_ctx(app: web.Application) -> AsyncIterator[None]:
    """cleanup_ctx: a channel to the dataproxy's Conversations service, closed on shutdown."""
    settings = app[SETTINGS]
    channel = open_channel(settings.dataproxy_addr)
    try:
        stub: Any = conversations_pb2_grpc.ConversationsStub(channel)
        app[CONVERSATIONS] = ConversationsClient(
            cast("ConversationsAsyncStub", stub), timeout_s=settings.rpc_timeout_s
        )
        yield
    finally:
        await channel.close()
