"""A turn's results as the Worker service's messages, one way for the calls and the stream.

`generated` is a streamed turn as `GenerateResponse`s (chunk batches, then the record, the
last batch with it unless it is also the first: the first token is never held back);
`completed` a unary turn as a `CompleteResponse`. Both count the turn in the worker's metrics
and log a failure before raising it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from protos import common_pb2, worker_pb2
from schema.packing import pack_float32, pack_int32
from services.runtime.errors import RollgateError, UpstreamError
from services.runtime.logs import get_logger
from services.worker.metrics import WorkerMetrics
from services.worker.turn import AnswerDelta, TurnResult
from services.worker.turns import EventSink, StreamBatch, TurnRunner
from services.worker.upstream import ClientRequest, client_request

log = get_logger(__name__)

# TurnRecord / TurnSample fields that travel packed (int32 / float32 little-endian).
_PACKED = {"prompt_token_ids": "i", "output_token_ids": "i", "output_logprobs": "f"}


def log_failure(request: worker_pb2.GenerateRequest, err: RollgateError) -> None:
    """The worker's line about a failed turn."""
    log.warning(
        "turn_failed",
        request_id=request.request_id,
        error=type(err).__name__,
        code=err.code,
        message=err.message,
    )


def _packed(values: Sequence[Any], kind: str) -> bytes:
    try:
        return pack_int32(values) if kind == "i" else pack_float32(values)
    except (TypeError, OverflowError):
        raise UpstreamError("the upstream sent token ids that are not 32-bit integers") from None


# The field names of each result type (TurnResult, TurnSample), read once.
_NAMES: dict[type, tuple[str, ...]] = {}


def _fields(result: Any) -> dict[str, Any]:
    names = _NAMES.get(type(result))
    if names is None:
        names = _NAMES[type(result)] = tuple(f.name for f in dataclasses.fields(result))
    fields = {name: getattr(result, name) for name in names}
    for name, kind in _PACKED.items():
        if name in fields:
            fields[name] = _packed(fields[name], kind)
    return fields


def turn_record(result: TurnResult) -> common_pb2.TurnRecord:
    """The `TurnRecord` message of a turn result (same field names, arrays packed once)."""
    fields = _fields(result)
    fields["extra_samples"] = [common_pb2.TurnSample(**_fields(s)) for s in result.extra_samples]
    return common_pb2.TurnRecord(**fields)


def _delta(delta: AnswerDelta) -> worker_pb2.Delta:
    return worker_pb2.Delta(
        content=delta.content,
        reasoning=delta.reasoning,
        tool_calls=[
            worker_pb2.ToolCallDelta(
                index=f.index, id=f.call_id, name=f.name, arguments=f.arguments
            )
            for f in delta.tool_calls
        ],
    )


def _fill_batch(batch: worker_pb2.ChunkBatch, event: StreamBatch) -> None:
    batch.SetInParent()  # present even when empty (an answer's end with nothing in it)
    batch.chunks.extend(event.chunks)
    batch.output_tokens = event.output_tokens
    batch.prompt_tokens = event.prompt_tokens
    if event.delta:
        batch.delta.CopyFrom(_delta(event.delta))


def batch_size(event: StreamBatch) -> int:
    """The bytes of chunks and delta text a batch carries (what flow control counts), read off
    the batch itself (the message's repeated field would copy each chunk out again)."""
    size = sum(map(len, event.chunks))
    delta = event.delta
    if delta:
        size += len(delta.content) + len(delta.reasoning)
        size += sum(len(f.arguments) for f in delta.tool_calls)
    return size


def client_of(request: worker_pb2.GenerateRequest) -> ClientRequest:
    """The client request a GenerateRequest carries."""
    return client_request(
        body_json=request.body_json,
        request_json=request.request_json,
        params_json=request.params_json,
    )


class StreamedTurn:
    """One streamed turn's events (`events()`, to iterate and close; or `push`, handed to a
    sink as they come) as `GenerateResponse`s: `fill` writes each into a message, holding the
    batch that ended the answer back to travel with the record (one message) unless it is also
    the first — the first token is never held back. A consumer builds its own message around
    the response (a `TurnEvent` of the turn stream takes it in place: no copy per batch) and
    calls `failed` with a RollgateError the events raise, before raising it on."""

    def __init__(
        self,
        runner: TurnRunner,
        request: worker_pb2.GenerateRequest,
        *,
        budget_s: float,
        metrics: WorkerMetrics | None,
    ) -> None:
        self._runner = runner
        self._budget_s = budget_s
        self._request = request
        self._metrics = metrics
        self._sent = False
        self._last: StreamBatch | None = None

    def events(self) -> AsyncGenerator[StreamBatch | TurnResult, None]:
        """The turn's events as they come (the upstream called as iteration starts)."""
        request = self._request
        return self._runner.stream(
            client_of(request),
            budget_s=self._budget_s,
            request_id=request.request_id,
            deltas_only=request.deltas_only,
        )

    async def push(self, sink: EventSink) -> None:
        """Runs the turn, its events handed to `sink` (`TurnRunner.push`)."""
        request = self._request
        await self._runner.push(
            client_of(request),
            budget_s=self._budget_s,
            sink=sink,
            request_id=request.request_id,
            deltas_only=request.deltas_only,
        )

    def fill(
        self, event: StreamBatch | TurnResult, response: worker_pb2.GenerateResponse
    ) -> int | None:
        """Writes the message of `event` into `response` (empty); the bytes of chunks and delta
        text it carries (`batch_size`), or None when the event is held back for the next
        message."""
        if isinstance(event, TurnResult):
            if self._metrics is not None:
                self._metrics.finished(event, stream=True)
            response.record.CopyFrom(turn_record(event))
            last = self._last
            if last is None:
                return 0
            _fill_batch(response.chunks, last)
            return batch_size(last)
        if event.final and self._sent:
            self._last = event
            return None
        self._sent = True
        _fill_batch(response.chunks, event)
        return batch_size(event)

    def failed(self, err: RollgateError) -> None:
        """Logs and counts the turn's failure."""
        log_failure(self._request, err)
        if self._metrics is not None:
            self._metrics.failed(err, stream=True)


async def generated(
    runner: TurnRunner,
    request: worker_pb2.GenerateRequest,
    *,
    budget_s: float,
    metrics: WorkerMetrics | None,
) -> AsyncGenerator[worker_pb2.GenerateResponse, None]:
    """A streamed turn's messages; raises RollgateError (logged and counted)."""
    turn = StreamedTurn(runner, request, budget_s=budget_s, metrics=metrics)
    try:
        async with contextlib.aclosing(turn.events()) as events:
            async for event in events:
                response = worker_pb2.GenerateResponse()
                if turn.fill(event, response) is not None:
                    yield response
    except RollgateError as err:
        turn.failed(err)
        raise


async def completed(
    runner: TurnRunner,
    request: worker_pb2.GenerateRequest,
    *,
    budget_s: float,
    metrics: WorkerMetrics | None,
) -> worker_pb2.CompleteResponse:
    """A unary turn's answer; raises RollgateError (logged and counted)."""
    try:
        turn = await runner.complete(client_of(request), budget_s=budget_s)
    except RollgateError as err:
        log_failure(request, err)
        if metrics is not None:
            metrics.failed(err, stream=False)
        raise
    if metrics is not None:
        metrics.finished(turn.record, stream=False)
    return worker_pb2.CompleteResponse(body_json=turn.body_json, record=turn_record(turn.record))
