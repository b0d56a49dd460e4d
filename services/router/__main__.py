"""`python -m services.router [--host H] [--port P]`: the router process."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator, Sequence

from protos import router_pb2_grpc
from services.router.registry import Registry, RouterKeys
from services.router.servicer import RouterServicer
from services.router.settings import RouterSettings
from services.runtime.config import merged_environ
from services.runtime.grpc_server import GrpcServer, ServerSpec, run, wait_for_stop_signal
from services.runtime.logs import configure_logging, get_logger
from services.runtime.redis_conn import open_redis

SERVICE_NAME = "rollgate.v1.Router"

log = get_logger(__name__)


class StartupError(Exception):
    """The router cannot start; the message says what to fix."""


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
        registry = Registry(
            redis,
            keys=RouterKeys(settings.redis_prefix),
            lease_s=settings.lease_s,
            affinity_ttl_s=settings.affinity_ttl_s,
        )
        server = GrpcServer(
            ServerSpec(
                name="router",
                host=settings.host,
                port=settings.port,
                service_names=(SERVICE_NAME,),
                grace_s=settings.grace_s,
            )
        )
        router_pb2_grpc.add_RouterServicer_to_server(
            RouterServicer(registry, settings), server.server
        )
        await stack.enter_async_context(server)
        await server.set_serving()
        yield server


async def _main(settings: RouterSettings) -> None:
    async with serving(settings):
        await wait_for_stop_signal()
        log.info("stop_signal_received")


def main(argv: Sequence[str] | None = None) -> None:
    """Parses the command line, reads the settings once and runs until SIGTERM/SIGINT."""
    parser = argparse.ArgumentParser(prog="python -m services.router", description=__doc__)
    parser.add_argument("--host", default=None, help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="port (default 50051; 0: any)")
    parser.add_argument("--config", default=None, help="rollgate YAML (the environment wins)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides: a.b.0.c=value")
    args = parser.parse_args(argv)
    try:
        settings = RouterSettings.from_env(
            merged_environ(os.environ, args.config, args.overrides, "router"),
            host=args.host,
            port=args.port,
        )
    except ValueError as err:
        parser.error(str(err))
    configure_logging(service="router", json_logs=settings.log_json, level=settings.log_level)
    try:
        run(lambda: _main(settings))
    except (StartupError, OSError) as err:
        log.error("startup_failed", error=str(err))
        sys.exit(1)


if __name__ == "__main__":
    main()
