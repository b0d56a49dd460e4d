"""`python -m services.dataproxy [--host H] [--port P]`: the dataproxy process."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

import redis.asyncio as aioredis

from protos import console_pb2_grpc, dataproxy_pb2, dataproxy_pb2_grpc, trainer_pb2_grpc
from services.dataproxy.access_keys import AccessKeyStore
from services.dataproxy.console_servicer import ConsoleServicer
from services.dataproxy.control import CapacityPolicy, Control, WeightVersionView
from services.dataproxy.conversations_servicer import (
    add_ConversationsServicer_to_server,
    build_conversations,
)
from services.dataproxy.error_log import ErrorLog
from services.dataproxy.history import HistorySampler
from services.dataproxy.keys_servicer import add_KeysServicer_to_server, build_keys
from services.dataproxy.ledger_streams import FailureHook, LedgerStreams, OpHook
from services.dataproxy.metrics import DataProxyMetrics, global_values
from services.dataproxy.overview import Overview
from services.dataproxy.reaper import Reaper
from services.dataproxy.redis_keys import RedisKeys
from services.dataproxy.scripts import Scripts
from services.dataproxy.servicer import DataProxyServicer
from services.dataproxy.sessions import EpisodePolicy, SessionStore
from services.dataproxy.settings import DataProxySettings
from services.dataproxy.stream_trim import StreamTrimmer
from services.dataproxy.trainer_auth import TrainerAuth
from services.dataproxy.trainer_servicer import TrainerServicer, build_control
from services.dataproxy.turn_ledger import TurnLedger
from services.runtime.framed import LEDGER_PREAMBLE, serve_framed
from services.runtime.grpc_server import GrpcServer, ServerSpec
from services.runtime.metrics import (
    ErrorHook,
    ExporterLease,
    MetricsServer,
    RpcMetrics,
    RpcMetricsInterceptor,
    ServiceMetrics,
)
from services.runtime.redis_conn import open_redis
from services.runtime.redis_pipeline import PipelinedScripts
from services.runtime.service_main import StartupError, service_main
from services.runtime.tasks import cancel_and_wait
from services.runtime.tracing import Tracer, tracer_for

SERVICE_NAMES = (
    "rollgate.v1.DataProxy",
    "rollgate.v1.Trainer",
    "rollgate.v1.Conversations",
    "rollgate.v1.Keys",
    "rollgate.v1.Console",
)
REDIS_PING_TIMEOUT_S = 5.0
REAPER_STOP_S = 5.0


def build_store(
    *,
    redis: aioredis.Redis,
    settings: DataProxySettings,
    pipelined: PipelinedScripts | None = None,
) -> SessionStore:
    """The session store with the settings' lifecycle policy (turn scripts on `pipelined`)."""
    return SessionStore(
        redis=redis,
        pipelined=pipelined,
        keys=RedisKeys(settings.redis_prefix),
        scripts=Scripts.load(),
        admin_key=settings.admin_key,
        refresh_lock_s=settings.refresh_lock_s,
        policy=EpisodePolicy(
            refresh_timeout_s=settings.refresh_timeout_s,
            capacity=CapacityPolicy(
                max_head_offpolicyness=settings.max_head_offpolicyness,
                batch_size=settings.batch_size,
            ),
            session_idle_timeout_s=settings.session_idle_timeout_s,
            late_reward_timeout_s=settings.late_reward_timeout_s,
        ),
    )


def build_dataproxy(
    *,
    redis: aioredis.Redis,
    settings: DataProxySettings,
    versions: WeightVersionView,
    store: SessionStore | None = None,
    control: Control | None = None,
    on_op: OpHook | None = None,
    on_failure: FailureHook | None = None,
    tracer: Tracer | None = None,
) -> tuple[DataProxyServicer, LedgerStreams]:
    """The DataProxy servicer over one Redis client and the process's weight-version view,
    and its ledger streams (drained first on shutdown; `on_op` sees each ledger op end,
    `on_failure` each failed turn a gateway reports)."""
    store = store or build_store(redis=redis, settings=settings)
    keys = RedisKeys(settings.redis_prefix)
    control = control or build_control(redis=redis, keys=keys, settings=settings)
    streams = LedgerStreams(
        ledger=TurnLedger(store=store, control=control),
        versions=versions,
        on_op=on_op,
        on_failure=on_failure,
        tracer=tracer,
    )
    return DataProxyServicer(store=store, ledger=streams), streams


def ledger_metrics(rpc: RpcMetrics, on_error: ErrorHook) -> OpHook:
    """Counts each ledger op like an RPC: `rollgate.v1.DataProxy` method `Ledger.<op>`."""
    service = "rollgate.v1.DataProxy"

    def observe(op: str, code: str, seconds: float, message: str) -> None:
        method = f"Ledger.{op}"
        rpc.handled_by(service, method, code).inc()
        rpc.duration_by(service, method).observe(seconds)
        if code != "OK":
            on_error(f"/{service}/{method}", code, message)

    return observe


@contextlib.asynccontextmanager
async def serving(settings: DataProxySettings) -> AsyncIterator[GrpcServer]:
    """A running, SERVING dataproxy; leaving drains in-flight turns, then closes clients."""
    async with contextlib.AsyncExitStack() as stack:
        redis = open_redis(settings.redis_url)
        stack.push_async_callback(redis.aclose)
        # The turn ledger's scripts: one pipelined connection (closed after the server stops).
        pipelined = PipelinedScripts(redis)
        stack.push_async_callback(pipelined.aclose)
        try:
            async with asyncio.timeout(REDIS_PING_TIMEOUT_S):
                await redis.ping()
        except Exception as err:
            raise StartupError(
                f"the dataproxy cannot reach Redis ({type(err).__name__}: {err}); "
                "check ROLLGATE_REDIS_URL"
            ) from err
        keys = RedisKeys(settings.redis_prefix)
        # One subscriber per process follows SetWeightVersion of every replica (streamed
        # turns stamp each chunk's tokens with it).
        versions = await stack.enter_async_context(WeightVersionView(redis=redis, keys=keys))
        # Trims the trajectories stream below what every consumer group has acked.
        await stack.enter_async_context(StreamTrimmer(redis=redis, keys=keys))
        metrics = ServiceMetrics("dataproxy")
        counted = DataProxyMetrics(metrics.registry)
        control = build_control(
            redis=redis, keys=keys, settings=settings, metrics=counted, pipelined=pipelined
        )
        store = build_store(redis=redis, settings=settings, pipelined=pipelined)
        store.on_ended = counted.ended
        trainer = TrainerServicer(redis=redis, keys=keys, settings=settings, control=control)
        overview = Overview(
            redis=redis,
            keys=keys,
            policy=CapacityPolicy(
                max_head_offpolicyness=settings.max_head_offpolicyness,
                batch_size=settings.batch_size,
            ),
        )
        lease = await stack.enter_async_context(ExporterLease(redis, key=keys.metrics_exporter))
        metrics.export_globals(lease, global_values(overview))
        errors = await stack.enter_async_context(ErrorLog(redis=redis, keys=keys))
        await stack.enter_async_context(MetricsServer(metrics, settings.metrics))
        tracer = await stack.enter_async_context(tracer_for("dataproxy", settings.tracing))
        await stack.enter_async_context(HistorySampler(redis=redis, keys=keys, overview=overview))
        server = GrpcServer(
            ServerSpec(
                name="dataproxy",
                host=settings.host,
                port=settings.port,
                service_names=SERVICE_NAMES,
                grace_s=settings.grace_s,
                stop_notice_s=settings.stop_notice_s,
                interceptors=(
                    RpcMetricsInterceptor(metrics.rpc, on_error=errors.record, tracer=tracer),
                ),
            )
        )
        servicer, streams = build_dataproxy(
            redis=redis,
            settings=settings,
            versions=versions,
            store=store,
            control=control,
            on_op=ledger_metrics(metrics.rpc, errors.record),
            on_failure=lambda f: errors.record_turn_failure(
                call=f.method, status=f.status, code=f.code, message=f.message
            ),
            tracer=tracer,
        )
        dataproxy_pb2_grpc.add_DataProxyServicer_to_server(servicer, server.server)
        # In the stop sequence, before the server stops: no new turns; turns already admitted
        # are recorded (their gateways send the records over these streams), then they end.
        server.on_drain(streams.close)
        trainer_pb2_grpc.add_TrainerServicer_to_server(trainer, server.server)
        console_pb2_grpc.add_ConsoleServicer_to_server(
            ConsoleServicer(
                overview=overview,
                auth=TrainerAuth(
                    admin_key=settings.admin_key,
                    trainer_key=settings.trainer_key,
                    lookup=AccessKeyStore(redis=redis, keys=keys).lookup,
                ),
            ),
            server.server,
        )
        add_ConversationsServicer_to_server(
            build_conversations(redis=redis, prefix=settings.redis_prefix), server.server
        )
        add_KeysServicer_to_server(
            build_keys(redis=redis, prefix=settings.redis_prefix, admin_key=settings.admin_key),
            server.server,
        )
        servicer.framed_port = await serve_framed(
            stack,
            streams.serve,
            host=settings.host,
            port=settings.framed_port,
            preamble=LEDGER_PREAMBLE,
            parse=dataproxy_pb2.LedgerRequests.FromString,
            name="dataproxy-ledger",
            sends=True,
        )
        # Entered last, so it stops first: in-flight turns drain while Redis lives.
        await stack.enter_async_context(server)
        # Runs before the server stops: open trainer pulls end now instead of holding the grace.
        stack.push_async_callback(trainer.close)
        await stack.enter_async_context(_reaping(store, settings))
        await server.set_serving()
        yield server


@contextlib.asynccontextmanager
async def _reaping(store: SessionStore, settings: DataProxySettings) -> AsyncIterator[None]:
    """The idle / late-reward reaper, running while the server serves."""
    reaper = Reaper(store=store, interval_s=settings.reaper_interval_s)
    stopping = asyncio.Event()
    task = asyncio.create_task(reaper.run(stopping), name="reaper")
    try:
        yield
    finally:
        stopping.set()
        try:
            async with asyncio.timeout(REAPER_STOP_S):
                await task
        except TimeoutError:
            await cancel_and_wait(task)


def main(argv: Sequence[str] | None = None) -> None:
    """Parses the command line, reads the settings once and runs until SIGTERM/SIGINT."""
    service_main(
        service="dataproxy",
        description=__doc__,
        default_port=50052,
        load_settings=DataProxySettings.load,
        serving=serving,
        argv=argv,
    )


if __name__ == "__main__":
    main()
