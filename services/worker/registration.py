"""Keeps the worker registered with the router: register, heartbeat, re-register, deregister."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from protos import router_pb2, router_pb2_grpc
from services.runtime.logs import get_logger

log = get_logger(__name__)

_BACKOFF_START_S = 0.2
_BACKOFF_MAX_S = 5.0


class Registration:
    """`async with`: a background task keeps the worker registered; leaving deregisters it."""

    def __init__(
        self,
        stub: router_pb2_grpc.RouterStub,
        *,
        worker_id: str,
        address: str,
        models: Sequence[str],
        in_flight: Callable[[], int],
        call_timeout_s: float = 2.0,
    ) -> None:
        self._stub = stub
        self.worker_id = worker_id
        self.address = address
        self.models = list(models)
        self._in_flight = in_flight
        self._call_timeout_s = call_timeout_s
        self._task: asyncio.Task[None] | None = None
        # Observable progress, for logs and tests.
        self.registrations = 0
        self.heartbeats = 0
        self.registered = asyncio.Event()

    async def __aenter__(self) -> Registration:
        self._task = asyncio.create_task(self._run(), name=f"registration-{self.worker_id}")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self._deregister()

    async def _register(self) -> float:
        """Registers once; returns the heartbeat interval the router asked for."""
        reply: Any = await self._stub.RegisterWorker(
            router_pb2.RegisterWorkerRequest(
                worker_id=self.worker_id, address=self.address, models=self.models
            ),
            timeout=self._call_timeout_s,
        )
        self.registrations += 1
        self.registered.set()
        interval = float(reply.heartbeat_interval_s) or 1.0
        log.info(
            "worker_registered",
            worker_id=self.worker_id,
            address=self.address,
            models=self.models,
            heartbeat_interval_s=interval,
        )
        return interval

    async def _run(self) -> None:
        backoff_s = _BACKOFF_START_S
        interval_s: float | None = None
        while True:
            try:
                if interval_s is None:
                    interval_s = await self._register()
                    backoff_s = _BACKOFF_START_S
                await asyncio.sleep(interval_s)
                reply: Any = await self._stub.Heartbeat(
                    router_pb2.HeartbeatRequest(
                        worker_id=self.worker_id, in_flight=self._in_flight()
                    ),
                    timeout=self._call_timeout_s,
                )
                self.heartbeats += 1
                if not reply.known:
                    log.warning("worker_unknown_to_router", worker_id=self.worker_id)
                    self.registered.clear()
                    interval_s = None
            except grpc.aio.AioRpcError as err:
                log.warning(
                    "router_call_failed",
                    worker_id=self.worker_id,
                    code=err.code().name,
                    details=err.details(),
                    retry_in_s=backoff_s,
                )
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, _BACKOFF_MAX_S)
            except Exception:
                # A bug here must not leave a serving worker silently unregistered: log, retry.
                log.exception("registration_loop_error", worker_id=self.worker_id)
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, _BACKOFF_MAX_S)

    async def _deregister(self) -> None:
        try:
            await self._stub.DeregisterWorker(
                router_pb2.DeregisterWorkerRequest(worker_id=self.worker_id),
                timeout=self._call_timeout_s,
            )
            log.info("worker_deregistered", worker_id=self.worker_id)
        except grpc.aio.AioRpcError as err:
            log.warning("worker_deregister_failed", worker_id=self.worker_id, code=err.code().name)
