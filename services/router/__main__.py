"""`python -m services.router [--host H] [--port P]`: the router process."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

from protos import router_pb2_grpc
from services.router.metrics import registry_values
from services.router.registry import Registry, RouterKeys
from services.router.servicer import RouterServicer
from services.router.settings import RouterSettings
from services.runtime.grpc_server import GrpcServer, ServerSpec
from services.runtime.metrics import (
    ExporterLease,
    MetricsServer,
    RpcMetricsInterceptor,
    ServiceMetrics,
)
from services.runtime.redis_conn import open_redis
from services.runtime.service_main import StartupError, service_main
from services.runtime.tracing import tracer_for

SERVICE_NAME = "rollgate.v1.Router"


@contextlib.asynccontextmanager
async def serving(settings: RouterSettings) -> AsyncIterator[GrpcServer]:
    """A running, SERVING router; leaving stops it gracefully and closes Redis."""
    async with contextlib.AsyncExitStack() as stack:
        redis = open_redis(settings.redis_url)
        stack.push_async_callback(redis.aclose)
        try:
            async with asyncio.timeout(settings.redis_timeout_s):
                await redis.ping()
        except Exception as err:
            raise StartupError(
                f"the router cannot reach Redis ({type(err).__name__}: {err}); "
                "check ROLLGATE_REDIS_URL"
            ) from err
        keys = RouterKeys(settings.redis_prefix)
        registry = Registry(
            redis,
            keys=keys,
            lease_s=settings.lease_s,
            affinity_ttl_s=settings.affinity_ttl_s,
            forget_after_s=settings.forget_after_s,
        )
        metrics = ServiceMetrics("router")
        lease = await stack.enter_async_context(ExporterLease(redis, key=keys.metrics_exporter))
        metrics.export_globals(lease, registry_values(registry))
        await stack.enter_async_context(MetricsServer(metrics, settings.metrics))
        tracer = await stack.enter_async_context(tracer_for("router", settings.tracing))
        server = GrpcServer(
            ServerSpec(
                name="router",
                host=settings.host,
                port=settings.port,
                service_names=(SERVICE_NAME,),
                grace_s=settings.grace_s,
                stop_notice_s=settings.stop_notice_s,
                interceptors=(RpcMetricsInterceptor(metrics.rpc, tracer=tracer),),
            )
        )
        router_pb2_grpc.add_RouterServicer_to_server(
            RouterServicer(registry, settings), server.server
        )
        await stack.enter_async_context(server)
        await server.set_serving()
        yield server


def main(argv: Sequence[str] | None = None) -> None:
    """Parses the command line, reads the settings once and runs until SIGTERM/SIGINT."""
    service_main(
        service="router",
        description=__doc__,
        default_port=50051,
        load_settings=RouterSettings.load,
        serving=serving,
        argv=argv,
    )


if __name__ == "__main__":
    main()
