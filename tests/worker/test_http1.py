"""The worker's lean HTTP/1.1 client against real servers: aiohttp's for what an engine's server
sends (keep-alive, chunked SSE, errors), and a scripted socket server for the edges of HTTP/1.1
the client must read right however the bytes are cut (chunk boundaries, 1xx heads, a server
that closes a kept-alive connection, bodies that end with the connection, broken answers)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web

from services.worker.http1 import _HIGH_WATER as HIGH_WATER
from services.worker.http1 import ConnectError, Http1Pool, HttpError, HttpTimeout
from tests.harness.poll import eventually

# What a scripted server does with one connection: reads requests, writes what it likes.
Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def scripted(script: Script) -> AsyncIterator[tuple[int, list[bytes]]]:
    """A TCP server running `script` per connection; yields its port and the request heads it
    read (`read_request` appends them)."""
    heads: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        reader.heads = heads  # type: ignore[attr-defined]
        try:
            await script(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield port, heads
    finally:
        server.close()
        await server.wait_closed()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One request (head and Content-Length body); its head is recorded."""
    head = await reader.readuntil(b"\r\n\r\n")
    reader.heads.append(head)  # type: ignore[attr-defined]
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return await reader.readexactly(length)


def pool(port: int, **headers: str) -> Http1Pool:
    return Http1Pool("127.0.0.1", port, connect_timeout_s=5.0, headers=headers)


async def bodies(port: int, times: int) -> list[bytes]:
    """`times` requests one after the other on one pool, each answer read to its end."""
    client = pool(port)
    read = []
    for _ in range(times):
        response = await client.request("POST", "/", b"{}")
        read.append(await response.read())
        response.release()
    await client.close()
    return read


async def test_a_content_length_answer_and_the_request_as_sent() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        body = await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()
        await reader.read()

    async with scripted(script) as (port, heads):
        client = pool(port, Authorization="Bearer k")
        response = await client.request("POST", "/v1/chat", b'{"a":1}', {"traceparent": "t"})
        assert response.status == 200
        assert await response.read() == b'{"a":1}'
        response.release()
        await client.close()

    head = heads[0].decode()
    assert head.startswith("POST /v1/chat HTTP/1.1\r\n")
    for line in (f"Host: 127.0.0.1:{port}", "Content-Length: 7", "traceparent: t"):
        assert f"\r\n{line}\r\n" in head, head
    assert "Authorization: Bearer k" in head


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 7, 64, 20_000])
@pytest.mark.parametrize(
    "size", [b"%x", b"%x;ext=1", b"%X  "], ids=["plain", "extension", "spaces"]
)
async def test_a_chunked_answer_cut_anywhere_reads_whole(cut: int, size: bytes) -> None:
    # Plain sizes in reads that hold whole chunks take the one-step path (`_whole_chunks`);
    # an extension, or a chunk cut by the read, the general loop.
    chunks = [b"data: one\n\n", b"data: two\n\n", b"x" * 40, b"y" * 300]
    wire = b"".join(size % len(c) + b"\r\n" + c + b"\r\n" for c in chunks) + b"0\r\nT: v\r\n\r\n"
    answer = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + wire

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(2):  # the same connection answers twice
            await read_request(reader)
            for at in range(0, len(answer), cut):
                writer.write(answer[at : at + cut])
                await writer.drain()

    async with scripted(script) as (port, heads):
        client = pool(port)
        for _ in range(2):
            response = await client.request("POST", "/", b"{}")
            got = []
            while data := await response.readany():
                got.append(data)
            assert b"".join(got) == b"".join(chunks)
            assert response.content.at_eof()
            response.release()
        await client.close()
    assert len(heads) == 2  # both on one kept-alive connection: one script run read both


async def test_informational_heads_are_skipped() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        await reader.read()

    async with scripted(script) as (port, _):
        client = pool(port)
        response = await client.request("POST", "/", b"{}")
        assert (response.status, await response.read()) == (200, b"ok")
        response.release()
        await client.close()


async def test_a_body_without_length_ends_with_the_connection_which_is_not_reused() -> None:
    connections = 0

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n\r\nall of it")
        await writer.drain()
        writer.close()

    async with scripted(script) as (port, _):
        assert await bodies(port, 2) == [b"all of it"] * 2
    assert connections == 2


async def test_connection_close_is_honoured() -> None:
    connections = 0

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 1\r\n\r\n1")
        await writer.drain()
        await reader.read()

    async with scripted(script) as (port, _):
        assert await bodies(port, 2) == [b"1"] * 2
    assert connections == 2


async def test_a_kept_alive_connection_the_server_closed_is_replaced() -> None:
    # The server answers once per connection and then closes it without saying so: the next
    # request finds it closed (gone from the pool, or failing before any answer) and is sent
    # on a new connection.
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()

    async with scripted(script) as (port, heads):
        assert await bodies(port, 3) == [b"ok"] * 3
    assert len(heads) == 3


async def test_a_reused_connection_that_fails_before_answering_is_retried_once_anew() -> None:
    # The race the pool cannot see: the server drops the connection as the request arrives.
    runs = 0

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal runs
        runs += 1
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        if runs == 1:
            await read_request(reader)  # the second request: read, then the connection drops
            writer.transport.abort()

    async with scripted(script) as (port, heads):
        assert await bodies(port, 2) == [b"ok"] * 2
    assert (runs, len(heads)) == (2, 3)


@pytest.mark.parametrize(
    ("answer", "what"),
    [
        (b"SSH-2.0-OpenSSH\r\n\r\n", "HTTP/1.1"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "colon"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n", "Content-Length"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "chunk size"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-5\r\nhello\r\n", "chunk size"),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n5\r\nhelloXX0\r\n\r\n",
            "malformed",
        ),
    ],
)
async def test_what_is_not_http_fails_clearly(answer: bytes, what: str) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answer)
        await writer.drain()
        await reader.read()

    async with scripted(script) as (port, _):
        client = pool(port)
        with pytest.raises(HttpError, match=what):
            response = await client.request("POST", "/", b"{}")
            await response.read()
        await client.close()


async def test_an_answer_cut_off_mid_body_fails() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this")
        await writer.drain()

    async with scripted(script) as (port, _):
        client = pool(port)
        response = await client.request("POST", "/", b"{}")
        with pytest.raises(HttpError, match="mid-answer"):
            await response.read()
        response.release()
        await client.close()


async def test_no_server_is_a_connect_error() -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    client = pool(port)
    with pytest.raises(ConnectError) as caught:
        await client.request("POST", "/", b"{}")
    assert isinstance(caught.value.os_error, ConnectionRefusedError)
    await client.close()


async def test_closing_a_streamed_answer_drops_the_connection_and_reading_waits_on_flow() -> None:
    # aiohttp's server as an engine's: an endless stream; the reader takes a little, then
    # closes, and the server sees its client go. Unread, the stream is held back by flow
    # control (the client pauses reading) instead of piling up in memory.
    gone = asyncio.Event()

    async def chat(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            while True:
                await response.write(b"data: " + b"x" * 4000 + b"\n\n")
        finally:
            gone.set()

    app = web.Application()
    app.router.add_post("/chat", chat)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        client = pool(port)
        response = await client.request("POST", "/chat", b"{}")
        assert response.status == 200
        assert (await response.readany()).startswith(b"data: ")
        # Unread, the stream is held back: the client pauses reading past its high water mark
        # and holds no more than that (the rest waits in the socket buffers and the server).
        await eventually(lambda: response.reading_paused, what="reading paused")
        assert HIGH_WATER < response.buffered_bytes <= HIGH_WATER + 256 * 1024
        assert (await response.readany()).startswith(b"data: ")
        assert not response.reading_paused
        response.close()
        async with asyncio.timeout(10):
            await gone.wait()
        with pytest.raises(HttpError):
            await response.readany()
        await client.close()
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("stall", ["head", "body"])
async def test_a_request_past_its_deadline_times_out_and_drops_its_connection(stall: str) -> None:
    dropped = asyncio.Event()

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        if stall == "body":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf")
            await writer.drain()
        await reader.read()  # until the client drops the connection
        dropped.set()

    async with scripted(script) as (port, _):
        client = pool(port)
        due = asyncio.get_running_loop().time() + 0.2  # the request's own deadline
        with pytest.raises(HttpTimeout):  # a TimeoutError too
            response = await client.request("POST", "/", b"{}", deadline=due)
            await response.read()
        async with asyncio.timeout(10):
            await dropped.wait()
        await client.close()


async def test_requests_past_the_limit_wait_their_turn_and_reuse_the_connection() -> None:
    connections = 0

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        while True:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()

    async with scripted(script) as (port, heads):
        client = Http1Pool("127.0.0.1", port, connect_timeout_s=5.0, limit=1)
        first = await client.request("POST", "/", b"{}")
        second = asyncio.create_task(client.request("POST", "/", b"{}"))
        due = asyncio.get_running_loop().time() + 0.2  # the third request's own deadline
        third = asyncio.create_task(client.request("POST", "/", b"{}", deadline=due))
        # The third gives up at its deadline while the first still holds the one connection.
        with pytest.raises(HttpTimeout):
            await third
        assert len(heads) == 1 and not second.done()
        assert await first.read() == b"ok"
        first.release()
        response = await second  # on the connection the first gave back
        assert await response.read() == b"ok"
        response.release()
        # The place the timed-out request never took is not lost: the next one goes at once.
        assert await (await client.request("POST", "/", b"{}")).read() == b"ok"
        await client.close()
    assert (len(heads), connections) == (3, 1)
