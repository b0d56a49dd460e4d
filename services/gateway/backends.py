"""The gateway's gRPC peers (router, dataproxy, workers), opened once per app, closed on
shutdown, and the turn relay over them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import grpc
from aiohttp import web
from grpc_health.v1 import health_pb2_grpc

from protos import console_pb2_grpc, dataproxy_pb2_grpc, router_pb2_grpc
from services.gateway.ledger import LedgerClient, Replica
from services.gateway.relay import RouterRoutes, TurnRelay
from services.gateway.routing import RouteCache
from services.gateway.settings import GatewaySettings
from services.gateway.turn_metrics import TurnMetrics
from services.runtime.grpc_client import ChannelPool, open_channel
from services.runtime.logs import get_logger

if TYPE_CHECKING:
    from protos.dataproxy_pb2_grpc import DataProxyAsyncStub
    from protos.router_pb2_grpc import RouterAsyncStub

log = get_logger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class Backends:
    """Stubs on the channels the gateway owns, the turn ledger and the workers' channels."""

    router: RouterAsyncStub
    dataproxy: DataProxyAsyncStub
    router_health: Any
    dataproxy_health: Any
    ledger: LedgerClient
    # The workers the router names, by address (the relay calls them directly).
    workers: ChannelPool
    # The dataproxy's read-only Console service (the live page, `rollgate status`).
    console: Any = None


SETTINGS = web.AppKey("settings", GatewaySettings)
# The relay's per-turn metrics (set by build_app, in the process's registry).
TURN_METRICS = web.AppKey("turn_metrics", TurnMetrics)
BACKENDS = web.AppKey("backends", Backends)
ROUTE_CACHE = web.AppKey("route_cache", RouteCache)
RELAY = web.AppKey("relay", TurnRelay)


def target_addresses(target: str) -> list[str]:
    """Each address a gRPC target lists, as a target of its own (`ipv4:a:1,b:2` →
    `ipv4:a:1`, `ipv4:b:2`); a target of one address (or a name to resolve) is itself."""
    if "," not in target:
        return [target]
    scheme, _, addresses = target.partition(":")
    return [f"{scheme}:{address}" for address in addresses.split(",")]


async def backends_ctx(app: web.Application) -> AsyncIterator[None]:
    """cleanup_ctx: opens the router, dataproxy and worker channels, closes them on shutdown
    (after the in-flight requests: aiohttp runs cleanup contexts last)."""
    settings = app[SETTINGS]
    router_channel = open_channel(settings.router_addr)
    dataproxy_channel = open_channel(settings.dataproxy_addr)
    async with ChannelPool() as workers:
        dataproxy = _dataproxy_stub(dataproxy_channel)
        router = cast("RouterAsyncStub", router_pb2_grpc.RouterStub(router_channel))
        # One ledger stream per dataproxy replica the target lists, each on its own channel:
        # a begin a stopping replica refused is retried on another one (services/gateway/
        # ledger.py), which one shared round-robin channel could not promise.
        addresses = target_addresses(settings.dataproxy_addr)
        ledger_channels = [open_channel(a) for a in addresses] if len(addresses) > 1 else []
        if ledger_channels:
            replicas = [
                Replica(_dataproxy_stub(c), channel=c, address=a)
                for c, a in zip(ledger_channels, addresses, strict=True)
            ]
        else:
            replicas = [Replica(dataproxy, address=settings.dataproxy_addr)]
        metrics = app.get(TURN_METRICS)
        ledger = LedgerClient(
            *replicas,
            framed=settings.framed_streams,
            on_open=metrics.stream_opened if metrics is not None else None,
        )
        try:
            app[BACKENDS] = Backends(
                router=router,
                dataproxy=dataproxy,
                router_health=health_pb2_grpc.HealthStub(router_channel),
                dataproxy_health=health_pb2_grpc.HealthStub(dataproxy_channel),
                ledger=ledger,
                workers=workers,
                console=console_pb2_grpc.ConsoleStub(dataproxy_channel),
            )
            app[RELAY] = relay = TurnRelay(
                routes=RouterRoutes(router, app[ROUTE_CACHE]),
                ledger=ledger,
                workers=workers,
                rpc_timeout_s=settings.rpc_timeout_s,
                metrics=metrics,
                framed_streams=settings.framed_streams,
            )
            log.info(
                "backends_opened", router=settings.router_addr, dataproxy=settings.dataproxy_addr
            )
            yield
            await relay.close()
        finally:
            await ledger.close()
            for channel in ledger_channels:
                await channel.close()
            await router_channel.close()
            await dataproxy_channel.close()


def _dataproxy_stub(channel: grpc.aio.Channel) -> DataProxyAsyncStub:
    return cast("DataProxyAsyncStub", dataproxy_pb2_grpc.DataProxyStub(channel))
