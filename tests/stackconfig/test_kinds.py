"""The upstream kinds are listed once (stackconfig/kinds.py); every other list follows it."""

from __future__ import annotations

import pytest

from rollgate.mock_llm import FLAVORS
from services.worker.adapters import adapter_for
from services.worker.settings import WorkerSettings
from stackconfig import KINDS, UPSTREAM_KINDS, ConfigError, load_config, upstream_kind


@pytest.mark.parametrize("kind", UPSTREAM_KINDS)
def test_every_kind_has_a_worker_adapter_that_writes_its_name_on_records(kind: str) -> None:
    assert adapter_for(kind).kind == kind


def test_the_worker_refuses_a_kind_the_list_does_not_have() -> None:
    with pytest.raises(ValueError, match="unknown upstream kind 'tgi'"):
        adapter_for("tgi")


def test_the_mock_speaks_every_kind_and_nothing_else() -> None:
    assert sorted(FLAVORS) == sorted(UPSTREAM_KINDS)


@pytest.mark.parametrize("kind", UPSTREAM_KINDS)
def test_the_file_and_the_worker_settings_accept_every_kind(kind: str) -> None:
    text = f"worker:\n  upstreams:\n    - kind: {kind}\n      base_url: http://127.0.0.1:9/v1\n"
    assert load_config(text=text, environ={}).upstreams[0].kind == kind
    env = {"ROLLGATE_UPSTREAM_BASE_URL": "http://127.0.0.1:9", "ROLLGATE_UPSTREAM_KIND": kind}
    assert WorkerSettings.from_env(env).upstream_kind == kind


def test_an_unknown_kind_is_refused_naming_the_same_list_in_the_file_and_the_worker() -> None:
    listed = ", ".join(UPSTREAM_KINDS)
    text = "worker:\n  upstreams:\n    - kind: tgi\n      base_url: http://127.0.0.1:9/v1\n"
    with pytest.raises(ConfigError, match=f"is not one of {listed} "):
        load_config(text=text, environ={})
    env = {"ROLLGATE_UPSTREAM_BASE_URL": "http://127.0.0.1:9", "ROLLGATE_UPSTREAM_KIND": "tgi"}
    with pytest.raises(ValueError, match=f"is not one of {listed}$"):
        WorkerSettings.from_env(env)
    with pytest.raises(ValueError, match=f"is not one of {listed}$"):
        upstream_kind("tgi")


def test_only_vllm_is_asked_for_ids_on_the_chat_path() -> None:
    assert {k.name: dict(k.ids_request) for k in KINDS} == {
        "vllm": {"return_token_ids": True},
        "sglang": {},
        "openai": {},
    }
