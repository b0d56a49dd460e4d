"""One real stack per module, started the way `rollgate up` starts it (separate processes)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollgate.redis_server import free_port
from rollgate.stack import Stack, StackConfig


@pytest.fixture(scope="module")
def stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The whole stack: router, dataproxy, two workers, gateway, mock LLM, on a real Redis."""
    config = StackConfig(
        admin_key="rg-admin-" + uuid.uuid4().hex,
        gateway_port=free_port(),
        redis_url=redis_url,
        redis_prefix=f"rge2e:{uuid.uuid4().hex[:8]}:",
        mock_token_interval_ms=5.0,
        state_dir=Path(tmp_path_factory.mktemp("stack")),
        extra_env={"ROLLGATE_LOG_LEVEL": os.environ.get("ROLLGATE_LOG_LEVEL", "info")},
    )
    with Stack(config) as running:
        yield running
