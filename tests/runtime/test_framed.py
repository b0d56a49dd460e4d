"""Framed streams (services/runtime/framed.py) on real loopback connections: messages in order
and intact across split reads, half-close and end, what is refused (a wrong preamble, a frame
too large, garbage), a client that goes away, and the choice between framed and gRPC."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest

from protos import dataproxy_pb2, worker_pb2
from rollgate.redis_server import free_port
from services.runtime import framed
from services.runtime.framed import Batch, FramedCall, FramedServer, PeerStream, framed_host
from services.runtime.settings import Sources, framed_port
from tests.harness.poll import eventually

PREAMBLE = b"rollgate-framed/1 test/Echo\n"


class Echo:
    """Answers each TurnOps with one TurnEvents of an event per op (its id, size = the op's
    credit), until the client half-closes; remembers whether its stream was closed."""

    def __init__(self) -> None:
        self.opened = 0
        self.closed = 0

    async def serve(
        self, requests: AsyncIterator[worker_pb2.TurnOps]
    ) -> AsyncIterator[worker_pb2.TurnEvents]:
        self.opened += 1
        try:
            async for batch in requests:
                yield worker_pb2.TurnEvents(
                    events=[
                        worker_pb2.TurnEvent(id=op.id, size=op.credit_bytes) for op in batch.ops
                    ]
                )
        finally:
            self.closed += 1


@contextlib.asynccontextmanager
async def echo_server() -> AsyncIterator[
    tuple[FramedServer[worker_pb2.TurnOps, worker_pb2.TurnEvents], Echo]
]:
    echo = Echo()
    server: FramedServer[worker_pb2.TurnOps, worker_pb2.TurnEvents] = FramedServer(
        echo.serve, preamble=PREAMBLE, parse=worker_pb2.TurnOps.FromString, name="echo"
    )
    await server.start("127.0.0.1", 0)
    try:
        yield server, echo
    finally:
        await server.close()


async def connect(port: int) -> FramedCall[worker_pb2.TurnEvents]:
    return await FramedCall.connect(
        "127.0.0.1", port, preamble=PREAMBLE, parse=worker_pb2.TurnEvents.FromString, peer="echo"
    )


def ops(*ids: int, credit: int = 0) -> worker_pb2.TurnOps:
    return worker_pb2.TurnOps(ops=[worker_pb2.TurnOp(id=i, credit_bytes=credit) for i in ids])


async def test_messages_come_back_in_order_then_the_stream_ends_after_a_half_close() -> None:
    async with echo_server() as (server, echo):
        call = await connect(server.port)
        for first in range(0, 300, 3):
            await call.write(ops(first, first + 1, first + 2, credit=first))
        await call.done_writing()
        ids: list[int] = []
        while (message := await call.read()) is not grpc.aio.EOF:
            ids.extend(event.id for event in message.events)
        assert ids == list(range(300))
        await eventually(lambda: echo.closed == 1, what="the server's stream closed")


async def test_a_large_message_crosses_whole() -> None:
    big = worker_pb2.TurnOps(
        ops=[worker_pb2.TurnOp(id=1, start=worker_pb2.TurnStart(traceparent="x" * 3_000_000))]
    )

    async def serve(
        requests: AsyncIterator[worker_pb2.TurnOps],
    ) -> AsyncIterator[worker_pb2.TurnOps]:
        async for batch in requests:
            yield batch

    server: FramedServer[worker_pb2.TurnOps, worker_pb2.TurnOps] = FramedServer(
        serve, preamble=PREAMBLE, parse=worker_pb2.TurnOps.FromString, name="mirror"
    )
    await server.start("127.0.0.1", 0)
    try:
        call = await FramedCall.connect(
            "127.0.0.1", server.port, preamble=PREAMBLE, parse=worker_pb2.TurnOps.FromString,
            peer="mirror",
        )  # fmt: skip
        await call.write(big)
        assert await call.read() == big
        call.cancel()
    finally:
        await server.close()


async def raw_connection(port: int, payload: bytes) -> bytes:
    """What the server sends back to `payload` before it closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(payload)
    await writer.drain()
    try:
        async with asyncio.timeout(10):
            return await reader.read()
    finally:
        writer.close()


async def test_a_wrong_preamble_a_huge_frame_or_garbage_ends_the_connection() -> None:
    async with echo_server() as (server, echo):
        assert await raw_connection(server.port, b"GET / HTTP/1.1\r\n\r\n") == b""
        huge = (framed.MAX_FRAME_BYTES + 1).to_bytes(4, "big")
        assert await raw_connection(server.port, PREAMBLE + huge) == b""
        assert await raw_connection(server.port, PREAMBLE + b"\x00\x00\x00\x03\xff\xff\xff") == b""
        # And the server goes on serving well-formed clients.
        call = await connect(server.port)
        await call.write(ops(7))
        message = await call.read()
        assert [e.id for e in message.events] == [7]
        call.cancel()
        await eventually(lambda: echo.closed == echo.opened, what="every stream closed")


async def test_a_client_that_goes_away_stops_its_stream() -> None:
    async with echo_server() as (server, echo):
        call = await connect(server.port)
        await call.write(ops(1))
        await call.read()
        assert echo.closed == 0
        assert call.cancel()
        await eventually(lambda: echo.closed == 1, what="the server's stream stopped")


async def test_a_server_that_closes_ends_the_call_and_later_writes_fail_unavailable() -> None:
    gate = asyncio.Event()

    async def serve(
        requests: AsyncIterator[worker_pb2.TurnOps],
    ) -> AsyncIterator[worker_pb2.TurnEvents]:
        async for _ in requests:
            yield worker_pb2.TurnEvents()  # the first answer, then held
            await gate.wait()

    server: FramedServer[worker_pb2.TurnOps, worker_pb2.TurnEvents] = FramedServer(
        serve, preamble=PREAMBLE, parse=worker_pb2.TurnOps.FromString, name="held"
    )
    await server.start("127.0.0.1", 0)
    call = await connect(server.port)
    await call.write(ops(1))
    assert await call.read() == worker_pb2.TurnEvents()  # all it sent has been read
    reading = asyncio.create_task(call.read())
    await server.close()  # its open streams are ended, the connection closed
    assert await reading is grpc.aio.EOF
    await eventually(lambda: call._connection.lost, what="the connection closed")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call.write(ops(1))
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(OSError):
        await connect(server.port)  # and nothing listens any more


async def test_a_message_over_the_frame_limit_is_refused_as_resource_exhausted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with echo_server() as (server, _):
        call = await connect(server.port)
        monkeypatch.setattr(framed, "MAX_FRAME_BYTES", 64)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call.write(ops(*range(100)))
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        call.cancel()


@pytest.mark.parametrize(
    ("target", "host"),
    [
        ("127.0.0.1:50052", "127.0.0.1"),
        ("ipv4:10.0.0.7:50052", "10.0.0.7"),
        ("dns:///rollgate-dataproxy:50052", "rollgate-dataproxy"),
        ("dns://8.8.8.8/dataproxy.ns.svc:50052", "dataproxy.ns.svc"),
        ("dns:dataproxy:50052", "dataproxy"),
        ("[::1]:50052", "::1"),
        ("ipv6:[fe80::1]:50052", "fe80::1"),
        ("unix:/tmp/dp.sock", None),
        ("ipv4:127.0.0.1:1,127.0.0.1:2", None),
        ("dataproxy", None),
        ("::1", None),
    ],
)
def test_framed_host_takes_the_host_of_a_grpc_target(target: str, host: str | None) -> None:
    assert framed_host(target) == host


class Answer:
    """What the endpoint call answers (FramedEndpointResponse's one field)."""

    def __init__(self, port: int) -> None:
        self.port = port


class Grpc:
    """Stands for a gRPC stream call: PeerStream only opens it (the choice is under test)."""

    opened = 0

    def __call__(self) -> Grpc:
        self.opened += 1
        return self

    def cancel(self) -> bool:
        return True


def peer(endpoint: object, grpc_call: Grpc, *, address: str = "127.0.0.1:1") -> PeerStream:
    return PeerStream(
        open_grpc=grpc_call,
        endpoint=endpoint,  # type: ignore[arg-type]
        address=address,
        preamble=PREAMBLE,
        parse=worker_pb2.TurnEvents.FromString,
        peer="echo",
    )


async def test_peer_stream_is_framed_when_offered_and_grpc_otherwise() -> None:
    async with echo_server() as (server, _):

        async def offered(request: object, **options: float) -> Answer:
            return Answer(server.port)

        async def none(request: object, **options: float) -> Answer:
            return Answer(0)

        async def unimplemented(request: object, **options: float) -> Answer:
            raise framed.rpc_error(grpc.StatusCode.UNIMPLEMENTED, "old peer")

        async def closed_port(request: object, **options: float) -> Answer:
            return Answer(free_port())

        async def down(request: object, **options: float) -> Answer:
            raise framed.rpc_error(grpc.StatusCode.UNAVAILABLE, "peer down")

        grpc_call = Grpc()
        stream = peer(offered, grpc_call)
        await stream.write(ops(3))
        assert [e.id for e in (await stream.read()).events] == [3]
        assert stream.transport == "framed" and grpc_call.opened == 0
        stream.cancel()

        for endpoint in (none, unimplemented, closed_port):
            grpc_call = Grpc()
            stream = peer(endpoint, grpc_call)
            assert await stream._opening is grpc_call
            assert stream.transport == "grpc"
        grpc_call = Grpc()
        stream = peer(offered, grpc_call, address="unix:/tmp/x.sock")  # no plain connection
        assert await stream._opening is grpc_call

        stream = peer(down, Grpc())
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stream.read()
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize(
    ("raw", "port"), [("", 0), ("0", 0), ("50063", 50063), ("off", None), (" OFF ", None)]
)
def test_the_framed_port_setting(raw: str, port: int | None) -> None:
    environ = {"ROLLGATE_WORKER_FRAMED_PORT": raw} if raw else {}
    assert framed_port(Sources(environ=environ), "worker") == port


@pytest.mark.parametrize("raw", ["-1", "65536", "fast", "5006x"])
def test_a_framed_port_that_is_not_one_is_refused_naming_the_setting(raw: str) -> None:
    with pytest.raises(ValueError, match="ROLLGATE_DATAPROXY_FRAMED_PORT") as caught:
        framed_port(Sources(environ={"ROLLGATE_DATAPROXY_FRAMED_PORT": raw}), "dataproxy")
    assert "0 for any free one, or off" in str(caught.value)


async def test_a_framed_port_in_use_fails_the_start_saying_what_to_do() -> None:
    async with echo_server() as (taken, _):
        server: FramedServer[worker_pb2.TurnOps, worker_pb2.TurnEvents] = FramedServer(
            Echo().serve, preamble=PREAMBLE, parse=worker_pb2.TurnOps.FromString, name="worker"
        )
        with pytest.raises(OSError, match=r"worker: cannot listen on 127\.0\.0\.1:\d+") as caught:
            await server.start("127.0.0.1", taken.port)
        assert "choose another port, or `off`" in str(caught.value)


async def test_listen_hands_each_message_over_as_it_is_read_then_the_end_once() -> None:
    async with echo_server() as (server, _):
        call = await connect(server.port)
        await call.write(ops(1))
        # Read before anyone listened: queued, then handed over first, in order.
        await eventually(lambda: len(call._connection._inbox) == 1, what="the first answer")
        got: list[int] = []
        ends: list[bool] = []
        call.listen(lambda m: got.extend(e.id for e in m.events), lambda: ends.append(True))
        assert got == [1]
        assert call.writable
        call.send_now(ops(2, 3))
        call.send_now(ops(4))
        await eventually(lambda: got == [1, 2, 3, 4], what="the later answers, in order")
        await call.done_writing()  # the server's stream ends after a half-close
        await eventually(lambda: ends == [True], what="the end")
        assert call.ended_by() is None  # a clean end
        await eventually(lambda: call._connection.lost, what="the connection closed")
        assert ends == [True]  # once
        assert not call.writable


class ListeningEcho:
    """Echo's answers, its requests taken by `take_each` (a framed stream's: from the
    connection's read callback, no task per message) and sent through `send`; an op with id
    `fail_on` makes the taking raise (a bug on the server's side)."""

    def __init__(self, fail_on: int = -1) -> None:
        self.fail_on = fail_on
        self.ended = 0

    async def serve(
        self,
        requests: framed.Requests[worker_pb2.TurnOps],
        *,
        send: Callable[[framed.Sendable], None],
    ) -> AsyncIterator[worker_pb2.TurnEvents]:
        def take(batch: worker_pb2.TurnOps) -> None:
            if any(op.id == self.fail_on for op in batch.ops):
                raise RuntimeError("a bug")
            send(worker_pb2.TurnEvents(events=[worker_pb2.TurnEvent(id=o.id) for o in batch.ops]))

        await framed.take_each(requests, take, name="listening-echo")
        self.ended += 1
        return
        yield  # an async generator that yields nothing: everything went through `send`


@contextlib.asynccontextmanager
async def listening_server(echo: ListeningEcho) -> AsyncIterator[FramedServer[Any, Any]]:
    server: FramedServer[Any, Any] = FramedServer(
        echo.serve,
        preamble=PREAMBLE,
        parse=worker_pb2.TurnOps.FromString,
        name="listening-echo",
        sends=True,
    )
    await server.start("127.0.0.1", 0)
    try:
        yield server
    finally:
        await server.close()


async def read_ids(call: FramedCall[worker_pb2.TurnEvents]) -> list[int]:
    ids: list[int] = []
    while (message := await call.read()) is not grpc.aio.EOF:
        ids.extend(event.id for event in message.events)
    return ids


async def test_a_server_can_take_its_requests_from_the_read_callback() -> None:
    echo = ListeningEcho()
    async with listening_server(echo) as server:
        call = await connect(server.port)
        for first in range(0, 30, 3):
            await call.write(ops(first, first + 1, first + 2))
        await call.done_writing()
        assert await read_ids(call) == list(range(30))
        assert echo.ended == 1


async def test_a_request_the_server_fails_to_take_ends_its_stream_not_the_process() -> None:
    echo = ListeningEcho(fail_on=4)
    async with listening_server(echo) as server:
        call = await connect(server.port)
        await call.write(ops(1, 2))
        await call.write(ops(3, 4))
        await call.write(ops(5))
        assert await read_ids(call) == [1, 2]
        assert echo.ended == 1
        # The server goes on: another connection is served.
        other = await connect(server.port)
        await other.write(ops(7))
        await other.done_writing()
        assert await read_ids(other) == [7]


async def test_a_broken_connection_ends_a_listener_with_unavailable() -> None:
    async with echo_server() as (server, _):
        call = await connect(server.port)
        ended = asyncio.Event()
        call.listen(lambda m: None, ended.set)
        await call.write(ops(1))
        call._connection.abort(ConnectionResetError())
        async with asyncio.timeout(10):
            await ended.wait()
        error = call.ended_by()
        assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("count", [0, 1, 3])
def test_a_batch_encodes_exactly_as_the_message_that_repeats_its_items(count: int) -> None:
    # Items of every size class of their length's varint (1, 2 and 3 bytes), in the four
    # batch messages the streams send.
    sizes = [10, 300, 70_000][:count]
    ops = [worker_pb2.TurnOp(id=i + 1) for i in range(count)]
    for op, size in zip(ops, sizes, strict=True):
        op.start.request.request_json = b"x" * size
    events = [worker_pb2.TurnEvent(id=i + 1, error_json=b"e" * s) for i, s in enumerate(sizes)]
    requests = [
        dataproxy_pb2.LedgerRequest(
            id=i + 1, record=dataproxy_pb2.RecordTurn(request_json=b"r" * s)
        )
        for i, s in enumerate(sizes)
    ]
    answers = [
        dataproxy_pb2.LedgerResponse(id=i + 1, error_json=b"a" * s) for i, s in enumerate(sizes)
    ]
    cases = [
        (worker_pb2.TurnOps(ops=ops), ops),
        (worker_pb2.TurnEvents(events=events), events),
        (dataproxy_pb2.LedgerRequests(ops=requests), requests),
        (dataproxy_pb2.LedgerResponses(answers=answers), answers),
    ]
    for message, items in cases:
        encoded = Batch(items).SerializeToString()
        assert encoded == message.SerializeToString()
        assert type(message).FromString(encoded) == message


def _frames(messages: list[worker_pb2.TurnOps]) -> bytes:
    out = bytearray()
    for message in messages:
        data = message.SerializeToString()
        out += len(data).to_bytes(4, "big") + data
    return bytes(out)


def test_frames_are_read_whole_however_the_reads_cut_them() -> None:
    # Parsed where they lie (in a read, or in the buffer collecting an unfinished frame): cut at
    # every byte, in a read each, many to a read, the last one unfinished until its final byte.
    messages = [ops(i, credit=i) for i in range(1, 4)] + [
        worker_pb2.TurnOps(
            ops=[worker_pb2.TurnOp(id=9, start=worker_pb2.TurnStart(traceparent="t" * 70_000))]
        )
    ]
    wire = _frames(messages)
    cuts = [[at] for at in range(1, len(_frames(messages[:3])) + 6)]
    cuts += [[len(wire) - 1], [4, 5, len(wire) - 70_000, len(wire) - 2], []]
    for cut in cuts:
        connection: Any = framed._Connection(worker_pb2.TurnOps.FromString)
        for start, end in zip([0, *cut], [*cut, len(wire)], strict=True):
            connection.data_received(wire[start:end])
        assert list(connection._inbox) == messages, cut
        assert not connection._buffer, cut


async def test_a_batch_of_large_and_small_items_crosses_whole() -> None:
    # A frame over the join threshold goes out as its pieces (a vectored write).
    async with echo_server() as (server, _):
        call = await connect(server.port)
        batch = [
            worker_pb2.TurnOp(id=1, credit_bytes=1),
            worker_pb2.TurnOp(id=2, start=worker_pb2.TurnStart(traceparent="p" * 40_000)),
            worker_pb2.TurnOp(id=3, credit_bytes=3),
        ]
        for _ in range(3):
            call.send_now(Batch(batch))
        got = []
        while len(got) < 9:
            got.extend((event.id, event.size) for event in (await call.read()).events)
        assert got == [(1, 1), (2, 0), (3, 3)] * 3
        call.cancel()
