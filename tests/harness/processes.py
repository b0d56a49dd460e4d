"""The real stack as separate processes (as `rollgate up` starts it), configured for a test."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import redis

from rollgate.redis_server import free_port
from rollgate.stack import Stack, StackConfig
from rollgate.trajectory import Interaction, decode_trajectory
from tests.harness.poll import eventually_sync
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


def published_interactions(
    stack: Stack, trajectory_id: str, *, timeout_s: float = 30.0
) -> list[Interaction]:
    """The interactions (in order) of one trajectory, once it is on the stack's stream."""
    client = redis.Redis.from_url(stack.redis_url)
    stream = f"{stack.config.redis_prefix}trajectories"

    def found() -> list[Interaction] | None:
        entries: list[tuple[bytes, dict[bytes, bytes]]] = client.xrange(stream)  # type: ignore[assignment]
        for _, fields in entries:
            if fields[b"trajectory_id"].decode() == trajectory_id:
                trajectory = decode_trajectory(fields[b"data"], fields[b"codec"].decode())
                return sorted(trajectory.interactions, key=lambda i: i.index)
        return None

    try:
        return eventually_sync(found, timeout_s=timeout_s, what=f"trajectory {trajectory_id}")
    finally:
        client.close()
