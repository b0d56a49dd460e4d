"""The settings every service has (host and port, grace, logs, metrics, traces, Redis), read
the same way for all four; each service's settings dataclass extends `ServiceSettings`.

Every value goes through `stackconfig.Sources` (command-line override > environment > file >
default); `__main__` builds the sources once (`service_main`) and passes them to the
service's `load`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Self

from redis.connection import parse_url

from services.runtime.metrics import NO_METRICS_PORT, MetricsEndpoint, metrics_endpoint
from services.runtime.tracing import NO_TRACING, TracingSettings, tracing_settings
from stackconfig import Sources, env_bool, env_float, env_int, env_str

__all__ = [
    "DEFAULT_REDIS_URL",
    "ServiceSettings",
    "Sources",
    "common_settings",
    "env_bool",
    "env_float",
    "env_int",
    "env_str",
    "framed_port",
    "positive",
    "redis_settings",
]

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_REDIS_PREFIX = "rg:"


@dataclass(frozen=True, slots=True, kw_only=True)
class ServiceSettings:
    """What every service reads: where it listens, how it stops, logs, metrics and traces."""

    host: str = "127.0.0.1"
    port: int = 0
    # In-flight requests get this long to finish on shutdown.
    grace_s: float = 10.0
    # A stopping service serves on until its clients went quiet, at most this long (0: no
    # wait); services.runtime.grpc_server.GrpcServer.stop.
    stop_notice_s: float = 1.5
    log_level: str = "info"
    # None: JSON unless stderr is a terminal.
    log_json: bool | None = None
    # Where GET /metrics is served (port None: nowhere), never a service port; docs/metrics.md.
    metrics: MetricsEndpoint = NO_METRICS_PORT
    # Spans over OTLP/HTTP when an endpoint is set (off by default); docs/metrics.md, Traces.
    tracing: TracingSettings = NO_TRACING

    @classmethod
    def load(cls, src: Sources, *, host: str | None = None, port: int | None = None) -> Self:
        """The settings from `src` (command-line host/port win); each service defines it."""
        raise NotImplementedError

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str], *, host: str | None = None, port: int | None = None
    ) -> Self:
        """The settings from the environment alone (no configuration file)."""
        return cls.load(Sources(environ=environ), host=host, port=port)


def common_settings(
    src: Sources, *, service: str, host: str | None, port: int | None, default_port: int
) -> dict[str, Any]:
    """The `ServiceSettings` fields of `service` (command-line host/port win)."""
    bind_host = host or src.text(f"ROLLGATE_{service.upper()}_HOST", "127.0.0.1")
    raw_json = src.text("ROLLGATE_LOG_JSON", "auto").lower()
    if port is not None and not 0 <= port <= MAX_PORT:
        raise ValueError(f"--port {port} is not a port: use 1-{MAX_PORT}, or 0 for any free one")
    return {
        "host": bind_host,
        "port": port if port is not None else default_port,
        "grace_s": src.number("ROLLGATE_GRACE_S", 10.0),
        "stop_notice_s": src.number("ROLLGATE_STOP_NOTICE_S", 1.5),
        "log_level": log_level(src.text("ROLLGATE_LOG_LEVEL", "info", file="log_level")),
        "log_json": None if raw_json == "auto" else src.flag("ROLLGATE_LOG_JSON", False),
        "metrics": metrics_endpoint(src.environ, service=service, host=bind_host),
        "tracing": tracing_settings(src.environ),
    }


MAX_PORT = 65535
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def log_level(raw: str) -> str:
    """The log level, lower case; ValueError naming the setting and the levels otherwise."""
    level = raw.strip().lower()
    level = {"warn": "warning", "fatal": "critical"}.get(level, level)
    if level not in LOG_LEVELS:
        raise ValueError(
            f"ROLLGATE_LOG_LEVEL={raw!r} (log_level in a configuration file) is not a log "
            f"level: use one of {', '.join(LOG_LEVELS)}"
        )
    return level


def redis_settings(src: Sources) -> dict[str, Any]:
    """`redis_url`: `ROLLGATE_REDIS_URL`, else the file's `redis.url`, else `REDIS_URL`, else
    the local default; `redis_prefix`: `ROLLGATE_REDIS_PREFIX`, else `redis.prefix`, else
    `rg:`."""
    fallback = env_str(src.environ, "REDIS_URL", DEFAULT_REDIS_URL)
    url = src.text("ROLLGATE_REDIS_URL", fallback, file="redis.url")
    try:
        parse_url(url)  # type: ignore[no-untyped-call]
    except ValueError as err:
        # redis-py's reason, never the URL itself (it may hold a password).
        raise ValueError(
            f"ROLLGATE_REDIS_URL (or redis.url in the file, or REDIS_URL) is not a Redis URL: "
            f"{err}; e.g. redis://127.0.0.1:6379/0"
        ) from None
    return {
        "redis_url": url,
        "redis_prefix": src.text(
            "ROLLGATE_REDIS_PREFIX", DEFAULT_REDIS_PREFIX, file="redis.prefix"
        ),
    }


def framed_port(src: Sources, service: str) -> int | None:
    """Where `service` serves its hot stream framed (services/runtime/framed.py):
    `ROLLGATE_<SERVICE>_FRAMED_PORT`, a port, 0 (the default: any free one, which the service
    names to its callers) or `off` (None: the gRPC stream only)."""
    name = f"ROLLGATE_{service.upper()}_FRAMED_PORT"
    raw = src.text(name, "0").strip().lower()
    if raw in ("off", "none", "false", "no"):
        return None
    try:
        port = int(raw)
    except ValueError:
        port = -1
    if not 0 <= port <= MAX_PORT:
        raise ValueError(
            f"{name}={raw!r} is not a port: use 1-{MAX_PORT}, 0 for any free one, or off"
        )
    return port


def positive(value: float, name: str) -> float:
    """`value`, or ValueError naming the setting when it is not positive."""
    if value <= 0:
        raise ValueError(f"{name}={value} must be positive")
    return value
