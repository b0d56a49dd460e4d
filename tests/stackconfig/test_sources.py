"""One precedence for every setting of every service: a dotted override on the command line,
then the environment, then the configuration file, then the default."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.dataproxy.settings import DataProxySettings
from services.gateway.settings import GatewaySettings
from services.worker.settings import WorkerSettings
from stackconfig import ConfigError, Sources, sources_for

FILE = """
admin_key: ${ADMIN}
dataproxy:
  pause_wait_s: 3
  session_idle_timeout_s: 90
worker:
  upstreams:
    - name: a
      base_url: http://127.0.0.1:9/v1
      models: [m-a]
    - name: b
      base_url: http://127.0.0.1:10/v1
      models: [m-b]
"""
ENV = {"ADMIN": "rg-admin-file"}


def _dataproxy(environ: dict[str, str], *overrides: str) -> DataProxySettings:
    src = sources_for("dataproxy", environ=ENV | environ, text=FILE, overrides=overrides)
    return DataProxySettings.load(src)


def test_the_file_fills_what_the_environment_leaves_out_and_defaults_the_rest() -> None:
    settings = _dataproxy({})
    assert (settings.pause_wait_s, settings.session_idle_timeout_s) == (3, 90)
    assert settings.turn_timeout_s == 600.0
    assert settings.admin_key.reveal() == "rg-admin-file"


def test_the_environment_wins_over_the_file() -> None:
    settings = _dataproxy({"ROLLGATE_PAUSE_WAIT_S": "5", "ROLLGATE_ADMIN_KEY": "rg-admin-env"})
    assert (settings.pause_wait_s, settings.session_idle_timeout_s) == (5, 90)
    assert settings.admin_key.reveal() == "rg-admin-env"


def test_an_empty_variable_counts_as_unset() -> None:
    assert _dataproxy({"ROLLGATE_PAUSE_WAIT_S": " "}).pause_wait_s == 3


def test_a_dotted_override_wins_over_the_environment_and_the_file() -> None:
    settings = _dataproxy({"ROLLGATE_PAUSE_WAIT_S": "5"}, "dataproxy.pause_wait_s=7")
    assert settings.pause_wait_s == 7
    # Only the overridden setting: the environment still wins over the file elsewhere.
    env = {"ROLLGATE_SESSION_IDLE_TIMEOUT_S": "60"}
    assert _dataproxy(env, "dataproxy.pause_wait_s=7").session_idle_timeout_s == 60


def test_an_override_of_one_upstream_wins_only_for_the_workers_of_that_upstream() -> None:
    environ = ENV | {"ROLLGATE_UPSTREAM_MODELS": "m-env"}
    override = "worker.upstreams.1.models=[m-cli]"

    def models(upstream: str) -> tuple[str, ...]:
        src = sources_for(
            "worker", environ=environ, text=FILE, overrides=[override], upstream=upstream
        )
        return WorkerSettings.load(src).upstream_models

    assert models("b") == ("m-cli",)
    assert models("a") == ("m-env",)


def test_an_areal_override_wins_like_the_rollgate_name_it_stands_for() -> None:
    areal = (
        "actor: {path: m}\nrollout: {base_url: http://127.0.0.1:9}\ngconfig: {max_new_tokens: 8}\n"
    )
    environ = {"ROLLGATE_DEFAULT_MAX_TOKENS": "16"}
    plain = sources_for("worker", environ=environ, text=areal)
    assert WorkerSettings.load(plain).default_max_tokens == 16
    overridden = sources_for(
        "worker", environ=environ, text=areal, overrides=["gconfig.max_new_tokens=32"]
    )
    assert WorkerSettings.load(overridden).default_max_tokens == 32


def test_the_file_keeps_its_types_and_a_bad_variable_is_named() -> None:
    src = sources_for("gateway", environ=ENV, text=FILE)
    assert src.file["dataproxy.pause_wait_s"] == 3 and src.file["router.address"]
    with pytest.raises(ValueError, match="ROLLGATE_MAX_BODY_BYTES='big' is not an integer"):
        GatewaySettings.load(
            Sources(environ=ENV | {"ROLLGATE_MAX_BODY_BYTES": "big"}, file=src.file)
        )


def test_overrides_without_a_file_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="dotted overrides need --config FILE"):
        sources_for("router", environ={}, overrides=["router.worker_lease_s=3"])
    missing = tmp_path / "missing.yaml"
    with pytest.raises(ConfigError, match="cannot read the configuration"):
        sources_for("router", environ={}, config_path=str(missing))
