"""The Router gRPC service: glue between protobuf and the registry."""

from __future__ import annotations

from typing import Any, TypeAlias

import grpc

from protos import router_pb2, router_pb2_grpc
from services.router.placement import WorkerState
from services.router.registry import Registry
from services.router.settings import RouterSettings

Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"


class RouterServicer(router_pb2_grpc.RouterServicer):
    """Answers Route, RegisterWorker, Heartbeat, ListWorkers and DeregisterWorker."""

    def __init__(self, registry: Registry, settings: RouterSettings) -> None:
        self._registry = registry
        self._settings = settings

    def _budget_s(self, context: Context) -> float:
        remaining = context.time_remaining()
        cap = self._settings.redis_timeout_s
        return cap if remaining is None else max(0.0, min(cap, remaining))

    async def Route(
        self, request: router_pb2.RouteRequest, context: Context
    ) -> router_pb2.RouteResponse:
        worker = await self._registry.route(
            session=request.session,
            model=request.model,
            avoid_worker_id=request.avoid_worker_id,
            timeout_s=self._budget_s(context),
        )
        return router_pb2.RouteResponse(worker_id=worker.worker_id, address=worker.address)

    async def RegisterWorker(
        self, request: router_pb2.RegisterWorkerRequest, context: Context
    ) -> router_pb2.RegisterWorkerResponse:
        await self._registry.register(
            worker_id=request.worker_id,
            address=request.address,
            models=tuple(request.models),
            timeout_s=self._budget_s(context),
        )
        return router_pb2.RegisterWorkerResponse(
            heartbeat_interval_s=self._settings.heartbeat_interval_s, lease_s=self._settings.lease_s
        )

    async def Heartbeat(
        self, request: router_pb2.HeartbeatRequest, context: Context
    ) -> router_pb2.HeartbeatResponse:
        known = await self._registry.heartbeat(
            worker_id=request.worker_id,
            in_flight=request.in_flight,
            timeout_s=self._budget_s(context),
        )
        return router_pb2.HeartbeatResponse(known=known)

    async def ListWorkers(
        self, request: router_pb2.ListWorkersRequest, context: Context
    ) -> router_pb2.ListWorkersResponse:
        workers = await self._registry.list_workers(timeout_s=self._budget_s(context))
        return router_pb2.ListWorkersResponse(workers=[_worker_info(w) for w in workers])

    async def DeregisterWorker(
        self, request: router_pb2.DeregisterWorkerRequest, context: Context
    ) -> router_pb2.DeregisterWorkerResponse:
        await self._registry.deregister(
            worker_id=request.worker_id, timeout_s=self._budget_s(context)
        )
        return router_pb2.DeregisterWorkerResponse()


def _worker_info(worker: WorkerState) -> router_pb2.WorkerInfo:
    return router_pb2.WorkerInfo(
        worker_id=worker.worker_id,
        address=worker.address,
        models=list(worker.models),
        in_flight=worker.in_flight,
        sessions=worker.sessions,
        last_heartbeat_age_s=worker.last_heartbeat_age_s,
        live=worker.live,
    )
