"""One real stack per module, started the way `rollgate up` starts it (separate processes)."""

from __future__ import annotations

import uuid
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
        # Keys of every kind, so the end-of-run secret scan sees each held by a real process.
        upstream_api_key="sk-upstream-e2e-" + uuid.uuid4().hex,
        extra_env=log_level_env() | {"ROLLGATE_TRAINER_KEY": "rg-trainer-e2e-" + uuid.uuid4().hex},
    )
    with Stack(config) as running:
        yield running
