"""Admin and trainer keys issued at run time: several valid at once, so a key is rotated by
adding the new one, moving its clients, and revoking the old — on every replica at once,
without a restart. Held in Redis only as SHA-256 digests (`P access_keys`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import orjson
import redis.asyncio as aioredis

from services.dataproxy.redis_keys import RedisKeys
from services.dataproxy.scripts import KeyRevoked, RevokeAccessKeyCall, RevokeKey
from services.runtime.errors import InvalidRequest
from services.runtime.keys import ACCESS_KEY_PREFIXES, key_digest, key_id_of, new_access_key
from services.runtime.logs import get_logger
from services.runtime.redis_scripts import Script, text_of

log = get_logger(__name__)

MAX_LABEL_LEN = 200
REVOKED = "revoked"


@dataclass(frozen=True, slots=True, kw_only=True)
class AccessKeyInfo:
    """What is stored about an issued key: never the key."""

    key_id: str
    kind: str
    label: str
    created_at: float


@dataclass(frozen=True, slots=True, kw_only=True)
class RevokedKey:
    """The outcome of a revocation (any kind of key)."""

    key_id: str
    kind: str
    episodes_discarded: int = 0
    already_revoked: bool = False


class AccessKeyStore:
    """Issues, lists, looks up and revokes admin and trainer keys."""

    def __init__(self, *, redis: aioredis.Redis, keys: RedisKeys) -> None:
        self._redis = redis
        self._keys = keys
        self._revoke = Script.load(RevokeAccessKeyCall, KeyRevoked.parse)

    async def issue(self, *, kind: str, label: str = "") -> tuple[str, AccessKeyInfo]:
        """A new key of `kind` ("admin" or "trainer") and what is stored about it."""
        if kind not in ACCESS_KEY_PREFIXES:
            raise InvalidRequest(
                '`kind` must be "admin" or "trainer" (session keys come from '
                '/rl/start_session, header-mode keys from `{"mode": "header"}`)',
                code="invalid_key_kind",
            )
        label = label.strip()
        if len(label) > MAX_LABEL_LEN or not label.isprintable():
            raise InvalidRequest(
                f"`label` must be printable and at most {MAX_LABEL_LEN} characters",
                code="invalid_label",
            )
        api_key = new_access_key(kind)
        digest = key_digest(api_key)
        info = AccessKeyInfo(
            key_id=key_id_of(digest), kind=kind, label=label, created_at=time.time()
        )
        await self._redis.hset(self._keys.access_keys, digest, _encode(info))
        log.info("access_key_issued", key_id=info.key_id, kind=kind)
        return api_key, info

    async def list(self) -> list[AccessKeyInfo]:
        """Every issued key still valid, oldest first."""
        stored: dict[Any, Any] = await self._redis.hgetall(self._keys.access_keys)
        return sorted((_decode(raw) for raw in stored.values()), key=lambda i: i.created_at)

    async def lookup(self, digest: str) -> str:
        """The key's kind, "revoked", or "" when it was never issued here."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.hget(self._keys.access_keys, digest)
        pipe.exists(self._keys.revoked(digest))
        raw, revoked = await pipe.execute()
        if raw:
            return _decode(raw).kind
        return REVOKED if revoked else ""

    async def digest_of(self, key_id: str) -> str | None:
        """The digest of the valid issued key with this key id, if any."""
        async for field, _ in self._redis.hscan_iter(self._keys.access_keys, match=f"{key_id}*"):
            return text_of(field)
        return None

    async def revoke(self, digest: str) -> RevokedKey | None:
        """Revokes the key (idempotent); None when it is not an issued admin or trainer key."""
        result = await self._revoke.run(
            self._redis,
            RevokeAccessKeyCall(
                access_keys=self._keys.access_keys,
                tombstone=self._keys.revoked(digest),
                digest=digest,
                now=time.time(),
            ),
        )
        if result.status is RevokeKey.UNKNOWN or result.kind not in ACCESS_KEY_PREFIXES:
            return None
        revoked = RevokedKey(
            key_id=result.key_id,
            kind=result.kind,
            already_revoked=result.status is RevokeKey.ALREADY,
        )
        log.info("access_key_revoked", key_id=revoked.key_id, kind=revoked.kind)
        return revoked


def _encode(info: AccessKeyInfo) -> bytes:
    return orjson.dumps(
        {
            "key_id": info.key_id,
            "kind": info.kind,
            "label": info.label,
            "created_at": info.created_at,
        }
    )


def _decode(raw: bytes) -> AccessKeyInfo:
    data: dict[str, Any] = orjson.loads(raw)
    return AccessKeyInfo(
        key_id=str(data["key_id"]),
        kind=str(data["kind"]),
        label=str(data.get("label", "")),
        created_at=float(data.get("created_at", 0.0)),
    )
