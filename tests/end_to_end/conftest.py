"""One real stack per module, started the way `rollgate up` starts it (separate processes)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from rollgate.stack import Stack
from tests.harness.processes import log_level_env, stack_config


@pytest.fixture(scope="module")
def stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The whole stack: router, dataproxy, two workers, gateway, mock LLM, on a real Redis."""
    config = stack_config(
        redis_url,
        Path(tmp_path_factory.mktemp("stack")),
        prefix="rge2e",
        mock_token_interval_ms=5.0,
        extra_env=log_level_env(),
    )
    with Stack(config) as running:
        yield running
