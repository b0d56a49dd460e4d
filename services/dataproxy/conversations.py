"""Server-kept conversation state in Redis: WebSocket histories, turn leases, Responses chains.

Everything is keyed by the session key's id, not the episode, so it survives a refresh. Each
operation is one Lua script (one round trip) that also checks that the key exists.

Responses chains: a response stores its own input + output items once, appended to its chain's
materialized item list (`rchain`), and remembers the chain and the chain's length at its end.
Continuing from the chain's tip appends (O(new items)); continuing from an older response (a
fork) copies that response's prefix into a new chain once. So turn n of a linear chain costs
two round trips (read the chain, store the turn) and storage grows linearly with the chain.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis

from services.dataproxy.redis_keys import RedisKeys
from services.dataproxy.revocation import SessionKeyRevoker
from services.dataproxy.scripts import (
    AcquireLeaseCall,
    AppendMessagesCall,
    ClaimRunCall,
    ConversationReply,
    GetMessagesCall,
    GetResponseCall,
    PutResponseCall,
    ReleaseLeaseCall,
    ResetConversationCall,
)
from services.dataproxy.scripts import ConversationStatus as Status
from services.runtime.errors import Conflict, InvalidRequest, NotFound
from services.runtime.keys import key_id_of
from services.runtime.logs import get_logger
from services.runtime.redis_scripts import Script, as_bool, text_of

log = get_logger(__name__)

# Idle conversations and stored responses are dropped after this long (OpenAI keeps 30 days).
STATE_TTL_S = 30 * 24 * 3600
MAX_LEASE_MS = 15 * 60 * 1000
MAX_RUN_CLAIM_MS = 7 * 24 * 3600 * 1000
MAX_NAME_LEN = 512


@dataclass(frozen=True, slots=True, kw_only=True)
class Messages:
    """The tail of a conversation and how many messages it holds in all."""

    messages: list[bytes]
    total: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Lease:
    """The outcome of a lease request."""

    granted: bool
    retry_after_ms: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RunClaim:
    """The outcome of a run claim: whether this run is the first, and the first run's id."""

    claimed: bool
    run_id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredResponse:
    """A stored response and, when asked, the items of its chain."""

    response_json: bytes
    chain_items: list[bytes]


def _check_name(name: str, what: str) -> None:
    if not name or len(name) > MAX_NAME_LEN:
        raise InvalidRequest(f"{what} must be 1 to {MAX_NAME_LEN} characters")


class ConversationStore:
    """Conversations, turn leases and stored responses of session keys, in Redis."""

    def __init__(self, *, redis: aioredis.Redis, keys: RedisKeys) -> None:
        self._redis = redis
        self._keys = keys
        parse = ConversationReply.parse
        self._get_messages = Script.load(GetMessagesCall, parse)
        self._append = Script.load(AppendMessagesCall, parse)
        self._reset = Script.load(ResetConversationCall, parse)
        self._acquire = Script.load(AcquireLeaseCall, parse)
        self._release = Script.load(ReleaseLeaseCall, as_bool)
        self._put_response = Script.load(PutResponseCall, parse)
        self._get_response = Script.load(GetResponseCall, parse)
        self._claim_run = Script.load(ClaimRunCall, parse)
        self._revoker = SessionKeyRevoker(redis=redis, keys=keys)

    async def _raise_for(self, reply: ConversationReply, digest: str) -> None:
        if reply.status is Status.UNKNOWN_KEY:
            raise await self._revoker.refusal(digest)

    def _conv_keys(self, digest: str, name: str) -> tuple[str, str, str]:
        _check_name(name, "the conversation name")
        key_id = key_id_of(digest)
        return (
            self._keys.key(digest),
            self._keys.conversation(key_id, name),
            self._keys.conversation_lease(key_id, name),
        )

    async def messages(self, digest: str, name: str, *, limit: int) -> Messages:
        """The last `limit` messages (all when limit <= 0), oldest first."""
        key, conv, _ = self._conv_keys(digest, name)
        reply = await self._get_messages.run(
            self._redis, GetMessagesCall(key=key, conversation=conv, limit=limit)
        )
        await self._raise_for(reply, digest)
        return Messages(messages=reply.items, total=int(reply.value))

    async def append(self, digest: str, name: str, *, messages: list[bytes], holder: str) -> int:
        """Appends messages (checking the lease when `holder` is set); the new total."""
        key, conv, lease = self._conv_keys(digest, name)
        reply = await self._append.run(
            self._redis,
            AppendMessagesCall(
                key=key,
                conversation=conv,
                lease=lease,
                holder=holder,
                ttl_s=STATE_TTL_S,
                messages=messages,
            ),
        )
        if reply.status is Status.NOT_HOLDER:
            raise Conflict(
                "this run no longer holds the conversation's turn lease", code="lease_lost"
            )
        await self._raise_for(reply, digest)
        return int(reply.value)

    async def reset(self, digest: str, name: str) -> int:
        """Drops the conversation's history; how many messages it held."""
        key, conv, _ = self._conv_keys(digest, name)
        reply = await self._reset.run(
            self._redis, ResetConversationCall(key=key, conversation=conv)
        )
        await self._raise_for(reply, digest)
        log.info("conversation_reset", key_id=key_id_of(digest), dropped=int(reply.value))
        return int(reply.value)

    async def acquire(self, digest: str, name: str, *, holder: str, lease_ms: int) -> Lease:
        """Takes or extends the turn lease for `holder`."""
        _check_name(holder, "the lease holder")
        if not 0 < lease_ms <= MAX_LEASE_MS:
            raise InvalidRequest(f"lease_ms must be in 1..{MAX_LEASE_MS}")
        key, _, lease = self._conv_keys(digest, name)
        reply = await self._acquire.run(
            self._redis, AcquireLeaseCall(key=key, lease=lease, holder=holder, lease_ms=lease_ms)
        )
        await self._raise_for(reply, digest)
        if reply.status is Status.GRANTED:
            return Lease(granted=True, retry_after_ms=0)
        return Lease(granted=False, retry_after_ms=max(1, int(reply.value)))

    async def release(self, digest: str, name: str, *, holder: str) -> bool:
        """Releases the lease if `holder` still holds it."""
        _, _, lease = self._conv_keys(digest, name)
        return await self._release.run(self._redis, ReleaseLeaseCall(lease=lease, holder=holder))

    async def claim_run(
        self, digest: str, name: str, *, idempotency_key: str, run_id: str, ttl_ms: int
    ) -> RunClaim:
        """Claims `idempotency_key` in the conversation for `run_id` unless a run has it."""
        _check_name(idempotency_key, "the idempotency key")
        _check_name(run_id, "the run id")
        if not 0 < ttl_ms <= MAX_RUN_CLAIM_MS:
            raise InvalidRequest(f"ttl_ms must be in 1..{MAX_RUN_CLAIM_MS}")
        key, _, _ = self._conv_keys(digest, name)
        claim = self._keys.conversation_run(key_id_of(digest), name, idempotency_key)
        reply = await self._claim_run.run(
            self._redis, ClaimRunCall(key=key, claim=claim, run_id=run_id, ttl_ms=ttl_ms)
        )
        await self._raise_for(reply, digest)
        return RunClaim(claimed=reply.status is Status.CLAIMED, run_id=text_of(reply.value))

    async def put_response(
        self,
        digest: str,
        *,
        response_id: str,
        previous_response_id: str,
        items: list[bytes],
        response_json: bytes,
    ) -> int:
        """Stores a response after its parent; the length of its chain."""
        _check_name(response_id, "the response id")
        key_id = key_id_of(digest)
        reply = await self._put_response.run(
            self._redis,
            PutResponseCall(
                key=self._keys.key(digest),
                response=self._keys.response(key_id, response_id),
                parent=self._keys.response(key_id, previous_response_id or response_id),
                chain=self._keys.response_chain(key_id, response_id),
                parent_id=previous_response_id,
                ttl_s=STATE_TTL_S,
                response_json=response_json,
                items=items,
            ),
        )
        if reply.status is Status.PARENT_NOT_FOUND:
            raise _response_not_found(previous_response_id)
        await self._raise_for(reply, digest)
        return int(reply.value)

    async def get_response(
        self, digest: str, response_id: str, *, include_chain: bool
    ) -> StoredResponse:
        """A stored response (NotFound `previous_response_not_found` when unknown)."""
        _check_name(response_id, "the response id")
        reply = await self._get_response.run(
            self._redis,
            GetResponseCall(
                key=self._keys.key(digest),
                response=self._keys.response(key_id_of(digest), response_id),
                include_chain=include_chain,
            ),
        )
        if reply.status is Status.NOT_FOUND:
            raise _response_not_found(response_id)
        await self._raise_for(reply, digest)
        return StoredResponse(response_json=reply.value, chain_items=reply.items)


def _response_not_found(response_id: str) -> NotFound:
    return NotFound(
        f"no stored response {response_id!r} for this key (it was never stored, "
        "was created with store: false, or expired)",
        code="previous_response_not_found",
    )
