"""The real stack as separate processes (as `rollgate up` starts it), configured for a test."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

from rollgate.redis_server import free_port
from rollgate.stack import StackConfig
from tests.harness.secret_scan import ISSUED


def stack_config(redis_url: str, state_dir: Path, *, prefix: str, **fields: Any) -> StackConfig:
    """A fresh admin key, a free gateway port and a unique `prefix:…:` Redis prefix; `fields`
    set or override the rest of the StackConfig."""
    base: dict[str, Any] = {
        "admin_key": "rg-admin-" + uuid.uuid4().hex,
        "gateway_port": free_port(),
        "redis_url": redis_url,
        "redis_prefix": f"{prefix}:{uuid.uuid4().hex[:8]}:",
        "state_dir": state_dir,
    }
    config = StackConfig(**(base | fields))
    register_secrets(config)
    return config


def register_secrets(config: StackConfig) -> None:
    """The stack's keys and log directory, for the end-of-run secret scan."""
    ISSUED.add(config.admin_key, config.upstream_api_key)
    ISSUED.add_env(dict(config.extra_env))
    if config.file is not None:
        ISSUED.add(config.file.admin_key, config.file.dataproxy.trainer_key)
        ISSUED.add(
            *(os.environ.get(u.api_key_var, "") for u in config.file.upstreams if u.api_key_var)
        )
    if config.state_dir is not None:
        ISSUED.watch(config.state_dir / "logs")


def log_level_env() -> dict[str, str]:
    """The services' log level: the test run's ROLLGATE_LOG_LEVEL, else info."""
    return {"ROLLGATE_LOG_LEVEL": os.environ.get("ROLLGATE_LOG_LEVEL", "info")}
