"""The Worker gRPC service: glue between protobuf and the turn runner."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, TypeAlias

import grpc

from protos import common_pb2, worker_pb2, worker_pb2_grpc
from services.runtime.tracing import Tracer
from services.worker.metrics import WorkerMetrics
from services.worker.turn_streams import TurnHook, TurnStreams
from services.worker.turns import TurnRunner
from services.worker.wire import completed, generated

Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Answers Generate (streaming), Complete (unary), Abort, and the Turns streams."""

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
        # The turns of the Turns streams (drained on shutdown: `streams.close`).
        self.streams = TurnStreams(
            runner,
            upstream_timeout_s=upstream_timeout_s,
            metrics=metrics,
            on_turn=on_turn,
            tracer=tracer,
        )
        # Where the Turns streams are also served framed (0: they are not).
        self.framed_port = 0

    def _budget_s(self, context: Context) -> float:
        remaining = context.time_remaining()
        cap = self._upstream_timeout_s
        return cap if remaining is None else max(0.0, min(cap, remaining))

    async def Generate(
        self, request: worker_pb2.GenerateRequest, context: Context
    ) -> AsyncIterator[worker_pb2.GenerateResponse]:
        responses = generated(
            self._runner, request, budget_s=self._budget_s(context), metrics=self._metrics
        )
        async for response in responses:
            yield response

    async def Abort(
        self, request: worker_pb2.AbortRequest, context: Context
    ) -> worker_pb2.AbortResponse:
        return worker_pb2.AbortResponse(found=self._runner.abort(request.request_id))

    async def Complete(
        self, request: worker_pb2.GenerateRequest, context: Context
    ) -> worker_pb2.CompleteResponse:
        return await completed(
            self._runner, request, budget_s=self._budget_s(context), metrics=self._metrics
        )

    async def Turns(
        self, request_iterator: AsyncIterator[worker_pb2.TurnOps], context: Context
    ) -> AsyncIterator[worker_pb2.TurnEvents]:
        async for events in self.streams.serve(request_iterator):
            yield events

    async def TurnsEndpoint(
        self, request: common_pb2.FramedEndpointRequest, context: Context
    ) -> common_pb2.FramedEndpointResponse:
        return common_pb2.FramedEndpointResponse(port=self.framed_port)
