"""The SSE responses' headers go out with their first event: one write, not two; chat's later
chunks are pushed to the transport as they come, framed as aiohttp frames them, only while the
client keeps up."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from aiohttp.base_protocol import BaseProtocol
from aiohttp.http_writer import HttpVersion, HttpVersion10, HttpVersion11, StreamWriter
from aiohttp.test_utils import make_mocked_request

from services.gateway.chat import PUSH_LIMIT_BYTES, EventStream, Pusher


class _Transport(asyncio.Transport):
    """Records each write the response makes (a write and a vectored write alike)."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        # What the transport holds unsent (the client is behind), and whether it closes.
        self.buffered = 0
        self.closing = False

    def write(self, data: Any) -> None:
        self.writes.append(bytes(data))

    def writelines(self, list_of_data: Any) -> None:
        self.writes.append(b"".join(bytes(d) for d in list_of_data))

    def is_closing(self) -> bool:
        return self.closing

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


class _Protocol(BaseProtocol):
    """aiohttp's protocol base on the recording transport, with what a request reads of it."""

    def __init__(self, transport: _Transport) -> None:
        super().__init__(asyncio.get_running_loop())
        self.connection_made(transport)
        self.ssl_context = None
        self.peername = None
        self.sockname = None


async def _prepared(version: HttpVersion = HttpVersion11) -> tuple[Any, EventStream, _Transport]:
    transport = _Transport()
    protocol = _Protocol(transport)
    writer = StreamWriter(protocol, asyncio.get_running_loop())
    request = make_mocked_request(
        "POST",
        "/v1/chat/completions",
        writer=writer,
        protocol=protocol,
        transport=transport,
        version=version,
    )
    return request, EventStream(), transport


async def _written(events: list[bytes], version: HttpVersion = HttpVersion11) -> list[bytes]:
    request, response, transport = await _prepared(version)
    await response.prepare(request)
    for event in events[:-1]:
        await response.write(event)
    await response.write_eof(events[-1])
    return transport.writes


async def test_the_headers_and_the_first_event_are_one_write() -> None:
    first = b'data: {"a": 1}\n\n'
    writes = await _written([first, b'data: {"b": 2}\n\n', b"data: [DONE]\n\n"])
    assert len(writes) == 3, writes
    head, _, body = writes[0].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK")
    assert b"Content-Type: text/event-stream" in head
    assert b"X-Accel-Buffering: no" in head
    assert body == b"%x\r\n%s\r\n" % (len(first), first)  # the first event, as its chunk
    assert writes[2].endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")


async def test_a_stream_that_ends_with_its_first_event_is_one_write() -> None:
    (only,) = await _written([b"data: [DONE]\n\n"])
    assert only.startswith(b"HTTP/1.1 200 OK")
    assert only.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")


async def test_an_http_1_0_client_gets_the_same_writes_unchunked() -> None:
    first = b'data: {"a": 1}\n\n'
    writes = await _written([first, b"data: [DONE]\n\n"], HttpVersion10)
    assert len(writes) == 2, writes
    head, _, body = writes[0].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200 OK")
    assert b"Transfer-Encoding" not in head
    assert body == first
    assert writes[1] == b"data: [DONE]\n\n"


def test_every_event_stream_of_the_gateway_is_one() -> None:
    """Chat, Responses and Anthropic Messages stream through EventStream, none through a
    plain StreamResponse (which would send its headers alone)."""
    gateway = Path(__file__).resolve().parents[2] / "services" / "gateway"
    plain = [p.name for p in gateway.glob("*.py") if "StreamResponse(" in p.read_text()]
    assert plain == [], plain
    users = {p.name for p in gateway.glob("*.py") if "EventStream()" in p.read_text()}
    assert users == {"chat.py", "messages.py", "responses.py"}


def _push(pusher: Pusher, data: bytes) -> bool:
    """`data` pushed as a protocol's push does: written only when the pusher can write now."""
    if not pusher.writable():
        return False
    pusher.write(data)
    return True


def _dechunked(body: bytes) -> bytes:
    """An HTTP/1.1 chunked body's data; AssertionError when it is not well framed."""
    data = b""
    while True:
        size, _, body = body.partition(b"\r\n")
        length = int(size, 16)
        assert body[length : length + 2] == b"\r\n", body
        if length == 0:
            assert body == b"\r\n"
            return data
        data, body = data + body[:length], body[length + 2 :]


async def test_pushed_chunks_are_framed_between_the_writes_of_aiohttp() -> None:
    request, response, transport = await _prepared()
    pusher = Pusher()
    assert not _push(pusher, b'data: {"early": 1}\n\n')  # not ready: nothing is written
    await response.prepare(request)
    await response.write(b'data: {"a": 1}\n\n')
    pusher.ready(request, response)
    assert _push(pusher, b'data: {"b": 2}\n\ndata: {"c": 3}\n\n')
    assert _push(pusher, b'data: {"d": 4}\n\n')
    await response.write_eof(b"data: [DONE]\n\n")
    assert len(transport.writes) == 4
    _, _, body = b"".join(transport.writes).partition(b"\r\n\r\n")
    assert _dechunked(body) == (
        b'data: {"a": 1}\n\ndata: {"b": 2}\n\ndata: {"c": 3}\n\ndata: {"d": 4}\n\ndata: [DONE]\n\n'
    )


async def test_pushed_chunks_to_an_http_1_0_client_are_the_events_alone() -> None:
    request, response, transport = await _prepared(HttpVersion10)
    pusher = Pusher()
    await response.prepare(request)
    await response.write(b'data: {"a": 1}\n\n')
    pusher.ready(request, response)
    assert _push(pusher, b'data: {"b": 2}\n\n')
    await response.write_eof(b"data: [DONE]\n\n")
    assert transport.writes[1:] == [b'data: {"b": 2}\n\n', b"data: [DONE]\n\n"]


async def test_nothing_is_pushed_to_a_client_that_is_behind_or_gone_or_compressed() -> None:
    request, response, transport = await _prepared()
    pusher = Pusher()
    await response.prepare(request)
    await response.write(b'data: {"a": 1}\n\n')
    pusher.ready(request, response)
    transport.buffered = PUSH_LIMIT_BYTES
    assert not _push(pusher, b'data: {"b": 2}\n\n')
    transport.buffered = PUSH_LIMIT_BYTES - 1
    assert _push(pusher, b'data: {"b": 2}\n\n')
    transport.closing = True
    assert not _push(pusher, b'data: {"c": 3}\n\n')
    assert len(transport.writes) == 2  # the first event, and the one push taken

    request, response, transport = await _prepared()
    response.enable_compression()
    pusher = Pusher()
    await response.prepare(request)
    pusher.ready(request, response)
    assert not _push(pusher, b'data: {"a": 1}\n\n')
    assert transport.writes == []
