"""The Worker gRPC service: glue between protobuf and the turn runner."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence
from typing import Any, TypeAlias

import grpc

from protos import common_pb2, worker_pb2, worker_pb2_grpc
from schema.packing import pack_float32, pack_int32
from services.runtime.errors import RollgateError, UpstreamError
from services.runtime.logs import get_logger
from services.worker.metrics import WorkerMetrics
from services.worker.turn import AnswerDelta, TurnResult
from services.worker.turns import StreamBatch, TurnRunner
from services.worker.upstream import ClientRequest, client_request

Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"

log = get_logger(__name__)

# TurnRecord / TurnSample fields that travel packed (int32 / float32 little-endian).
_PACKED = {"prompt_token_ids": "i", "output_token_ids": "i", "output_logprobs": "f"}


def _log_failure(request: worker_pb2.GenerateRequest, err: RollgateError) -> None:
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


def _fields(result: Any) -> dict[str, Any]:
    fields = {f.name: getattr(result, f.name) for f in dataclasses.fields(result)}
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


def _batch(event: StreamBatch) -> worker_pb2.ChunkBatch:
    batch = worker_pb2.ChunkBatch(
        chunks=event.chunks, output_tokens=event.output_tokens, prompt_tokens=event.prompt_tokens
    )
    if event.delta:
        batch.delta.CopyFrom(_delta(event.delta))
    return batch


def _client(request: worker_pb2.GenerateRequest) -> ClientRequest:
    return client_request(
        body_json=request.body_json,
        request_json=request.request_json,
        params_json=request.params_json,
    )


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Answers Generate (streaming) and Complete (unary)."""

    def __init__(
        self,
        runner: TurnRunner,
        *,
        upstream_timeout_s: float,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self._runner = runner
        self._upstream_timeout_s = upstream_timeout_s
        self._metrics = metrics

    def _budget_s(self, context: Context) -> float:
        remaining = context.time_remaining()
        cap = self._upstream_timeout_s
        return cap if remaining is None else max(0.0, min(cap, remaining))

    async def Generate(
        self, request: worker_pb2.GenerateRequest, context: Context
    ) -> AsyncIterator[worker_pb2.GenerateResponse]:
        events = self._runner.stream(
            _client(request),
            budget_s=self._budget_s(context),
            request_id=request.request_id,
            deltas_only=request.deltas_only,
        )
        # The batch that ended the answer travels with the record (one message), unless it
        # is also the first: the first token is never held back.
        sent = False
        last: worker_pb2.ChunkBatch | None = None
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    if isinstance(event, TurnResult):
                        if self._metrics is not None:
                            self._metrics.finished(event, stream=True)
                        response = worker_pb2.GenerateResponse(record=turn_record(event))
                        if last is not None:
                            response.chunks.CopyFrom(last)
                        yield response
                    elif event.final and sent:
                        last = _batch(event)
                    else:
                        sent = True
                        yield worker_pb2.GenerateResponse(chunks=_batch(event))
        except RollgateError as err:
            _log_failure(request, err)
            if self._metrics is not None:
                self._metrics.failed(err, stream=True)
            raise

    async def Abort(
        self, request: worker_pb2.AbortRequest, context: Context
    ) -> worker_pb2.AbortResponse:
        return worker_pb2.AbortResponse(found=self._runner.abort(request.request_id))

    async def Complete(
        self, request: worker_pb2.GenerateRequest, context: Context
    ) -> worker_pb2.CompleteResponse:
        try:
            turn = await self._runner.complete(_client(request), budget_s=self._budget_s(context))
        except RollgateError as err:
            _log_failure(request, err)
            if self._metrics is not None:
                self._metrics.failed(err, stream=False)
            raise
        if self._metrics is not None:
            self._metrics.finished(turn.record, stream=False)
        return worker_pb2.CompleteResponse(
            body_json=turn.body_json, record=turn_record(turn.record)
        )
