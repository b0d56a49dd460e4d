"""The HTTP/1.1 edge: what aiohttp's parser refuses, slow heads, idle keep-alive, hostile headers
and bodies — all answered in the routes' JSON error shape with the status that names them."""

from __future__ import annotations

import asyncio
import dataclasses
import gzip
import logging
import zlib
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson
import pytest

from services.gateway.app import GatewayServer, build_app
from services.gateway.json_body import MAX_JSON_DEPTH, dump_json, load_json
from services.runtime.errors import MAX_IDENTIFIER_CHARS, InvalidRequest
from tests.gateway.conftest import Gateway, gateway_settings

SESSION = b"sk-sess-" + b"A" * 43

# (raw request, status, code): every class of request aiohttp's parser refuses.
PARSER_CASES: dict[str, tuple[bytes, int, str]] = {
    "lowercase method": (b"get /health HTTP/1.1\r\nHost: x\r\n\r\n", 405, "method_not_allowed"),
    "unknown method": (b"FOO /health HTTP/1.1\r\nHost: x\r\n\r\n", 405, "method_not_allowed"),
    "malformed method": (b"G(T /health HTTP/1.1\r\nHost: x\r\n\r\n", 400, "malformed_request_line"),
    "header over 8 KB": (
        b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n",
        431,
        "headers_too_large",
    ),
    "too many headers": (
        b"GET /health HTTP/1.1\r\nHost: x\r\n"
        + b"".join(b"X-%d: a\r\n" % i for i in range(200))
        + b"\r\n",
        431,
        "headers_too_large",
    ),
    "URL over 8 KB": (
        b"GET /health?" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
        414,
        "uri_too_long",
    ),
    "NUL in a header": (
        b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n",
        400,
        "invalid_header",
    ),
    "folded header": (
        b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\r\n  b\r\n\r\n",
        400,
        "invalid_header",
    ),
    "header without colon": (
        b"GET /health HTTP/1.1\r\nHost: x\r\nXA\r\n\r\n",
        400,
        "invalid_header",
    ),
    "bad Content-Length": (
        b"POST /rl/set_reward HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
        400,
        "invalid_content_length",
    ),
    "two Content-Lengths": (
        b"POST /rl/set_reward HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
        400,
        "invalid_content_length",
    ),
    "Content-Length with chunked": (
        b"POST /rl/set_reward HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        b"Content-Length: 3\r\n\r\n0\r\n\r\n",
        400,
        "invalid_content_length",
    ),
    "unknown Transfer-Encoding": (
        b"POST /rl/set_reward HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n",
        400,
        "invalid_transfer_encoding",
    ),
    "bad chunk size": (
        b"POST /rl/set_reward HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n\r\n",
        400,
        "invalid_transfer_encoding",
    ),
    "non-ASCII query": (b"GET /health?x=\xff\xfe HTTP/1.1\r\nHost: x\r\n\r\n", 400, "invalid_url"),
    "non-ASCII path": (b"GET /he\xffalth HTTP/1.1\r\nHost: x\r\n\r\n", 400, "invalid_url"),
    "Expect other than 100-continue": (
        b"POST /rl/set_reward HTTP/1.1\r\nHost: x\r\nExpect: 200-ok\r\nContent-Length: 2\r\n\r\n{}",
        417,
        "expectation_failed",
    ),
    "HTTP/1.2": (b"GET /health HTTP/1.2\r\nHost: x\r\n\r\n", 505, "http_version_not_supported"),
    "HTTP/2.0 in HTTP/1 syntax": (
        b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n",
        505,
        "http_version_not_supported",
    ),
    "bare LF line ends": (b"GET /health HTTP/1.1\nHost: x\n\n", 400, "malformed_request"),
    "non-ASCII Authorization": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-sess-\xff\xfe\r\n"
        b"Content-Length: 2\r\n\r\n{}",
        400,
        "invalid_header",
    ),
    "non-ASCII X-Request-Id": (
        b"GET /health HTTP/1.1\r\nHost: x\r\nX-Request-Id: \xff\xfe\r\n\r\n",
        400,
        "invalid_header",
    ),
    "non-ASCII X-Session-Id": (
        b"POST /rl/set_reward HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + SESSION + b"\r\n"
        b"X-Session-Id: caf\xc3\xa9\r\nContent-Length: 2\r\n\r\n{}",
        400,
        "invalid_header",
    ),
    "bogus Content-Encoding": (
        b"POST /rl/set_reward HTTP/1.1\r\nHost: x\r\nContent-Encoding: bogus\r\nContent-Length: 2\r\n\r\n{}",
        415,
        "unsupported_content_encoding",
    ),
    "HTTP/2 connection preface": (
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        505,
        "http_version_not_supported",
    ),
    "brotli (not decodable here)": (
        b"POST /rl/set_reward HTTP/1.1\r\nHost: x\r\nContent-Encoding: br\r\nContent-Length: 2\r\n\r\n{}",
        415,
        "unsupported_content_encoding",
    ),
}


async def exchange(port: int, data: bytes, *, chunks: int = 1, gap_s: float = 0.0) -> bytes:
    """Sends `data` (in `chunks` pieces, `gap_s` apart) and returns the first response."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    answer = asyncio.ensure_future(read_response(reader))
    try:
        size = max(1, len(data) // chunks)
        for start in range(0, len(data), size):
            if answer.done():
                break  # answered (and cut off) before the client finished
            writer.write(data[start : start + size])
            await writer.drain()
            if gap_s:
                await asyncio.sleep(gap_s)  # the client under test is slow on purpose
        async with asyncio.timeout(30):
            return await answer
    finally:
        answer.cancel()
        writer.close()


async def read_response(reader: asyncio.StreamReader) -> bytes:
    """One response: its head, then Content-Length bytes of body (or up to EOF)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = parse(head)[1].get("content-length")
    body = await reader.readexactly(int(length)) if length else await reader.read()
    return head + body


def parse(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of one HTTP/1.x response."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    return status, {k.lower(): v for k, v in headers.items()}, body


def assert_error_shape(headers: dict[str, str], body: bytes, code: str) -> str:
    assert headers["content-type"].startswith("application/json"), headers
    error = orjson.loads(body)["error"]
    assert set(error) == {"message", "type", "code"}
    assert error["code"] == code and error["message"] and error["type"]
    return str(error["message"])


@pytest.mark.parametrize("case", sorted(PARSER_CASES))
async def test_every_refused_request_gets_the_json_error_shape(
    gateway_without_backends: Gateway, case: str
) -> None:
    raw, status, code = PARSER_CASES[case]
    answer = await exchange(gateway_without_backends.server.port, raw)
    got, headers, body = parse(answer)
    assert got == status, answer[:300]
    message = assert_error_shape(headers, body, code)
    # Nothing the client sent is echoed back (no bytes, no keys).
    assert "\\x" not in message and "sk-sess-" not in message and "aaaa" not in message
    if status == 405:
        assert headers["allow"] == "GET, POST"


@pytest.mark.parametrize(
    "request_line",
    [b"GET /health HTTP/2.0", b"GET /health HTTP/0.9", b"GET /health", b"GET /health HTTP/1.2"],
)
async def test_a_refused_version_is_answered_in_http_1_and_closed(
    gateway_without_backends: Gateway, request_line: bytes
) -> None:
    # aiohttp answers in the request's version (`HTTP/2.0 505`, `HTTP/0.9 505`) unless the
    # edge rewrites it (a private attribute of the pinned aiohttp: this fails if it goes away).
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", gateway_without_backends.server.port
    )
    try:
        writer.write(request_line + b"\r\nHost: x\r\n\r\n")
        await writer.drain()
        async with asyncio.timeout(30):
            answer = await reader.read()  # up to EOF: the connection is closed after it
    finally:
        writer.close()
    status_line = answer.split(b"\r\n", 1)[0]
    assert status_line in (
        b"HTTP/1.1 505 HTTP Version Not Supported",
        b"HTTP/1.0 505 HTTP Version Not Supported",
    ), status_line
    got, headers, body = parse(answer)
    assert got == 505
    assert_error_shape(headers, body, "http_version_not_supported")


def edge_refusals(server: GatewayServer) -> dict[tuple[str, str], float]:
    """requests_total of the requests refused before routing, by (method, status)."""
    counted: dict[tuple[str, str], float] = {}
    for family in server.metrics.registry.collect():
        for sample in family.samples:
            if sample.name == "rollgate_gateway_requests_total" and (
                sample.labels["route"] == "edge"
            ):
                counted[(sample.labels["method"], sample.labels["status"])] = sample.value
    return counted


async def test_every_refusal_before_routing_is_counted_by_status(
    gateway_without_backends: Gateway,
) -> None:
    server = gateway_without_backends.server
    want: dict[str, float] = {}
    for case in sorted(PARSER_CASES):
        raw, status, _ = PARSER_CASES[case]
        got, _, _ = parse(await exchange(server.port, raw))
        assert got == status, case
        want[str(status)] = want.get(str(status), 0) + 1
    counted = edge_refusals(server)
    by_status: dict[str, float] = {}
    for (_, status), n in counted.items():
        by_status[status] = by_status.get(status, 0) + n
    assert by_status == want
    # The method is a label only when the request line parsed (bounded: llhttp's methods).
    assert {method for method, _ in counted} <= {"GET", "POST", "unparsed"}
    assert counted[("unparsed", "405")] == 2  # lowercase and unknown methods
    # The head checks (non-ASCII keys and ids, Content-Encoding, the version) know the method.
    assert counted[("POST", "400")] == 2 and counted[("GET", "400")] == 1
    assert counted[("POST", "415")] == 1 and counted[("POST", "417")] == 1


async def test_every_route_refuses_non_ascii_keys_and_ids_with_400(
    gateway_without_backends: Gateway,
) -> None:
    app = build_app(gateway_without_backends.settings)
    port = gateway_without_backends.server.port
    routes = {(r.method, r.resource.canonical) for r in app.router.routes() if r.resource}
    assert len(routes) >= 10
    for method, path in sorted(routes):
        target = path.replace("{response_id}", "resp_x").encode()
        for header in (
            b"Authorization: Bearer sk-sess-\xff\xfe",
            b"x-api-key: \xc3\xa9",
            b"X-Session-Id: \xff",
        ):
            raw = (
                method.encode() + b" " + target + b" HTTP/1.1\r\nHost: x\r\n" + header
                + b"\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"
            )  # fmt: skip
            got, headers, body = parse(await exchange(port, raw))
            assert got == 400, (method, path, header, body)
            message = assert_error_shape(headers, body, "invalid_header")
            assert header.split(b":")[0].decode().lower() in message.lower()


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_a_body_that_is_not_compressed_as_declared_is_400(
    gateway_without_backends: Gateway, encoding: str
) -> None:
    async with gateway_without_backends.http.post(
        gateway_without_backends.url + "/v1/chat/completions",
        data=b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}',
        headers={"Authorization": "Bearer " + SESSION.decode(), "Content-Encoding": encoding},
    ) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert error["code"] == "invalid_body_encoding" and "Content-Encoding" in error["message"]


@pytest.mark.parametrize("body", [b'{"reward":1}', b'{"reward": 1.0}'])
@pytest.mark.parametrize("encoding", [b"gzip", b"deflate"])
async def test_a_body_sent_with_its_head_that_is_not_compressed_as_declared_is_400(
    gateway_without_backends: Gateway,
    encoding: bytes,
    body: bytes,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # In one packet with its head, aiohttp's parser decodes the body (and refuses it) before
    # the route reads it; it was 415 "send it compressed with gzip or deflate" there.
    raw = (
        b"POST /rl/set_reward HTTP/1.1\r\nHost: x\r\nContent-Encoding: " + encoding + b"\r\n"
        b"Authorization: Bearer " + SESSION + b"\r\nContent-Length: %d\r\n\r\n" % len(body)
    ) + body
    for _ in range(5):
        got, headers, answer = parse(await exchange(gateway_without_backends.server.port, raw))
        assert got == 400, answer
        message = assert_error_shape(headers, answer, "invalid_body_encoding")
        assert "Content-Encoding" in message
    # A client's mistake, not a crash: never logged as an unhandled exception.
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.records


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_a_compressed_body_is_decoded(
    gateway_without_backends: Gateway, encoding: str
) -> None:
    body = b'{"reward": 1.0}'
    data = gzip.compress(body) if encoding == "gzip" else zlib.compress(body)
    async with gateway_without_backends.http.post(
        gateway_without_backends.url + "/rl/set_reward",
        data=data,
        headers={"Authorization": "Bearer " + SESSION.decode(), "Content-Encoding": encoding},
    ) as resp:
        # Parsed fine; the (absent) dataproxy is the only thing missing.
        assert resp.status == 503
        assert (await resp.json())["error"]["code"] == "dataproxy_unavailable"


async def test_deeply_nested_json_is_400_naming_the_depth(
    gateway_without_backends: Gateway,
) -> None:
    for depth in (MAX_JSON_DEPTH + 1, 1_000, 5_000):
        nested = b"[" * depth + b"]" * depth
        async with gateway_without_backends.http.post(
            gateway_without_backends.url + "/rl/set_reward",
            data=b'{"reward": 1, "x": ' + nested + b"}",
            headers={"Authorization": "Bearer " + SESSION.decode()},
        ) as resp:
            assert resp.status == 400, depth
            error = (await resp.json())["error"]
        assert error["code"] == "json_too_deep" and str(MAX_JSON_DEPTH) in error["message"]


@pytest.mark.parametrize("field", ["messages", "response_format"])
async def test_chat_checks_the_depth_by_the_encoding_it_relays(
    gateway_without_backends: Gateway, field: str
) -> None:
    """A chat body skips load_json's own check: split_body's encoding does it, for the
    recorded part and the other fields alike, to the same limit."""

    def body(depth: int) -> bytes:
        if field == "messages":
            # The body's object, `messages` and the message's object are three levels.
            lists = depth - 3
            nested = b"[" * lists + b"]" * lists
            content = b'{"role": "user", "content": ' + nested + b"}"
            return b'{"model": "m", "messages": [' + content + b"]}"
        lists = depth - 1
        nested = b"[" * lists + b"]" * lists
        return b'{"model": "m", "messages": [{"role": "user"}], "response_format": ' + nested + b"}"

    for depth, status, code in (
        (MAX_JSON_DEPTH + 1, 400, "json_too_deep"),
        (MAX_JSON_DEPTH, 503, "dataproxy_unavailable"),  # accepted: the absent ledger next
    ):
        async with gateway_without_backends.http.post(
            gateway_without_backends.url + "/v1/chat/completions",
            data=body(depth),
            headers={"Authorization": "Bearer " + SESSION.decode()},
        ) as resp:
            assert resp.status == status, depth
            error = (await resp.json())["error"]
        assert error["code"] == code, depth
        if status == 400:
            assert str(MAX_JSON_DEPTH) in error["message"]


def test_dump_json_is_orjsons_encoding_within_the_depth_limit() -> None:
    value = {"a": [1, 2.5, "x", None, True, {"b": []}], "ü": "\u2028"}
    assert dump_json(value) == orjson.dumps(value)
    ok: Any = {}
    for _ in range(MAX_JSON_DEPTH - 1):
        ok = [ok]
    assert dump_json(ok) == orjson.dumps(ok)
    with pytest.raises(InvalidRequest, match="nested more than") as caught:
        dump_json([ok], what="the frame")
    assert caught.value.code == "json_too_deep" and "the frame" in str(caught.value)


def test_dump_json_keeps_nothing_and_works_from_any_thread() -> None:
    # Its padding lists are built once per thread and reused: a failed encoding must leave
    # them empty and usable, and threads must not see each other's values.
    from services.gateway import json_body

    with pytest.raises(orjson.JSONEncodeError):
        dump_json({"x": object()})
    with pytest.raises(InvalidRequest):
        deep: Any = {}
        for _ in range(MAX_JSON_DEPTH):
            deep = [deep]
        dump_json(deep)
    assert json_body._PADS.inner == [None]
    assert dump_json({"a": 1}) == b'{"a":1}'
    with ThreadPoolExecutor(4) as pool:
        encoded = list(pool.map(lambda i: dump_json({"i": i, "s": "x" * i}), range(300)))
    assert encoded == [orjson.dumps({"i": i, "s": "x" * i}) for i in range(300)]


def test_load_json_takes_exactly_the_depth_limit() -> None:
    ok = "[" * (MAX_JSON_DEPTH - 1) + "{}" + "]" * (MAX_JSON_DEPTH - 1)
    assert load_json(ok, what="x") is not None
    too_deep = "[" * MAX_JSON_DEPTH + "{}" + "]" * MAX_JSON_DEPTH
    with pytest.raises(InvalidRequest, match="nested more than"):
        load_json(too_deep, what="x")
    # Many shallow containers are fine (only depth counts).
    assert len(load_json(b"[" + b",".join([b"{}"] * 5000) + b"]")) == 5000


async def test_an_over_long_identifier_is_400_stating_the_limit(
    gateway_without_backends: Gateway,
) -> None:
    huge = "i" * 16_384
    auth = {"Authorization": "Bearer " + SESSION.decode()}
    cases = [
        ("/rl/set_reward", {"reward": 1, "interaction_id": huge}, {}),
        ("/rl/set_reward", {"reward": 1, "session_id": huge}, {}),
        ("/rl/end_session", {"session_id": huge}, {}),
        (
            "/v1/chat/completions",
            {"model": huge, "messages": [{"role": "user", "content": "x"}]},
            {},
        ),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": "x"}]},
            {"X-Session-Id": "s" * (MAX_IDENTIFIER_CHARS + 1)},
        ),
        ("/v1/responses", {"model": huge, "input": "x"}, {}),
        ("/v1/responses", {"model": "m", "input": "x", "previous_response_id": huge}, {}),
        (
            "/v1/messages",
            {"model": huge, "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]},
            {},
        ),
    ]
    for path, body, headers in cases:
        async with gateway_without_backends.http.post(
            gateway_without_backends.url + path, json=body, headers=auth | headers
        ) as resp:
            assert resp.status == 400, (path, body.keys(), await resp.text())
            error = (await resp.json())["error"]
        assert error["code"] == "identifier_too_long"
        assert f"the limit is {MAX_IDENTIFIER_CHARS}" in error["message"]
        assert len(error["message"]) < 200


@pytest.fixture
async def edge_gateway(dead_address: str) -> AsyncIterator[GatewayServer]:
    """A gateway with short head and keep-alive limits."""
    settings = dataclasses.replace(
        gateway_settings(router_addr=dead_address, dataproxy_addr=dead_address),
        header_timeout_s=0.5,
        body_timeout_s=0.5,
        keepalive_timeout_s=1.0,
    )
    async with GatewayServer(settings) as server:
        yield server


async def test_a_request_head_that_stalls_is_answered_408(edge_gateway: GatewayServer) -> None:
    answer = await exchange(edge_gateway.port, b"GET /health HTTP/1.1\r\nHo")
    status, headers, body = parse(answer)
    assert status == 408
    assert "ROLLGATE_HEADER_TIMEOUT_S" in assert_error_shape(headers, body, "request_timeout")
    assert edge_refusals(edge_gateway) == {("unparsed", "408"): 1}


async def test_a_head_sent_a_byte_at_a_time_is_cut_off(edge_gateway: GatewayServer) -> None:
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200 + b"\r\n\r\n"
    # 200+ bytes, one every 20 ms: the head would take over 4 s, the limit is 0.5 s.
    answer = await exchange(edge_gateway.port, head, chunks=len(head), gap_s=0.02)
    status, headers, body = parse(answer)
    assert status == 408
    assert_error_shape(headers, body, "request_timeout")


async def test_a_body_that_stalls_is_answered_408(edge_gateway: GatewayServer) -> None:
    head = (
        b"POST /rl/set_reward HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + SESSION
        + b"\r\nContent-Length: 100\r\n\r\n{\"reward\": "
    )  # fmt: skip
    status, headers, body = parse(await exchange(edge_gateway.port, head))
    assert status == 408
    assert "ROLLGATE_BODY_TIMEOUT_S" in assert_error_shape(headers, body, "request_timeout")


async def test_an_idle_keep_alive_connection_is_closed(edge_gateway: GatewayServer) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", edge_gateway.port)
    try:
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        async with asyncio.timeout(30):
            assert (await read_response(reader)).startswith(b"HTTP/1.1 200")
            # The server closes the idle connection (no 408: no request was started).
            assert await reader.read() == b""
    finally:
        writer.close()


async def test_keep_alive_serves_several_requests_within_the_limits(
    edge_gateway: GatewayServer,
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", edge_gateway.port)
    try:
        for _ in range(4):
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            await writer.drain()
            async with asyncio.timeout(30):
                assert (await read_response(reader)).startswith(b"HTTP/1.1 200")
    finally:
        writer.close()


@pytest.mark.parametrize(
    "stalled",
    [
        b"GET /health HTTP/1.1\r\nHo",
        b"POST /rl/set_reward HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + SESSION
        + b"\r\nContent-Length: 100\r\n\r\n{\"reward\": ",
    ],
    ids=["head", "body"],
)  # fmt: skip
async def test_a_stall_after_a_served_request_on_the_connection_is_answered_408(
    edge_gateway: GatewayServer, stalled: bytes
) -> None:
    # The deadlines of a connection share one timer, armed at the first head's first byte: it
    # must still end the stall that starts later (the first head takes 0.3 s of the 0.5 s).
    reader, writer = await asyncio.open_connection("127.0.0.1", edge_gateway.port)
    try:
        served = b"POST /rl/set_reward HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
        for piece in (served[:10], served[10:20]):
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.15)  # the client under test is slow on purpose
        writer.write(served[20:])
        await writer.drain()
        async with asyncio.timeout(30):
            assert (await read_response(reader)).startswith(b"HTTP/1.1 401")
            writer.write(stalled)
            await writer.drain()
            status, headers, body = parse(await read_response(reader))
        assert status == 408
        assert_error_shape(headers, body, "request_timeout")
    finally:
        writer.close()


async def test_edge_refusals_on_messages_paths_take_anthropics_shape(
    gateway_without_backends: Gateway,
) -> None:
    raw = (
        b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nx-api-key: \xff\r\n"
        b"Content-Encoding: bogus\r\nContent-Length: 2\r\n\r\n{}"
    )
    status, _, body = parse(await exchange(gateway_without_backends.server.port, raw))
    assert status == 400
    answer = orjson.loads(body)
    assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
    assert "x-api-key" in answer["error"]["message"].lower()


async def test_an_escaped_slash_in_a_session_path_keeps_the_messages_shape(
    gateway_without_backends: Gateway,
) -> None:
    async with gateway_without_backends.http.post(
        gateway_without_backends.url + "/sessions/..%2F..%2Fetc/v1/messages",
        data=b"{}",
        headers={"x-api-key": SESSION.decode()},
    ) as resp:
        assert resp.status == 400
        answer = await resp.json()
    assert answer["type"] == "error" and answer["error"]["code"] == "invalid_session_id"


async def test_deep_json_on_messages_is_400_in_anthropics_shape(
    gateway_without_backends: Gateway,
) -> None:
    nested = b"[" * 300 + b"]" * 300
    async with gateway_without_backends.http.post(
        gateway_without_backends.url + "/v1/messages",
        data=b'{"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": '
        + nested
        + b"}]}",
        headers={"x-api-key": SESSION.decode()},
    ) as resp:
        assert resp.status == 400
        answer = await resp.json()
    assert answer["type"] == "error" and answer["error"]["code"] == "json_too_deep"
