"""The Worker gRPC service: glue between protobuf and the turn runner."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any, TypeAlias

import grpc

from protos import common_pb2, worker_pb2, worker_pb2_grpc
from services.runtime.errors import RollgateError
from services.runtime.logs import get_logger
from services.worker.turn import TurnResult
from services.worker.turns import TurnRunner

Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"

log = get_logger(__name__)


def _log_failure(request: worker_pb2.GenerateRequest, err: RollgateError) -> None:
    log.warning(
        "turn_failed",
        request_id=request.request_id,
        error=type(err).__name__,
        code=err.code,
        message=err.message,
    )


def turn_record(result: TurnResult) -> common_pb2.TurnRecord:
    """The `TurnRecord` message of a turn result (same field names)."""
    fields = {f.name: getattr(result, f.name) for f in dataclasses.fields(result)}
    fields["extra_samples"] = [
        common_pb2.TurnSample(**{f.name: getattr(s, f.name) for f in dataclasses.fields(s)})
        for s in result.extra_samples
    ]
    return common_pb2.TurnRecord(**fields)


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Answers Generate (streaming) and Complete (unary)."""

    def __init__(self, runner: TurnRunner, *, upstream_timeout_s: float) -> None:
        self._runner = runner
        self._upstream_timeout_s = upstream_timeout_s

    def _budget_s(self, context: Context) -> float:
        remaining = context.time_remaining()
        cap = self._upstream_timeout_s
        return cap if remaining is None else max(0.0, min(cap, remaining))

    async def Generate(
        self, request: worker_pb2.GenerateRequest, context: Context
    ) -> AsyncIterator[worker_pb2.GenerateResponse]:
        events = self._runner.stream(
            request.body_json, budget_s=self._budget_s(context), request_id=request.request_id
        )
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    if isinstance(event, TurnResult):
                        yield worker_pb2.GenerateResponse(record=turn_record(event))
                    else:
                        yield worker_pb2.GenerateResponse(
                            chunks=worker_pb2.ChunkBatch(
                                chunks=event.chunks, output_tokens=event.output_tokens
                            )
                        )
        except RollgateError as err:
            _log_failure(request, err)
            raise

    async def Abort(
        self, request: worker_pb2.AbortRequest, context: Context
    ) -> worker_pb2.AbortResponse:
        return worker_pb2.AbortResponse(found=self._runner.abort(request.request_id))

    async def Complete(
        self, request: worker_pb2.GenerateRequest, context: Context
    ) -> worker_pb2.CompleteResponse:
        try:
            turn = await self._runner.complete(request.body_json, budget_s=self._budget_s(context))
        except RollgateError as err:
            _log_failure(request, err)
            raise
        return worker_pb2.CompleteResponse(
            body_json=turn.body_json, record=turn_record(turn.record)
        )
