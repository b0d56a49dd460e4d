"""`python -m services.worker [--host H] [--port P]`: the worker process."""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from protos import router_pb2_grpc, worker_pb2_grpc
from services.runtime.grpc_client import open_channel
from services.runtime.grpc_server import GrpcServer, ServerSpec, run, wait_for_stop_signal
from services.runtime.logs import configure_logging, get_logger
from services.worker.adapters import adapter_for
from services.worker.registration import Registration
from services.worker.servicer import WorkerServicer
from services.worker.settings import WorkerSettings
from services.worker.turns import TurnRunner
from services.worker.upstream import UpstreamClient

SERVICE_NAME = "rollgate.v1.Worker"

log = get_logger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class RunningWorker:
    """What a running worker exposes to its owner (and to tests)."""

    server: GrpcServer
    runner: TurnRunner
    registration: Registration
    address: str


async def discover_models(upstream: UpstreamClient, settings: WorkerSettings) -> list[str]:
    """The configured models, else the upstream's /models, else [] (any model)."""
    if settings.upstream_models:
        return list(settings.upstream_models)
    try:
        models = await upstream.list_models(timeout_s=settings.models_timeout_s)
    except Exception as err:  # any failure here only widens what the worker claims to serve
        log.warning(
            "upstream_models_unknown",
            url=upstream.base_url + "/models",
            error=f"{type(err).__name__}: {err}",
            consequence="registering for any model",
        )
        return []
    log.info("upstream_models", models=models)
    return models


def advertised_address(settings: WorkerSettings, port: int) -> str:
    """ROLLGATE_WORKER_ADVERTISE, else the bound host and port."""
    if settings.advertise:
        return settings.advertise
    host = settings.host
    if host in {"0.0.0.0", "::", ""}:
        host = socket.gethostname()
    return f"{host}:{port}"


@contextlib.asynccontextmanager
async def serving(settings: WorkerSettings) -> AsyncIterator[RunningWorker]:
    """A SERVING, registered worker; leaving deregisters, drains, and closes the upstream."""
    async with contextlib.AsyncExitStack() as stack:
        upstream = await stack.enter_async_context(
            UpstreamClient(base_url=settings.upstream_base_url, api_key=settings.upstream_api_key)
        )
        models = await discover_models(upstream, settings)
        runner = TurnRunner(upstream=upstream, adapter=adapter_for(settings.upstream_kind))
        server = GrpcServer(
            ServerSpec(
                name="worker",
                host=settings.host,
                port=settings.port,
                service_names=(SERVICE_NAME,),
                grace_s=settings.grace_s,
            )
        )
        worker_pb2_grpc.add_WorkerServicer_to_server(
            WorkerServicer(runner, upstream_timeout_s=settings.upstream_timeout_s), server.server
        )
        await stack.enter_async_context(server)
        await server.set_serving()
        channel = open_channel(settings.router_addr)
        stack.push_async_callback(channel.close)
        address = advertised_address(settings, server.port)
        registration = await stack.enter_async_context(
            Registration(
                router_pb2_grpc.RouterStub(channel),
                worker_id=settings.worker_id,
                address=address,
                models=models,
                in_flight=lambda: runner.in_flight,
                call_timeout_s=settings.router_timeout_s,
            )
        )
        log.info(
            "worker_ready",
            worker_id=settings.worker_id,
            address=address,
            upstream=settings.upstream_base_url,
            upstream_kind=settings.upstream_kind,
            upstream_key_set=bool(settings.upstream_api_key),
        )
        yield RunningWorker(
            server=server, runner=runner, registration=registration, address=address
        )


async def _main(settings: WorkerSettings) -> None:
    async with serving(settings):
        await wait_for_stop_signal()
        log.info("stop_signal_received")


def main(argv: Sequence[str] | None = None) -> None:
    """Parses the command line, reads the settings once and runs until SIGTERM/SIGINT."""
    parser = argparse.ArgumentParser(prog="python -m services.worker", description=__doc__)
    parser.add_argument("--host", default=None, help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="port (default 50061; 0: any)")
    args = parser.parse_args(argv)
    try:
        settings = WorkerSettings.from_env(os.environ, host=args.host, port=args.port)
    except ValueError as err:
        parser.error(str(err))
    configure_logging(service="worker", json_logs=settings.log_json, level=settings.log_level)
    try:
        run(lambda: _main(settings))
    except OSError as err:
        log.error("startup_failed", error=str(err))
        sys.exit(1)


if __name__ == "__main__":
    main()
