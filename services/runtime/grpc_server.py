"""The gRPC server every service runs: health service, one log line per RPC, graceful stop."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TextIO

import grpc
from google.protobuf.descriptor import FieldDescriptor
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from redis.exceptions import RedisError

from grpcpoller import unblock_grpc_poller
from services.runtime.errors import (
    InternalError,
    RollgateError,
    Unavailable,
    abort_with,
    check_identifier,
    state_store_unavailable,
)
from services.runtime.logs import get_logger

log = get_logger(__name__)

# A stopping server keeps serving, health NOT_SERVING, until no RPC came in for QUIET_S (its
# clients with health checking moved to another replica), at most its stop notice
# (ROLLGATE_STOP_NOTICE_S): an RPC that arrives once the server stops is failed CANCELLED
# unserved (grpc/grpc#41785).
QUIET_S = 0.25
STOP_NOTICE_S = 1.5
# 64 MiB: trajectories and long prompts exceed gRPC's default 4 MiB.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# A backstop above the gateway's own identifier limit: hops compose identifiers
# (digest/session), and direct callers (training code) skip the gateway.
MAX_RPC_STRING_CHARS = 1024

SERVER_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.so_reuseport", 0),
)


class _ServiceInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc is untyped
    """Every RPC of every servicer: request identifiers bounded, errors mapped, one log line.

    Servicers raise RollgateError; this puts it on the wire (status + bounded trailing
    metadata). Redis failures become 503 "state store unavailable"; anything else unexpected is
    logged with its traceback and answered INTERNAL without details.
    """

    def __init__(self, service: str) -> None:
        self._service = service
        # When the last RPC (health checks aside) came in: a stopping server waits for its
        # clients to go quiet (`GrpcServer.stop`).
        self.last_call_at = time.monotonic()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith("/grpc.health"):
            return handler
        self.last_call_at = time.monotonic()
        kind = _kind(handler)
        if not kind:
            return handler
        method_handler, wrap = _WRAPPERS[kind]
        return method_handler(
            wrap(getattr(handler, kind), service=self._service, method=method),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


def _kind(handler: grpc.RpcMethodHandler) -> str:
    for kind in ("unary_unary", "unary_stream", "stream_stream", "stream_unary"):
        if getattr(handler, kind) is not None:
            return kind
    return ""


def _answering(
    inner: Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[Any]],
    *,
    service: str,
    method: str,
    unary_request: bool,
) -> Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[Any]]:
    """A unary-response RPC (unary_unary, stream_unary) with errors mapped and logged."""

    async def call(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        started = time.perf_counter()
        try:
            if unary_request:
                check_request_strings(request)
            return await inner(request, context)
        except Exception as err:
            await _abort(context, err, service=service, method=method)
        finally:
            _log_rpc(method, started, context)

    return call


def _streaming(
    inner: Callable[[Any, grpc.aio.ServicerContext[Any, Any]], AsyncIterator[Any]],
    *,
    service: str,
    method: str,
    unary_request: bool,
) -> Callable[[Any, grpc.aio.ServicerContext[Any, Any]], AsyncIterator[Any]]:
    """A streaming-response RPC (unary_stream, stream_stream) with errors mapped and logged.

    A stream of requests is bounded by its servicer, per op: a stream carries many turns, and
    one bad op must not end the others.
    """

    async def call(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        started = time.perf_counter()
        try:
            if unary_request:
                check_request_strings(request)
            async for item in inner(request, context):
                yield item
        except Exception as err:
            await _abort(context, err, service=service, method=method)
        finally:
            _log_rpc(method, started, context)

    return call


_WRAPPERS: dict[str, tuple[Callable[..., grpc.RpcMethodHandler], Callable[..., Any]]] = {
    "unary_unary": (
        grpc.unary_unary_rpc_method_handler,
        functools.partial(_answering, unary_request=True),
    ),
    "stream_unary": (
        grpc.stream_unary_rpc_method_handler,
        functools.partial(_answering, unary_request=False),
    ),
    "unary_stream": (
        grpc.unary_stream_rpc_method_handler,
        functools.partial(_streaming, unary_request=True),
    ),
    "stream_stream": (
        grpc.stream_stream_rpc_method_handler,
        functools.partial(_streaming, unary_request=False),
    ),
}


def check_request_strings(request: Any) -> None:
    """InvalidRequest naming the field when a request's string field is over the limit.

    Every string field of rollgate's requests is an identifier (ids, names, digests,
    addresses); bodies travel as bytes. Checked here, nested messages included, so no servicer
    echoes a huge one.
    """
    for field, value in request.ListFields():
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            if field.message_type.GetOptions().map_entry:
                continue  # no maps of strings in our protos
            for message in value if field.is_repeated else (value,):
                check_request_strings(message)
            continue
        if field.type != FieldDescriptor.TYPE_STRING:
            continue
        values = value if field.is_repeated else (value,)
        for text in values:
            check_identifier(text, field.name, limit=MAX_RPC_STRING_CHARS)


async def _abort(
    context: grpc.aio.ServicerContext[Any, Any], err: Exception, *, service: str, method: str
) -> NoReturn:
    if isinstance(err, grpc.aio.AbortError):
        raise err  # the servicer ended the RPC itself
    await abort_with(context, as_rollgate_error(err, service=service, method=method))


def as_rollgate_error(err: Exception, *, service: str, method: str) -> RollgateError:
    if isinstance(err, RollgateError):
        return err
    if isinstance(err, RedisError):
        log.warning("state_store_failed", method=method, error=type(err).__name__, detail=str(err))
        return state_store_unavailable()
    if isinstance(err, TimeoutError):
        log.warning("rpc_timed_out", method=method)
        return Unavailable(
            f"the {service} timed out on an internal call; retry shortly",
            code=f"{service}_timeout",
            retry_after_s=1.0,
        )
    log.error("rpc_crashed", method=method, exc_info=err)
    return InternalError(f"internal error in the {service}; see its logs", code="internal_error")


def _log_rpc(method: str, started: float, context: grpc.aio.ServicerContext[Any, Any]) -> None:
    code = context.code()
    log.debug(
        "rpc",
        method=method,
        code=code.name if isinstance(code, grpc.StatusCode) else "OK",
        duration_ms=round((time.perf_counter() - started) * 1000, 3),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerSpec:
    """What a service needs from the shared bootstrap."""

    name: str
    host: str
    port: int
    # Service names (full proto names) announced on the health service.
    service_names: Sequence[str]
    grace_s: float = 10.0
    # How long a stop serves on at most, waiting for its clients to go quiet (0: not at all).
    stop_notice_s: float = STOP_NOTICE_S
    # Outermost first (the metrics interceptor comes first: it sees every final status).
    interceptors: Sequence[grpc.aio.ServerInterceptor] = ()


class GrpcServer:
    """An `async with` gRPC server with health; `stop()` runs the one shutdown sequence."""

    def __init__(self, spec: ServerSpec) -> None:
        self.spec = spec
        self._calls = _ServiceInterceptor(spec.name)
        self.server = grpc.aio.server(
            interceptors=[*spec.interceptors, self._calls], options=SERVER_OPTIONS
        )
        unblock_grpc_poller()
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = 0
        # What must end before the server stops (long-lived streams that end on their own
        # once their work is done), each given the grace period.
        self._drains: list[Callable[[float], Awaitable[None]]] = []
        # True from the start of `stop` (health NOT_SERVING, drains running).
        self.draining = False

    def on_drain(self, drain: Callable[[float], Awaitable[None]]) -> None:
        """Runs `drain(grace_s)` in `stop`, after health goes NOT_SERVING, before the server
        stops taking RPCs (the streams it ends may still carry the end of running work)."""
        self._drains.append(drain)

    async def __aenter__(self) -> GrpcServer:
        try:
            self.port = self.server.add_insecure_port(f"{self.spec.host}:{self.spec.port}")
        except RuntimeError:
            # grpcio raises RuntimeError ("Failed to bind") where older versions returned 0.
            self.port = 0
        if self.port == 0:
            raise OSError(
                f"{self.spec.name}: cannot listen on {self.spec.host}:{self.spec.port} (in use, "
                "or not an address of this host): choose another --port or --host"
            )
        await self.server.start()
        return self

    async def set_serving(self) -> None:
        """Marks the service and each named service SERVING."""
        for name in ("", *self.spec.service_names):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("service_started", name=self.spec.name, port=self.port)

    async def stop(self) -> None:
        """Health → NOT_SERVING, drains, serve until the clients went quiet (≤ the notice),
        then refuse new RPCs and let in-flight ones finish within the grace."""
        self.draining = True
        await self.health.enter_graceful_shutdown()
        drains, self._drains = self._drains, []
        for drain in drains:
            await drain(self.spec.grace_s)
        await self._until_quiet()
        await self.server.stop(self.spec.grace_s)
        log.info("service_stopped", name=self.spec.name)

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _until_quiet(self) -> None:
        """Returns once no RPC came in for QUIET_S, or after the stop notice."""
        deadline = time.monotonic() + self.spec.stop_notice_s
        while (now := time.monotonic()) < deadline:
            quiet_for = now - self._calls.last_call_at
            if quiet_for >= QUIET_S:
                return
            await asyncio.sleep(min(QUIET_S - quiet_for, deadline - now))


async def wait_for_stop_signal() -> None:
    """Returns on SIGTERM or SIGINT; on SIGUSR1 prints every task's stack to stderr."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, dump_tasks)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(sig)


def dump_tasks(file: TextIO | None = None) -> None:
    """Every asyncio task of the running loop with where it waits (`kill -USR1 <pid>`: what a
    process that went quiet is waiting for). Code locations only, no values."""
    out = file or sys.stderr
    tasks = asyncio.all_tasks()
    print(f"--- {len(tasks)} asyncio tasks ---", file=out)
    for task in sorted(tasks, key=lambda t: t.get_name()):
        print(f"task {task.get_name()}:", file=out)
        # The chain of awaits down to what it waits on (a task's own stack stops at its
        # outermost coroutine).
        awaited: Any = task.get_coro()
        while awaited is not None:
            frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None)
            if frame is None:
                print(f"  waiting on {type(awaited).__qualname__}", file=out)
                break
            code = frame.f_code
            print(f"  {code.co_filename}:{frame.f_lineno} in {code.co_name}", file=out)
            awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
    print("--- end of tasks ---", file=out, flush=True)


def run(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Runs a service's async main on uvloop."""
    try:
        import uvloop

        uvloop.run(main())
    except ImportError:  # pragma: no cover - uvloop is a pinned dependency
        asyncio.run(main())
