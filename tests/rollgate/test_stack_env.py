"""What `rollgate up` gives each service: the configuration file (`--config`, read by the
service itself), the user's environment, and what the stack wires itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rollgate.stack import Stack, StackConfig
from services.dataproxy.settings import DataProxySettings
from services.gateway.settings import GatewaySettings
from services.router.settings import RouterSettings
from services.runtime.service_main import command_line, settings_from
from services.worker.__main__ import _upstream_argument
from services.worker.settings import WorkerSettings
from stackconfig import load_config

LIFECYCLE_YAML = """
log_level: debug
dataproxy:
  refresh_timeout_s: 7
  session_idle_timeout_s: 90
  pause_wait_s: 3
  late_reward_timeout_s: 45
"""
LOADERS: dict[str, Any] = {
    "gateway": GatewaySettings.load,
    "router": RouterSettings.load,
    "dataproxy": DataProxySettings.load,
    "worker": WorkerSettings.load,
}


def _stack(tmp_path: Path, text: str | None = None, *overrides: str) -> Stack:
    file = load_config(text=text, environ={}, overrides=overrides) if text else None
    stack = Stack(StackConfig(admin_key="rg-admin-stack", file=file, state_dir=tmp_path))
    stack.redis_url = "redis://127.0.0.1:1/0"
    return stack


def _settings(stack: Stack, name: str, kind: str, **env: str) -> Any:
    """Adds the service as `rollgate up` would and reads its settings from the command line
    and environment the process would get, as its `__main__` does."""
    stack._add(name, kind, [f"services.{kind}"], 1, **env)
    service = stack.services[name]
    assert service.argv[1:3] == ["-m", f"services.{kind}"]
    extra = _upstream_argument if kind == "worker" else None
    args = command_line(kind, default_port=1, add_arguments=extra).parse_args(service.argv[3:])
    return settings_from(kind, args, service.env, LOADERS[kind])


def test_the_stack_passes_its_file_and_the_services_read_their_settings_from_it(
    tmp_path: Path,
) -> None:
    stack = _stack(tmp_path, LIFECYCLE_YAML)
    dataproxy = _settings(stack, "dataproxy", "dataproxy")
    assert "--config" in stack.services["dataproxy"].argv
    assert dataproxy.refresh_timeout_s == 7
    assert (dataproxy.session_idle_timeout_s, dataproxy.pause_wait_s) == (90, 3)
    assert dataproxy.late_reward_timeout_s == 45
    assert dataproxy.log_level == "debug"
    # The gateway's start_session deadline follows the refresh wait.
    gateway = _settings(stack, "gateway", "gateway")
    assert gateway.start_session_timeout_s == 7 + 10
    assert "ROLLGATE_PAUSE_WAIT_S" not in stack.services["dataproxy"].env, "no variables rebuilt"


def test_the_environment_wins_over_the_file_and_the_stack_wires_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROLLGATE_REFRESH_TIMEOUT_S", "11")
    monkeypatch.setenv("ROLLGATE_ADMIN_KEY", "not-the-stacks-key")
    monkeypatch.setenv("ROLLGATE_REDIS_URL", "redis://not-the-stacks:6379/0")
    stack = _stack(tmp_path, LIFECYCLE_YAML)
    dataproxy = _settings(stack, "dataproxy", "dataproxy")
    assert dataproxy.refresh_timeout_s == 11, "the environment wins over the file"
    assert dataproxy.pause_wait_s == 3, "the file fills what the environment leaves out"
    assert dataproxy.admin_key.reveal() == "rg-admin-stack"
    assert dataproxy.redis_url == "redis://127.0.0.1:1/0"


def test_overrides_reach_the_services_except_those_of_what_the_stack_wires(
    tmp_path: Path,
) -> None:
    stack = _stack(
        tmp_path, LIFECYCLE_YAML, "dataproxy.pause_wait_s=4", "redis.url=redis://elsewhere:1/0"
    )
    dataproxy = _settings(stack, "dataproxy", "dataproxy")
    assert dataproxy.pause_wait_s == 4
    assert dataproxy.redis_url == "redis://127.0.0.1:1/0", "rollgate up wires its own Redis"
    assert not [a for a in stack.services["dataproxy"].argv if a.startswith("redis.")]


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
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AUDIT_KEYED", "sk-keyed-secret")
    monkeypatch.setenv("ROLLGATE_UPSTREAM_API_KEY", "sk-default-secret")
    # A shell variable naming an upstream is for the no-file case: it redirects no worker.
    monkeypatch.setenv("ROLLGATE_UPSTREAM_BASE_URL", "http://127.0.0.1:11/v1")
    config = load_config(text=TWO_UPSTREAMS_YAML, environ={"AUDIT_KEYED": "sk-keyed-secret"})
    stack = Stack(StackConfig(admin_key="rg-admin-stack", file=config, state_dir=tmp_path))
    stack.redis_url = "redis://127.0.0.1:1/0"
    workers = {}
    for name, group in stack._worker_groups("127.0.0.1:1").items():
        stack._add(name, "worker", ["services.worker"], 1, upstream=group.upstream, **group.env)
        service = stack.services[name]
        args = command_line("worker", default_port=1, add_arguments=_upstream_argument)
        parsed = args.parse_args(service.argv[3:])
        workers[name] = (settings_from("worker", parsed, service.env, WorkerSettings.load), service)
    keyed, keyed_process = next(w for name, w in workers.items() if "keyed" in name)
    open_, open_process = next(w for name, w in workers.items() if "open" in name)
    assert keyed.upstream_api_key.reveal() == "sk-keyed-secret"
    assert (keyed.upstream_base_url, open_.upstream_base_url) == (
        "http://127.0.0.1:9/v1",
        "http://127.0.0.1:10/v1",
    )
    assert open_.upstream_api_key.reveal() == ""
    assert "sk-keyed-secret" not in open_process.env.values()
    assert "sk-default-secret" not in open_process.env.values(), "no fallback to another key"
    assert "sk-default-secret" not in keyed_process.env.values()
    for service in ("gateway", "router", "dataproxy"):
        stack._add(service, service, [f"services.{service}"], 1)
        env = stack.services[service].env
        assert not {"sk-keyed-secret", "sk-default-secret"} & set(env.values()), service


def test_a_config_file_without_upstreams_still_configures_the_mock(tmp_path: Path) -> None:
    stack = _stack(tmp_path, LIFECYCLE_YAML)
    stack.mock_url = "http://127.0.0.1:2/v1"
    groups = stack._worker_groups("127.0.0.1:1")
    assert {g.upstream for g in groups.values()} == {None}
    name, group = next(iter(groups.items()))
    stack._add(name, "worker", ["services.worker"], 1, **group.env)
    args = command_line("worker", default_port=1, add_arguments=_upstream_argument)
    service = stack.services[name]
    worker = settings_from(
        "worker", args.parse_args(service.argv[3:]), service.env, WorkerSettings.load
    )
    assert (worker.upstream_base_url, worker.upstream_kind) == ("http://127.0.0.1:2/v1", "vllm")
    stack._add("mock-llm", "http", ["rollgate.mock_llm"], 2)
    assert "--config" not in stack.services["mock-llm"].argv


def test_tail_and_export_find_the_stack_file_of_a_custom_state_dir(tmp_path: Path) -> None:
    from rollgate.trajectories_cli import stack_file

    assert stack_file({"ROLLGATE_STATE_DIR": str(tmp_path)}) == tmp_path / "stack.json"
    assert stack_file({}) == Path.home() / ".rollgate" / "stack.json"
