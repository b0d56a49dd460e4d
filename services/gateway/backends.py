"""The gateway's gRPC peers (router, dataproxy), opened once per app and closed on shutdown."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from aiohttp import web
from grpc_health.v1 import health_pb2_grpc

from protos import console_pb2_grpc, dataproxy_pb2_grpc, router_pb2_grpc
from services.gateway.settings import GatewaySettings
from services.runtime.grpc_client import open_channel
from services.runtime.logs import get_logger

if TYPE_CHECKING:
    from protos.dataproxy_pb2_grpc import DataProxyAsyncStub
    from protos.router_pb2_grpc import RouterAsyncStub

log = get_logger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class Backends:
    """Stubs on the two channels the gateway owns."""

    router: RouterAsyncStub
    dataproxy: DataProxyAsyncStub
    router_health: Any
    dataproxy_health: Any
    # The dataproxy's read-only Console service (the live page, `rollgate status`).
    console: Any = None


SETTINGS = web.AppKey("settings", GatewaySettings)
BACKENDS = web.AppKey("backends", Backends)


async def backends_ctx(app: web.Application) -> AsyncIterator[None]:
    """cleanup_ctx: opens the router and dataproxy channels, closes them on shutdown."""
    settings = app[SETTINGS]
    router_channel = open_channel(settings.router_addr)
    dataproxy_channel = open_channel(settings.dataproxy_addr)
    try:
        app[BACKENDS] = Backends(
            router=cast("RouterAsyncStub", router_pb2_grpc.RouterStub(router_channel)),
            dataproxy=cast(
                "DataProxyAsyncStub", dataproxy_pb2_grpc.DataProxyStub(dataproxy_channel)
            ),
            router_health=health_pb2_grpc.HealthStub(router_channel),
            dataproxy_health=health_pb2_grpc.HealthStub(dataproxy_channel),
            console=console_pb2_grpc.ConsoleStub(dataproxy_channel),
        )
        log.info("backends_opened", router=settings.router_addr, dataproxy=settings.dataproxy_addr)
        yield
    finally:
        await router_channel.close()
        await dataproxy_channel.close()
