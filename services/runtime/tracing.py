"""W3C trace context through every hop, and spans exported over OTLP/HTTP when configured.

Propagation is always on: a `traceparent` a client sends (OpenClaw does, on every call) is
carried by every gRPC call the request causes, and by the worker's call to the upstream, so
the engine's own traces (vLLM `--otlp-traces-endpoint`) join the client's. Without a
`traceparent` and without export, nothing happens at all: one context-variable read per
outgoing call.

Export is off unless `ROLLGATE_OTLP_ENDPOINT` is set (an OTLP/HTTP collector, e.g.
`http://otel-collector:4318`). Then each service records one span per request it serves
(SERVER: the gateway's HTTP requests, every RPC) and posts them in batches as OTLP/JSON to
`<endpoint>/v1/traces` from a background task: never on the request path; a slow or absent
collector only drops spans (counted). This is a small exporter of our own rather than the
OpenTelemetry SDK: the SDK brings six packages and a worker thread per process for what is
here one JSON document per second (docs/metrics.md, *Traces*).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import time
from collections import deque
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import aiohttp
import orjson

from services.runtime.logs import get_logger
from services.runtime.secret import Secret
from stackconfig import env_float, env_str

log = get_logger(__name__)

TRACEPARENT = "traceparent"
_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")
_ZERO_TRACE = "0" * 32
_ZERO_SPAN = "0" * 16

# OTLP span kinds.
SPAN_KIND_SERVER = 2
SPAN_KIND_CLIENT = 3
STATUS_OK = 1
STATUS_ERROR = 2

EXPORT_INTERVAL_S = 1.0
EXPORT_BATCH = 512
QUEUE_MAX = 4096
EXPORT_TIMEOUT_S = 5.0
VERSION = "0.1.0"


@dataclass(frozen=True, slots=True)
class TraceContext:
    """A position in a trace: the trace, and the span that outgoing calls name as parent."""

    trace_id: str
    span_id: str
    sampled: bool = True

    @classmethod
    def parse(cls, value: str | None) -> TraceContext | None:
        """A `traceparent` header, or None when absent or malformed (then it is ignored, as
        the W3C spec says: the request starts a new trace if anything does)."""
        if not value:
            return None
        match = _TRACEPARENT.match(value.strip().lower())
        if match is None:
            return None
        version, trace_id, span_id, flags, rest = match.groups()
        # Version 00 has exactly four fields; later versions may add more; ff is invalid.
        if version == "ff" or (version == "00" and rest):
            return None
        if trace_id == _ZERO_TRACE or span_id == _ZERO_SPAN:
            return None
        return cls(trace_id=trace_id, span_id=span_id, sampled=bool(int(flags, 16) & 1))

    @classmethod
    def new_root(cls, *, sampled: bool = True) -> TraceContext:
        """The start of a new trace."""
        return cls(trace_id=_hex(16), span_id=_hex(8), sampled=sampled)

    def child(self) -> TraceContext:
        """The same trace with a new span id (this hop's span)."""
        return TraceContext(trace_id=self.trace_id, span_id=_hex(8), sampled=self.sampled)

    def header(self) -> str:
        """The `traceparent` value that names this span as the parent."""
        return f"00-{self.trace_id}-{self.span_id}-{'01' if self.sampled else '00'}"


def _hex(n_bytes: int) -> str:
    return os.urandom(n_bytes).hex()


_CURRENT: ContextVar[TraceContext | None] = ContextVar("rollgate_trace_context", default=None)


def current() -> TraceContext | None:
    """The trace the running request belongs to, if any."""
    return _CURRENT.get()


def grpc_metadata() -> tuple[tuple[str, str], ...] | None:
    """Metadata for an outgoing gRPC call: the traceparent, or None (no metadata) outside
    a trace."""
    context = _CURRENT.get()
    return None if context is None else ((TRACEPARENT, context.header()),)


def with_trace(metadata: tuple[tuple[str, str], ...] | None) -> tuple[tuple[str, str], ...] | None:
    """`metadata` (e.g. a bearer key) plus the traceparent when there is one."""
    context = _CURRENT.get()
    if context is None:
        return metadata
    return (*(metadata or ()), (TRACEPARENT, context.header()))


def http_headers() -> dict[str, str]:
    """Headers for an outgoing HTTP call (the worker's upstream request)."""
    context = _CURRENT.get()
    return {} if context is None else {TRACEPARENT: context.header()}


def incoming(metadata: Any) -> TraceContext | None:
    """The traceparent of gRPC invocation metadata (a sequence of key/value pairs)."""
    for key, value in metadata or ():
        if key == TRACEPARENT:
            return TraceContext.parse(value.decode() if isinstance(value, bytes) else value)
    return None


# -- spans ---------------------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class Span:
    """One unit of work of this process, as OTLP describes it."""

    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int = 0
    attributes: dict[str, str | int | float | bool] = field(default_factory=dict)
    status: int = 0
    status_message: str = ""

    def fail(self, message: str) -> None:
        """Marks the span as failed (a non-OK status)."""
        self.status = STATUS_ERROR
        self.status_message = message[:256]


@dataclass(frozen=True, slots=True, kw_only=True)
class TracingSettings:
    """Where spans go (endpoint "": nowhere), extra headers for the collector, and the share
    of new traces (those no client started) that are recorded."""

    endpoint: str = ""
    headers: Secret = field(default_factory=lambda: Secret(""))
    sample_ratio: float = 1.0


NO_TRACING = TracingSettings()


def tracing_settings(environ: Mapping[str, str]) -> TracingSettings:
    """`ROLLGATE_OTLP_ENDPOINT`, `ROLLGATE_OTLP_HEADERS` (`k=v,k2=v2`, e.g. a collector's API
    key: held as a secret), `ROLLGATE_OTLP_SAMPLE_RATIO` (1.0)."""
    endpoint = env_str(environ, "ROLLGATE_OTLP_ENDPOINT", "").rstrip("/")
    if endpoint and not endpoint.startswith(("http://", "https://")):
        raise ValueError(
            f"ROLLGATE_OTLP_ENDPOINT={endpoint!r} must be an http(s) URL of an OTLP/HTTP "
            "collector, e.g. http://otel-collector:4318"
        )
    ratio = env_float(environ, "ROLLGATE_OTLP_SAMPLE_RATIO", 1.0)
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"ROLLGATE_OTLP_SAMPLE_RATIO={ratio} must be between 0 and 1")
    headers = env_str(environ, "ROLLGATE_OTLP_HEADERS", "")
    for item in filter(None, headers.split(",")):
        if "=" not in item:
            raise ValueError("ROLLGATE_OTLP_HEADERS must be k=v pairs separated by commas")
    return TracingSettings(endpoint=endpoint, headers=Secret(headers), sample_ratio=ratio)


class Tracer:
    """Opens this process's span for each request it serves; a no-op without an exporter
    beyond carrying the incoming traceparent on."""

    def __init__(self, exporter: OtlpExporter | None = None, *, sample_ratio: float = 1.0) -> None:
        self.exporter = exporter
        self._ratio = sample_ratio

    @contextlib.contextmanager
    def serve(
        self, name: str, parent: TraceContext | None, *, kind: int = SPAN_KIND_SERVER,
        attributes: Mapping[str, str | int | float | bool] | None = None,
    ) -> Iterator[Span | None]:  # fmt: skip
        """Runs the body in the request's trace; yields its span when one is recorded."""
        if self.exporter is None:
            if parent is None:
                yield None
                return
            # Not recording: pass the caller's context on unchanged, as the spec allows.
            previous = _CURRENT.get()
            _CURRENT.set(parent)
            try:
                yield None
            finally:
                # set(), not reset(): an async generator may be closed from another task.
                _CURRENT.set(previous)
            return
        if parent is None:
            context = TraceContext.new_root(sampled=random.random() < self._ratio)
            parent_id = ""
        else:
            context = parent.child()
            parent_id = parent.span_id
        previous = _CURRENT.get()
        _CURRENT.set(context)
        span = Span(
            name=name,
            kind=kind,
            trace_id=context.trace_id,
            span_id=context.span_id,
            parent_span_id=parent_id,
            start_ns=time.time_ns(),
            attributes=dict(attributes or {}),
        )
        try:
            yield span
        except BaseException as err:
            if span.status == 0:
                span.fail(type(err).__name__)
            raise
        finally:
            _CURRENT.set(previous)
            span.end_ns = time.time_ns()
            if context.sampled:
                self.exporter.add(span)


# -- OTLP/HTTP JSON export ------------------------------------------------------------------


def _attribute(key: str, value: str | int | float | bool) -> dict[str, Any]:
    if isinstance(value, bool):
        return {"key": key, "value": {"boolValue": value}}
    if isinstance(value, int):
        return {"key": key, "value": {"intValue": str(value)}}
    if isinstance(value, float):
        return {"key": key, "value": {"doubleValue": value}}
    return {"key": key, "value": {"stringValue": value}}


def otlp_json(service: str, spans: list[Span]) -> bytes:
    """An OTLP ExportTraceServiceRequest in its JSON encoding (ids as hex)."""
    body = {
        "resourceSpans": [
            {
                "resource": {
                    "attributes": [
                        _attribute("service.name", f"rollgate-{service}"),
                        _attribute("service.namespace", "rollgate"),
                        _attribute("service.version", VERSION),
                    ]
                },
                "scopeSpans": [
                    {
                        "scope": {"name": "rollgate", "version": VERSION},
                        "spans": [
                            {
                                "traceId": s.trace_id,
                                "spanId": s.span_id,
                                **({"parentSpanId": s.parent_span_id} if s.parent_span_id else {}),
                                "name": s.name,
                                "kind": s.kind,
                                "startTimeUnixNano": str(s.start_ns),
                                "endTimeUnixNano": str(s.end_ns),
                                "attributes": [_attribute(k, v) for k, v in s.attributes.items()],
                                "status": {"code": s.status, "message": s.status_message}
                                if s.status
                                else {},
                            }
                            for s in spans
                        ],
                    }
                ],
            }
        ]
    }
    return orjson.dumps(body)


class OtlpExporter:
    """`async with`: batches spans and posts them every second; bounded, never blocking."""

    def __init__(self, *, service: str, settings: TracingSettings) -> None:
        self.service = service
        endpoint = settings.endpoint
        self.url = endpoint if endpoint.endswith("/v1/traces") else endpoint + "/v1/traces"
        self._headers = settings.headers
        self._queue: deque[Span] = deque(maxlen=QUEUE_MAX)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._http: aiohttp.ClientSession | None = None
        self.exported = 0
        self.dropped = 0

    def add(self, span: Span) -> None:
        """Queues a finished span (the oldest is dropped when the queue is full)."""
        if len(self._queue) == self._queue.maxlen:
            self.dropped += 1
        self._queue.append(span)
        if len(self._queue) >= EXPORT_BATCH:
            self._wake.set()

    def _header_map(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        for item in filter(None, self._headers.reveal().split(",")):
            key, _, value = item.partition("=")
            headers[key.strip()] = value.strip()
        return headers

    async def flush(self) -> None:
        """Posts everything queued now (in batches)."""
        while self._queue:
            batch = [self._queue.popleft() for _ in range(min(EXPORT_BATCH, len(self._queue)))]
            assert self._http is not None
            try:
                async with self._http.post(
                    self.url,
                    data=otlp_json(self.service, batch),
                    headers=self._header_map(),
                    timeout=aiohttp.ClientTimeout(total=EXPORT_TIMEOUT_S),
                ) as resp:
                    if resp.status >= 300:
                        raise aiohttp.ClientResponseError(
                            resp.request_info, (), status=resp.status, message=resp.reason or ""
                        )
                self.exported += len(batch)
            except (aiohttp.ClientError, TimeoutError, OSError) as err:
                self.dropped += len(batch)
                log.warning(
                    "otlp_export_failed", url=self.url, error=type(err).__name__, spans=len(batch)
                )

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(EXPORT_INTERVAL_S):
                    await self._wake.wait()
            self._wake.clear()
            await self.flush()

    async def __aenter__(self) -> OtlpExporter:
        self._http = aiohttp.ClientSession()
        self._task = asyncio.create_task(self._run(), name="otlp-exporter")
        log.info("otlp_export_on", url=self.url)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(EXPORT_TIMEOUT_S):
                await self.flush()
        if self._http is not None:
            await self._http.close()


@contextlib.asynccontextmanager
async def tracer_for(service: str, settings: TracingSettings) -> Any:
    """`async with tracer_for(...) as tracer:` an exporting Tracer when an endpoint is set,
    else the propagating-only one."""
    if not settings.endpoint:
        yield Tracer()
        return
    async with OtlpExporter(service=service, settings=settings) as exporter:
        yield Tracer(exporter, sample_ratio=settings.sample_ratio)
