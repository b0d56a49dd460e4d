"""`python -m services.worker [--host H] [--port P]`: the worker process."""

from __future__ import annotations

import argparse
import contextlib
import socket
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from chatml.tokenizer import LocalTokenizer
from protos import router_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.runtime.framed import TURNS_PREAMBLE, serve_framed
from services.runtime.grpc_client import open_channel
from services.runtime.grpc_server import GrpcServer, ServerSpec
from services.runtime.logs import get_logger
from services.runtime.metrics import (
    MetricsServer,
    RpcMetrics,
    RpcMetricsInterceptor,
    ServiceMetrics,
)
from services.runtime.service_main import service_main
from services.runtime.settings import Sources
from services.runtime.tracing import tracer_for
from services.worker.adapters import adapter_for
from services.worker.metrics import WorkerMetrics
from services.worker.registration import Registration
from services.worker.servicer import WorkerServicer
from services.worker.settings import WorkerSettings
from services.worker.turn_streams import TurnHook
from services.worker.turns import TurnRunner
from services.worker.upstream import RequestPolicy, UpstreamClient
from stackconfig import DEFAULT_MODEL_ALIAS

SERVICE_NAME = "rollgate.v1.Worker"

log = get_logger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class RunningWorker:
    """What a running worker exposes to its owner (and to tests)."""

    server: GrpcServer
    runner: TurnRunner
    registration: Registration
    address: str


def default_alias(served: Sequence[str], settings: WorkerSettings) -> tuple[str, str] | None:
    """(`default`, the model it stands for) when this worker serves the name `default`.

    None when it is off here, when the upstream's models are unknown, when a model or alias
    already has that name, or when the configured default model is not served here.
    """
    if not settings.serve_default_model or not served:
        return None
    if DEFAULT_MODEL_ALIAS in served or any(
        alias == DEFAULT_MODEL_ALIAS for alias, _ in settings.upstream_aliases
    ):
        return None
    target = dict(settings.upstream_aliases).get(settings.default_model, settings.default_model)
    if not target:
        return DEFAULT_MODEL_ALIAS, served[0]
    if target in served:
        return DEFAULT_MODEL_ALIAS, target
    log.warning(
        "default_model_not_served", default_model=settings.default_model, served=list(served)
    )
    return None


def model_names(served: Sequence[str], aliases: Sequence[tuple[str, str]]) -> list[str]:
    """What the worker registers: the served ids plus the aliases ([] = any model)."""
    if not served:
        return []
    return [*served, *(a for a, _ in aliases if a not in served)]


async def served_models(upstream: UpstreamClient, settings: WorkerSettings) -> list[str]:
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


def build_runner(
    upstream: UpstreamClient, settings: WorkerSettings, aliases: Sequence[tuple[str, str]]
) -> TurnRunner:
    """The turn runner for the configured upstream kind, aliases, defaults and group size."""
    tokenizer = LocalTokenizer(settings.tokenizer_path) if settings.tokenizer_path else None
    adapter = adapter_for(
        settings.upstream_kind, sglang_path=settings.sglang_path, tokenizer=tokenizer
    )
    if adapter.single_sample and settings.n_samples > 1:
        raise ValueError(
            "group sampling (ROLLGATE_N_SAMPLES / gconfig.n_samples > 1) is not available on "
            "the sglang generate path: use sglang_path: chat or kind: vllm"
        )
    policy = RequestPolicy(
        aliases=dict(aliases),
        default_max_tokens=settings.default_max_tokens,
        default_temperature=settings.default_temperature,
        n_samples=settings.n_samples,
    )
    return TurnRunner(upstream=upstream, adapter=adapter, policy=policy, tokenizer=tokenizer)


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
            UpstreamClient(
                base_url=settings.upstream_base_url,
                api_key=settings.upstream_api_key,
                key_var=settings.upstream_api_key_var,
            )
        )
        served = await served_models(upstream, settings)
        aliases = list(settings.upstream_aliases)
        default = default_alias(served, settings)
        if default is not None:
            aliases.append(default)
        runner = build_runner(upstream, settings, aliases)
        models = model_names(served, aliases)
        metrics = ServiceMetrics("worker")
        counted = WorkerMetrics(metrics, runner)
        await stack.enter_async_context(MetricsServer(metrics, settings.metrics))
        tracer = await stack.enter_async_context(tracer_for("worker", settings.tracing))
        server = GrpcServer(
            ServerSpec(
                name="worker",
                host=settings.host,
                port=settings.port,
                service_names=(SERVICE_NAME,),
                grace_s=settings.grace_s,
                stop_notice_s=settings.stop_notice_s,
                interceptors=(RpcMetricsInterceptor(metrics.rpc, tracer=tracer),),
            )
        )
        servicer = WorkerServicer(
            runner,
            upstream_timeout_s=settings.upstream_timeout_s,
            metrics=counted,
            on_turn=turn_metrics(metrics.rpc),
            tracer=tracer,
        )
        worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server.server)
        # In the stop sequence, before the server stops: no new turns on the gateways'
        # streams; the running ones finish within the grace period, then the streams end.
        server.on_drain(servicer.streams.close)
        servicer.framed_port = await serve_framed(
            stack,
            servicer.streams.serve,
            host=settings.host,
            port=settings.framed_port,
            preamble=TURNS_PREAMBLE,
            parse=worker_pb2.TurnOps.FromString,
            name="worker-turns",
            sends=True,
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
            upstream_name=settings.upstream_name,
            models=models,
            default_model=default[1] if default is not None else None,
            upstream_key_var=settings.upstream_api_key_var,
            upstream_key_set=bool(settings.upstream_api_key),
            n_samples=settings.n_samples,
        )
        yield RunningWorker(
            server=server, runner=runner, registration=registration, address=address
        )


def turn_metrics(rpc: RpcMetrics) -> TurnHook:
    """Counts each turn of a Turns stream like the call it replaces: `rollgate.v1.Worker`
    method `Generate` or `Complete`."""

    def observe(method: str, code: str, seconds: float, message: str) -> None:
        rpc.handled_by(SERVICE_NAME, method, code).inc()
        rpc.duration_by(SERVICE_NAME, method).observe(seconds)

    return observe


def _settings(src: Sources, *, host: str | None, port: int | None) -> WorkerSettings:
    settings = WorkerSettings.load(src, host=host, port=port)
    if settings.tokenizer_path:
        LocalTokenizer(settings.tokenizer_path)  # a bad tokenizer file fails at start-up
    return settings


def _upstream_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--upstream", default=None, help="which configured upstream to serve")


def main(argv: Sequence[str] | None = None) -> None:
    """Parses the command line, reads the settings once and runs until SIGTERM/SIGINT."""
    service_main(
        service="worker",
        description=__doc__,
        default_port=50061,
        load_settings=_settings,
        serving=serving,
        argv=argv,
        add_arguments=_upstream_argument,
    )


if __name__ == "__main__":
    main()
