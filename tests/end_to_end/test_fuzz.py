"""Property-based fuzzing of every route the gateway registers, and of the WebSocket protocol,
against the real processes.

The routes are enumerated from the gateway's application, so a route added later is fuzzed
without editing this file. Each route gets a few hundred generated requests (seeded, and
bounded in time: ROLLGATE_FUZZ_SECONDS, 150 s by default, is shared by the routes): hostile keys and headers, broken and
hostile bodies, route-shaped bodies with wrong values. The properties: never a 5xx without an
upstream cause, every error in the JSON error shape with a non-empty message, never a hang;
and afterwards the stack is ready and a normal session (start, chat, reward, refresh) is
still published.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import re
import time
import urllib.parse
import uuid
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollgate.stack import Stack
from services.gateway.app import build_app
from services.gateway.messages_translate import MESSAGES_PATH
from services.gateway.settings import GatewaySettings
from services.runtime.secret import Secret
from tests.end_to_end.test_lifecycle import published
from tests.harness.poll import eventually_sync
from tests.harness.processes import log_level_env, stack_config

pytestmark = pytest.mark.e2e

MODEL = "rollgate-mock"
EXAMPLES_PER_ROUTE = int(os.environ.get("ROLLGATE_FUZZ_EXAMPLES", "300"))
# Every route gets at least this many real cases, even when a loaded machine spends its time
# budget first (the budget bounds the run; this floor keeps it meaningful).
MIN_CASES = 25
REQUEST_DEADLINE_S = 30.0
# 5xx the gateway may give without anything being broken: transient states with Retry-After.
RETRYABLE_503_CODES = {"no_active_episode", "unavailable", "between_episodes"}

FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES_PER_ROUTE,
    deadline=None,
    derandomize=True,  # seeded: the same cases every run
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def gateway_routes() -> list[tuple[str, str]]:
    """(method, path pattern) of every route the gateway application registers."""
    app = build_app(GatewaySettings(admin_key=Secret("enumerating-routes-only")))
    routes = {
        (route.method, route.resource.canonical)
        for route in app.router.routes()
        if route.resource is not None and route.method != "*"
    }
    return sorted(routes)


ROUTES = gateway_routes()
# The time budget, shared by the routes and the WebSocket protocol (which gets two shares).
SECONDS_PER_ROUTE = max(
    2.0, float(os.environ.get("ROLLGATE_FUZZ_SECONDS", "150")) / (len(ROUTES) + 2)
)


@dataclass(slots=True)
class FuzzTarget:
    """The stack under fuzz and the keys the cases may use."""

    stack: Stack
    admin_key: str
    session_key: str
    cases: dict[str, int] = field(default_factory=dict)


@pytest.fixture(scope="module")
def fuzz_stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The whole stack as processes; the mock answers at once (no token interval)."""
    config = stack_config(
        redis_url,
        Path(tmp_path_factory.mktemp("fuzz-stack")),
        prefix="rgfuzz",
        workers=1,
        upstream_api_key="sk-upstream-fuzz-" + uuid.uuid4().hex,
        extra_env=log_level_env() | {"ROLLGATE_TRAINER_KEY": "rg-trainer-fuzz-" + uuid.uuid4().hex},
    )
    with Stack(config) as running:
        yield running


@pytest.fixture(scope="module")
def target(fuzz_stack: Stack) -> FuzzTarget:
    status, _, body = asyncio.run(
        send(fuzz_stack, b"POST", b"/rl/start_session", admin(fuzz_stack), b"{}")
    )
    assert status == 200, body
    return FuzzTarget(
        stack=fuzz_stack,
        admin_key=fuzz_stack.config.admin_key,
        session_key=orjson.loads(body)["api_key"],
    )


def admin(stack: Stack) -> list[tuple[bytes, bytes]]:
    return [(b"Authorization", b"Bearer " + stack.config.admin_key.encode())]


# -- sending ---------------------------------------------------------------------------------


async def send(
    stack: Stack, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes
) -> tuple[int, dict[str, str], bytes]:
    """One raw HTTP/1.1 request (any bytes allowed); (status, headers, decoded body)."""
    url = urllib.parse.urlsplit(stack.gateway_url)
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    try:
        head = method + b" " + target + b" HTTP/1.1\r\nHost: rollgate\r\nConnection: close\r\n"
        head += b"".join(name + b": " + value + b"\r\n" for name, value in headers)
        if not any(name.lower() == b"content-length" for name, _ in headers):
            head += b"Content-Length: " + str(len(body)).encode() + b"\r\n"
        writer.write(head + b"\r\n" + body)
        await writer.drain()
        async with asyncio.timeout(REQUEST_DEADLINE_S):
            raw = await reader.read()
    finally:
        writer.close()
    return parse_response(raw)


def parse_response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, sep, body = raw.partition(b"\r\n\r\n")
    assert sep, f"no complete response head: {raw[:200]!r}"
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = dechunk(body)
    return status, headers, body


def dechunk(data: bytes) -> bytes:
    out = b""
    while data:
        size_line, _, rest = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out += rest[:size]
        data = rest[size + 2 :]
    return out


# -- what every answer must be ---------------------------------------------------------------


# Routes that speak another protocol answer errors in its shape: the console's pages are for
# a browser (an HTML page that says what went wrong); everything else, its JSON API included,
# uses the OpenAI error shape.
HTML_PAGES = ("/console", "/console/login", "/console/logout", "/console/trajectories")


def check_answer(
    status: int, headers: dict[str, str], body: bytes, what: str, *, pattern: str = ""
) -> None:
    """The properties every gateway answer has."""
    assert status < 500 or upstream_caused(status, headers, body), (what, status, body[:300])
    content_type = headers.get("content-type", "")
    if status >= 400 and pattern in HTML_PAGES and content_type.startswith("text/html"):
        assert b"<html" in body.lower() and len(body.strip()) > 0, (what, body[:300])
    elif status >= 400:
        assert headers.get("content-type", "").startswith("application/json"), (what, headers)
        parsed = orjson.loads(body)
        error = parsed["error"]
        assert isinstance(error["message"], str) and error["message"].strip(), (what, body)
        assert isinstance(error["type"], str), (what, body)
        if MESSAGES_PATH.fullmatch(pattern) and not unparseable(headers, error):
            # Anthropic's shape: {"type": "error", "error": {type, message[, code]}}.
            assert parsed.get("type") == "error", (what, body)
        else:
            assert isinstance(error["code"], str), (what, body)
    if headers.get("content-type", "").startswith("text/event-stream"):
        for line in body.decode().split("\n"):
            if line.startswith("data: {") and '"error"' in line[:12]:
                error = orjson.loads(line[len("data: ") :])["error"]
                assert error["message"] and error["code"], (what, line)


# What the HTTP parser refuses before it knows the path (so before any route's shape applies):
# answered in the default shape, and the connection is closed.
PARSER_CODES = {
    "malformed_request", "malformed_request_line", "invalid_header", "invalid_url",
    "uri_too_long", "headers_too_large", "invalid_content_length", "invalid_transfer_encoding",
    "method_not_allowed", "http_version_not_supported", "unsupported_content_encoding",
    # A body declared gzip/deflate that is not: when it arrives with its head the parser
    # decodes it (default shape); when it arrives later, the route does (the route's shape).
    "invalid_body_encoding",
}  # fmt: skip


def unparseable(headers: dict[str, str], error: dict[str, Any]) -> bool:
    """True for an answer to a request the parser refused."""
    return headers.get("connection", "").lower() == "close" and error.get("code") in PARSER_CODES


def upstream_caused(status: int, headers: dict[str, str], body: bytes) -> bool:
    """5xx that name an upstream cause, or a transient state with Retry-After."""
    try:
        code = str(orjson.loads(body)["error"].get("code", ""))
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        return False
    if status in (502, 504):
        return code.startswith("upstream")
    return status == 503 and "retry-after" in headers and bool(code)


# -- strategies -------------------------------------------------------------------------------

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=16)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)
identifiers = (
    st.text(max_size=24)
    | st.sampled_from(
        ["", " ", "main", "side", "x" * 257, "y" * 17_000, "\u00e9t\u00e9", "../../etc"]
    )
    | st.from_regex(r"[A-Za-z0-9_\-]{1,40}", fullmatch=True)
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool"]) | st.text(max_size=6)},
        optional={"content": st.text(max_size=40) | json_values, "name": identifiers},
    ),
    min_size=1,
    max_size=3,
)
BODY_FIELDS: dict[str, dict[str, st.SearchStrategy[Any]]] = {
    "/chat/completions": {
        "model": st.just(MODEL) | identifiers,
        "messages": messages | json_values,
        "stream": st.booleans() | json_values,
        "max_tokens": st.integers(min_value=-3, max_value=40) | json_values,
        "session_id": identifiers,
        "turn_type": identifiers,
        "session_done": json_values,
        "logprobs": st.booleans() | json_values,
        "api_base": st.just("http://evil.invalid/v1"),
    },
    "/responses": {
        "model": st.just(MODEL) | identifiers,
        "input": st.text(max_size=40) | json_values,
        "previous_response_id": identifiers,
        "stream": st.booleans() | json_values,
        "store": st.booleans() | json_values,
        "instructions": st.text(max_size=20) | json_values,
        "max_output_tokens": st.integers(min_value=-3, max_value=40) | json_values,
    },
    "/messages": {
        "model": st.just(MODEL) | identifiers,
        "max_tokens": st.integers(min_value=-3, max_value=40) | json_values,
        "messages": messages | json_values,
        "system": st.text(max_size=30) | json_values,
        "stream": st.booleans() | json_values,
        "tools": json_values,
        "stop_sequences": json_values,
    },
    "/rl/start_session": {
        "task_id": identifiers | json_values,
        "api_key": identifiers | st.just("SESSION") | json_values,
        "group_size": st.integers(min_value=-2, max_value=4) | json_values,
    },
    "/rl/set_reward": {
        "reward": st.floats(allow_nan=False, allow_infinity=False) | st.integers() | json_values,
        "interaction_id": identifiers | json_values,
        "session_id": identifiers,
    },
    "/rl/end_session": {"session_id": identifiers | json_values},
    "/rl/keys": {"mode": st.just("header") | identifiers, "task_id": identifiers},
}
header_bytes = st.binary(max_size=40).map(
    lambda b: b.replace(b"\r", b"").replace(b"\n", b"").strip()
) | st.sampled_from([b"", b"\xff\xfe", b"caf\xc3\xa9", b"a" * 300, b"main", b"side", b"1"])
# Content-Types a careless client sends: forms without their boundary, unknown charsets.
content_types = (
    st.sampled_from(
        [
            b"application/json",
            b"application/json; charset=no-such-charset",
            b"application/x-www-form-urlencoded",
            b"application/x-www-form-urlencoded; charset=no-such-charset",
            b"multipart/form-data",
            b"multipart/form-data; boundary=zz",
            b"text/plain; charset=utf-16",
        ]
    )
    | header_bytes
)
AUTH_KINDS = ["none", "admin", "session", "admin-x-api-key", "session-x-api-key", "bad"]


@st.composite
def http_cases(draw: st.DrawFn, method: str, pattern: str) -> dict[str, Any]:
    """One request for a route: method, path, headers and body, each sometimes hostile."""
    path = pattern
    # Each path variable ({response_id}, {session_id}, ...): a generated identifier.
    for name in re.findall(r"\{[^}]*\}", pattern):
        value = draw(st.from_regex(r"[A-Za-z0-9._:-]{1,40}", fullmatch=True) | identifiers)
        path = path.replace(name, urllib.parse.quote(value, safe="") or "x", 1)
    if draw(st.booleans()):
        query = urllib.parse.urlencode({draw(st.text(max_size=5)): draw(st.text(max_size=10))})
        path += "?" + query
    shape = next((fields for suffix, fields in BODY_FIELDS.items() if pattern.endswith(suffix)), {})
    body_kind = draw(
        st.sampled_from(["shaped", "shaped", "shaped", "json", "bytes", "empty", "deep", "gzip"])
    )
    if body_kind in ("shaped", "gzip"):
        body_obj: Any = (
            draw(st.fixed_dictionaries({}, optional=shape)) if shape else draw(json_values)
        )
        body = json.dumps(body_obj).encode()
    elif body_kind == "json":
        body = json.dumps(draw(json_values)).encode()
    elif body_kind == "bytes":
        body = draw(st.binary(max_size=200))
    elif body_kind == "deep":
        depth = draw(st.integers(min_value=100, max_value=3000))
        body = b'{"reward": 1, "model": "m", "x": ' + b"[" * depth + b"]" * depth + b"}"
    else:
        body = b""
    extra: list[tuple[bytes, bytes]] = []
    if body_kind == "gzip":
        encoding = draw(st.sampled_from([b"gzip", b"deflate"]))
        compress = draw(st.booleans())
        if compress:
            body = gzip.compress(body) if encoding == b"gzip" else zlib.compress(body)
        extra.append((b"Content-Encoding", encoding))
    for name in (
        b"X-Session-Id",
        b"X-Turn-Type",
        b"X-Session-Done",
        b"X-Request-Id",
        b"Content-Type",
    ):
        if draw(st.integers(min_value=0, max_value=3)) == 0:
            extra.append((name, draw(content_types if name == b"Content-Type" else header_bytes)))
    other_method = draw(
        st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])
    )
    return {
        "method": method if draw(st.integers(min_value=0, max_value=5)) else other_method,
        "path": path,
        "auth": draw(st.sampled_from(AUTH_KINDS)),
        "bad_auth": draw(header_bytes),
        "headers": extra,
        "body": body,
    }


def auth_headers(case: dict[str, Any], target: FuzzTarget) -> list[tuple[bytes, bytes]]:
    kind = case["auth"]
    key = {"admin": target.admin_key, "session": target.session_key}.get(kind.split("-")[0])
    if kind == "none":
        return []
    if kind == "bad":
        return [(b"Authorization", b"Bearer " + case["bad_auth"])]
    assert key is not None
    if kind.endswith("x-api-key"):
        return [(b"x-api-key", key.encode())]
    return [(b"Authorization", b"Bearer " + key.encode())]


def body_for(case: dict[str, Any], target: FuzzTarget) -> bytes:
    # Refreshing the fuzz session's own key is a real path worth exercising.
    return bytes(case["body"]).replace(b'"SESSION"', b'"' + target.session_key.encode() + b'"')


@pytest.mark.parametrize(("method", "pattern"), ROUTES, ids=[f"{m} {p}" for m, p in ROUTES])
def test_every_route_answers_hostile_requests_in_its_error_shape(
    target: FuzzTarget, method: str, pattern: str
) -> None:
    route = f"{method} {pattern}"
    stop_at = time.monotonic() + SECONDS_PER_ROUTE
    target.cases[route] = 0

    @FUZZ_SETTINGS
    @given(case=http_cases(method, pattern))
    def fuzz(case: dict[str, Any]) -> None:
        if time.monotonic() > stop_at and target.cases[route] >= MIN_CASES:
            return  # the route's time budget is spent: the remaining cases are skipped
        target.cases[route] += 1
        headers = auth_headers(case, target) + case["headers"]
        status, answer_headers, body = asyncio.run(
            send(
                target.stack,
                case["method"].encode(),
                case["path"].encode(),
                headers,
                body_for(case, target),
            )
        )
        if case["method"] == "HEAD":
            return  # no body to check
        what = f"{route}: {case['method']} {case['path'][:80]}"
        check_answer(status, answer_headers, body, what, pattern=pattern)
        if any(name == b"Content-Encoding" for name, _ in case["headers"]):
            # gzip and deflate are served: a body not compressed as declared is the client's
            # 400 invalid_body_encoding, never a 415 that says to use them.
            assert status != 415, (what, body[:300])

    fuzz()
    assert target.cases[route] >= MIN_CASES, f"{route}: only {target.cases[route]} cases ran"
    assert_ready(target.stack)


def assert_ready(stack: Stack) -> None:
    status, _, body = asyncio.run(send(stack, b"GET", b"/ready", [], b""))
    assert status == 200, body


# -- the WebSocket protocol --------------------------------------------------------------------

WS_METHODS = [
    "connect", "chat.send", "agent", "agent.wait", "chat.history", "chat.abort",
    "sessions.reset", "sessions.list", "health", "models.list", "nope",
]  # fmt: skip
CLOSE_CODES_ALLOWED = {1000, 1002, 1003, 1007, 1008, 1009, 1013, 4000, 4001, 4008}


@st.composite
def ws_frames(draw: st.DrawFn) -> list[tuple[str, Any]]:
    """A connect (right, wrong or missing) and then a few frames, each sometimes hostile."""
    frames: list[tuple[str, Any]] = []
    connect = draw(st.sampled_from(["good", "good", "good", "bad-key", "bad-protocol", "none"]))
    if connect != "none":
        params: dict[str, Any] = {
            "minProtocol": 3 if connect != "bad-protocol" else 9,
            "maxProtocol": 4 if connect != "bad-protocol" else 9,
            "client": {"id": "cli", "version": "1", "platform": "linux", "mode": "cli"},
            "auth": {"token": "SESSION" if connect != "bad-key" else draw(st.text(max_size=30))},
        }
        frames.append(("req", {"type": "req", "id": "c", "method": "connect", "params": params}))
    for index in range(draw(st.integers(min_value=1, max_value=4))):
        kind = draw(st.sampled_from(["req", "req", "req", "text", "json", "binary"]))
        if kind == "req":
            params = draw(
                st.fixed_dictionaries(
                    {},
                    optional={
                        "sessionKey": identifiers,
                        "message": st.text(max_size=30) | json_values,
                        "idempotencyKey": identifiers | json_values,
                        "runId": identifiers | json_values,
                        "agentId": identifiers,
                        "limit": st.integers(min_value=-5, max_value=500) | json_values,
                        "timeoutMs": st.integers(min_value=-5, max_value=2000) | json_values,
                        "timeout": st.integers(min_value=-5, max_value=5) | json_values,
                        "key": identifiers,
                    },
                )
            )
            method = draw(st.sampled_from(WS_METHODS) | st.text(max_size=12))
            frames.append(
                ("req", {"type": "req", "id": f"r{index}", "method": method, "params": params})
            )
        elif kind == "text":
            frames.append(("text", draw(st.text(max_size=60))))
        elif kind == "json":
            frames.append(("text", json.dumps(draw(json_values)).encode().decode()))
        else:
            frames.append(("binary", draw(st.binary(max_size=60))))
    return frames


async def ws_exchange(target: FuzzTarget, frames: list[tuple[str, Any]]) -> None:
    """Sends the frames; checks every answer; then proves the connection is not hung."""
    url = target.stack.gateway_url.replace("http://", "ws://") + "/ws"
    pending: set[str] = set()
    async with aiohttp.ClientSession() as http, http.ws_connect(url) as ws:
        challenge = await ws.receive(timeout=REQUEST_DEADLINE_S)
        check_ws_frame(challenge.data)
        for kind, frame in frames:
            if ws.closed:
                break
            if kind == "binary":
                await ws.send_bytes(frame)
            elif kind == "text":
                await ws.send_str(frame)
            else:
                text = json.dumps(frame).replace('"SESSION"', f'"{target.session_key}"')
                pending.add(frame["id"])
                await ws.send_str(text)
        # Every request gets its `res` (or the server closes the connection), in time.
        probe_sent = False
        async with asyncio.timeout(REQUEST_DEADLINE_S):
            while True:
                if not pending and not probe_sent and not ws.closed:
                    pending.add("probe")
                    probe_sent = True
                    await ws.send_str(
                        '{"type": "req", "id": "probe", "method": "sessions.list", "params": {}}'
                    )
                message = await ws.receive()
                if message.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED):
                    assert ws.close_code in CLOSE_CODES_ALLOWED, ws.close_code
                    return
                assert message.type == aiohttp.WSMsgType.TEXT, message
                frame = check_ws_frame(message.data)
                if frame["type"] == "res":
                    pending.discard(str(frame.get("id")))
                if probe_sent and not pending:
                    return


def check_ws_frame(text: str) -> dict[str, Any]:
    """A server frame: a JSON object, `res` or `event`; a failed `res` says why."""
    frame = orjson.loads(text)
    assert isinstance(frame, dict) and frame.get("type") in ("res", "event"), text[:200]
    if frame["type"] == "res" and not frame.get("ok"):
        error = frame["error"]
        assert isinstance(error.get("code"), str) and error["code"], text[:200]
        assert isinstance(error.get("message"), str) and error["message"].strip(), text[:200]
    return frame


def test_the_websocket_protocol_survives_hostile_frames(target: FuzzTarget) -> None:
    stop_at = time.monotonic() + SECONDS_PER_ROUTE * 2
    ran = 0

    @FUZZ_SETTINGS
    @given(frames=ws_frames())
    def fuzz(frames: list[tuple[str, Any]]) -> None:
        nonlocal ran
        if time.monotonic() > stop_at and ran >= MIN_CASES:
            return
        ran += 1
        asyncio.run(ws_exchange(target, frames))

    fuzz()
    assert ran >= MIN_CASES, f"only {ran} WebSocket cases ran"
    assert_ready(target.stack)


# -- afterwards --------------------------------------------------------------------------------


def test_after_the_fuzz_a_normal_session_is_still_published(target: FuzzTarget) -> None:
    stack = target.stack

    async def session() -> str:
        status, _, body = await send(stack, b"POST", b"/rl/start_session", admin(stack), b"{}")
        assert status == 200, body
        started = orjson.loads(body)
        auth = [(b"Authorization", b"Bearer " + started["api_key"].encode())]
        chat = orjson.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": "still ok?"}]}
        )
        status, _, body = await send(stack, b"POST", b"/v1/chat/completions", auth, chat)
        assert status == 200, body
        status, _, body = await send(stack, b"POST", b"/rl/set_reward", auth, b'{"reward": 0.5}')
        assert status == 200, body
        refresh = orjson.dumps({"api_key": started["api_key"]})
        status, _, body = await send(stack, b"POST", b"/rl/start_session", admin(stack), refresh)
        assert status == 200, body
        return str(started["session_id"])

    assert_ready(stack)
    session_id = asyncio.run(session())
    mine = eventually_sync(
        lambda: [t for t in published(stack) if t.get("session_id") == session_id],
        timeout_s=30,
        what="the session after the fuzz published",
    )
    assert len(mine) == 1, "the session after the fuzz was not published exactly once"
    assert mine[0]["final_reward"] == 0.5 and len(mine[0]["interactions"]) == 1
    assert all(count >= MIN_CASES for count in target.cases.values()), target.cases
