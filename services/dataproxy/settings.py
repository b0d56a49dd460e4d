"""Dataproxy settings, read once in `__main__`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from services.runtime.metrics import NO_METRICS_PORT, MetricsEndpoint, metrics_endpoint
from services.runtime.secret import NO_SECRET, Secret
from services.runtime.settings import env_bool, env_float, env_int, env_str, redis_url
from services.runtime.tracing import NO_TRACING, TracingSettings, tracing_settings


@dataclass(frozen=True, slots=True, kw_only=True)
class DataProxySettings:
    """Everything the dataproxy needs to know at start-up."""

    host: str = "127.0.0.1"
    port: int = 50052
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_prefix: str = "rg:"
    # Verifies the Trainer service's callers; required.
    admin_key: Secret = NO_SECRET
    # A second key that may call the Trainer service (optional).
    trainer_key: Secret = NO_SECRET
    # Deadline for one turn at the worker, streaming included.
    turn_timeout_s: float = 600.0
    # How long a start or refresh waits for capacity before 429 (the key stays valid).
    refresh_timeout_s: float = 120.0
    # Staleness bound (AReaL): open + published episodes ≤ (this + weight version + 1) x
    # batch_size. None: no bound (capacity unlimited unless GrantCapacity is called).
    max_head_offpolicyness: int | None = None
    batch_size: int = 1
    # How long a new turn waits while submission is paused before 503.
    pause_wait_s: float = 30.0
    # PauseSubmission waits this long for running turns when the call names no timeout.
    pause_drain_timeout_s: float = 60.0
    # An active episode without activity for this long is ended by the reaper ("idle").
    session_idle_timeout_s: float = 3600.0
    # > 0: an ended episode whose last interaction has no reward waits this long for one.
    late_reward_timeout_s: float = 0.0
    # How often each replica's reaper looks for due episodes.
    reaper_interval_s: float = 1.0
    grace_s: float = 10.0
    log_level: str = "info"
    # None: JSON unless stderr is a terminal.
    log_json: bool | None = None
    # Where GET /metrics is served (port None: nowhere); docs/metrics.md.
    metrics: MetricsEndpoint = NO_METRICS_PORT
    # Spans over OTLP/HTTP when an endpoint is set (off by default); docs/metrics.md, Traces.
    tracing: TracingSettings = NO_TRACING

    @property
    def refresh_lock_s(self) -> float:
        """How long a refresh marker lives if its holder dies mid-refresh."""
        return self.refresh_timeout_s + 10.0

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str], *, host: str | None = None, port: int | None = None
    ) -> DataProxySettings:
        """Settings from the environment (and command-line host/port)."""
        admin_key = env_str(environ, "ROLLGATE_ADMIN_KEY", "")
        if not admin_key:
            raise ValueError(
                "ROLLGATE_ADMIN_KEY is not set: the dataproxy needs the admin key to "
                "authenticate Trainer calls (rollgate up sets it for you)"
            )
        raw_json = env_str(environ, "ROLLGATE_LOG_JSON", "auto").lower()
        raw_ofp = env_str(environ, "ROLLGATE_MAX_HEAD_OFFPOLICYNESS", "")
        max_head_offpolicyness = (
            env_int(environ, "ROLLGATE_MAX_HEAD_OFFPOLICYNESS", 0) if raw_ofp else None
        )
        batch_size = env_int(environ, "ROLLGATE_BATCH_SIZE", 1)
        if max_head_offpolicyness is not None and max_head_offpolicyness < 0:
            raise ValueError("ROLLGATE_MAX_HEAD_OFFPOLICYNESS must be 0 or more")
        if batch_size < 1:
            raise ValueError(f"ROLLGATE_BATCH_SIZE={batch_size} must be at least 1")
        bind_host = host or env_str(environ, "ROLLGATE_DATAPROXY_HOST", "127.0.0.1")
        return cls(
            host=bind_host,
            metrics=metrics_endpoint(environ, service="dataproxy", host=bind_host),
            tracing=tracing_settings(environ),
            port=port if port is not None else 50052,
            redis_url=redis_url(environ),
            redis_prefix=env_str(environ, "ROLLGATE_REDIS_PREFIX", "rg:"),
            admin_key=Secret(admin_key),
            trainer_key=Secret(env_str(environ, "ROLLGATE_TRAINER_KEY", "")),
            turn_timeout_s=env_float(environ, "ROLLGATE_TURN_TIMEOUT_S", 600.0),
            refresh_timeout_s=_positive(environ, "ROLLGATE_REFRESH_TIMEOUT_S", 120.0),
            max_head_offpolicyness=max_head_offpolicyness,
            batch_size=batch_size,
            pause_wait_s=env_float(environ, "ROLLGATE_PAUSE_WAIT_S", 30.0),
            pause_drain_timeout_s=_positive(environ, "ROLLGATE_PAUSE_DRAIN_TIMEOUT_S", 60.0),
            session_idle_timeout_s=_positive(environ, "ROLLGATE_SESSION_IDLE_TIMEOUT_S", 3600.0),
            late_reward_timeout_s=env_float(environ, "ROLLGATE_LATE_REWARD_TIMEOUT_S", 0.0),
            reaper_interval_s=_positive(environ, "ROLLGATE_REAPER_INTERVAL_S", 1.0),
            grace_s=env_float(environ, "ROLLGATE_GRACE_S", 10.0),
            log_level=env_str(environ, "ROLLGATE_LOG_LEVEL", "info"),
            log_json=None if raw_json == "auto" else env_bool(environ, "ROLLGATE_LOG_JSON", False),
        )


def _positive(environ: Mapping[str, str], name: str, default: float) -> float:
    value = env_float(environ, name, default)
    if value <= 0:
        raise ValueError(f"{name}={value} must be positive")
    return value
