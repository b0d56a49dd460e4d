"""Upstream keys at load time, and AReaL files: literal keys refused, ignored fields reported
once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rollgate import cli
from services.gateway.settings import GatewaySettings
from services.worker.settings import WorkerSettings
from stackconfig import ConfigError, load_config, sources_for

TWO = """
admin_key: ${RG_ADMIN}
worker:
  upstreams:
    - name: local
      kind: vllm
      base_url: http://127.0.0.1:9
      models: [m1]
    - name: hosted
      kind: openai
      base_url: https://api.example.com/v1
      api_key: ${HOSTED_KEY_FOR_TEST}
      models: [m2]
"""


def test_an_unset_upstream_key_variable_fails_at_load_naming_it_and_how_to_set_it() -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(text=TWO, environ={"RG_ADMIN": "a"})
    message = str(caught.value)
    assert "worker.upstreams.1.api_key" in message
    assert "HOSTED_KEY_FOR_TEST is not set" in message
    assert "export HOSTED_KEY_FOR_TEST=" in message
    config = load_config(text=TWO, environ={"RG_ADMIN": "a", "HOSTED_KEY_FOR_TEST": "k"})
    assert config.upstreams[1].api_key_var == "HOSTED_KEY_FOR_TEST"


def test_services_without_upstream_keys_load_the_file_but_the_keyed_worker_does_not(
    tmp_path: Path,
) -> None:
    path = tmp_path / "rollgate.yaml"
    path.write_text(TWO)
    environ = {"RG_ADMIN": "a"}
    gateway = sources_for("gateway", environ=environ, config_path=str(path))
    assert GatewaySettings.load(gateway).admin_key.reveal() == "a"
    local = sources_for("worker", environ=environ, config_path=str(path), upstream="local")
    assert WorkerSettings.load(local).upstream_name == "local"
    with pytest.raises(ConfigError, match="export HOSTED_KEY_FOR_TEST="):
        sources_for("worker", environ=environ, config_path=str(path), upstream="hosted")


def test_the_worker_process_says_which_key_variable_to_set_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "rollgate.yaml"
    path.write_text(TWO)
    done = subprocess.run(
        [sys.executable, "-m", "services.worker", "--config", str(path), "--upstream", "hosted"],
        env={"RG_ADMIN": "a", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).parents[2],
    )
    assert done.returncode == 2
    assert "export HOSTED_KEY_FOR_TEST=" in done.stderr
    assert "usage:" not in done.stderr and "Traceback" not in done.stderr


def test_check_upstream_refuses_an_unset_key_variable_before_calling_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "rollgate.yaml"
    path.write_text(TWO)
    monkeypatch.setenv("RG_ADMIN", "a")
    monkeypatch.delenv("HOSTED_KEY_FOR_TEST", raising=False)
    assert cli.main(["check-upstream", "--config", str(path), "--no-stack"]) == 2
    err = capsys.readouterr().err
    assert "HOSTED_KEY_FOR_TEST is not set" in err and "export HOSTED_KEY_FOR_TEST=" in err


AREAL = """
experiment_name: openclaw
trial_name: t1
actor: {path: Qwen/Qwen3-0.6B}
rollout:
  base_url: http://127.0.0.1:9
  kind: vllm
  api_key: ${AREAL_KEY_FOR_TEST}
  max_concurrent_rollouts: 256
  agent: {mode: online, turn_discount: 1.0}
gconfig: {max_new_tokens: 16, temperature: 1.0}
train_dataset: {batch_size: 4, path: "null"}
sglang: {context_length: 32768}
"""


@pytest.mark.parametrize("literal", ["sk-abc123", "'sk-${AREAL_KEY_FOR_TEST}'"])
def test_an_areal_literal_rollout_api_key_is_refused_with_an_explanation(literal: str) -> None:
    text = AREAL.replace("${AREAL_KEY_FOR_TEST}", literal)
    with pytest.raises(ConfigError) as caught:
        load_config(text=text, environ={"AREAL_KEY_FOR_TEST": "k"})
    message = str(caught.value)
    assert "rollout.api_key holds a literal key" in message
    assert "environment variable" in message and "sk-abc123" not in message


def test_an_areal_unset_rollout_api_key_names_the_variable() -> None:
    with pytest.raises(ConfigError, match=r"rollout\.api_key is \$\{AREAL_KEY_FOR_TEST\}"):
        load_config(text=AREAL, environ={})


def test_areal_ignored_fields_are_reported_exactly_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(AREAL)
    monkeypatch.setenv("AREAL_KEY_FOR_TEST", "k")
    # The upstream (port 9) is unreachable: the command fails after reporting.
    assert cli.main(["check-upstream", "--config", str(path), "--no-stack"]) == 1
    captured = capsys.readouterr()
    report = captured.out + captured.err
    ignored = [
        "experiment_name",
        "trial_name",
        "rollout.max_concurrent_rollouts",
        "rollout.agent.mode",
        "rollout.agent.turn_discount",
        "train_dataset.path",
        "sglang.context_length",
    ]
    for name in ignored:
        assert report.count(name) == 1, (name, report)
    assert report.count("(ignored)") == 1
    for used in ("gconfig.max_new_tokens", "train_dataset.batch_size", "rollout.base_url"):
        assert used not in report
