"""Sessions named in the URL path: `/sessions/<id>/v1/...` for clients that cannot add headers.

rLLM's, verl's and miles' gateways let a stock client name its session in `base_url`
(`http://<gw>/sessions/<id>/v1`). Here the path does what `X-Session-Id` does with a header-mode
key (POST /rl/keys), on every session-key route: each one a protocol declares (services/gateway/protocols.py) gets a twin under
`/sessions/{session_id}` whose handler is the same one, called with `X-Session-Id` set from the
path. Agent Lightning's `/rollout/<rollout>/attempt/<attempt>/v1/...` names the session
`<rollout>:<attempt>` the same way. A per-episode key cannot name episodes, so it is refused on
these paths; so is a path id that disagrees with an `X-Session-Id` header (or a body
`session_id` on the /rl/* routes).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any, NoReturn

import grpc
import orjson
from aiohttp import web
from multidict import CIMultiDict

from protos import dataproxy_pb2
from services.gateway.auth import KeyKind, require_any_key, require_session_key
from services.gateway.backends import BACKENDS, SETTINGS
from services.gateway.header_mode import SESSION_ID_HEADER
from services.gateway.key_admin import KEYS
from services.gateway.protocols import Handler, Route, Twins
from services.runtime.errors import InvalidRequest, bounded, from_rpc_error
from services.runtime.keys import key_digest

# The path parameter may be empty so that `/sessions//v1/...` gets the 400 that says why.
SESSION_PREFIX = "/sessions/{session_id:[^{}/]*}"
# Agent Lightning's LLM proxy form: one episode per attempt, named `<rollout_id>:<attempt_id>`.
ATTEMPT_PREFIX = "/rollout/{rollout_id:[^{}/]*}/attempt/{attempt_id:[^{}/]*}"
SESSION_ID_PATTERN = re.compile(r"[A-Za-z0-9._:-]{1,128}")
HEADER_MODE = "header"
# Key digests whose mode this gateway has seen (a key's mode never changes).
MAX_KNOWN_KEYS = 65536

INVALID_SESSION_ID_MESSAGE = (
    "the session id in the URL path (/sessions/<id>/…, or <rollout>:<attempt> for "
    "/rollout/<rollout>/attempt/<attempt>/…) must be 1 to 128 characters of A-Z a-z 0-9 . _ : -"
)
PER_EPISODE_KEY_MESSAGE = (
    "this is a per-episode session key (from /rl/start_session): its episode is the key's, so "
    "a session in the URL path (/sessions/<id>/…) cannot name one. Use a header-mode key "
    "(POST /rl/keys) with this path, or drop /sessions/<id> from the base URL"
)


class KeyModes:
    """The mode ("header" or "key") of session keys, asked of the dataproxy (once per
    header-mode key: a key's mode never changes)."""

    def __init__(self, *, max_entries: int = MAX_KNOWN_KEYS) -> None:
        self._max_entries = max_entries
        self._modes: OrderedDict[str, str] = OrderedDict()

    async def mode(self, request: web.Request, digest: str, *, fresh: bool = False) -> str:
        """The key's mode; Unauthenticated (from the dataproxy) for unknown or revoked keys.
        `fresh` asks the dataproxy even for a remembered key (revoked since, on any replica?)."""
        known = None if fresh else self._modes.get(digest)
        if known is not None:
            self._modes.move_to_end(digest)
            return known
        self._modes.pop(digest, None)
        try:
            resolved = await request.app[BACKENDS].dataproxy.ResolveKey(
                dataproxy_pb2.ResolveKeyRequest(key_digest=digest),
                timeout=request.app[SETTINGS].rpc_timeout_s,
            )
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err, hop="dataproxy") from None
        mode = str(resolved.mode)
        # Only header mode is remembered: a per-episode key is asked again, so once revoked it
        # gets the 401 `key_revoked` every route gives, not the 400 about its mode.
        if mode == HEADER_MODE:
            self._modes[digest] = mode
            while len(self._modes) > self._max_entries:
                self._modes.popitem(last=False)
        return mode


KEY_MODES = web.AppKey("key_modes", KeyModes)


def path_session_id(raw: str) -> str:
    """The path's session id, or InvalidRequest saying what an id may be."""
    if SESSION_ID_PATTERN.fullmatch(raw) is None:
        raise InvalidRequest(INVALID_SESSION_ID_MESSAGE, code="invalid_session_id")
    return raw


def session_of(match_info: Mapping[str, str]) -> str:
    """The session a scoped path names: `/sessions/<id>`, or `<rollout>:<attempt>` for
    `/rollout/<rollout>/attempt/<attempt>` (each part, and the whole, checked as an id)."""
    if "session_id" in match_info:
        return path_session_id(match_info["session_id"])
    rollout = path_session_id(match_info["rollout_id"])
    attempt = path_session_id(match_info["attempt_id"])
    return path_session_id(f"{rollout}:{attempt}")


def _conflict(path_id: str, other: str, where: str) -> InvalidRequest:
    return InvalidRequest(
        f"the URL path names session {path_id!r} but {where} says {bounded(other, 140)!r}: "
        "send one of them, or the same id in both",
        code="session_id_conflict",
    )


async def _require_header_mode(request: web.Request, *, admin_allowed: bool) -> str:
    """The digest of the request's header-mode session key ("" for an admin key where the
    route allows one); Unauthenticated or InvalidRequest otherwise."""
    settings = request.app[SETTINGS]
    if admin_allowed:
        kind, key = await require_any_key(
            request.headers, settings.admin_key, request.app[KEYS].lookup
        )
        if kind is KeyKind.ADMIN:
            return ""
    else:
        key = require_session_key(request.headers, settings.admin_key)
    digest = key_digest(key)
    if await request.app[KEY_MODES].mode(request, digest) != HEADER_MODE:
        raise InvalidRequest(PER_EPISODE_KEY_MESSAGE, code="session_path_needs_header_key")
    return digest


async def _refuse(request: web.Request, digest: str, error: InvalidRequest) -> NoReturn:
    """Raises `error` for a key that is still valid: a remembered key is asked about again
    first, so one revoked since (on any replica) gets the 401 every route gives, not a 400."""
    if digest:
        await request.app[KEY_MODES].mode(request, digest, fresh=True)
    raise error


def _body_session_id(raw: bytes) -> str:
    """The body's `session_id`, "" when it names none (or is no JSON object)."""
    try:
        body: Any = orjson.loads(raw) if raw.strip() else {}
    except orjson.JSONDecodeError:
        return ""  # the route's own parser says what is wrong with the body
    named = body.get("session_id") if isinstance(body, dict) else None
    return named.strip() if isinstance(named, str) else ""


def scoped(route: Route) -> Handler:
    """The route's handler behind a session named by the path: checks it, then sets
    X-Session-Id."""
    handler, admin_allowed, check_body = route.handler, route.admin_key, route.body_session_id

    async def scoped_handler(request: web.Request) -> web.StreamResponse:
        session_id = session_of(request.match_info)
        # The key first: a revoked or unknown one is the 401 every route gives.
        digest = await _require_header_mode(request, admin_allowed=admin_allowed)
        header = request.headers.get(SESSION_ID_HEADER, "").strip()
        if header and header != session_id:
            await _refuse(request, digest, _conflict(session_id, header, SESSION_ID_HEADER))
        headers = CIMultiDict(request.headers)
        headers[SESSION_ID_HEADER] = session_id
        # Cloned before the body is read: the handler reads it from the clone.
        named = request.clone(headers=headers)
        if check_body:
            in_body = _body_session_id(await named.read())
            if in_body and in_body != session_id:
                error = _conflict(session_id, in_body, "the body's `session_id`")
                await _refuse(request, digest, error)
        return await handler(named)

    scoped_handler.__doc__ = f"{route.path} with the session named by the URL path."
    return scoped_handler


def mount(app: web.Application, routes: Iterable[Route]) -> None:
    """Adds a `/sessions/{session_id}` twin and an Agent Lightning
    `/rollout/{rollout_id}/attempt/{attempt_id}` twin of each route as its `twins` says."""
    app[KEY_MODES] = KeyModes()
    for route in routes:
        if route.twins is Twins.NONE:
            continue
        handler = scoped(route) if route.twins is Twins.SESSION else route.handler
        for prefix in (SESSION_PREFIX, ATTEMPT_PREFIX):
            app.router.add_route(route.method, prefix + route.path, handler)
