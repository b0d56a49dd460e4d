"""Router settings, read once in `__main__`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from services.runtime.metrics import NO_METRICS_PORT, MetricsEndpoint, metrics_endpoint
from services.runtime.settings import DEFAULT_REDIS_URL, env_bool, env_float, env_str, redis_url
from services.runtime.tracing import NO_TRACING, TracingSettings, tracing_settings

# An affinity unused this long is forgotten; the next turn of that session is placed afresh.
AFFINITY_TTL_S = 24 * 3600.0


@dataclass(frozen=True, slots=True, kw_only=True)
class RouterSettings:
    """Everything the router needs to know at start-up."""

    host: str = "127.0.0.1"
    port: int = 50051
    redis_url: str = DEFAULT_REDIS_URL
    redis_prefix: str = "rg:"
    # A worker is live while its last heartbeat is younger than this.
    lease_s: float = 6.0
    # How often workers are told to heartbeat.
    heartbeat_interval_s: float = 1.0
    # A worker silent this long leaves the registry (and its per-worker metric series go):
    # workers that die without deregistering, each restart a new id, must not pile up.
    forget_after_s: float = 60.0
    affinity_ttl_s: float = AFFINITY_TTL_S
    # Upper bound on the Redis work of one RPC (less when the caller's deadline is shorter).
    redis_timeout_s: float = 5.0
    grace_s: float = 10.0
    log_level: str = "info"
    # None: JSON unless stderr is a terminal.
    log_json: bool | None = None
    # Where GET /metrics is served (port None: nowhere); docs/metrics.md.
    metrics: MetricsEndpoint = NO_METRICS_PORT
    # Spans over OTLP/HTTP when an endpoint is set (off by default); docs/metrics.md, Traces.
    tracing: TracingSettings = NO_TRACING

    def __post_init__(self) -> None:
        if self.heartbeat_interval_s <= 0 or self.lease_s <= self.heartbeat_interval_s:
            raise ValueError(
                f"the worker lease ({self.lease_s}s, ROLLGATE_WORKER_LEASE_S) must be longer than "
                f"the heartbeat interval ({self.heartbeat_interval_s}s, "
                "ROLLGATE_HEARTBEAT_INTERVAL_S), and both positive"
            )
        if self.forget_after_s < self.lease_s:
            raise ValueError(
                f"a silent worker is forgotten after {self.forget_after_s}s "
                "(ROLLGATE_WORKER_FORGET_AFTER_S), which must be at least its lease "
                f"({self.lease_s}s, ROLLGATE_WORKER_LEASE_S)"
            )

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str], *, host: str | None = None, port: int | None = None
    ) -> RouterSettings:
        """Settings from the environment (and command-line host/port)."""
        raw_json = env_str(environ, "ROLLGATE_LOG_JSON", "auto").lower()
        bind_host = host or env_str(environ, "ROLLGATE_ROUTER_HOST", "127.0.0.1")
        return cls(
            host=bind_host,
            metrics=metrics_endpoint(environ, service="router", host=bind_host),
            tracing=tracing_settings(environ),
            port=port if port is not None else 50051,
            redis_url=redis_url(environ),
            redis_prefix=env_str(environ, "ROLLGATE_REDIS_PREFIX", "rg:"),
            lease_s=env_float(environ, "ROLLGATE_WORKER_LEASE_S", 6.0),
            heartbeat_interval_s=env_float(environ, "ROLLGATE_HEARTBEAT_INTERVAL_S", 1.0),
            forget_after_s=env_float(environ, "ROLLGATE_WORKER_FORGET_AFTER_S", 60.0),
            grace_s=env_float(environ, "ROLLGATE_GRACE_S", 10.0),
            log_level=env_str(environ, "ROLLGATE_LOG_LEVEL", "info"),
            log_json=None if raw_json == "auto" else env_bool(environ, "ROLLGATE_LOG_JSON", False),
        )
