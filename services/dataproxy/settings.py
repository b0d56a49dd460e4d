"""Dataproxy settings, read once in `__main__`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from services.runtime.settings import env_bool, env_float, env_str, redis_url


@dataclass(frozen=True, slots=True, kw_only=True)
class DataProxySettings:
    """Everything the dataproxy needs to know at start-up."""

    host: str = "127.0.0.1"
    port: int = 50052
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_prefix: str = "rg:"
    # Verifies the Trainer service's callers; required.
    admin_key: str = ""
    # A second key that may call the Trainer service (optional).
    trainer_key: str = ""
    # Deadline for one turn at the worker, streaming included.
    turn_timeout_s: float = 600.0
    # How long a refresh marker lives if its holder dies mid-refresh.
    refresh_lock_s: float = 130.0
    grace_s: float = 10.0
    log_level: str = "info"
    # None: JSON unless stderr is a terminal.
    log_json: bool | None = None

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
        return cls(
            host=host or env_str(environ, "ROLLGATE_DATAPROXY_HOST", "127.0.0.1"),
            port=port if port is not None else 50052,
            redis_url=redis_url(environ),
            redis_prefix=env_str(environ, "ROLLGATE_REDIS_PREFIX", "rg:"),
            admin_key=admin_key,
            trainer_key=env_str(environ, "ROLLGATE_TRAINER_KEY", ""),
            turn_timeout_s=env_float(environ, "ROLLGATE_TURN_TIMEOUT_S", 600.0),
            grace_s=env_float(environ, "ROLLGATE_GRACE_S", 10.0),
            log_level=env_str(environ, "ROLLGATE_LOG_LEVEL", "info"),
            log_json=None if raw_json == "auto" else env_bool(environ, "ROLLGATE_LOG_JSON", False),
        )
