"""The Keys gRPC service: glue between protobuf and the access-key store and revocation."""

from __future__ import annotations

from typing import Any, TypeAlias

import grpc
import redis.asyncio as aioredis

from protos import keys_pb2 as pb
from protos import keys_pb2_grpc
from protos.keys_pb2_grpc import add_KeysServicer_to_server
from services.dataproxy.access_keys import AccessKeyInfo, AccessKeyStore
from services.dataproxy.redis_keys import RedisKeys
from services.dataproxy.revocation import KeyRevocation, SessionKeyRevoker
from services.dataproxy.trainer_auth import TrainerAuth
from services.runtime.secret import Keys

Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"

ADMIN_NEEDED = "managing keys needs an admin key as `authorization: Bearer …` metadata"


def _info(info: AccessKeyInfo) -> pb.AccessKeyInfo:
    return pb.AccessKeyInfo(
        key_id=info.key_id, kind=info.kind, label=info.label, created_at=info.created_at
    )


class KeysServicer(keys_pb2_grpc.KeysServicer):
    """Issued admin/trainer keys and the revocation of any key, over gRPC.

    Issue, List and Revoke need an admin key in the call metadata (the gateway forwards the
    caller's): the port is also reachable by trainer pods, which must not mint admin keys.
    Errors are raised; the server's interceptor maps them (services/runtime/grpc_server.py).
    """

    def __init__(
        self, *, access: AccessKeyStore, revocation: KeyRevocation, admin_key: Keys
    ) -> None:
        self._access = access
        self._revocation = revocation
        self._auth = TrainerAuth(admin_key=admin_key, lookup=self._admin_only)

    async def _admin_only(self, digest: str) -> str:
        kind = await self._access.lookup(digest)
        return "" if kind == "trainer" else kind

    async def _authorize(self, context: Context) -> None:
        await self._auth.check(context.invocation_metadata(), what=ADMIN_NEEDED)

    async def IssueAccessKey(
        self, request: pb.IssueAccessKeyRequest, context: Context
    ) -> pb.IssueAccessKeyResponse:
        await self._authorize(context)
        api_key, info = await self._access.issue(kind=request.kind, label=request.label)
        return pb.IssueAccessKeyResponse(api_key=api_key, info=_info(info))

    async def ListAccessKeys(
        self, request: pb.ListAccessKeysRequest, context: Context
    ) -> pb.ListAccessKeysResponse:
        await self._authorize(context)
        return pb.ListAccessKeysResponse(keys=[_info(i) for i in await self._access.list()])

    async def LookupAccessKey(
        self, request: pb.LookupAccessKeyRequest, context: Context
    ) -> pb.LookupAccessKeyResponse:
        return pb.LookupAccessKeyResponse(kind=await self._access.lookup(request.key_digest))

    async def RevokeKey(
        self, request: pb.RevokeKeyRequest, context: Context
    ) -> pb.RevokeKeyResponse:
        await self._authorize(context)
        revoked = await self._revocation.revoke(digest=request.key_digest, key_id=request.key_id)
        return pb.RevokeKeyResponse(
            key_id=revoked.key_id,
            kind=revoked.kind,
            episodes_discarded=revoked.episodes_discarded,
            already_revoked=revoked.already_revoked,
        )


def build_keys(*, redis: aioredis.Redis, prefix: str, admin_key: Keys) -> KeysServicer:
    """The Keys servicer over one Redis client and key prefix."""
    keys = RedisKeys(prefix)
    access = AccessKeyStore(redis=redis, keys=keys)
    sessions = SessionKeyRevoker(redis=redis, keys=keys)
    return KeysServicer(
        access=access,
        revocation=KeyRevocation(sessions=sessions, access=access),
        admin_key=admin_key,
    )


__all__ = ["KeysServicer", "add_KeysServicer_to_server", "build_keys"]
