"""The worker's `Turns` streams: many turns of one gateway over one long-lived stream.

A gateway keeps one `Worker.Turns` stream open per worker and sends each turn's start over
it (the GenerateRequest, whether it streams, its remaining budget, its traceparent, its
flow-control window) instead of a `Generate` or `Complete` call per turn; the turn's events
(chunk batches, the record, the answer or the error) come back with its id. A message on an
open stream costs a fraction of a call, and the cost is per message: every event that is
ready when the stream can write goes out in one `TurnEvents` (docs/internals.md, *What a
turn costs*).

One task per turn (what a call per turn costs grpc.aio anyway), none per chunk. Per-turn flow
control: a turn may send `window_bytes` of chunks ahead of what its gateway has handed on
(its credits); past that it waits, and so does its upstream read behind it, exactly as a call
per turn waits on its own HTTP/2 window, while the stream's other turns go on.
A cancel stops the turn (its upstream call is closed); a stream that ends (the gateway went
away) stops all of its turns. Shutdown (`close`) refuses new turns (`worker_stopping`: not
started, the gateway routes it to another worker), lets the running ones finish within the
grace period, then ends every stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

from protos import worker_pb2
from services.runtime.errors import RollgateError, Unavailable
from services.runtime.framed import Batch, Sendable, take_each
from services.runtime.grpc_server import as_rollgate_error, check_request_strings
from services.runtime.logs import get_logger
from services.runtime.tasks import PerLoopTurn, cancel_and_wait
from services.runtime.tracing import Span, TraceContext, Tracer
from services.worker.metrics import WorkerMetrics
from services.worker.turn import TurnResult
from services.worker.turns import StreamBatch, TurnRunner
from services.worker.wire import StreamedTurn, completed

log = get_logger(__name__)

SERVICE = "rollgate.v1.Worker"
STOPPING = "this worker is shutting down; the turn was not started, retry"
STOPPING_CODE = "worker_stopping"

# Called with (method: Generate | Complete, gRPC status code name, seconds, error message) as
# each turn on a stream ends: the RPC metrics count it like the call it replaces.
TurnHook = Callable[[str, str, float, str], None]


class _Turn:
    """One running turn of a stream: its task and its flow-control window."""

    __slots__ = ("_credit", "_window", "allowed", "id", "sent", "task")

    def __init__(self, turn_id: int, window_bytes: int) -> None:
        self.id = turn_id
        self._window = window_bytes
        # Bytes of events sent, and how many the gateway allows (its window + its credits).
        self.sent = 0
        self.allowed = window_bytes
        self._credit: asyncio.Event | None = None
        self.task: asyncio.Task[None] | None = None

    def grant(self, credit_bytes: int) -> None:
        """The gateway handed on `credit_bytes` more of this turn."""
        self.allowed += credit_bytes
        if self._credit is not None:
            self._credit.set()

    def spend_now(self, size: int) -> bool:
        """Counts `size` when the window has room (or the turn has none); False when it must
        wait for credit first (`spend`). One event may cross the window's end: the gateway
        credits once it has handed half a window on, so a turn never waits on credit its
        gateway is not going to send."""
        if self._window and self.sent >= self.allowed:
            return False
        self.sent += size
        return True

    async def spend(self, size: int) -> None:
        """Waits while the window is used up, then counts `size`."""
        while not self.spend_now(size):
            if self._credit is None:
                self._credit = asyncio.Event()
            self._credit.clear()
            await self._credit.wait()


class _Stream:
    """One open Turns stream: its outgoing events and its running turns.

    Events are sent together: everything queued in one turn of the event loop is one
    `TurnEvents`, written by a callback scheduled after them (`direct`: a framed stream's
    send) or yielded by `serve` (a gRPC stream's)."""

    def __init__(self, direct: Callable[[Sendable], None] | None = None) -> None:
        self.outbox: list[worker_pb2.TurnEvent] = []
        self.ready = asyncio.Event()
        self.turns: dict[int, _Turn] = {}
        # The gateway closed its side: the stream ends once its turns are done.
        self.read_all = False
        self.ended = False
        self._direct: PerLoopTurn[worker_pb2.TurnEvent] | None = None
        if direct is not None:
            self._direct = PerLoopTurn(lambda events: direct(Batch(events)))

    def send(self, event: worker_pb2.TurnEvent) -> None:
        if self._direct is not None:
            self._direct.put(event)
        else:
            self.outbox.append(event)
            self.ready.set()

    def end(self) -> None:
        if self._direct is not None:
            self._direct.flush_now()  # what was sent before the end goes out before it
        self.ended = True
        self.ready.set()


class _TurnEventsOut:
    """A streamed turn's events as `TurnEvent`s on its stream, within its flow-control window:
    an event past the window is held back (and the upstream's reading with it) until the
    gateway's credit lets it go (`flush`)."""

    __slots__ = ("_held", "_stream", "_streamed", "_turn")

    def __init__(self, stream: _Stream, turn: _Turn, streamed: StreamedTurn) -> None:
        self._stream = stream
        self._turn = turn
        self._streamed = streamed
        self._held: list[tuple[worker_pb2.TurnEvent, int]] = []

    def put(self, event: StreamBatch | TurnResult) -> bool:
        message = worker_pb2.TurnEvent(id=self._turn.id)
        size = self._streamed.fill(event, message.generated)
        if size is None:
            return True
        if self._held or not self._turn.spend_now(size):
            self._held.append((message, size))
            return False
        message.size = size
        self._stream.send(message)
        return True

    async def flush(self) -> None:
        held = self._held
        while held:
            message, size = held[0]
            await self._turn.spend(size)
            del held[0]
            message.size = size
            self._stream.send(message)


class TurnStreams:
    """Serves the Turns streams of this process over one TurnRunner."""

    def __init__(
        self,
        runner: TurnRunner,
        *,
        upstream_timeout_s: float,
        metrics: WorkerMetrics | None = None,
        on_turn: TurnHook | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        self._runner = runner
        self._upstream_timeout_s = upstream_timeout_s
        self._metrics = metrics
        self._on_turn = on_turn
        self._tracer = tracer
        self._streams: set[_Stream] = set()
        self._closing = False
        self._drained = asyncio.Event()

    @property
    def running(self) -> int:
        """Turns running on open streams."""
        return sum(len(s.turns) for s in self._streams)

    async def serve(
        self,
        requests: AsyncIterator[worker_pb2.TurnOps],
        *,
        send: Callable[[Sendable], None] | None = None,
    ) -> AsyncIterator[worker_pb2.TurnEvents]:
        """One stream's events until the gateway closes its side (and its turns are done) or
        this process shuts the stream down; each message carries every event that was ready.
        With `send` (a framed stream) the events go to it instead of being yielded."""
        stream = _Stream(send)
        self._streams.add(stream)
        reader = asyncio.create_task(self._read(stream, requests), name="turns-reader")
        try:
            while True:
                if stream.outbox:
                    events, stream.outbox = stream.outbox, []
                    yield worker_pb2.TurnEvents(events=events)
                elif stream.ended:
                    return
                else:
                    stream.ready.clear()
                    await stream.ready.wait()
        finally:
            await cancel_and_wait(reader)
            # The gateway went away (or the stream was ended): what still runs stops.
            tasks = [t.task for t in stream.turns.values() if t.task is not None]
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks)
            self._streams.discard(stream)
            self._check_drained()

    async def close(self, timeout_s: float) -> None:
        """Refuses new turns, waits (≤ timeout_s) for the running ones, then ends every stream."""
        self._closing = True
        self._check_drained()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._drained.wait()
        if self.running:
            log.warning("turn_streams_closed_with_running_turns", turns=self.running)
        for stream in list(self._streams):
            stream.end()

    def _check_drained(self) -> None:
        if self._closing and self.running == 0:
            self._drained.set()

    async def _read(self, stream: _Stream, requests: AsyncIterator[worker_pb2.TurnOps]) -> None:
        await take_each(requests, lambda batch: self._take(stream, batch), name="turns")
        stream.read_all = True
        if not stream.turns:
            stream.end()

    def _take(self, stream: _Stream, batch: worker_pb2.TurnOps) -> None:
        """Applies one message's ops: starts, cancels, credit."""
        for op in batch.ops:
            kind = op.WhichOneof("op")
            if kind == "start":
                self._start(stream, op.id, op.start)
                continue
            turn = stream.turns.get(op.id)
            if turn is None:
                continue  # already ended: its last event and this op crossed
            if kind == "cancel":
                del stream.turns[op.id]
                if turn.task is not None:
                    turn.task.cancel()
            elif kind == "credit_bytes":
                turn.grant(op.credit_bytes)
        if self._closing and not stream.turns:
            # Shutting down with nothing running here (its starts were refused): it ends
            # now, so the stop need not wait out a stream opened after it began.
            stream.end()

    def _start(self, stream: _Stream, turn_id: int, start: worker_pb2.TurnStart) -> None:
        try:
            if self._closing:
                raise Unavailable(STOPPING, code=STOPPING_CODE, retry_after_s=1.0)
            # Bounded per turn, as the server interceptor bounds each call's request.
            check_request_strings(start)
        except RollgateError as err:
            stream.send(worker_pb2.TurnEvent(id=turn_id, error_json=err.to_payload()))
            return
        turn = _Turn(turn_id, start.window_bytes)
        stream.turns[turn_id] = turn
        turn.task = asyncio.create_task(self._run(stream, turn, start))

    def _budget_s(self, start: worker_pb2.TurnStart) -> float:
        cap = self._upstream_timeout_s
        return cap if start.timeout_s <= 0 else min(cap, start.timeout_s)

    async def _run(self, stream: _Stream, turn: _Turn, start: worker_pb2.TurnStart) -> None:
        method = "Generate" if start.stream else "Complete"
        began = time.perf_counter()
        code, message = "CANCELLED", ""
        try:
            with self._traced(start.traceparent, method) as span:
                try:
                    await self._turn(stream, turn, start)
                    code = "OK"
                except Exception as err:
                    error = as_rollgate_error(err, service="worker", method=f"/{SERVICE}/{method}")
                    code, message = error.grpc_status.name, error.message
                    if span is not None:
                        span.fail(code)
                    stream.send(worker_pb2.TurnEvent(id=turn.id, error_json=error.to_payload()))
        finally:
            stream.turns.pop(turn.id, None)
            if self._on_turn is not None:
                self._on_turn(method, code, time.perf_counter() - began, message)
            if stream.read_all and not stream.turns:
                stream.end()
            self._check_drained()

    async def _turn(self, stream: _Stream, turn: _Turn, start: worker_pb2.TurnStart) -> None:
        budget_s = self._budget_s(start)
        if not start.stream:
            answer = await completed(
                self._runner, start.request, budget_s=budget_s, metrics=self._metrics
            )
            stream.send(worker_pb2.TurnEvent(id=turn.id, completed=answer))
            return
        # The runner's events straight into TurnEvents (no generator between, no copy): from
        # the upstream connection's read callback for an http:// upstream.
        streamed = StreamedTurn(
            self._runner, start.request, budget_s=budget_s, metrics=self._metrics
        )
        try:
            await streamed.push(_TurnEventsOut(stream, turn, streamed))
        except RollgateError as err:
            streamed.failed(err)
            raise

    def _traced(
        self, traceparent: str, method: str
    ) -> contextlib.AbstractContextManager[Span | None]:
        """The turn's span in its trace, named like the call it replaces (nothing when
        untraced and not exporting)."""
        parent = TraceContext.parse(traceparent)
        tracer = self._tracer
        if tracer is None or (parent is None and tracer.exporter is None):
            return contextlib.nullcontext()
        return tracer.serve(f"{SERVICE}/{method}", parent)
