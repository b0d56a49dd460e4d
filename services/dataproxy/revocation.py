"""Revoking keys: a session key's open episodes are discarded (never published) and every
later call with it is refused as revoked; issued admin and trainer keys stop working at once.

Why discard rather than publish: a key is revoked because it leaked, and from then on nobody
can tell the owner's turns from someone else's. A trainer reading the stream must never train
on them, and nothing in a trajectory would let it tell (docs/lifecycle.md, *Revoked keys*).
Episodes published before the revocation stay on the stream; their `key_id` names the key.
"""

from __future__ import annotations

import time

import redis.asyncio as aioredis

from services.dataproxy.access_keys import AccessKeyStore, RevokedKey
from services.dataproxy.redis_keys import ENDED_EPISODE_TTL_S, EpisodeFields, RedisKeys
from services.dataproxy.scripts import (
    KeyRevoked,
    RevokeCandidate,
    RevokeKey,
    RevokeKeyCall,
)
from services.runtime.errors import Conflict, InvalidRequest, NotFound, Unauthenticated
from services.runtime.keys import key_id_of, looks_like_key_id
from services.runtime.logs import get_logger
from services.runtime.redis_scripts import Script, text_of

log = get_logger(__name__)

UNKNOWN_KEY = "unknown session key: use the sk-sess-… key returned by /rl/start_session"
KEY_REVOKED = (
    "this session key was revoked by the admin and cannot be used again: ask for a new one "
    "(/rl/start_session without api_key, or POST /rl/keys for a header-mode key)"
)
# The script re-runs with the episodes it asked for; the key can only gain so many meanwhile.
MAX_REVOKE_ATTEMPTS = 5
SCAN_COUNT = 1000


class SessionKeyRevoker:
    """Revokes session keys and tells a revoked key from an unknown one."""

    def __init__(self, *, redis: aioredis.Redis, keys: RedisKeys) -> None:
        self._redis = redis
        self._keys = keys
        self._script = Script.load(RevokeKeyCall, KeyRevoked.parse)

    async def refusal(self, digest: str) -> Unauthenticated:
        """The error for a digest with no key hash: revoked, or never issued here."""
        if await self._redis.exists(self._keys.revoked(digest)):
            return Unauthenticated(KEY_REVOKED, code="key_revoked")
        return Unauthenticated(UNKNOWN_KEY)

    async def revoke(self, digest: str) -> RevokedKey | None:
        """Revokes the session key and discards its open episodes; None when unknown."""
        names = await self._open_episodes(digest)
        first = await self._run(digest, names)
        if first is None:
            return None
        # A header-mode episode bound while the script ran: binds now fail, sweep once more.
        late = await self._open_episodes(digest) - names
        extra = await self._run(digest, late) if late else None
        discarded = first.episodes_discarded + (extra.episodes_discarded if extra else 0)
        revoked = RevokedKey(
            key_id=first.key_id,
            kind=first.kind,
            episodes_discarded=discarded,
            already_revoked=first.already_revoked,
        )
        log.info(
            "session_key_revoked",
            key_id=revoked.key_id,
            kind=revoked.kind,
            episodes_discarded=discarded,
            already=revoked.already_revoked,
        )
        return revoked

    async def digest_of(self, key_id: str) -> str | None:
        """The digest of the session key (valid or revoked) with this key id, if any."""
        for pattern in (self._keys.key_pattern(key_id), self._keys.revoked_pattern(key_id)):
            async for name in self._redis.scan_iter(match=pattern, count=SCAN_COUNT):
                return text_of(name).rsplit(":", 1)[1]
        return None

    async def _open_episodes(self, digest: str) -> set[str]:
        """Episodes of the key that may be open: in the idle or the awaiting-reward zset."""
        names: set[str] = set()
        for zset in (self._keys.idle, self._keys.awaiting_reward):
            async for member, _ in self._redis.zscan_iter(
                zset, match=f"{digest}/*", count=SCAN_COUNT
            ):
                names.add(text_of(member).split("/", 1)[1])
        return names

    async def _run(self, digest: str, names: set[str]) -> RevokedKey | None:
        key_id = key_id_of(digest)
        candidates = set(names)
        for _ in range(MAX_REVOKE_ATTEMPTS):
            call = await self._call(digest, key_id, sorted(candidates))
            result = await self._script.run(self._redis, call)
            if result.status is RevokeKey.RETRY:
                candidates.add(result.missing)
                continue
            if result.status is RevokeKey.UNKNOWN:
                return None
            return RevokedKey(
                key_id=result.key_id,
                kind=result.kind,
                episodes_discarded=result.discarded,
                already_revoked=result.status is RevokeKey.ALREADY,
            )
        raise Conflict("the key kept starting episodes while it was being revoked; retry")

    async def _call(self, digest: str, key_id: str, names: list[str]) -> RevokeKeyCall:
        pipe = self._redis.pipeline(transaction=False)
        for name in names:
            pipe.hmget(
                self._keys.episode(key_id, name), EpisodeFields.SESSION_ID, EpisodeFields.GROUP_ID
            )
        found = await pipe.execute() if names else []
        candidates = []
        for name, (session_id, group_id) in zip(names, found, strict=True):
            group = text_of(group_id)
            candidates.append(
                RevokeCandidate(
                    episode_hash=self._keys.episode(key_id, name),
                    turns=self._keys.turns(key_id, name),
                    rewards=self._keys.rewards(key_id, name),
                    interaction_index=self._keys.interaction_index(key_id, name),
                    group=self._keys.group(group) if group else self._keys.stats,
                    session=self._keys.session(key_id, text_of(session_id))
                    if session_id
                    else self._keys.stats,
                    episode=name,
                    group_id=group,
                )
            )
        return RevokeKeyCall(
            key=self._keys.key(digest),
            tombstone=self._keys.revoked(digest),
            stats=self._keys.stats,
            idle=self._keys.idle,
            awaiting_reward=self._keys.awaiting_reward,
            episode_turns=self._keys.episode_turns,
            digest=digest,
            now=time.time(),
            ttl_s=ENDED_EPISODE_TTL_S,
            default_kind="session",
            candidates=candidates,
        )


class KeyRevocation:
    """Revokes any issued key by its digest or key id: admin, trainer or session."""

    def __init__(self, *, sessions: SessionKeyRevoker, access: AccessKeyStore) -> None:
        self._sessions = sessions
        self._access = access

    async def revoke(self, *, digest: str = "", key_id: str = "") -> RevokedKey:
        """Revokes the key; NotFound when no key of this deployment has that digest or id."""
        if bool(digest) == bool(key_id):
            raise InvalidRequest("name the key by exactly one of key_digest and key_id")
        if key_id:
            if not looks_like_key_id(key_id):
                raise InvalidRequest(
                    "key_id must be 24 lowercase hex digits (as in trajectories and GET /rl/keys)",
                    code="invalid_key_id",
                )
            digest = (
                await self._access.digest_of(key_id) or await self._sessions.digest_of(key_id) or ""
            )
        revoked = None
        if digest:
            revoked = await self._access.revoke(digest) or await self._sessions.revoke(digest)
        if revoked is None:
            raise NotFound("no key of this deployment matches", code="key_not_found")
        return revoked
