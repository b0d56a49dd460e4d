"""The AReaL-compatible session API (/rl/start_session, set_reward, end_session) and /rl/keys."""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from aiohttp import web

from protos import dataproxy_pb2
from services.gateway.auth import require_session_key
from services.gateway.backends import BACKENDS, SETTINGS
from services.gateway.header_mode import session_id_header
from services.gateway.http_errors import json_response
from services.gateway.json_body import load_json
from services.gateway.key_admin import issue_access_key, require_admin, revoke_key
from services.gateway.protocols import Protocol, Route, Twins
from services.runtime import tracing
from services.runtime.errors import InvalidRequest, check_identifier, from_rpc_error
from services.runtime.keys import key_digest, looks_like_session_key
from services.runtime.secret import Keys

# As the dataproxy allows (services/dataproxy/sessions.py MAX_GROUP_SIZE).
MAX_GROUP_SIZE = 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class StartSessionCall:
    """A validated /rl/start_session body."""

    task_id: str
    api_key: str
    group_size: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class SetRewardCall:
    """A validated /rl/set_reward body."""

    reward: float
    interaction_id: str
    session_id: str = ""


def _json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; an empty body counts as `{}`."""
    if not raw.strip():
        return {}
    body: Any = load_json(raw)
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    return body


def _optional_str(body: dict[str, Any], name: str) -> str:
    value = body.get(name)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise InvalidRequest(f"`{name}` must be a string")
    # Every string these bodies carry is an identifier (ids, names, keys).
    return check_identifier(value, f"`{name}`")


def _group_size(body: dict[str, Any]) -> int:
    value = body.get("group_size")
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_GROUP_SIZE:
        raise InvalidRequest(
            f"`group_size` must be an integer from 1 to {MAX_GROUP_SIZE}", code="invalid_group_size"
        )
    return value


def parse_start_session(raw: bytes, admin_key: Keys) -> StartSessionCall:
    """`{task_id?, api_key?, group_size?}`; refuses the admin key as a session key."""
    body = _json_object(raw)
    task_id = _optional_str(body, "task_id")
    group_size = _group_size(body)
    api_key = _optional_str(body, "api_key").strip()
    if api_key and admin_key.matches(api_key):
        raise InvalidRequest(
            "api_key is the admin key; pass a `sk-sess-…` key from an earlier "
            "/rl/start_session to refresh it, or omit api_key for a new one",
            code="admin_key_as_session_key",
        )
    if api_key and not looks_like_session_key(api_key):
        raise InvalidRequest(
            "api_key must be a `sk-sess-…` key returned by an earlier /rl/start_session",
            code="not_a_session_key",
        )
    if api_key and group_size > 1:
        raise InvalidRequest(
            "group_size > 1 starts new keys: omit api_key (a refresh is per key)",
            code="group_with_api_key",
        )
    return StartSessionCall(task_id=task_id, api_key=api_key, group_size=group_size)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        _non_finite(text)
    return value


def _non_finite(_: str) -> float:
    raise InvalidRequest("reward must be a finite number", code="invalid_reward")


def parse_set_reward(raw: bytes) -> SetRewardCall:
    """`{reward, interaction_id?, session_id?}` with a finite numeric reward."""
    try:
        body = _json_object(raw)
    except InvalidRequest as err:
        # orjson refuses NaN, Infinity and 1e999 outright; name the real problem if that is it.
        if err.code == "invalid_json":
            with contextlib.suppress(ValueError, RecursionError):
                json.loads(raw, parse_constant=_non_finite, parse_float=_finite_float)
        raise
    reward = body.get("reward")
    if not isinstance(reward, int | float) or isinstance(reward, bool) or not math.isfinite(reward):
        raise InvalidRequest("reward must be a finite number", code="invalid_reward")
    return SetRewardCall(
        reward=float(reward),
        interaction_id=_optional_str(body, "interaction_id"),
        session_id=_optional_str(body, "session_id"),
    )


Req = TypeVar("Req")
Resp = TypeVar("Resp")


async def _once_more_if_cut(
    call: Callable[..., Awaitable[Resp]], rpc_request: Req, timeout_s: float
) -> Resp:
    """A session call to the dataproxy, sent once more (within the same `timeout_s`) when it
    failed CANCELLED: grpcio fails a call that reaches a replica as it stops that way,
    unserved (grpc/grpc#41785), and the channel sends the second to a replica serving.
    Ending is idempotent (a second call gets the first's publication). A start that was
    cut unserved started nothing. Were one cut after it was served (a handler cancelled at
    the end of its server's grace, not what grpc/grpc#41785 does), the second start leaves
    the first's episode empty and unused — the idle reaper ends it unpublished — and a
    second refresh ends the first's fresh, empty episode unpublished."""
    due = time.monotonic() + timeout_s

    def send() -> Awaitable[Resp]:
        left = max(due - time.monotonic(), 0.001)
        return call(rpc_request, timeout=left, metadata=tracing.grpc_metadata())

    try:
        return await send()
    except grpc.aio.AioRpcError as err:
        if err.code() != grpc.StatusCode.CANCELLED:
            raise from_rpc_error(err, hop="dataproxy") from None
    try:
        return await send()
    except grpc.aio.AioRpcError as err:
        raise from_rpc_error(err, hop="dataproxy") from None


async def start_session(request: web.Request) -> web.Response:
    """POST /rl/start_session (admin key): a new session, or a refresh of `api_key`."""
    settings = request.app[SETTINGS]
    await require_admin(request)
    call = parse_start_session(await request.read(), settings.admin_key)
    rpc_request = dataproxy_pb2.StartSessionRequest(
        task_id=call.task_id, api_key=call.api_key, group_size=call.group_size
    )
    response = await _once_more_if_cut(
        request.app[BACKENDS].dataproxy.StartSession, rpc_request, settings.start_session_timeout_s
    )
    body: dict[str, Any] = {"session_id": response.session_id, "api_key": response.api_key}
    if response.group_id:
        body["group_id"] = response.group_id
        body["members"] = [
            {"session_id": m.session_id, "api_key": m.api_key} for m in response.members
        ]
    return json_response(body)


async def set_reward(request: web.Request) -> web.Response:
    """POST /rl/set_reward (session key): reward the last (or named) interaction."""
    settings = request.app[SETTINGS]
    key = require_session_key(request.headers, settings.admin_key)
    call = parse_set_reward(await request.read())
    rpc_request = dataproxy_pb2.SetRewardRequest(
        key_digest=key_digest(key),
        reward=call.reward,
        interaction_id=call.interaction_id,
        session_id=call.session_id or session_id_header(request.headers),
    )
    try:
        response = await request.app[BACKENDS].dataproxy.SetReward(
            rpc_request, timeout=settings.rpc_timeout_s, metadata=tracing.grpc_metadata()
        )
    except grpc.aio.AioRpcError as err:
        raise from_rpc_error(err, hop="dataproxy") from None
    return json_response({"message": "success", "interaction_id": response.interaction_id})


async def end_session(request: web.Request) -> web.Response:
    """POST /rl/end_session (session key): end the episode and publish its trajectory."""
    settings = request.app[SETTINGS]
    key = require_session_key(request.headers, settings.admin_key)
    body = _json_object(await request.read())
    session_id = _optional_str(body, "session_id") or session_id_header(request.headers)
    rpc_request = dataproxy_pb2.EndSessionRequest(
        key_digest=key_digest(key), session_id=session_id.strip()
    )
    response = await _once_more_if_cut(
        request.app[BACKENDS].dataproxy.EndSession, rpc_request, settings.end_session_timeout_s
    )
    return json_response(
        {
            "message": "success",
            "session_id": response.session_id,
            "trajectory_id": response.trajectory_id,
            "interaction_count": response.interaction_count,
        }
    )


async def issue_key(request: web.Request) -> web.Response:
    """POST /rl/keys (admin key): a long-lived header-mode key (X-Session-Id names episodes),
    or with `kind` an admin or trainer key (services/gateway/key_admin.py)."""
    settings = request.app[SETTINGS]
    await require_admin(request)
    body = _json_object(await request.read())
    if body.get("kind") not in (None, "session"):
        return await issue_access_key(request, body)
    mode = _optional_str(body, "mode") or "header"
    if mode != "header":
        raise InvalidRequest(
            '`mode` must be "header" (per-episode keys come from /rl/start_session)',
            code="invalid_key_mode",
        )
    rpc_request = dataproxy_pb2.IssueKeyRequest(mode=mode, task_id=_optional_str(body, "task_id"))
    try:
        response = await request.app[BACKENDS].dataproxy.IssueKey(
            rpc_request, timeout=settings.rpc_timeout_s, metadata=tracing.grpc_metadata()
        )
    except grpc.aio.AioRpcError as err:
        raise from_rpc_error(err, hop="dataproxy") from None
    return json_response(
        {"api_key": response.api_key, "key_id": response.key_id, "mode": response.mode}
    )


async def revoke(request: web.Request) -> web.Response:
    """POST /rl/keys/revoke (admin key): revokes a session, admin or trainer key."""
    await require_admin(request)
    return await revoke_key(request, _json_object(await request.read()))


PROTOCOL = Protocol(
    name="rl",
    routes=(
        Route(method="POST", path="/rl/start_session", handler=start_session, twins=Twins.NONE),
        # A body's `session_id` would otherwise win over the path's (it names the episode).
        Route(method="POST", path="/rl/set_reward", handler=set_reward, body_session_id=True),
        Route(method="POST", path="/rl/end_session", handler=end_session, body_session_id=True),
        Route(method="POST", path="/rl/keys", handler=issue_key, twins=Twins.NONE),
        Route(method="POST", path="/rl/keys/revoke", handler=revoke, twins=Twins.NONE),
    ),
)
