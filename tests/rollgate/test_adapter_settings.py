"""Where the trainer adapters find rollgate: arguments, ROLLGATE_* variables, `rollgate:` in YAML."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from rollgate.adapter_settings import AdapterConfigError, resolve
from rollgate.areal_workflow import AREAL_INSTALLED, with_rollgate_section

ROOT = Path(__file__).resolve().parents[2]
AREAL_EXAMPLE = ROOT / "examples" / "areal" / "config.yaml"
KEY = "rg-admin-" + "k" * 30


def test_the_areal_example_config_gives_address_key_group_style_and_discount() -> None:
    settings = resolve(
        default_group="areal",
        config=AREAL_EXAMPLE,
        environ={"ROLLGATE_ADMIN_KEY": KEY, "RANK": "3"},
    )
    assert settings.trainer_address == "127.0.0.1:50052"
    assert settings.admin_key == KEY
    assert settings.group == "areal"
    assert settings.consumer.endswith("-3")  # host name and RANK: stable across restarts
    assert (settings.style, settings.discount) == ("individual", 1.0)
    assert KEY not in repr(settings)


def test_variables_win_over_the_file_and_arguments_over_both() -> None:
    environ = {"ROLLGATE_ADMIN_KEY": KEY, "ROLLGATE_TRAINER_ADDR": "10.0.0.9:50052"}
    from_env = resolve(default_group="areal", config=AREAL_EXAMPLE, environ=environ)
    assert from_env.trainer_address == "10.0.0.9:50052"
    given = resolve(
        default_group="areal",
        config=AREAL_EXAMPLE,
        environ=environ,
        trainer_address="10.0.0.1:1",
        style="concat",
        discount=0.9,
    )
    assert (given.trainer_address, given.style, given.discount) == ("10.0.0.1:1", "concat", 0.9)


def test_a_literal_key_in_the_section_is_refused_saying_what_to_write() -> None:
    config = {"rollgate": {"admin_key": KEY}}
    with pytest.raises(AdapterConfigError) as refused:
        resolve(default_group="g", config=config, environ={})
    assert "holds a literal key" in str(refused.value)
    assert "rollgate.admin_key: ${ROLLGATE_ADMIN_KEY}" in str(refused.value)
    assert KEY not in str(refused.value)


def test_an_unset_variable_and_an_unknown_field_are_named() -> None:
    with pytest.raises(AdapterConfigError, match=r"\$\{MY_KEY\} but MY_KEY is not set"):
        resolve(default_group="g", config={"rollgate": {"admin_key": "${MY_KEY}"}}, environ={})
    with pytest.raises(AdapterConfigError, match=r"rollgate\.adress is not a setting"):
        resolve(default_group="g", config={"rollgate": {"adress": "x"}}, environ={})
    with pytest.raises(AdapterConfigError, match="no rollgate admin key"):
        resolve(default_group="g", environ={})


def test_areal_itself_accepts_the_section_and_keeps_the_key_a_reference() -> None:
    # `make test` installs areal==1.0.4: this reads the example with AReaL's own loader.
    assert AREAL_INSTALLED, "areal is not importable: run `make test` (it installs areal)"
    from areal.api.cli_args import PPOConfig, parse_cli_args, to_structured_cfg
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigKeyError

    raw, _ = parse_cli_args(["--config", str(AREAL_EXAMPLE)])
    with pytest.raises(ConfigKeyError, match="rollgate"):
        to_structured_cfg(raw, config_cls=PPOConfig)  # why with_rollgate_section exists
    merged = to_structured_cfg(raw, config_cls=with_rollgate_section(PPOConfig))
    section = OmegaConf.to_container(merged.rollgate, resolve=True)
    assert section == {
        "trainer_address": "127.0.0.1:50052",
        "admin_key": "${ROLLGATE_ADMIN_KEY}",  # never the key: AReaL saves its config to disk
        "group": "areal",
    }
    assert merged.rollout.agent.mode == "online"
    assert merged.rollout.max_head_offpolicyness == 2
    # The section as AReaL resolved it is read the same way as the file.
    settings = resolve(
        default_group="areal", config={"rollgate": section}, environ={"ROLLGATE_ADMIN_KEY": KEY}
    )
    assert settings.admin_key == KEY


def test_default_consumer_names_are_unique_per_process_and_stable_per_rank() -> None:
    import os
    import subprocess
    import sys

    code = (
        "from rollgate.adapter_settings import resolve;"
        "print(resolve(default_group='g', admin_key='k').consumer)"
    )

    def name(**env: str) -> str:
        environ = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK")}
        run = subprocess.run(
            [sys.executable, "-c", code],
            env={**environ, "PYTHONPATH": str(ROOT), **env},
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        return run.stdout.strip()

    # Two trainer processes on one host without RANK: two consumers, so neither is handed
    # the other's pending entries.
    first, second = name(), name()
    assert first != second
    assert first.startswith(socket.gethostname() + "-pid")
    # With RANK (torchrun, AReaL, slime set it): one name per rank, the same after a restart,
    # so a restarted rank gets its unacked entries back at once.
    rank_two = name(RANK="2")
    assert rank_two == name(RANK="2") == f"{socket.gethostname()}-2"
    assert name(RANK="3") == f"{socket.gethostname()}-3"


def test_a_variable_listing_keys_gives_its_first_the_current_one() -> None:
    # During a rotation (docs/deploy.md) ROLLGATE_ADMIN_KEY lists new and old: clients send new.
    old = "rg-admin-" + "o" * 30
    listed = {"ROLLGATE_ADMIN_KEY": f"{KEY}, {old}"}
    assert resolve(default_group="areal", environ=listed).admin_key == KEY
    section = {"rollgate": {"admin_key": "${ROLLGATE_ADMIN_KEY}"}}
    assert resolve(default_group="areal", config=section, environ=listed).admin_key == KEY
