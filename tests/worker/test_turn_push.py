"""A streamed turn on the worker's Turns stream, its answer carried from the HTTP/1.1 client's
read callback to the TurnEvent (`TurnRunner.push`, no task wake-up per read): what it keeps
of the generator path — the flow-control window (reading pauses, credit resumes it), the
request's deadline, abort, cancel, an upstream error mid-stream, a broken stream, and an
answer however its bytes are cut. Real things: the mock LLM, or a scripted socket server
replaying the mock's own bytes; the worker's TurnStreams fed its ops as a gateway sends them."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import fcntl
import termios
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import orjson
import pytest

from protos import worker_pb2
from rollgate.mock_llm import MockLLM
from services.runtime.errors import RollgateError, UpstreamError, UpstreamTimeout, from_payload
from services.runtime.framed import Sendable
from services.runtime.metrics import ServiceMetrics
from services.runtime.secret import Secret
from services.worker.adapters import adapter_for
from services.worker.http1 import _Connection
from services.worker.metrics import WorkerMetrics
from services.worker.turn_streams import TurnStreams
from services.worker.turns import TurnRunner
from services.worker.upstream import UpstreamClient
from services.worker.wire import client_of
from tests.harness.poll import eventually
from tests.worker.harness import unpacked
from tests.worker.test_http1 import read_request, scripted
from tests.worker.test_worker_grpc import LONG_TEXT, body


class Turns:
    """One Turns stream of a worker (TurnStreams over a real TurnRunner and UpstreamClient):
    ops in as a gateway sends them, every event it sends kept by turn id."""

    def __init__(self, runner: TurnRunner, upstream: UpstreamClient, metrics: WorkerMetrics):
        self.runner = runner
        self.upstream = upstream
        self.metrics = metrics
        self.events: dict[int, list[worker_pb2.TurnEvent]] = collections.defaultdict(list)
        self.ops: asyncio.Queue[worker_pb2.TurnOps | None] = asyncio.Queue()
        # The task serving the stream (cancelled: the gateway went away).
        self.serving: asyncio.Task[None] | None = None

    async def requests(self) -> AsyncIterator[worker_pb2.TurnOps]:
        while (ops := await self.ops.get()) is not None:
            yield ops

    def take(self, message: Sendable) -> None:
        # What the framed stream would write: a TurnEvents (a Batch of them), as its bytes.
        for event in worker_pb2.TurnEvents.FromString(message.SerializeToString()).events:
            self.events[event.id].append(event)

    def _op(self, op: worker_pb2.TurnOp) -> None:
        self.ops.put_nowait(worker_pb2.TurnOps(ops=[op]))

    def start(
        self,
        turn_id: int,
        payload: bytes,
        *,
        window_bytes: int = 256 * 1024,
        timeout_s: float = 10.0,
        request_id: str = "",
    ) -> None:
        request = worker_pb2.GenerateRequest(body_json=payload, request_id=request_id)
        start = worker_pb2.TurnStart(
            request=request, stream=True, window_bytes=window_bytes, timeout_s=timeout_s
        )
        self._op(worker_pb2.TurnOp(id=turn_id, start=start))

    def credit(self, turn_id: int, credit_bytes: int) -> None:
        self._op(worker_pb2.TurnOp(id=turn_id, credit_bytes=credit_bytes))

    def cancel(self, turn_id: int) -> None:
        self._op(worker_pb2.TurnOp(id=turn_id, cancel=True))

    def ended(self, turn_id: int) -> worker_pb2.TurnEvent | None:
        """The turn's last event once it ended (its record or its error)."""
        events = self.events.get(turn_id)
        if events and (events[-1].generated.HasField("record") or events[-1].error_json):
            return events[-1]
        return None

    async def end_of(self, turn_id: int, *, interval_s: float = 0.02) -> worker_pb2.TurnEvent:
        found = await eventually(
            lambda: self.ended(turn_id), interval_s=interval_s, what=f"turn {turn_id} ended"
        )
        assert found is not None
        return found

    def chunks(self, turn_id: int) -> list[dict[str, Any]]:
        return [
            orjson.loads(chunk)
            for event in self.events[turn_id]
            for chunk in event.generated.chunks.chunks
        ]

    def error(self, turn_id: int) -> RollgateError:
        ended = self.ended(turn_id)
        assert ended is not None and ended.error_json, ended
        error = from_payload(ended.error_json)
        assert error is not None
        return error

    def connections(self) -> list[_Connection]:
        """The HTTP/1.1 client's connections to the upstream."""
        pool = self.upstream._http1
        return [] if pool is None else list(pool._all)

    def turns_counted(self, outcome: str) -> float:
        value = self.metrics.turns.labels(stream="true", outcome=outcome)._value.get()
        return float(value)


@contextlib.asynccontextmanager
async def turns_on(base_url: str) -> AsyncIterator[Turns]:
    """A worker's Turns stream calling the upstream at `base_url`."""
    async with UpstreamClient(base_url=base_url, api_key=Secret("")) as upstream:
        runner = TurnRunner(upstream=upstream, adapter=adapter_for("vllm"))
        metrics = WorkerMetrics(ServiceMetrics("worker"), runner)
        turns = Turns(runner, upstream, metrics)
        streams = TurnStreams(runner, upstream_timeout_s=30.0, metrics=metrics)

        async def serve() -> None:
            async for _ in streams.serve(turns.requests(), send=turns.take):
                pass

        serving = turns.serving = asyncio.create_task(serve())
        try:
            yield turns
        finally:
            turns.ops.put_nowait(None)  # the gateway closes its side
            serving.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await serving


async def mock_answer(mock: MockLLM, payload: bytes) -> bytes:
    """The SSE body the mock streams for the worker's upstream request of `payload`."""
    async with UpstreamClient(base_url=mock.base_url, api_key=Secret("")) as upstream:
        runner = TurnRunner(upstream=upstream, adapter=adapter_for("vllm"))
        request = runner._request(
            client_of(worker_pb2.GenerateRequest(body_json=payload)), stream=True
        )
    async with (
        aiohttp.ClientSession() as session,
        session.post(mock.base_url + "/chat/completions", data=request.body) as response,
    ):
        assert response.status == 200
        return await response.read()


HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def sse_events(sse: bytes) -> list[bytes]:
    """The events of an SSE body, each with its blank line."""
    return [event + b"\n\n" for event in sse.split(b"\n\n") if event]


def chunks_of(events: list[bytes]) -> bytes:
    """`events` in HTTP/1.1 chunks, one each."""
    return b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events)


def chunked_answer(sse: bytes) -> bytes:
    """An HTTP/1.1 answer carrying `sse`, one chunk per event, as an engine's server sends it."""
    return HEAD + chunks_of(sse_events(sse)) + b"0\r\n\r\n"


@contextlib.asynccontextmanager
async def stalling(
    answer: bytes, *, then: list[bytes] | None = None
) -> AsyncIterator[tuple[int, asyncio.Event, asyncio.Queue[bytes]]]:
    """A server that sends `answer` (the start of one), then what is put in its queue until
    b"" (`then` puts that at once), then nothing until its client drops the connection (the
    event is set then); its port."""
    dropped = asyncio.Event()
    more: asyncio.Queue[bytes] = asyncio.Queue()
    for part in then or []:
        more.put_nowait(part)

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answer)
        while part := await more.get():
            writer.write(part)
        await writer.drain()
        await reader.read()  # b"" once the client closed the connection
        dropped.set()

    async with scripted(script) as (port, _):
        yield port, dropped, more


@contextlib.contextmanager
def loop_errors() -> Iterator[list[dict[str, Any]]]:
    """What reaches the event loop's exception handler meanwhile (an error that escaped a
    protocol callback would)."""
    loop = asyncio.get_running_loop()
    seen: list[dict[str, Any]] = []
    before = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: seen.append(context))
    try:
        yield seen
    finally:
        loop.set_exception_handler(before)


def unread_bytes(connection: _Connection) -> int:
    """Bytes waiting in the client's socket: 0 once its read callback took what came."""
    assert connection.transport is not None
    sock = connection.transport.get_extra_info("socket")
    return int.from_bytes(fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0" * 4), "little")


def answer_of(turns: Turns, turn_id: int) -> tuple[list[dict[str, Any]], tuple[Any, ...]]:
    """A finished turn's client chunks and what its record says (without its timing)."""
    ended = turns.ended(turn_id)
    assert ended is not None and ended.generated.HasField("record"), ended
    record = unpacked(ended.generated.record)
    said = (
        record.interaction_id,
        record.output_token_ids,
        record.output_logprobs,
        record.prompt_token_ids,
        record.finish_reason,
    )
    return turns.chunks(turn_id), said


@pytest.mark.parametrize("piece", [1, 3, 64])
async def test_an_answer_cut_at_every_byte_reads_as_the_whole_answer(piece: int) -> None:
    # The mock's own answer, replayed whole (one write: body bytes come with the head), then
    # in pieces of `piece` bytes, each read by the client on its own before the next is
    # written: with 1, every byte boundary of the head, the chunk framing, the SSE lines and
    # the JSON is a cut.
    payload = body("hi", stream=True, max_tokens=3)
    async with MockLLM(port=0) as mock:
        answer = chunked_answer(await mock_answer(mock, payload))
    pieces: asyncio.Queue[int] = asyncio.Queue()
    worker: list[Turns] = []

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            size = await pieces.get()
            (connection,) = (c for c in worker[0].connections() if c.response is not None)
            for at in range(0, len(answer), size):
                writer.write(answer[at : at + size])
                await writer.drain()
                # The client's read callback takes this piece on its own.
                await eventually(lambda c=connection: unread_bytes(c) == 0, interval_s=0)

    async with scripted(script) as (port, _), turns_on(f"http://127.0.0.1:{port}/v1") as turns:
        worker.append(turns)
        pieces.put_nowait(len(answer))
        turns.start(1, payload)
        await turns.end_of(1)
        whole = answer_of(turns, 1)
        assert whole[1][-1] == "length" and len(whole[1][1]) == 3
        assert len(whole[0]) == 4  # the role chunk, three tokens (the last with its reason)
        pieces.put_nowait(piece)
        turns.start(2, payload)
        await turns.end_of(2)
        assert answer_of(turns, 2) == whole
        assert len(turns.events[2]) > 3  # the chunks came as they were read, not at the end
        assert turns.runner.in_flight == 0
        assert turns.turns_counted("ok") == 2


# A few events' worth of client chunks (each ≈ 150 bytes without logprobs).
WINDOW = 600


def base_url(mock: MockLLM, client: str) -> str:
    """The mock's URL for the HTTP/1.1 client (`http1`: pushed from its read callback) or
    aiohttp's (`aiohttp`, a base URL with credentials: the generator path)."""
    if client == "http1":
        return mock.base_url
    return mock.base_url.replace("http://", "http://user:secret@")


@pytest.mark.parametrize("client", ["http1", "aiohttp"])
async def test_a_turn_past_its_window_holds_its_upstream_back_until_credit_comes(
    client: str,
) -> None:
    async with (
        MockLLM(port=0, token_interval_ms=5, answer_tokens=40) as mock,
        turns_on(base_url(mock, client)) as turns,
    ):
        turns.start(1, body(LONG_TEXT, stream=True), window_bytes=WINDOW)
        await eventually(lambda: sum(e.size for e in turns.events[1]) >= WINDOW)
        if client == "http1":
            # The event past the window is held, and the connection is not read meanwhile.
            await eventually(
                lambda: [c.paused for c in turns.connections()], want=[True], what="paused"
            )
        # The mock wrote its whole answer (into the socket buffers): none of it went on.
        await eventually(lambda: mock.stats.streams_finished, want=1)
        sent = list(turns.events[1])
        assert turns.ended(1) is None
        assert sum(e.size for e in sent[:-1]) < WINDOW <= sum(e.size for e in sent)
        assert all(e.size > 0 for e in sent)

        turns.credit(1, 1 << 20)
        last = await turns.end_of(1)
        record = unpacked(last.generated.record)
        assert record.finish_reason == "stop" and len(record.output_token_ids) == 40
        content = "".join(c["choices"][0]["delta"].get("content") or "" for c in turns.chunks(1))
        assert content and content.count(" ") >= 30  # every token reached the client
        assert not any(c.paused for c in turns.connections())
        assert turns.runner.in_flight == 0
        assert turns.turns_counted("ok") == 1


async def test_a_stream_that_stalls_mid_answer_fails_as_timed_out_at_the_turns_deadline() -> None:
    payload = body("hi", stream=True, max_tokens=3)
    async with MockLLM(port=0) as mock:
        events = sse_events(await mock_answer(mock, payload))
    async with (
        stalling(HEAD + chunks_of(events[:2]), then=[b""]) as (port, dropped, _),
        turns_on(f"http://127.0.0.1:{port}/v1") as turns,
    ):
        turns.start(1, payload, timeout_s=0.3)
        await turns.end_of(1)
        error = turns.error(1)
        assert isinstance(error, UpstreamTimeout)
        assert error.message == "the upstream did not finish its answer in time"
        assert len(turns.chunks(1)) == 2  # the role chunk and the first token went on
        assert turns.runner.in_flight == 0
        assert turns.turns_counted("timeout") == 1
        await eventually(dropped.is_set, what="the upstream connection dropped")


@pytest.mark.parametrize("client", ["http1", "aiohttp"])
async def test_abort_ends_the_turn_with_an_abort_chunk_and_the_partial_record(client: str) -> None:
    async with (
        MockLLM(port=0, token_interval_ms=50) as mock,
        turns_on(base_url(mock, client)) as turns,
    ):
        turns.start(1, body(LONG_TEXT, stream=True, max_tokens=200), request_id="run-1")
        await eventually(lambda: turns.events[1], what="the first event")
        assert turns.runner.abort("run-1") is True
        last = await turns.end_of(1)
        record = unpacked(last.generated.record)
        chunks = turns.chunks(1)
        assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
        assert record.finish_reason == "abort"
        assert 0 < len(record.output_token_ids) < 200
        assert len(record.output_logprobs) == len(record.output_token_ids)
        assert record.interaction_id == chunks[0]["id"]
        await eventually(lambda: mock.stats.disconnects, want=1, what="the upstream call closed")
        assert mock.stats.streams_finished == 0
        assert turns.runner.in_flight == 0
        assert turns.turns_counted("ok") == 1


async def test_a_cancelled_turn_and_an_ended_stream_close_their_upstream_calls() -> None:
    async with (
        MockLLM(port=0, token_interval_ms=50) as mock,
        turns_on(mock.base_url) as turns,
    ):
        turns.start(1, body(LONG_TEXT, stream=True))
        turns.start(2, body(LONG_TEXT, stream=True))
        await eventually(lambda: turns.events[1] and turns.events[2], what="first events")
        turns.cancel(1)
        await eventually(lambda: mock.stats.disconnects, want=1, what="turn 1's call closed")
        assert turns.runner.in_flight == 1
        assert turns.serving is not None
        turns.serving.cancel()  # the gateway went away: the stream ends
        await eventually(lambda: mock.stats.disconnects, want=2, what="turn 2's call closed")
        assert turns.runner.in_flight == 0
        assert mock.stats.streams_finished == 0
        assert turns.ended(1) is None and turns.ended(2) is None
        assert turns.turns_counted("ok") == 0


async def test_an_upstream_error_mid_stream_fails_the_turn_and_drops_the_connection() -> None:
    payload = body("hi", stream=True, max_tokens=3)
    async with MockLLM(port=0) as mock:
        events = sse_events(await mock_answer(mock, payload))
    failure = b'data: {"error": {"message": "boom", "code": 500}}\n\n'
    with loop_errors() as escaped:
        async with (
            stalling(HEAD + chunks_of(events[:1])) as (port, dropped, more),
            turns_on(f"http://127.0.0.1:{port}/v1") as turns,
        ):
            turns.start(1, payload)
            await eventually(lambda: turns.chunks(1), what="the first chunk")
            more.put_nowait(chunks_of([failure]))  # read by the connection's callback
            more.put_nowait(b"")
            await turns.end_of(1)
            error = turns.error(1)
            assert isinstance(error, UpstreamError)
            assert error.message == "the upstream failed mid-stream: boom"
            assert len(turns.chunks(1)) == 1
            # The read callback closed the response: the upstream sees its client go.
            await eventually(dropped.is_set, what="the upstream connection dropped")
            assert turns.runner.in_flight == 0
            assert turns.turns_counted("upstream_error") == 1
    assert escaped == []


async def test_a_stream_broken_midway_fails_after_the_chunks_already_sent() -> None:
    with loop_errors() as escaped:
        async with MockLLM(port=0) as mock, turns_on(mock.base_url) as turns:
            turns.start(1, body("/fail-midstream", stream=True))
            await turns.end_of(1)
            error = turns.error(1)
            assert isinstance(error, UpstreamError)
            assert error.code == "upstream_broken_stream"
            assert len(turns.chunks(1)) == 2  # the role chunk and the first token
            assert turns.runner.in_flight == 0
            assert turns.turns_counted("upstream_broken_stream") == 1
    assert escaped == []
