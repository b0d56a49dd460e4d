"""Gateway settings, read once in `__main__`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from services.gateway.ws_protocol import DEFAULT_SYSTEM_PROMPT
from services.runtime.metrics import NO_METRICS_PORT, MetricsEndpoint, metrics_endpoint
from services.runtime.secret import Secret
from services.runtime.settings import env_bool, env_float, env_int, env_str
from services.runtime.tracing import NO_TRACING, TracingSettings, tracing_settings

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
# start_session waits the dataproxy's refresh timeout plus this much (publication, hops).
START_SESSION_MARGIN_S = 10.0


@dataclass(frozen=True, slots=True, kw_only=True)
class GatewaySettings:
    """Everything the gateway needs to know at start-up."""

    # Authenticates /rl/start_session (and /v1/models); required, compared in constant time.
    admin_key: Secret
    host: str = "127.0.0.1"
    port: int = 8080
    router_addr: str = "127.0.0.1:50051"
    dataproxy_addr: str = "127.0.0.1:50052"
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # Deadline for one chat turn, streaming included.
    request_timeout_s: float = 600.0
    # Deadline for routing and the small session calls (set_reward, models, ...).
    rpc_timeout_s: float = 5.0
    # start_session may wait for capacity: the dataproxy's refresh timeout plus a margin.
    start_session_timeout_s: float = 130.0
    # end_session publishes the trajectory: more work than a reward.
    end_session_timeout_s: float = 30.0
    # Deadline for each health check behind /ready.
    ready_timeout_s: float = 2.0
    # How often /health's cached count of live workers is refreshed from the router.
    health_workers_refresh_s: float = 2.0
    route_cache_ttl_s: float = 5.0
    route_cache_size: int = 100_000
    # In-flight requests get this long to finish on shutdown.
    grace_s: float = 10.0
    log_level: str = "info"
    log_json: bool | None = None
    # The console (/console): how long a login cookie lives without use (renewed while the
    # page is open), and the longest a login lasts however often it is renewed.
    console_session_s: float = 900.0
    console_max_login_s: float = 12 * 3600.0
    # Refused console logins a client address may make per minute (then 429 until they refill).
    console_login_failures_per_min: int = 10
    # Where GET /metrics is served (port None: nowhere), never the public port; docs/metrics.md.
    metrics: MetricsEndpoint = NO_METRICS_PORT
    # Spans over OTLP/HTTP when an endpoint is set (off by default); docs/metrics.md, Traces.
    tracing: TracingSettings = NO_TRACING
    # The WebSocket bridge (`/ws`, docs/protocols.md): the model its runs use ("": the first
    # model a live worker serves), their system prompt, the tick interval, the frame and
    # buffer limits announced in hello-ok, and the deadline of one run.
    ws_model: str = ""
    ws_system_prompt: str = DEFAULT_SYSTEM_PROMPT
    ws_tick_interval_ms: int = 15_000
    ws_max_payload_bytes: int = 25 * 1024 * 1024
    ws_max_buffered_bytes: int = 50 * 1024 * 1024
    ws_run_timeout_s: float = 600.0
    # The HTTP/1.1 edge (docs/deploy.md): a request head (request line and headers) must
    # arrive within header_timeout_s of its first byte; an idle keep-alive connection is
    # closed after keepalive_timeout_s; a header line (and the request line) may be at most
    # max_header_bytes long, and a request may carry at most max_headers headers.
    header_timeout_s: float = 10.0
    # The whole body must arrive within this long of the head.
    body_timeout_s: float = 60.0
    keepalive_timeout_s: float = 75.0
    max_header_bytes: int = 8190
    max_headers: int = 128

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str], *, host: str | None = None, port: int | None = None
    ) -> GatewaySettings:
        """Settings from the environment (and command-line host/port)."""
        admin_key = env_str(environ, "ROLLGATE_ADMIN_KEY", "")
        if not admin_key:
            raise ValueError(
                "ROLLGATE_ADMIN_KEY is not set: the gateway needs the admin key to authenticate "
                "/rl/start_session (rollgate up sets it for you)"
            )
        max_body_bytes = env_int(environ, "ROLLGATE_MAX_BODY_BYTES", DEFAULT_MAX_BODY_BYTES)
        if max_body_bytes <= 0:
            raise ValueError(f"ROLLGATE_MAX_BODY_BYTES={max_body_bytes} must be positive")
        request_timeout_s = env_float(environ, "ROLLGATE_REQUEST_TIMEOUT_S", 600.0)
        if request_timeout_s <= 0:
            raise ValueError(f"ROLLGATE_REQUEST_TIMEOUT_S={request_timeout_s} must be positive")
        raw_json = environ.get("ROLLGATE_LOG_JSON", "").strip().lower()
        refresh_timeout_s = env_float(environ, "ROLLGATE_REFRESH_TIMEOUT_S", 120.0)
        if refresh_timeout_s <= 0:
            raise ValueError(f"ROLLGATE_REFRESH_TIMEOUT_S={refresh_timeout_s} must be positive")
        bind_host = host or env_str(environ, "ROLLGATE_GATEWAY_HOST", "127.0.0.1")
        return cls(
            admin_key=Secret(admin_key),
            host=bind_host,
            metrics=metrics_endpoint(environ, service="gateway", host=bind_host),
            tracing=tracing_settings(environ),
            console_session_s=_positive(environ, "ROLLGATE_CONSOLE_SESSION_S", 900.0),
            console_max_login_s=_positive(environ, "ROLLGATE_CONSOLE_MAX_LOGIN_S", 12 * 3600.0),
            console_login_failures_per_min=_at_least_one(
                environ, "ROLLGATE_CONSOLE_LOGIN_FAILURES_PER_MIN", 10
            ),
            port=port if port is not None else 8080,
            router_addr=env_str(environ, "ROLLGATE_ROUTER_ADDR", "127.0.0.1:50051"),
            dataproxy_addr=env_str(environ, "ROLLGATE_DATAPROXY_ADDR", "127.0.0.1:50052"),
            max_body_bytes=max_body_bytes,
            request_timeout_s=request_timeout_s,
            start_session_timeout_s=refresh_timeout_s + START_SESSION_MARGIN_S,
            grace_s=env_float(environ, "ROLLGATE_GRACE_S", 10.0),
            log_level=env_str(environ, "ROLLGATE_LOG_LEVEL", "info"),
            log_json=None
            if raw_json in ("", "auto")
            else env_bool(environ, "ROLLGATE_LOG_JSON", False),
            **_ws_settings(environ),
            **_edge_settings(environ),
        )


def _ws_settings(environ: Mapping[str, str]) -> dict[str, Any]:
    """The `ROLLGATE_WS_*` variables; every limit must be positive."""
    numbers: dict[str, Any] = {
        "ws_tick_interval_ms": env_int(environ, "ROLLGATE_WS_TICK_INTERVAL_MS", 15_000),
        "ws_max_payload_bytes": env_int(environ, "ROLLGATE_WS_MAX_PAYLOAD_BYTES", 25 << 20),
        "ws_max_buffered_bytes": env_int(environ, "ROLLGATE_WS_MAX_BUFFERED_BYTES", 50 << 20),
        "ws_run_timeout_s": env_float(environ, "ROLLGATE_WS_RUN_TIMEOUT_S", 600.0),
    }
    for name, value in numbers.items():
        if value <= 0:
            raise ValueError(f"ROLLGATE_{name.upper()}={value} must be positive")
    return numbers | {
        "ws_model": env_str(environ, "ROLLGATE_WS_MODEL", ""),
        "ws_system_prompt": env_str(environ, "ROLLGATE_WS_SYSTEM_PROMPT", DEFAULT_SYSTEM_PROMPT),
    }


def _positive(environ: Mapping[str, str], name: str, default: float) -> float:
    value = env_float(environ, name, default)
    if value <= 0:
        raise ValueError(f"{name}={value} must be positive")
    return value


def _at_least_one(environ: Mapping[str, str], name: str, default: int) -> int:
    value = env_int(environ, name, default)
    if value < 1:
        raise ValueError(f"{name}={value} must be at least 1")
    return value


def _edge_settings(environ: Mapping[str, str]) -> dict[str, Any]:
    """The HTTP/1.1 edge's limits; each must be positive."""
    numbers: dict[str, Any] = {
        "header_timeout_s": env_float(environ, "ROLLGATE_HEADER_TIMEOUT_S", 10.0),
        "body_timeout_s": env_float(environ, "ROLLGATE_BODY_TIMEOUT_S", 60.0),
        "keepalive_timeout_s": env_float(environ, "ROLLGATE_KEEPALIVE_TIMEOUT_S", 75.0),
        "max_header_bytes": env_int(environ, "ROLLGATE_MAX_HEADER_BYTES", 8190),
        "max_headers": env_int(environ, "ROLLGATE_MAX_HEADERS", 128),
    }
    for name, value in numbers.items():
        if value <= 0:
            raise ValueError(f"ROLLGATE_{name.upper()}={value} must be positive")
    return numbers
