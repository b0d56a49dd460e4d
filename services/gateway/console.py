"""The operator's console on the gateway: login, the live page, the trajectory viewer, and the
JSON they read (also what `rollgate status` reads, with the admin key as a bearer token).

Admin only. A browser logs in with a form (the key travels in the POST body, never in a URL)
and gets a signed, short-lived, stateless cookie (console_auth.py) that any gateway replica
accepts. Pages are static files that draw themselves from the JSON API; every value comes from
Redis through the dataproxy's Console service, so every replica shows the same.
"""

from __future__ import annotations

import asyncio
import html
import math
from pathlib import Path
from typing import Any

import grpc
from aiohttp import web
from prometheus_client import Counter

from protos import console_pb2, router_pb2
from services.gateway import health
from services.gateway.auth import require_admin_key
from services.gateway.backends import BACKENDS, SETTINGS
from services.gateway.console_auth import (
    CONFIGURED,
    COOKIE_NAME,
    COOKIE_PATH,
    ConsoleCookies,
    ConsoleSession,
    CookieRefused,
    cookie_attributes,
)
from services.gateway.console_view import overview_json, summary_json, trajectory_json
from services.gateway.http_errors import json_response
from services.gateway.key_admin import KEYS
from services.gateway.login_limit import LoginLimiter
from services.gateway.settings import GatewaySettings
from services.runtime.errors import InvalidRequest, Unauthenticated, from_rpc_error
from services.runtime.keys import access_key_kind, key_digest
from services.runtime.logs import get_logger

log = get_logger(__name__)

STATIC_DIR = Path(__file__).with_name("console_static")
STATIC_FILES = {
    "console.css": "text/css",
    "live.js": "text/javascript",
    "viewer.js": "text/javascript",
    "console.js": "text/javascript",
}
# Pages load only their own scripts and styles and talk only to this origin; no frame may
# embed them; nothing is cached or sent as a referrer.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
LOGIN_FIELD = "admin_key"
HISTORY_DEFAULT_S = 3600.0
HISTORY_MAX_S = 24 * 3600.0
NO_KEY_IN_URLS = (
    "never put a key in a URL (it ends up in logs and browser history): "
    "log in with the form at /console/login"
)
NOT_LOGGED_IN = (
    "log in at /console/login with an admin key (or send the admin key as "
    "`Authorization: Bearer …`)"
)

COOKIES = web.AppKey("console_cookies", ConsoleCookies)
LOGINS = web.AppKey("console_logins", Counter)
LOGIN_LIMITER = web.AppKey("console_login_limiter", LoginLimiter)


class IssuedKeyCheck:
    """Whether an issued admin key (by digest) is still valid: asked on every request, so a
    revocation ends the sessions it opened at once, on every gateway (one lookup per console
    call; the console is not on the data path)."""

    async def valid(self, request: web.Request, digest: str) -> bool:
        """True while the Keys service knows `digest` as an admin key."""
        return bool(await request.app[KEYS].lookup(digest) == "admin")


ISSUED = web.AppKey("console_issued_keys", IssuedKeyCheck)


def mount(app: web.Application, settings: GatewaySettings) -> None:
    """Adds the console's routes to the gateway app."""
    app[COOKIES] = ConsoleCookies(
        settings.admin_key,
        session_s=settings.console_session_s,
        max_login_s=settings.console_max_login_s,
    )
    app[ISSUED] = IssuedKeyCheck()
    app[LOGIN_LIMITER] = LoginLimiter(failures_per_min=settings.console_login_failures_per_min)
    app[LOGINS] = Counter(
        "rollgate_gateway_console_logins",
        "Console login attempts by result (ok, refused, limited: too many refused from the "
        "client's address).",
        ["result"],
        registry=app[health.METRICS].registry,
    )
    app.router.add_get("/console", live_page, allow_head=False)
    app.router.add_get("/console/trajectories", viewer_page, allow_head=False)
    app.router.add_get("/console/login", login_page, allow_head=False)
    app.router.add_post("/console/login", login)
    app.router.add_post("/console/logout", logout)
    app.router.add_get("/console/static/{name}", static_file, allow_head=False)
    app.router.add_get("/console/api/overview", api_overview, allow_head=False)
    app.router.add_get("/console/api/trajectories", api_trajectories, allow_head=False)
    app.router.add_get("/console/api/trajectories/{stream_id}", api_trajectory, allow_head=False)


# -- pages ---------------------------------------------------------------------------------


def _page(name: str, *, status: int = 200, error: str = "") -> web.Response:
    body = (STATIC_DIR / name).read_text()
    body = body.replace("<!--ERROR-->", html.escape(error))
    response = web.Response(text=body, status=status, content_type="text/html", charset="utf-8")
    response.headers.update(SECURITY_HEADERS)
    return response


async def _session(request: web.Request) -> ConsoleSession | None:
    """The valid session of the request's cookie, or None (the reason is logged)."""
    value = request.cookies.get(COOKIE_NAME)
    if not value:
        return None
    try:
        session = request.app[COOKIES].check(value)
    except CookieRefused as refused:
        log.info("console_cookie_refused", reason=str(refused))
        return None
    if session.issued_key and not await request.app[ISSUED].valid(request, session.subject):
        log.info("console_cookie_refused", reason="its admin key was revoked")
        return None
    return session


def _redirect(location: str) -> web.Response:
    """303 See Other: after a login or logout, and to the login page."""
    response = web.Response(status=303, headers={"Location": location})
    response.headers.update(SECURITY_HEADERS)
    return response


def _to_login() -> web.Response:
    return _redirect("/console/login")


async def _bearer_admin(request: web.Request) -> bool:
    """True for an admin key sent as a bearer token (scripts), False for no key at all; any
    other key is refused with the JSON 401 every other route gives it."""
    if "Authorization" not in request.headers and "x-api-key" not in request.headers:
        return False
    await require_admin_key(
        request.headers, request.app[SETTINGS].admin_key, request.app[KEYS].lookup
    )
    return True


async def live_page(request: web.Request) -> web.StreamResponse:
    """GET /console: the live page, or the login page first."""
    _refuse_keys_in_url(request)
    if not await _bearer_admin(request) and await _session(request) is None:
        return _to_login()
    return _page("live.html")


async def viewer_page(request: web.Request) -> web.StreamResponse:
    """GET /console/trajectories: the trajectory viewer."""
    _refuse_keys_in_url(request)
    if not await _bearer_admin(request) and await _session(request) is None:
        return _to_login()
    return _page("viewer.html")


async def login_page(request: web.Request) -> web.Response:
    """GET /console/login: the form."""
    await _bearer_admin(request)
    if request.query:
        return _page("login.html", status=400, error=NO_KEY_IN_URLS)
    return _page("login.html")


async def login(request: web.Request) -> web.StreamResponse:
    """POST /console/login (form field `admin_key`): a session cookie, then the live page."""
    # Before the key is even read: an address whose refused logins are spent waits.
    address = request.remote or ""
    retry_after_s = request.app[LOGIN_LIMITER].retry_after_s(address)
    if retry_after_s is not None:
        return _login_limited(request, retry_after_s)
    await _bearer_admin(request)
    if request.query:
        return _page("login.html", status=400, error=NO_KEY_IN_URLS)
    if request.content_type not in ("application/x-www-form-urlencoded", "multipart/form-data"):
        return _page("login.html", status=400, error="send the login form")
    try:
        form = await request.post()
    except (ValueError, LookupError):
        # A multipart body without its boundary, a charset Python does not know, ...
        return _page(
            "login.html",
            status=400,
            error="The login form could not be read: send it as the page does "
            "(application/x-www-form-urlencoded, UTF-8).",
        )
    presented = form.get(LOGIN_FIELD)
    subject = await _login_subject(request, presented if isinstance(presented, str) else "")
    if subject is None:
        request.app[LOGIN_LIMITER].refused(address)
        request.app[LOGINS].labels(result="refused").inc()
        log.warning("console_login_refused", remote=request.remote)
        return _page("login.html", status=401, error="That is not an admin key.")
    request.app[LOGINS].labels(result="ok").inc()
    log.info("console_login", remote=request.remote)
    response = _redirect("/console")
    _set_cookie(request, response, request.app[COOKIES].issue(subject))
    return response


def _login_limited(request: web.Request, retry_after_s: float) -> web.Response:
    """429: the login page again, saying how long to wait (and Retry-After)."""
    wait_s = max(1, math.ceil(retry_after_s))
    request.app[LOGINS].labels(result="limited").inc()
    log.warning("console_login_limited", remote=request.remote, retry_after_s=wait_s)
    limit = request.app[SETTINGS].console_login_failures_per_min
    response = _page(
        "login.html",
        status=429,
        error=(
            f"Too many refused logins from your address ({limit} a minute); "
            f"try again in {wait_s} s."
        ),
    )
    response.headers["Retry-After"] = str(wait_s)
    return response


async def _login_subject(request: web.Request, presented: str) -> str | None:
    """Who logs in: CONFIGURED for the configured admin key, an issued admin key's digest, or
    None when `presented` is no admin key."""
    if not presented:
        return None
    if request.app[SETTINGS].admin_key.matches(presented):
        return CONFIGURED
    if access_key_kind(presented) == "admin":
        digest = key_digest(presented)
        if await request.app[KEYS].lookup(digest) == "admin":
            return digest
    return None


async def logout(request: web.Request) -> web.StreamResponse:
    """POST /console/logout: forgets the cookie in this browser."""
    await _bearer_admin(request)
    response = _redirect("/console/login")
    response.del_cookie(COOKIE_NAME, path=COOKIE_PATH)
    return response


async def static_file(request: web.Request) -> web.Response:
    """GET /console/static/{name}: the pages' scripts and styles (no data in them)."""
    await _bearer_admin(request)
    name = request.match_info["name"]
    content_type = STATIC_FILES.get(name)
    if content_type is None:
        raise web.HTTPNotFound()
    response = web.Response(
        text=(STATIC_DIR / name).read_text(), content_type=content_type, charset="utf-8"
    )
    response.headers.update(SECURITY_HEADERS)
    return response


# -- the JSON API --------------------------------------------------------------------------


async def _authorize(request: web.Request) -> ConsoleSession | None:
    """The cookie's session, or None for an admin key as bearer; else Unauthenticated."""
    _refuse_keys_in_url(request)
    session = await _session(request)
    if session is not None:
        return session
    if await _bearer_admin(request):
        return None
    raise Unauthenticated(NOT_LOGGED_IN, code="console_login_required")


def _refuse_keys_in_url(request: web.Request) -> None:
    """A key in a query string is refused before anything else reads it."""
    text = request.query_string
    configured = request.app[SETTINGS].admin_key
    if any(key.reveal() in text for key in configured) or any(
        shape in text for shape in ("sk-sess-", "sk-admin-", "sk-trainer-")
    ):
        raise InvalidRequest(NO_KEY_IN_URLS, code="key_in_url")


def _metadata(settings: GatewaySettings) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {settings.admin_key.reveal()}"),)


def _json(request: web.Request, payload: Any, session: ConsoleSession | None) -> web.Response:
    response = json_response(payload)
    response.headers.update(SECURITY_HEADERS)
    if session is not None:
        renewed = request.app[COOKIES].renewal(session)
        if renewed is not None:
            _set_cookie(request, response, renewed)
    return response


def _set_cookie(request: web.Request, response: web.StreamResponse, value: str) -> None:
    secure = request.secure or request.headers.get("X-Forwarded-Proto", "") == "https"
    attributes = cookie_attributes(max_age_s=request.app[COOKIES].session_s, secure=secure)
    response.set_cookie(COOKIE_NAME, value, **attributes)  # type: ignore[arg-type]


async def _call(call: Any) -> Any:
    try:
        return await call
    except grpc.aio.AioRpcError as err:
        raise from_rpc_error(err, hop="dataproxy") from err


async def api_overview(request: web.Request) -> web.Response:
    """GET /console/api/overview[?window=seconds]: the live page's data."""
    session = await _authorize(request)
    settings = request.app[SETTINGS]
    backends = request.app[BACKENDS]
    window_s = _number(request.query.get("window"), HISTORY_DEFAULT_S, low=0.0, high=HISTORY_MAX_S)
    timeout = settings.rpc_timeout_s
    meta = _metadata(settings)
    overview, recent, workers = await asyncio.gather(
        _call(
            backends.console.Overview(
                console_pb2.OverviewRequest(history_s=window_s, max_sessions=200, max_errors=50),
                metadata=meta,
                timeout=timeout,
            )
        ),
        _call(
            backends.console.ListTrajectories(
                console_pb2.ListTrajectoriesRequest(limit=200), metadata=meta, timeout=timeout
            )
        ),
        _workers(request),
    )
    return _json(request, overview_json(overview, workers, recent), session)


async def _workers(request: web.Request) -> router_pb2.ListWorkersResponse | None:
    """The router's registry; None when the router cannot answer (the page says so)."""
    try:
        reply: router_pb2.ListWorkersResponse = await request.app[BACKENDS].router.ListWorkers(
            router_pb2.ListWorkersRequest(), timeout=request.app[SETTINGS].rpc_timeout_s
        )
    except grpc.aio.AioRpcError as err:
        log.warning("console_workers_unavailable", code=err.code().name)
        return None
    return reply


async def api_trajectories(request: web.Request) -> web.Response:
    """GET /console/api/trajectories[?limit=&offset=]: the newest published trajectories."""
    session = await _authorize(request)
    settings = request.app[SETTINGS]
    limit = int(_number(request.query.get("limit"), 50, low=1, high=200))
    offset = int(_number(request.query.get("offset"), 0, low=0, high=10_000))
    reply = await _call(
        request.app[BACKENDS].console.ListTrajectories(
            console_pb2.ListTrajectoriesRequest(limit=limit, offset=offset),
            metadata=_metadata(settings),
            timeout=settings.rpc_timeout_s,
        )
    )
    rows = [summary_json(t) for t in reply.trajectories]
    return _json(request, {"trajectories": rows}, session)


async def api_trajectory(request: web.Request) -> web.Response:
    """GET /console/api/trajectories/{stream_id}: one trajectory, turn by turn, token by token."""
    session = await _authorize(request)
    settings = request.app[SETTINGS]
    stream_id = request.match_info["stream_id"]
    reply = await _call(
        request.app[BACKENDS].console.GetTrajectory(
            console_pb2.GetTrajectoryRequest(stream_id=stream_id),
            metadata=_metadata(settings),
            timeout=settings.rpc_timeout_s,
        )
    )
    return _json(request, trajectory_json(reply), session)


def _number(raw: str | None, default: float, *, low: float, high: float) -> float:
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise InvalidRequest(f"{raw[:40]!r} is not a number", code="invalid_query") from None
    return min(max(value, low), high)
