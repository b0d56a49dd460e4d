"""What environment `rollgate up` gives each service: the user's settings and the file's."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollgate.stack import Stack, StackConfig
from stackconfig import load_config, settings_env

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
    # The gateway's start_session deadline follows the refresh wait.
    assert float(settings_env(config, "gateway")["ROLLGATE_REFRESH_TIMEOUT_S"]) == 7


def test_user_settings_reach_services_but_the_stack_wires_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ROLLGATE_REFRESH_TIMEOUT_S", "11")
    monkeypatch.setenv("ROLLGATE_ADMIN_KEY", "not-the-stacks-key")
    stack = Stack(StackConfig(admin_key="rg-admin-stack", redis_url="redis://127.0.0.1:1/0"))
    stack.redis_url = "redis://127.0.0.1:1/0"
    env = stack._env({"ROLLGATE_REFRESH_TIMEOUT_S": "7", "ROLLGATE_PAUSE_WAIT_S": "3"})
    assert env["ROLLGATE_REFRESH_TIMEOUT_S"] == "11", "the environment wins over the file"
    assert env["ROLLGATE_PAUSE_WAIT_S"] == "3", "the file fills what the environment leaves out"
    assert env["ROLLGATE_ADMIN_KEY"] == "rg-admin-stack"


TWO_UPSTREAMS_YAML = """
worker:
  upstreams:
    - name: keyed
      kind: vllm
      base_url: http://127.0.0.1:9/v1
      api_key: ${AUDIT_KEYED}
      models: [a]
    - name: open
      kind: openai
      base_url: http://127.0.0.1:10/v1
      models: [b]
"""


def test_upstream_keys_reach_only_the_workers_of_their_upstream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AUDIT_KEYED", "sk-keyed-secret")
    monkeypatch.setenv("ROLLGATE_UPSTREAM_API_KEY", "sk-default-secret")
    config = load_config(text=TWO_UPSTREAMS_YAML, environ={"AUDIT_KEYED": "sk-keyed-secret"})
    stack = Stack(StackConfig(admin_key="rg-admin-stack", file=config))
    stack.redis_url = "redis://127.0.0.1:1/0"
    groups = stack._worker_groups("127.0.0.1:1")
    envs = {name: stack._env(stack._service_env("worker"), **env) for name, env in groups.items()}
    keyed = next(env for name, env in envs.items() if "keyed" in name)
    open_ = next(env for name, env in envs.items() if "open" in name)
    assert keyed["AUDIT_KEYED"] == "sk-keyed-secret"
    assert "sk-keyed-secret" not in open_.values()
    assert "sk-default-secret" not in open_.values(), "no fallback to another upstream's key"
    for service in ("gateway", "router", "dataproxy"):
        env = stack._env(stack._service_env(service))
        assert not {"sk-keyed-secret", "sk-default-secret"} & set(env.values()), service


def test_a_config_file_without_upstreams_still_configures_the_mock() -> None:
    config = load_config(text=LIFECYCLE_YAML, environ={})
    stack = Stack(StackConfig(admin_key="rg-admin-stack", file=config))
    assert stack._service_env("http") == {}
    assert float(stack._service_env("dataproxy")["ROLLGATE_PAUSE_WAIT_S"]) == 3


def test_tail_and_export_find_the_stack_file_of_a_custom_state_dir(tmp_path: Path) -> None:
    from rollgate.trajectories_cli import stack_file

    assert stack_file({"ROLLGATE_STATE_DIR": str(tmp_path)}) == tmp_path / "stack.json"
    assert stack_file({}) == Path.home() / ".rollgate" / "stack.json"
