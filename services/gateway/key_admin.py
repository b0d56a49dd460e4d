"""Key lifecycle routes (admin key): issue admin and trainer keys, list them, revoke any key.

`POST /rl/keys {"kind": "admin" | "trainer", "label"?}`, `GET /rl/keys`,
`POST /rl/keys/revoke {"api_key"} | {"key_id"}` — glue over the dataproxy's Keys service,
which holds issued keys only as SHA-256 digests (docs/deploy.md, *Rotating keys*).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar, cast

import grpc
from aiohttp import web

from protos import keys_pb2 as pb
from protos import keys_pb2_grpc
from services.gateway.auth import read_key, require_admin_key
from services.gateway.backends import SETTINGS
from services.gateway.http_errors import json_response
from services.runtime.errors import Conflict, InvalidRequest, from_rpc_error
from services.runtime.grpc_client import open_channel
from services.runtime.keys import access_key_kind, key_digest, looks_like_session_key

if TYPE_CHECKING:
    from protos.keys_pb2_grpc import KeysAsyncStub

R = TypeVar("R")

ENV_ADMIN_KEY_MESSAGE = (
    "this is the admin key from ROLLGATE_ADMIN_KEY (configuration, not issued here): it cannot "
    "be revoked through the API; rotate it in the configuration (ROLLGATE_ADMIN_KEY=new,old, "
    "then new: docs/deploy.md, Rotating keys)"
)


class KeysClient:
    """Typed calls on `rollgate.v1.Keys`; gRPC errors become RollgateErrors."""

    def __init__(self, stub: KeysAsyncStub, *, timeout_s: float) -> None:
        self._stub = stub
        self._timeout_s = timeout_s

    async def _call(self, call: Awaitable[R]) -> R:
        try:
            return await call
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err, hop="dataproxy") from None

    async def lookup(self, digest: str) -> str:
        """ "admin", "trainer", "revoked" or "" for the issued key with this digest."""
        got = await self._call(
            self._stub.LookupAccessKey(
                pb.LookupAccessKeyRequest(key_digest=digest), timeout=self._timeout_s
            )
        )
        return str(got.kind)

    async def issue(self, admin: str, *, kind: str, label: str) -> pb.IssueAccessKeyResponse:
        """A new admin or trainer key (`admin`: the caller's admin key, checked again there)."""
        return await self._call(
            self._stub.IssueAccessKey(
                pb.IssueAccessKeyRequest(kind=kind, label=label),
                timeout=self._timeout_s,
                metadata=_bearer(admin),
            )
        )

    async def list(self, admin: str) -> pb.ListAccessKeysResponse:
        """The issued admin and trainer keys still valid."""
        return await self._call(
            self._stub.ListAccessKeys(
                pb.ListAccessKeysRequest(), timeout=self._timeout_s, metadata=_bearer(admin)
            )
        )

    async def revoke(
        self, admin: str, *, digest: str = "", key_id: str = ""
    ) -> pb.RevokeKeyResponse:
        """Revokes the key named by its digest or its key id."""
        return await self._call(
            self._stub.RevokeKey(
                pb.RevokeKeyRequest(key_digest=digest, key_id=key_id),
                timeout=self._timeout_s,
                metadata=_bearer(admin),
            )
        )


def _bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


KEYS = web.AppKey("keys", KeysClient)


async def keys_ctx(app: web.Application) -> AsyncIterator[None]:
    """cleanup_ctx: a channel to the dataproxy's Keys service, closed on shutdown."""
    settings = app[SETTINGS]
    channel = open_channel(settings.dataproxy_addr)
    try:
        stub: Any = keys_pb2_grpc.KeysStub(channel)
        app[KEYS] = KeysClient(cast("KeysAsyncStub", stub), timeout_s=settings.rpc_timeout_s)
        yield
    finally:
        await channel.close()


async def require_admin(request: web.Request) -> None:
    """Passes for the configured admin key and for admin keys issued by POST /rl/keys."""
    await require_admin_key(
        request.headers, request.app[SETTINGS].admin_key, request.app[KEYS].lookup
    )


def _caller(request: web.Request) -> str:
    """The admin key the request was authorized with (require_admin ran first)."""
    return read_key(request.headers) or ""


def _info(info: pb.AccessKeyInfo) -> dict[str, Any]:
    return {
        "key_id": info.key_id,
        "kind": info.kind,
        "label": info.label,
        "created_at": info.created_at,
    }


async def issue_access_key(request: web.Request, body: Mapping[str, Any]) -> web.Response:
    """POST /rl/keys with `kind` admin or trainer (the caller has checked the admin key)."""
    kind, label = body.get("kind"), body.get("label", "")
    if not isinstance(label, str):
        raise InvalidRequest("`label` must be a string", code="invalid_label")
    if kind not in ("admin", "trainer"):
        raise InvalidRequest(
            '`kind` must be "admin" or "trainer" (omit it for a header-mode session key)',
            code="invalid_key_kind",
        )
    issued = await request.app[KEYS].issue(_caller(request), kind=str(kind), label=label)
    return json_response({"api_key": issued.api_key, **_info(issued.info)})


async def list_keys(request: web.Request) -> web.Response:
    """GET /rl/keys (admin key): the issued admin and trainer keys (never the keys)."""
    await require_admin(request)
    listed = await request.app[KEYS].list(_caller(request))
    return json_response({"keys": [_info(info) for info in listed.keys]})


async def revoke_key(request: web.Request, body: Mapping[str, Any]) -> web.Response:
    """POST /rl/keys/revoke `{api_key}` or `{key_id}` (the caller has checked the admin key)."""
    api_key, key_id = body.get("api_key"), body.get("key_id")
    if (api_key is None) == (key_id is None):
        raise InvalidRequest(
            "send exactly one of `api_key` (the key itself) and `key_id` (its id, as in "
            "trajectories and GET /rl/keys)",
            code="invalid_revoke_request",
        )
    if api_key is not None:
        if not isinstance(api_key, str) or not api_key.strip():
            raise InvalidRequest("`api_key` must be a non-empty string", code="invalid_api_key")
        api_key = api_key.strip()
        if request.app[SETTINGS].admin_key.matches(api_key):
            raise Conflict(ENV_ADMIN_KEY_MESSAGE, code="configured_key")
        if not looks_like_session_key(api_key) and not access_key_kind(api_key):
            raise InvalidRequest(
                "`api_key` is not a rollgate key (`sk-sess-…`, `sk-admin-…` or "
                "`sk-trainer-…`); configured keys (ROLLGATE_TRAINER_KEY) change with the "
                "configuration",
                code="not_a_rollgate_key",
            )
        revoked = await request.app[KEYS].revoke(_caller(request), digest=key_digest(api_key))
    else:
        if not isinstance(key_id, str):
            raise InvalidRequest("`key_id` must be a string", code="invalid_key_id")
        revoked = await request.app[KEYS].revoke(_caller(request), key_id=key_id.strip().lower())
    return json_response(
        {
            "revoked": True,
            "key_id": revoked.key_id,
            "kind": revoked.kind,
            "episodes_discarded": revoked.episodes_discarded,
            "already_revoked": revoked.already_revoked,
        }
    )


def mount(app: web.Application) -> None:
    """Adds the key routes other than `POST /rl/keys` (session_api owns it) and the channel."""
    if keys_ctx not in app.cleanup_ctx:
        app.cleanup_ctx.append(keys_ctx)
    app.router.add_get("/rl/keys", list_keys, allow_head=False)
