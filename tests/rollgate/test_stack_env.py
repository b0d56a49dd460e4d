"""What environment `rollgate up` gives each service: the user's settings and the file's."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollgate.stack import Stack, StackConfig
from services.runtime.config import load_config, settings_env

LIFECYCLE_YAML = """
dataproxy:
  refresh_timeout_s: 7
  session_idle_timeout_s: 90
  pause_wait_s: 3
  late_reward_timeout_s: 45
"""


def test_lifecycle_settings_in_the_file_reach_the_dataproxy() -> None:
    config = load_config(text=LIFECYCLE_YAML, environ={})
    env = settings_env(config, "dataproxy")
    assert float(env["ROLLGATE_REFRESH_TIMEOUT_S"]) == 7
    assert float(env["ROLLGATE_SESSION_IDLE_TIMEOUT_S"]) == 90
    assert float(env["ROLLGATE_PAUSE_WAIT_S"]) == 3
    assert float(env["ROLLGATE_LATE_REWARD_TIMEOUT_S"]) == 45


def test_user_settings_reach_services_but_the_stack_wires_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ROLLGATE_REFRESH_TIMEOUT_S", "11")
    monkeypatch.setenv("ROLLGATE_ADMIN_KEY", "not-the-stacks-key")
    stack = Stack(StackConfig(admin_key="rg-admin-stack", redis_url="redis://127.0.0.1:1/0"))
    stack.redis_url = "redis://127.0.0.1:1/0"
    env = stack._env()
    assert env["ROLLGATE_REFRESH_TIMEOUT_S"] == "11"
    assert env["ROLLGATE_ADMIN_KEY"] == "rg-admin-stack"


def test_a_config_file_without_upstreams_still_configures_the_mock() -> None:
    config = load_config(text=LIFECYCLE_YAML, environ={})
    stack = Stack(StackConfig(admin_key="rg-admin-stack", file=config))
    assert stack._service_env("http") == {}
    assert float(stack._service_env("dataproxy")["ROLLGATE_PAUSE_WAIT_S"]) == 3


def test_tail_and_export_find_the_stack_file_of_a_custom_state_dir(tmp_path: Path) -> None:
    from rollgate.trajectories_cli import stack_file

    assert stack_file({"ROLLGATE_STATE_DIR": str(tmp_path)}) == tmp_path / "stack.json"
    assert stack_file({}) == Path.home() / ".rollgate" / "stack.json"
