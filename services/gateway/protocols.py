"""The HTTP protocols the gateway speaks, each declared once as a `Protocol`.

A protocol module (chat.py, responses.py, messages.py, …) ends with its `PROTOCOL`: the routes
it serves, which of them take a session key, and, when its clients expect errors in a shape of
their own, that shape. app.py mounts the protocols it lists in `PROTOCOLS`; from the same
declarations url_sessions.py gives every session-key route its `/sessions/<id>` and
`/rollout/<r>/attempt/<a>` twins, and `ErrorShapes` reshapes an error on a protocol's paths —
in the app (its request middleware, middleware.py) and at the edge, before routing (edge.py). Adding a protocol is its
module(s) and one line in app.py (docs/internals.md, "Adding a protocol").
"""

from __future__ import annotations

import enum
import re
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
from aiohttp import web

from services.gateway.http_errors import JSON_CONTENT_TYPE

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# An error body in a protocol's shape: (HTTP status, message, rollgate's error code) -> JSON.
ErrorBody = Callable[[int, str, str], dict[str, Any]]
_Response = TypeVar("_Response", bound=web.StreamResponse)
# Run when the protocol is mounted, e.g. to add a cleanup context its handlers need.
Setup = Callable[[web.Application], None]


class Twins(enum.Enum):
    """What a route gets under the session prefixes of url_sessions.py."""

    # A session-key route: the twins name the session (url_sessions.scoped).
    SESSION = "session"
    # No key is asked: the same handler answers under every prefix, the same way.
    SAME = "same"
    # Only the path itself.
    NONE = "none"


@dataclass(frozen=True, slots=True, kw_only=True)
class Route:
    """One route. `admin_key`: its session-prefixed twins take the admin key too (it names no
    episode); `body_session_id`: the body's `session_id` must agree with the path's."""

    method: str
    path: str
    handler: Handler
    twins: Twins = Twins.SESSION
    admin_key: bool = False
    body_session_id: bool = False


def openai_paths(path: str) -> tuple[str, str]:
    """`/v1<path>` and `<path>`: OpenAI-style clients put `/v1` in `base_url` or not."""
    return "/v1" + path, path


@dataclass(frozen=True, slots=True, kw_only=True)
class Protocol:
    """A protocol's routes and, if its clients expect another shape than OpenAI's
    `{"error": {...}}`, `error_body` for the raw paths `error_paths` matches (session prefixes
    included)."""

    name: str
    routes: tuple[Route, ...]
    error_paths: re.Pattern[str] | None = None
    error_body: ErrorBody | None = None
    setup: Setup | None = None

    def mount(self, app: web.Application) -> None:
        """Adds the routes (GET without HEAD) and runs `setup`."""
        if self.setup is not None:
            self.setup(app)
        for route in self.routes:
            app.router.add_route(route.method, route.path, route.handler)


def routes_of(protocols: Iterable[Protocol]) -> list[Route]:
    """Every route of `protocols`, in order."""
    return [route for protocol in protocols for route in protocol.routes]


class ErrorShapes:
    """Reshapes an error response on a protocol's paths into that protocol's error body (same
    status and headers); OpenAI's shape, which every error starts in, stays elsewhere."""

    def __init__(self, protocols: Iterable[Protocol] = ()) -> None:
        self._shapes = [
            (protocol.error_paths, protocol.error_body)
            for protocol in protocols
            if protocol.error_paths is not None and protocol.error_body is not None
        ]

    def body_for(self, raw_path: str) -> ErrorBody | None:
        """The error shape of the raw path (no query); None for OpenAI's."""
        path = raw_path.partition("?")[0]
        for pattern, body in self._shapes:
            if pattern.fullmatch(path) is not None:
                return body
        return None

    def reshape(self, request: web.BaseRequest, response: _Response) -> _Response:
        """`response` itself, its body in the shape of the request's protocol if it is a JSON
        error on such a path. The raw path: decoded, an escaped `/` in a session id
        (`..%2F..`) would hide the route."""
        if response.status < 400 or not self._shapes:
            return response
        shape = self.body_for(request.raw_path)
        if shape is None or not isinstance(response, web.Response):
            return response
        if response.content_type != JSON_CONTENT_TYPE:
            return response
        try:
            body: Any = orjson.loads(response.body) if isinstance(response.body, bytes) else None
        except orjson.JSONDecodeError:
            body = None
        error = body.get("error") if isinstance(body, dict) else None
        error = error if isinstance(error, dict) else {}
        message, code = error.get("message"), error.get("code")
        response.body = orjson.dumps(
            shape(
                response.status,
                message if isinstance(message, str) else response.reason,
                code if isinstance(code, str) else "",
            )
        )
        return response


ERROR_SHAPES = web.AppKey("error_shapes", ErrorShapes)
