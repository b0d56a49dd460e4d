"""Framed streams: a long-lived stream of protobuf messages on a plain TCP connection.

The two streams every turn crosses (`Worker.Turns`, `DataProxy.Ledger`) carry several messages
per turn; on grpc.aio each message end costs ≈ 90 µs of CPU in its machinery (a batch op, the
completion through its poller thread, a future), where a length-prefixed frame on an asyncio
connection costs ≈ 7-40 µs (docs/internals.md, *What a turn costs*). So the worker and the
dataproxy also serve those two streams framed, and a gateway uses the framed one when its peer
offers it (a unary gRPC call names the port: `Worker.TurnsEndpoint`,
`DataProxy.LedgerEndpoint`), else the gRPC stream. Everything else stays gRPC.

On the wire: the client's preamble (the protocol and the stream's name, so a connection to the
wrong port fails at once), then in each direction frames of a 4-byte big-endian length and one
serialized message. A client half-closes its side (EOF) when it is done writing; the server
closes the connection when its stream ended. A frame over `MAX_FRAME_BYTES`, a message that
does not parse or a wrong preamble ends the connection. The same messages, ids, deadlines,
cancels and credits as on the gRPC streams: only the transport differs, so `FramedCall` offers
what the gateway uses of a grpc.aio stream-stream call (`write`, `read`, `done_writing`,
`cancel`) and fails the way it does (`grpc.aio.AioRpcError`, UNAVAILABLE when the connection
broke, RESOURCE_EXHAUSTED for a frame too large), and the server hands `serve` the requests as
an async iterator as a gRPC servicer gets them. Like the gRPC channels, the connections are
plain TCP: the NetworkPolicies are the boundary (deploy/k8s).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from typing import Any, Generic, TypeVar, cast

import grpc
from google.protobuf.message import DecodeError, Message

from protos import common_pb2
from services.runtime.grpc_server import MAX_MESSAGE_BYTES
from services.runtime.logs import get_logger
from services.runtime.tasks import cancel_and_wait

log = get_logger(__name__)

_SIZE = struct.Struct(">I")
# Frames smaller than this are joined into one buffer to write (a vectored write's bookkeeping
# costs more than copying a few KB); larger ones are written as their pieces.
_JOINED_BELOW = 16 * 1024
# As large as a gRPC message may be (trajectories, long prompts).
MAX_FRAME_BYTES = MAX_MESSAGE_BYTES
# A connection that cannot be made in this long is given up (the gRPC stream is used).
CONNECT_TIMEOUT_S = 2.0
# The deadline of the call that asks a peer where it serves its stream framed.
ENDPOINT_TIMEOUT_S = 5.0
# Dead peers (a node gone without a reset) are found like the gRPC channels' keepalive does.
_KEEPALIVE = (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3))

TURNS_PREAMBLE = b"rollgate-framed/1 rollgate.v1.Worker/Turns\n"
LEDGER_PREAMBLE = b"rollgate-framed/1 rollgate.v1.DataProxy/Ledger\n"

In = TypeVar("In", bound=Message)
Out = TypeVar("Out", bound=Message)

# The key of a length-delimited field 1: what every batch message of the two streams repeats
# (`TurnOps.ops`, `TurnEvents.events`, `LedgerRequests.ops`, `LedgerResponses.answers`).
_FIELD_1 = b"\x0a"


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


class Batch:
    """The messages of one turn of the loop as the batch message that repeats them in its field
    1, encoded without building that message: its constructor copies every item in (a record
    with a prompt's ids, a 60 KB request: ≈ 10-30 µs), here each is serialized once. The bytes
    are the batch message's own (a test compares them)."""

    __slots__ = ("items",)

    def __init__(self, items: Sequence[Message]) -> None:
        self.items = items

    def SerializeToString(self) -> bytes:
        return b"".join(self.parts())

    def parts(self) -> list[bytes]:
        """The batch message's bytes in pieces, each item's serialization one of them (a
        large frame is written as these pieces: no copy joins them)."""
        parts: list[bytes] = []
        for item in self.items:
            data = item.SerializeToString()
            parts += (_FIELD_1, _varint(len(data)), data)
        return parts


# What `send` writes: a message, or a Batch of them.
Sendable = Message | Batch


class FrameError(Exception):
    """The peer sent what is not a frame of this stream (the connection is ended)."""


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The error a grpc.aio call would raise (callers already map those per hop)."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def _tune(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in _KEEPALIVE:
            if hasattr(socket, name):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class _Connection(asyncio.Protocol, Generic[In]):
    """Frames in and out of one connection: parsed messages queue up in order; a write waits
    while the peer's side of the connection is full."""

    def __init__(self, parse: Callable[[bytes], In], *, expect: bytes = b"") -> None:
        self._parse = parse
        # The server's side expects the preamble; it alone stays half-open after an EOF (the
        # client is done writing; the server ends the stream, then the connection).
        self._server_side = bool(expect)
        self._expect = expect
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._inbox: deque[In] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._writable: asyncio.Future[None] | None = None
        # Why the connection ended (None: still open); EOF alone is a clean end.
        self.error: Exception | None = None
        self.eof = False
        self.lost = False
        self.on_made: Callable[[], None] | None = None
        self.on_lost: Callable[[], None] | None = None
        # The connection's loop, once made (asyncio.get_running_loop costs a getpid call).
        self._loop: asyncio.AbstractEventLoop | None = None
        # Set by `listen`: each message goes straight to it from the read callback (no task
        # wakes per message), and the end to `_on_end` once.
        self._on_message: Callable[[In], None] | None = None
        self._on_end: Callable[[], None] | None = None

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses; they offer the same calls.
        self.transport = cast("asyncio.Transport", transport)
        self._loop = asyncio.get_running_loop()
        _tune(transport)
        if self.on_made is not None:
            self.on_made()

    def data_received(self, data: bytes) -> None:
        # Frames are parsed where they lie: in `data` itself while nothing is left over from an
        # earlier read (the common case: a read holds whole frames), else in the buffer that
        # collects the pieces of a frame. Only an unfinished frame's bytes are copied, once.
        buffer = self._buffer
        try:
            if buffer or self._expect:
                buffer += data
                if self._expect and not self._preamble_checked():
                    return
                with memoryview(buffer) as view:
                    at = self._frames(view)
                del buffer[:at]
            else:
                with memoryview(data) as view:
                    at = self._frames(view)
                    if at < len(data):
                        buffer += view[at:]
        except (FrameError, DecodeError) as err:
            self.abort(err if isinstance(err, FrameError) else FrameError("a frame did not parse"))
            return
        if self._inbox:
            self._wake()

    def _frames(self, view: memoryview) -> int:
        """Parses and hands on the whole frames at the start of `view`; how many bytes they
        took."""
        at = 0
        parse = self._parse
        while len(view) - at >= 4:
            (size,) = _SIZE.unpack_from(view, at)
            if size > MAX_FRAME_BYTES:
                raise FrameError(f"a frame of {size} bytes is over {MAX_FRAME_BYTES}")
            end = at + 4 + size
            if len(view) < end:
                break
            message = parse(view[at + 4 : end])  # type: ignore[arg-type]
            at = end
            if self._on_message is not None:
                self._on_message(message)
            else:
                self._inbox.append(message)
        return at

    def _preamble_checked(self) -> bool:
        """True once the preamble came and matched (it is taken off the buffer); FrameError
        as soon as what came differs from it."""
        size = len(self._expect)
        head = bytes(self._buffer[:size])
        if not self._expect.startswith(head):
            raise FrameError("not a connection of this stream (wrong preamble)")
        if len(head) < size:
            return False
        del self._buffer[:size]
        self._expect = b""
        return True

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        self._ended()
        return self._server_side

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.error is None and exc is not None:
            self.error = exc
        self._wake()
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        self._ended()
        if self.on_lost is not None:
            self.on_lost()

    def pause_writing(self) -> None:
        if self._writable is None or self._writable.done():
            self._writable = (self._loop or asyncio.get_running_loop()).create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    def listen(self, on_message: Callable[[In], None], on_end: Callable[[], None]) -> None:
        """Hands every message to `on_message` as it is read (those read before first), and
        calls `on_end` once when the peer closed its side or the connection ended."""
        while self._inbox:
            on_message(self._inbox.popleft())
        self._on_message = on_message
        self._on_end = on_end
        if self.eof or self.lost:
            self._ended()

    def _ended(self) -> None:
        on_end, self._on_end = self._on_end, None
        if on_end is not None:
            on_end()

    @property
    def writable(self) -> bool:
        """Open, and the peer keeps up (a send now is not queued past the write buffer)."""
        transport = self.transport
        if self.lost or transport is None or transport.is_closing():
            return False
        return self._writable is None or self._writable.done()

    # Frames

    def send(self, message: Sendable) -> None:
        """Queues one frame (raises FrameError when it is too large to send). A small frame
        goes as one buffer; a large one (a 60 KB request, a record with a prompt's ids) as its
        pieces in one vectored write, never copied into one buffer first."""
        parts = message.parts() if isinstance(message, Batch) else [message.SerializeToString()]
        size = sum(map(len, parts))
        if size > MAX_FRAME_BYTES:
            raise FrameError(f"a message of {size} bytes is over {MAX_FRAME_BYTES}")
        if self.transport is None:
            raise FrameError("the connection is not open")
        if size < _JOINED_BELOW:
            self.transport.write(b"".join((_SIZE.pack(size), *parts)))
        else:
            self.transport.writelines((_SIZE.pack(size), *parts))

    async def drained(self) -> None:
        """Returns once the connection takes more (at once unless the peer is behind)."""
        writable = self._writable
        if writable is not None and not writable.done():
            await writable

    async def next(self) -> In | None:
        """The next message; None once the peer closed its side or the connection ended."""
        while not self._inbox:
            if self.eof or self.lost:
                return None
            self._waiter = (self._loop or asyncio.get_running_loop()).create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._inbox.popleft()

    def abort(self, error: Exception) -> None:
        """Ends the connection at once (`error` says why)."""
        if self.error is None:
            self.error = error
        if self.transport is not None:
            self.transport.abort()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class FramedCall(Generic[In]):
    """The client's side of a framed stream, used as a grpc.aio stream-stream call is."""

    def __init__(self, connection: _Connection[In], *, peer: str) -> None:
        self._connection = connection
        self._peer = peer

    @classmethod
    async def connect(
        cls, host: str, port: int, *, preamble: bytes, parse: Callable[[bytes], In], peer: str
    ) -> FramedCall[In]:
        """A connection to the stream at host:port (OSError / TimeoutError when there is none
        within CONNECT_TIMEOUT_S)."""
        loop = asyncio.get_running_loop()
        connection: _Connection[In] = _Connection(parse)
        async with asyncio.timeout(CONNECT_TIMEOUT_S):
            await loop.create_connection(lambda: connection, host, port)
        if connection.transport is None:
            raise ConnectionError("the connection closed as it opened")
        connection.transport.write(preamble)
        return cls(connection, peer=peer)

    async def write(self, message: Message) -> None:
        connection = self._connection
        if connection.lost or connection.transport is None or connection.transport.is_closing():
            raise self._broken()
        self.send_now(message)
        await connection.drained()

    def listen(self, on_message: Callable[[In], None], on_end: Callable[[], None]) -> None:
        """Instead of `read`: each message to `on_message` as it arrives, then `on_end` (the
        error, if it broke, is `ended_by()`)."""
        self._connection.listen(on_message, on_end)

    def ended_by(self) -> grpc.aio.AioRpcError | None:
        """Why the stream ended: None for the server's clean end."""
        return self._broken() if self._connection.error is not None else None

    @property
    def writable(self) -> bool:
        """Whether `send_now` may write (open, the peer keeping up)."""
        return self._connection.writable

    def send_now(self, message: Sendable) -> None:
        """Writes at once (check `writable` first): what `write` does without waiting."""
        try:
            self._connection.send(message)
        except FrameError as err:
            raise rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err)) from None

    async def read(self) -> Any:
        """The next message, grpc.aio.EOF once the server ended the stream."""
        message = await self._connection.next()
        if message is not None:
            return message
        if self._connection.error is not None:
            raise self._broken()
        return grpc.aio.EOF

    async def done_writing(self) -> None:
        transport = self._connection.transport
        if transport is not None and not transport.is_closing() and transport.can_write_eof():
            transport.write_eof()

    def cancel(self) -> bool:
        transport = self._connection.transport
        if transport is None or transport.is_closing():
            return False
        transport.close()
        return True

    def _broken(self) -> grpc.aio.AioRpcError:
        error = self._connection.error
        if isinstance(error, FrameError):
            return rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self._peer}: {error}")
        reason = type(error).__name__ if error is not None else "closed"
        return rpc_error(
            grpc.StatusCode.UNAVAILABLE, f"the framed stream to the {self._peer} broke ({reason})"
        )


def framed_host(target: str) -> str | None:
    """The host a gRPC target names (`host:port`, `ipv4:h:p`, `dns:///h:p`, `[::1]:p`), None
    for what a plain connection cannot reach (a unix socket, several addresses)."""
    rest = target
    for scheme in ("dns:", "ipv4:", "ipv6:"):
        if rest.startswith(scheme):
            rest = rest[len(scheme) :]
            if scheme == "dns:" and rest.startswith("//"):
                rest = rest[2:].partition("/")[2]  # dns://[authority]/host:port
            break
    if not rest or "," in rest or rest.startswith("unix") or "/" in rest:
        return None
    if rest.startswith("["):
        host, _, after = rest[1:].partition("]")
        return host if after.startswith(":") and host else None
    host, sep, _ = rest.rpartition(":")
    return host if sep and host and ":" not in host else None


class PeerStream:
    """The stream to the peer at `address` (a gRPC target), the way `BatchedCall` drives a
    call: framed when the peer offers it (its `endpoint` call, `Worker.TurnsEndpoint` or
    `DataProxy.LedgerEndpoint`, names the port; 0 or UNIMPLEMENTED: none; None: not asked),
    else `open_grpc()`; `on_open(peer, transport)` once it is open.

    Opening runs in the background; `write` and `read` wait for it. An endpoint call that fails
    otherwise (the peer is down) fails the stream as the gRPC call would have; a port that
    cannot be connected to (a NetworkPolicy without it, say) is logged and the gRPC stream is
    used.
    """

    def __init__(
        self,
        *,
        open_grpc: Callable[[], Any],
        endpoint: Callable[..., Awaitable[Any]] | None,
        address: str,
        preamble: bytes,
        parse: Callable[[bytes], Any],
        peer: str,
        on_open: Callable[[str, str], None] | None = None,
    ) -> None:
        self._open_grpc = open_grpc
        # Called with (peer, transport) once the stream is open (the gateway's metrics).
        self._on_open = on_open
        host = framed_host(address) if address else None
        self._endpoint = endpoint if host else None
        self._host = host or ""
        self._preamble = preamble
        self._parse = parse
        self.peer = peer
        # "framed" or "grpc" once open.
        self.transport = ""
        self._opening: asyncio.Task[Any] = asyncio.create_task(self._open(), name=f"open-{peer}")

    async def _open(self) -> Any:
        port = 0
        if self._endpoint is not None:
            try:
                answer = await self._endpoint(
                    common_pb2.FramedEndpointRequest(), timeout=ENDPOINT_TIMEOUT_S
                )
                port = int(answer.port)
            except grpc.aio.AioRpcError as err:
                if err.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
        if port:
            try:
                call = await FramedCall.connect(
                    self._host, port, preamble=self._preamble, parse=self._parse, peer=self.peer
                )
            except (OSError, TimeoutError) as err:
                log.warning(
                    "framed_stream_unreachable_using_grpc",
                    peer=self.peer,
                    port=port,
                    error=type(err).__name__,
                )
            else:
                self._opened("framed", port=port)
                return call
        self._opened("grpc")
        return self._open_grpc()

    def _opened(self, transport: str, **fields: Any) -> None:
        self.transport = transport
        log.info("peer_stream_opened", peer=self.peer, transport=transport, **fields)
        if self._on_open is not None:
            self._on_open(self.peer, transport)

    async def framed(self) -> FramedCall[Any] | None:
        """The framed call once open (None: the stream is gRPC), for `listen`/`send_now`."""
        call = await self._opening
        return call if isinstance(call, FramedCall) else None

    async def write(self, message: Message) -> None:
        call = await self._opening
        await call.write(message)

    async def read(self) -> Any:
        call = await self._opening
        return await call.read()

    async def done_writing(self) -> None:
        call = await self._opening
        await call.done_writing()

    def cancel(self) -> bool:
        if not self._opening.done():
            self._opening.cancel()
            return True
        if self._opening.cancelled() or self._opening.exception() is not None:
            return False
        return bool(self._opening.result().cancel())


class Requests(Generic[In]):
    """A framed connection's messages as `serve` reads them: iterated (`async for`: a task
    wakes per message), or handed to a callback from the connection's read callback as they
    are read (`listen`: no task wakes; the serve function does its own waiting for the end)."""

    __slots__ = ("_connection",)

    def __init__(self, connection: _Connection[In]) -> None:
        self._connection = connection

    def __aiter__(self) -> Requests[In]:
        return self

    async def __anext__(self) -> In:
        message = await self._connection.next()
        if message is None:
            raise StopAsyncIteration
        return message

    def listen(self, on_message: Callable[[In], None], on_end: Callable[[], None]) -> None:
        """Every message to `on_message` as it is read (must not raise), then `on_end` once
        when the peer closed its side or the connection ended (instead of iterating)."""
        self._connection.listen(on_message, on_end)


async def take_each(requests: AsyncIterator[In], take: Callable[[In], None], *, name: str) -> None:
    """Hands each request to `take` and returns once they end: a framed stream's (`Requests`)
    from its connection's read callback, without a task waking per message; any other's
    (a gRPC stream's) by iterating. An error `take` raises on a framed stream (a bug) is logged
    and ends the stream; elsewhere it propagates."""
    listen = getattr(requests, "listen", None)
    if listen is None:
        async for request in requests:
            take(request)
        return
    ended = asyncio.get_running_loop().create_future()

    def end() -> None:
        if not ended.done():
            ended.set_result(None)

    def taken(request: In) -> None:
        if ended.done():
            return  # the stream is ending (or its reader was cancelled)
        try:
            take(request)
        except Exception:
            log.exception("framed_stream_failed", stream=name)
            end()

    listen(taken, end)
    try:
        await ended
    finally:
        end()


class FramedServer(Generic[In, Out]):
    """Serves one stream framed: each connection's requests go to `serve`, what it yields (or,
    with `sends`, what it hands to its `send`) goes back; `close` stops listening and ends the
    connections still open."""

    def __init__(
        self,
        serve: Callable[..., AsyncIterator[Out]],
        *,
        preamble: bytes,
        parse: Callable[[bytes], In],
        name: str,
        sends: bool = False,
    ) -> None:
        self._serve = serve
        # `serve(requests, send=…)` writes its messages itself (through `send`, at once)
        # instead of yielding them: no task wakes per message it sends.
        self._sends = sends
        self._preamble = preamble
        self._parse = parse
        self.name = name
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0

    async def start(self, host: str, port: int) -> None:
        """Listens on host:port (0: any free port; `self.port` is the bound one)."""
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(self._connected, host, port)
        except OSError as err:
            raise OSError(
                f"{self.name}: cannot listen on {host}:{port} for its framed stream "
                f"({err.strerror or err}): choose another port, or `off`"
            ) from None
        self.port = self._server.sockets[0].getsockname()[1]

    def _connected(self) -> _Connection[In]:
        connection: _Connection[In] = _Connection(self._parse, expect=self._preamble)
        task: asyncio.Task[None] | None = None

        def made() -> None:
            nonlocal task
            task = asyncio.get_running_loop().create_task(
                self._run(connection), name=f"{self.name}-framed"
            )
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        def lost() -> None:
            # The gateway went away (or sent what is not a frame): its stream stops, as a
            # cancelled gRPC call stops its handler (what still runs on it is cancelled).
            if task is not None and not task.done():
                task.cancel()

        connection.on_made = made
        connection.on_lost = lost
        return connection

    async def _run(self, connection: _Connection[In]) -> None:
        requests = Requests(connection)
        if self._sends:
            messages = self._serve(requests, send=self._sender(connection))
        else:
            messages = self._serve(requests)
        try:
            async for message in messages:
                connection.send(message)
                await connection.drained()
        except FrameError as err:
            log.warning("framed_stream_message_too_large", stream=self.name, error=str(err))
        finally:
            # Its turns stop now (cancelled with the connection, or ended), not when collected.
            aclose = getattr(messages, "aclose", None)
            if aclose is not None:
                await aclose()
            if connection.error is not None and isinstance(connection.error, FrameError):
                log.warning("framed_stream_refused", stream=self.name, error=str(connection.error))
            if connection.transport is not None:
                connection.transport.close()

    def _sender(self, connection: _Connection[In]) -> Callable[[Sendable], None]:
        def send(message: Sendable) -> None:
            try:
                connection.send(message)
            except FrameError as err:  # too large: the stream cannot go on (as `_run` does)
                log.warning("framed_stream_message_too_large", stream=self.name, error=str(err))
                connection.abort(ConnectionAbortedError("a message too large to send"))
            except (OSError, RuntimeError):
                pass  # the connection is going away: its stream is being stopped

        return send

    async def close(self) -> None:
        """Stops listening; the connections still open are ended (their streams stop)."""
        for task in list(self._tasks):
            await cancel_and_wait(task)  # each closes its connection as it ends
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None


async def serve_framed(
    stack: AsyncExitStack,
    serve: Callable[..., AsyncIterator[Out]],
    *,
    host: str,
    port: int | None,
    preamble: bytes,
    parse: Callable[[bytes], In],
    name: str,
    sends: bool = False,
) -> int:
    """Serves `serve` framed on host:port until `stack` closes (None: not at all); the bound
    port (0 when off). Entered before the gRPC server, it closes after that server's stop
    sequence: its drains end the streams (framed ones included), then the listener goes."""
    if port is None:
        return 0
    server: FramedServer[In, Out] = FramedServer(
        serve, preamble=preamble, parse=parse, name=name, sends=sends
    )
    await server.start(host, port)
    stack.push_async_callback(server.close)
    log.info("framed_stream_listening", stream=name, host=host, port=server.port)
    return server.port
