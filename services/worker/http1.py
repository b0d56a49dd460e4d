"""A lean HTTP/1.1 client for a plain-HTTP upstream: keep-alive connections, one write per
request, the response head and body parsed as the connection's read callback gets them.

The worker's one hot outbound call is `POST …/chat/completions` to an engine on the cluster
network (`http://`). aiohttp's client spent ≈ 90 µs of CPU per call on layers this call never
uses — a request object with cookies, redirects, signals and proxies, a multidict per header
set, a timer task per phase (docs/internals.md, *The upstream call*); this client writes the
request as one buffer and hands the body on as it arrives. What it keeps of HTTP/1.1: keep-alive
(a connection returns to its pool once its response was read to the end, a connection the
server closed while idle is dropped as its FIN comes), `Content-Length`, chunked and
read-until-close bodies, 1xx heads skipped, `Connection: close`, and flow control (reading
pauses while more than `_HIGH_WATER` bytes wait for the reader). A request that fails on a
reused connection before any byte of an answer came (the server closed it as the request went
out) is sent once more on a new one. An `https://` upstream, or anything else this client does
not speak (a redirect is answered as the upstream's error), goes through aiohttp as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import deque
from typing import Final, Protocol

from multidict import CIMultiDict, CIMultiDictProxy

# The response head may be this large at most (aiohttp's default limit too).
_MAX_HEAD_BYTES: Final = 64 * 1024
# Reading pauses while more body than this waits for the reader, and resumes below _LOW_WATER.
_HIGH_WATER: Final = 256 * 1024
_LOW_WATER: Final = 64 * 1024
# Chunked framing: longest size or trailer line taken, and the states between chunks.
_MAX_FRAMING_BYTES: Final = 4096
_CHUNK_END: Final = -1
_TRAILERS: Final = -2
# Idle connections kept per upstream (more are closed as they come back).
_MAX_IDLE: Final = 256
# Requests under way at once per upstream (as aiohttp's connector allowed); more wait their
# turn, in order, within their deadline.
MAX_CONNECTIONS: Final = 1024


class HttpError(Exception):
    """The upstream's connection failed or it did not speak HTTP/1.1 as this client reads it."""


class HttpTimeout(HttpError, TimeoutError):
    """The request's deadline passed before its answer was read to the end."""


class ConnectError(HttpError):
    """No connection could be made: `os_error` says why (refused, unreachable, timed out)."""

    def __init__(self, os_error: OSError) -> None:
        super().__init__(f"cannot connect to the upstream ({type(os_error).__name__})")
        self.os_error = os_error


class BodySink(Protocol):
    """Takes a response's body as the connection reads it (`Http1Response.consume`). Called
    from the connection's read callback: it must not raise."""

    def body(self, data: bytes) -> None:
        """The body bytes of one read."""

    def ended(self, error: HttpError | None) -> None:
        """The body's end (None: read whole), or why it will not come; called once."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection: the response being read on it, parsed as bytes come."""

    def __init__(self, pool: Http1Pool) -> None:
        self._pool = pool
        self.transport: asyncio.Transport | None = None
        self.response: Http1Response | None = None
        self.reusable = False
        self.lost = False
        self._head = bytearray()
        self.paused = False
        # Its loop, once made (asyncio.get_running_loop costs a getpid system call each time).
        self.loop: asyncio.AbstractEventLoop | None = None

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.loop = asyncio.get_running_loop()
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None:
            # Nothing was asked: an idle connection the server writes on cannot be trusted.
            self.close()
            return
        try:
            if response.status == 0:
                self._head += data
                data = self._read_head(response)
                if response.status == 0:
                    return
            if data:
                response._body(data)
        except HttpError as err:
            response._fail(err)
            self.close()

    def eof_received(self) -> bool:
        response = self.response
        if response is not None:
            response._eof_from_peer()
        self.reusable = False
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.reusable = False
        self._pool._forget(self)
        response = self.response
        if response is not None:
            response._fail(HttpError("the upstream closed the connection"))

    # Reading

    def _read_head(self, response: Http1Response) -> bytes:
        """Parses the head once it is whole (skipping 1xx heads); returns the body bytes that
        came with it."""
        while True:
            end = self._head.find(b"\r\n\r\n")
            if end < 0:
                if len(self._head) > _MAX_HEAD_BYTES:
                    raise HttpError("the upstream's response head is too large")
                return b""
            head = bytes(self._head[:end])
            rest = bytes(self._head[end + 4 :])
            self._head.clear()
            status, keep_alive, headers = _parse_head(head)
            if 100 <= status < 200:
                self._head += rest
                continue
            self.reusable = keep_alive
            response._start(status, headers)
            return rest

    def pause(self) -> None:
        if not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        self.reusable = False
        if self.transport is not None:
            self.transport.close()

    @property
    def open(self) -> bool:
        transport = self.transport
        return not self.lost and transport is not None and not transport.is_closing()


def _parse_head(head: bytes) -> tuple[int, bool, CIMultiDictProxy[str]]:
    """Status, whether the connection stays open, and the headers of a response head."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
        raise HttpError("the upstream did not answer in HTTP/1.1")
    try:
        status = int(parts[1])
    except ValueError:
        raise HttpError("the upstream's status line has no status") from None
    headers: CIMultiDict[str] = CIMultiDict()
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon:
            raise HttpError("the upstream sent a header line without a colon")
        headers.add(name.strip().decode("latin-1"), value.strip().decode("latin-1"))
    connection = headers.get("Connection", "").lower()
    keep_alive = "close" not in connection and (
        parts[0] == b"HTTP/1.1" or "keep-alive" in connection
    )
    return status, keep_alive, CIMultiDictProxy(headers)


class Http1Response:
    """An answer as it arrives: its status and headers, then its body (`readany`, `read`)."""

    def __init__(self, connection: _Connection, pool: Http1Pool) -> None:
        self._connection = connection
        self._pool = pool
        self.status = 0
        self.headers: CIMultiDictProxy[str] = CIMultiDictProxy(CIMultiDict())
        self._buffered: deque[bytes] = deque()
        self._size = 0
        self._eof = False
        self._error: HttpError | None = None
        self._waiter: asyncio.Future[None] | None = None
        # The body's framing: bytes still to come (Content-Length), chunked, or until close.
        self._left = -1
        self._chunked = False
        # A chunk's data bytes still to come (> 0), or where the framing stands: a size line
        # next (0), the CRLF after a chunk (_CHUNK_END), trailer lines (_TRAILERS).
        self._chunk_left = 0
        self._framing = b""
        self._released = False
        # Whether any byte of the answer came (a request that failed before may go again).
        self.answered = False
        # Fails the answer and drops its connection at the request's deadline (one timer for
        # the head and the body, cancelled once the response is released or closed).
        self._timer: asyncio.TimerHandle | None = None
        # Where the body goes as it is read, instead of waiting for `readany` (`consume`), and
        # whether it was told the end.
        self._sink: BodySink | None = None
        self._sink_ended = False

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        return self._connection.loop or asyncio.get_running_loop()

    def _arm(self, deadline: float) -> None:
        self._timer = self._running_loop().call_at(deadline, self._expire)

    def _expire(self) -> None:
        self._timer = None
        if not self._eof:
            self._fail(HttpTimeout("the upstream did not answer in time"))
            self.close()

    @property
    def content(self) -> Http1Response:
        """The body stream (the response itself: `readany`, `read`, `at_eof`)."""
        return self

    async def head(self) -> None:
        """Returns once the status and headers are here."""
        while self.status == 0:
            await self._wait()

    def consume(self, sink: BodySink | None) -> None:
        """Hands the body to `sink` from the connection's read callback: what arrived already
        at once, then each read's bytes as it comes, then the end (no task wakes per read).
        None: the body waits for `readany` again (nothing more is told to the sink)."""
        self._sink = sink
        if sink is not None:
            self._wake()

    def pause_reading(self) -> None:
        """Stops reading the connection (the sink's reader is full) until `resume_reading`."""
        self._connection.pause()

    def resume_reading(self) -> None:
        """Reads the connection again."""
        self._connection.resume()

    @property
    def reading_paused(self) -> bool:
        """Whether reading the connection waits for the reader (flow control)."""
        return self._connection.paused

    @property
    def buffered_bytes(self) -> int:
        """Body bytes arrived and not read yet."""
        return self._size

    def at_eof(self) -> bool:
        """Whether the whole body was read."""
        return self._eof and not self._buffered

    async def readany(self) -> bytes:
        """What of the body has arrived (waits for some); b"" at its end."""
        while not self._buffered:
            if self._eof:
                return b""
            await self._wait()
        if len(self._buffered) == 1:
            data = self._buffered.popleft()
        else:
            data = b"".join(self._buffered)
            self._buffered.clear()
        self._size = 0
        self._connection.resume()
        return data

    async def read(self, limit: int = -1) -> bytes:
        """The body to its end (or its first `limit` bytes)."""
        while not self._eof and (limit < 0 or self._size < limit):
            await self._wait()
        data = b"".join(self._buffered)
        self._buffered.clear()
        self._size = 0
        self._connection.resume()
        return data if limit < 0 else data[:limit]

    def close(self) -> None:
        """Drops the connection (the upstream sees the client go: it stops generating)."""
        self._disarm()
        if not self._released:
            self._released = True
            self._connection.close()
            self._fail(HttpError("the response was closed"))
            self._pool._free()

    def release(self) -> None:
        """Gives the connection back for another request (when the body was read to its end;
        else it is closed)."""
        self._disarm()
        if self._released:
            return
        self._released = True
        self._pool._free()
        connection = self._connection
        connection.response = None
        if self._eof and self._error is None and connection.reusable and connection.open:
            self._pool._idle(connection)
        else:
            connection.close()

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def _wait(self) -> None:
        if self._error is not None:
            raise self._error
        waiter = self._waiter = self._running_loop().create_future()
        try:
            await waiter
        finally:
            self._waiter = None
        if self._error is not None and not self._buffered:
            raise self._error

    def _wake(self) -> None:
        if self._sink is not None:
            self._hand_on(self._sink)
            return
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _hand_on(self, sink: BodySink) -> None:
        """What arrived to the sink, then the end once it came (the sink may close the
        response or pause reading from its calls: this is entered again then)."""
        if self._buffered:
            data = (
                self._buffered.popleft() if len(self._buffered) == 1 else b"".join(self._buffered)
            )
            self._buffered.clear()
            self._size = 0
            self._connection.resume()  # paused by _HIGH_WATER before the sink came
            sink.body(data)
        if self._sink is sink and not self._sink_ended and (self._eof or self._error is not None):
            self._sink_ended = True
            sink.ended(self._error)

    # Fed by the connection

    def _start(self, status: int, headers: CIMultiDictProxy[str]) -> None:
        self.status = status
        self.headers = headers
        self.answered = True
        if "chunked" in headers.get("Transfer-Encoding", "").lower():
            self._chunked = True
        elif (length := headers.get("Content-Length")) is not None:
            try:
                self._left = int(length)
            except ValueError:
                raise HttpError("the upstream sent a Content-Length that is not a number") from None
            if self._left < 0:
                raise HttpError("the upstream sent a negative Content-Length")
        elif status in (204, 304):
            self._left = 0
        else:
            self._connection.reusable = False  # the body ends when the connection does
        if self._left == 0:
            self._eof = True
        self._wake()

    def _body(self, data: bytes) -> None:
        if self._chunked:
            self._dechunk(data)
        elif self._left >= 0:
            if len(data) > self._left:
                raise HttpError("the upstream sent more than its Content-Length")
            self._left -= len(data)
            self._push(data)
            if self._left == 0:
                self._eof = True
        else:
            self._push(data)
        self._wake()

    def _dechunk(self, data: bytes) -> None:
        """Chunked transfer coding: chunk bytes through, sizes and trailers parsed. Framing
        that arrives cut (a size line, the CRLF after a chunk) waits in `_framing` for the
        rest; the usual read holds whole chunks and takes one `find` each."""
        if self._eof:
            raise HttpError("the upstream sent bytes after its answer")
        if self._framing:
            data = self._framing + data
            self._framing = b""
        end = len(data)
        at = self._whole_chunks(data, end) if self._chunk_left == 0 else 0
        while at < end:
            left = self._chunk_left
            if left > 0:  # inside a chunk's data
                take = left if left < end - at else end - at
                self._push(data[at : at + take])
                at += take
                self._chunk_left = left - take or _CHUNK_END
                continue
            if left == _CHUNK_END:  # the CRLF after a chunk's data
                if end - at < 2:
                    self._framing = data[at:]
                    return
                if data[at : at + 2] != b"\r\n":
                    raise HttpError("a chunk of the upstream's answer is malformed")
                at += 2
                self._chunk_left = 0
                continue
            stop = data.find(b"\r\n", at)
            if stop < 0:
                self._framing = data[at:]
                if len(self._framing) > _MAX_FRAMING_BYTES:
                    raise HttpError("a chunk size line of the upstream's answer is too long")
                return
            line = data[at:stop]
            at = stop + 2
            if left == _TRAILERS:  # after the last chunk: trailer lines up to an empty one
                if not line:
                    self._eof = True
                    if at < end:
                        raise HttpError("the upstream sent bytes after its answer")
                    return
                continue
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise HttpError("a chunk size of the upstream's answer is not a number") from None
            if size < 0:
                raise HttpError("a chunk size of the upstream's answer is not a number")
            self._chunk_left = size if size else _TRAILERS

    def _whole_chunks(self, data: bytes, end: int) -> int:
        """The usual read, whole chunks from its start (a size line, the data, its CRLF),
        each taken in one step and all pushed as one piece; returns where the rest begins
        (a chunk cut by the read's end, the last chunk, anything unusual), which the general
        loop reads, raising what it finds wrong."""
        at = 0
        pieces: list[bytes] = []
        find = data.find
        while True:
            stop = find(b"\r\n", at)
            if stop < 0:
                break
            try:
                size = int(data[at:stop], 16)  # a chunk extension (`;`) is the loop's to read
            except ValueError:
                break
            start = stop + 2
            after = start + size
            if size <= 0 or after + 2 > end or data[after : after + 2] != b"\r\n":
                break
            pieces.append(data[start:after])
            at = after + 2
        if pieces:
            self._push(pieces[0] if len(pieces) == 1 else b"".join(pieces))
        return at

    def _push(self, data: bytes) -> None:
        if data:
            self._buffered.append(data)
            self._size += len(data)
            if self._size > _HIGH_WATER:
                self._connection.pause()

    def _eof_from_peer(self) -> None:
        if self.status == 0:
            self._fail(HttpError("the upstream closed the connection before answering"))
        elif self._left < 0 and not self._chunked:
            self._eof = True  # read until close: this is the end
        elif not self._eof:
            self._fail(HttpError("the upstream closed the connection mid-answer"))
        self._wake()

    def _fail(self, error: HttpError) -> None:
        if self._error is None and not self._eof:
            self._error = error
        self._wake()


class Http1Pool:
    """Keep-alive connections to one `http://host:port`, each carrying one request at a time."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        connect_timeout_s: float,
        headers: dict[str, str] | None = None,
        limit: int = MAX_CONNECTIONS,
    ) -> None:
        self._host = host
        self._port = port
        self._connect_timeout_s = connect_timeout_s
        # Fixed header lines every request carries (the upstream key among them: sent, never
        # logged; this object has no repr that shows them).
        named = f"[{host}]" if ":" in host else host  # an IPv6 address
        host_header = named if port == 80 else f"{named}:{port}"
        lines = [f"Host: {host_header}", *(f"{k}: {v}" for k, v in (headers or {}).items())]
        self._fixed = ("\r\n".join(lines) + "\r\n").encode("latin-1")
        self._idle_connections: deque[_Connection] = deque()
        self._all: set[_Connection] = set()
        # Requests holding a connection (or opening one), and those waiting for one to free.
        self._limit = limit
        self._busy = 0
        self._waiting: deque[asyncio.Future[None]] = deque()

    def __repr__(self) -> str:
        return f"Http1Pool({self._host}:{self._port})"

    async def request(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        headers: dict[str, str] | None = None,
        *,
        deadline: float | None = None,
    ) -> Http1Response:
        """Sends the request; returns its response once the head came (read its body, then
        `release` or `close` it). HttpError (ConnectError: no connection) when it failed;
        HttpTimeout (a TimeoutError too) when `deadline` (loop time) passes first — while
        connecting, waiting for the head or reading the body."""
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        head = (
            f"{method} {path} HTTP/1.1\r\nContent-Length: {len(body)}\r\n{extra}".encode("latin-1")
            + self._fixed
            + b"\r\n"
        )
        data = head + body if len(body) < 16384 else None
        while True:
            if self._busy >= self._limit or self._waiting:
                await self._slot(deadline)
            else:
                self._busy += 1
            connection = self._take()
            reused = connection is not None
            if connection is None:
                try:
                    connection = await self._connect(deadline)
                except BaseException:
                    self._free()
                    raise
            response = Http1Response(connection, self)
            connection.response = response
            if deadline is not None:
                response._arm(deadline)
            transport = connection.transport
            assert transport is not None
            if data is not None:
                transport.write(data)
            else:
                transport.writelines((head, body))
            try:
                await response.head()
            except HttpError:
                response.close()
                if reused and not response.answered:
                    continue  # closed by the server as the request went out: once more, anew
                raise
            except BaseException:  # cancelled (the caller's deadline): the answer is not read
                response.close()
                raise
            return response

    async def _slot(self, deadline: float | None) -> None:
        """Waits (in order, within `deadline`) until a request under way ends and hands its
        place over."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        try:
            async with asyncio.timeout_at(deadline):
                await waiter
        except BaseException as err:
            if waiter.done() and not waiter.cancelled():
                self._free()  # handed a place as it gave up: the place goes on
            else:
                with contextlib.suppress(ValueError):
                    self._waiting.remove(waiter)
            if isinstance(err, TimeoutError):
                raise HttpTimeout("the upstream did not answer in time") from None
            raise

    def _free(self) -> None:
        """A request's connection is released or closed: its place goes to the first request
        waiting, else it is free."""
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._busy -= 1

    def _take(self) -> _Connection | None:
        while self._idle_connections:
            connection = self._idle_connections.pop()
            if connection.open:
                return connection
        return None

    async def _connect(self, deadline: float | None) -> _Connection:
        loop = asyncio.get_running_loop()
        connection = _Connection(self)
        limit = self._connect_timeout_s
        if deadline is not None:
            limit = min(limit, deadline - loop.time())
        try:
            async with asyncio.timeout(limit):
                await loop.create_connection(lambda: connection, self._host, self._port)
        except TimeoutError as err:
            if deadline is not None and loop.time() >= deadline:
                raise HttpTimeout("the upstream did not answer in time") from None
            raise ConnectError(err) from None
        except OSError as err:
            raise ConnectError(err) from None
        self._all.add(connection)
        return connection

    def _idle(self, connection: _Connection) -> None:
        if len(self._idle_connections) >= _MAX_IDLE:
            connection.close()
            return
        self._idle_connections.append(connection)

    def _forget(self, connection: _Connection) -> None:
        self._all.discard(connection)
        with contextlib.suppress(ValueError):
            self._idle_connections.remove(connection)

    async def close(self) -> None:
        """Closes every connection (a response still being read fails)."""
        for connection in list(self._all):
            connection.close()
        self._idle_connections.clear()
