"""The YAML configuration: expansion, overrides, validation messages, AReaL files, and the
environment each service gets from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.dataproxy.settings import DataProxySettings
from services.gateway.settings import GatewaySettings
from services.router.settings import RouterSettings
from services.worker.settings import WorkerSettings
from stackconfig import ConfigError, Sources, load_config, normalize_base_url, sources_for

ENV = {"TAOTOKEN_API_KEY": "sk-tao-secret", "RG_ADMIN": "admin-secret", "HOST": "gpu1"}

CONFIG = """
admin_key: ${RG_ADMIN}
redis: {url: "redis://${HOST}:6379/0", prefix: "t:"}
worker:
  sampling: {max_new_tokens: 256, temperature: 0.8, n_samples: 4}
  upstreams:
    - name: local
      kind: vllm
      base_url: http://${HOST}:8000
      models: [Qwen/Qwen3-8B]
      aliases: {qwen: Qwen/Qwen3-8B}
      workers: 3
    - name: hosted
      kind: openai
      base_url: https://api.taotoken.net/v1/
      api_key: ${TAOTOKEN_API_KEY}
      models: [deepseek-v3]
"""


def sources(
    service: str, *overrides: str, upstream: str | None = None, text: str = CONFIG
) -> Sources:
    return sources_for(service, environ=ENV, text=text, overrides=overrides, upstream=upstream)


def load(text: str, *overrides: str, environ: dict[str, str] | None = None) -> object:
    return load_config(text=text, environ=ENV if environ is None else environ, overrides=overrides)


def test_a_full_file_loads_with_variables_expanded_and_keys_kept_as_names() -> None:
    config = load_config(text=CONFIG, environ=ENV)
    local, hosted = config.upstreams
    assert local.base_url == "http://gpu1:8000/v1"
    assert hosted.base_url == "https://api.taotoken.net/v1"
    assert hosted.api_key_var == "TAOTOKEN_API_KEY"
    assert local.aliases == (("qwen", "Qwen/Qwen3-8B"),) and local.workers == 3
    assert config.redis_url == "redis://gpu1:6379/0"
    assert config.sampling.n_samples == 4
    assert "sk-tao-secret" not in repr(config) and "admin-secret" not in repr(config)


def test_the_worker_gets_its_upstream_and_never_the_key_value() -> None:
    src = sources("worker", upstream="hosted")
    assert src.file["upstream.base_url"] == "https://api.taotoken.net/v1"
    assert src.file["upstream.api_key_var"] == "TAOTOKEN_API_KEY"
    assert "sk-tao-secret" not in repr(dict(src.file))
    settings = WorkerSettings.load(src)
    assert settings.upstream_api_key.reveal() == "sk-tao-secret"
    assert "sk-tao-secret" not in repr(settings)
    assert settings.upstream_api_key_var == "TAOTOKEN_API_KEY"
    assert (settings.default_max_tokens, settings.default_temperature) == (256, 0.8)
    assert settings.n_samples == 4
    local = WorkerSettings.load(sources("worker", upstream="local"))
    assert local.upstream_aliases == (("qwen", "Qwen/Qwen3-8B"),)
    assert local.upstream_kind == "vllm"
    assert local.upstream_base_url == "http://gpu1:8000/v1"


def test_each_service_reads_its_own_settings_from_the_file() -> None:
    gateway = GatewaySettings.load(sources("gateway"))
    assert gateway.admin_key.reveal() == "admin-secret"
    assert DataProxySettings.load(sources("dataproxy")).redis_prefix == "t:"
    router = RouterSettings.load(sources("router"))
    assert (router.redis_url, router.redis_prefix) == ("redis://gpu1:6379/0", "t:")
    with pytest.raises(ConfigError, match="--upstream NAME"):
        sources("worker")


def test_dotted_overrides_replace_values_before_validation() -> None:
    config = load_config(
        text=CONFIG,
        environ=ENV,
        overrides=[
            "worker.upstreams.0.base_url=http://other:9000/v1",
            "worker.sampling.n_samples=1",
        ],
    )
    assert config.upstreams[0].base_url == "http://other:9000/v1"
    assert config.sampling.n_samples == 1


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://h:8000/v1/v1", "drop one /v1"),
        ("https://api.example.com/v1?ref=promo", "copied from a web page"),
        ("https://platform.example.com/models", "website address"),
        ("http://h:8000/v1/chat/completions", "names an endpoint"),
        ("h:8000", "not an http"),
    ],
)
def test_bad_base_urls_are_refused_with_an_explanation(url: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(text=CONFIG, environ=ENV, overrides=[f"worker.upstreams.1.base_url={url}"])


def test_a_literal_key_is_refused_with_an_explanation() -> None:
    with pytest.raises(ConfigError, match=r"literal key.*\$\{MY_API_KEY\}"):
        load_config(text=CONFIG, environ=ENV, overrides=["worker.upstreams.1.api_key=sk-abc"])


def test_an_unset_variable_says_which_field_and_how_to_fix_it() -> None:
    with pytest.raises(ConfigError, match=r"redis.url uses \$\{HOST\}.*export HOST"):
        load_config(text=CONFIG, environ={k: v for k, v in ENV.items() if k != "HOST"})


def test_an_unset_key_variable_is_named() -> None:
    with pytest.raises(ConfigError, match="RG_ADMIN is not set"):
        load_config(text=CONFIG, environ={"HOST": "h"})


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("worker.upstreams.0.kind=tgi", "not one of vllm, sglang, openai"),
        ("worker.upstreams.0.modle=x", "unknown field.*modle"),
        ("worker.upstreams.1.models=[Qwen/Qwen3-8B]", "listed by upstreams"),
        ("worker.upstreams.0.aliases.q=missing", "not in worker.upstreams.0.models"),
        ("worker.upstreams.0.tokenizer=/nope/tokenizer.json", "not a file"),
        ("worker.sampling.n_samples=0", "integer ≥ 1"),
        ("gatway.port=1", "unknown field.*gatway"),
    ],
)
def test_validation_messages_say_what_is_wrong(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(text=CONFIG, environ=ENV, overrides=[override])


def _default_of(upstream: str, *overrides: str) -> tuple[bool, str]:
    settings = WorkerSettings.load(sources("worker", *overrides, upstream=upstream))
    return settings.serve_default_model, settings.default_model


def test_default_is_the_first_upstreams_first_model_unless_the_file_names_one() -> None:
    config = load_config(text=CONFIG, environ=ENV)
    assert config.default_model == ""
    assert _default_of("local") == (True, "")
    assert _default_of("hosted") == (False, "")
    named = "worker.default_model=deepseek-v3"
    assert _default_of("local", named) == (False, "")
    assert _default_of("hosted", named) == (True, "deepseek-v3")
    # An alias names its upstream's model (the worker resolves it).
    aliased = "worker.default_model=qwen"
    assert _default_of("local", aliased) == (True, "qwen")
    assert _default_of("hosted", aliased) == (False, "")


def test_an_explicit_default_alias_wins_and_cannot_be_combined_with_default_model() -> None:
    explicit = ["worker.upstreams.1.aliases.default=deepseek-v3"]
    assert _default_of("local", *explicit) == (False, "")
    settings = WorkerSettings.load(sources("worker", *explicit, upstream="hosted"))
    assert ("default", "deepseek-v3") in settings.upstream_aliases
    with pytest.raises(ConfigError, match="already serves a model named 'default'"):
        load_config(text=CONFIG, environ=ENV, overrides=[*explicit, "worker.default_model=qwen"])


def test_a_default_model_no_upstream_serves_is_refused_naming_the_served_ones() -> None:
    with pytest.raises(ConfigError, match=r"not served by any upstream.*Qwen/Qwen3-8B, qwen"):
        load_config(text=CONFIG, environ=ENV, overrides=["worker.default_model=gpt-9"])
    # An upstream that asks its /models might serve it: it registers `default` if it does.
    discovering = ["worker.upstreams.1.models=[]", "worker.default_model=gpt-9"]
    assert _default_of("hosted", *discovering) == (True, "gpt-9")
    assert _default_of("local", *discovering) == (False, "")


AREAL = """
experiment_name: openclaw
actor: {path: Qwen/Qwen3-0.6B}
rollout:
  base_url: http://127.0.0.1:30000
  api_key: ${TAOTOKEN_API_KEY}
  max_head_offpolicyness: 2
  max_concurrent_rollouts: 256
  agent: {mode: online, admin_api_key: "${RG_ADMIN}", turn_discount: 1.0}
gconfig: {max_new_tokens: 2048, temperature: 1.0, n_samples: 1}
train_dataset: {batch_size: 4, path: "null"}
sglang: {context_length: 32768}
"""


def test_an_areal_file_maps_its_fields_and_reports_the_rest_as_ignored() -> None:
    config = load_config(text=AREAL, environ=ENV)
    assert config.style == "areal"
    (upstream,) = config.upstreams
    assert upstream.base_url == "http://127.0.0.1:30000/v1"
    assert upstream.models == ("Qwen/Qwen3-0.6B",) and upstream.kind == "sglang"
    assert upstream.api_key_var == "TAOTOKEN_API_KEY"
    assert config.admin_key == "admin-secret"
    assert (config.sampling.max_new_tokens, config.sampling.temperature) == (2048, 1.0)
    assert (config.rollout.batch_size, config.rollout.max_head_offpolicyness) == (4, 2)
    assert "rollout.max_concurrent_rollouts" in config.ignored
    assert "sglang.context_length" in config.ignored
    assert "gconfig.max_new_tokens" not in config.ignored
    dataproxy = DataProxySettings.load(sources("dataproxy", text=AREAL))
    assert (dataproxy.batch_size, dataproxy.max_head_offpolicyness) == (4, 2)
    worker = WorkerSettings.load(sources("worker", text=AREAL))
    assert (worker.upstream_kind, worker.upstream_models) == ("sglang", ("Qwen/Qwen3-0.6B",))
    assert (worker.default_max_tokens, worker.upstream_api_key.reveal()) == (2048, "sk-tao-secret")


def test_the_areal_example_literal_admin_key_is_refused() -> None:
    text = AREAL.replace('"${RG_ADMIN}"', "sk-test123456")
    with pytest.raises(ConfigError, match=r"rollout\.agent\.admin_api_key holds a literal key"):
        load_config(text=text, environ=ENV)


def test_the_example_file_in_the_repository_loads() -> None:
    example = Path(__file__).parents[2] / "rollgate.example.yaml"
    environ = {"ROLLGATE_ADMIN_KEY": "a", "TAOTOKEN_API_KEY": "k", "VLLM_API_KEY": "v"}
    config = load_config(example, environ=environ)
    assert {u.kind for u in config.upstreams} == {"vllm", "sglang", "openai"}
    for upstream in config.upstreams:
        src = sources_for(
            "worker", environ=environ, config_path=str(example), upstream=upstream.name
        )
        assert WorkerSettings.load(src).upstream_kind == upstream.kind
    router = RouterSettings.load(sources_for("router", environ=environ, config_path=str(example)))
    assert (router.lease_s, router.heartbeat_interval_s, router.forget_after_s) == (6, 2, 60)


def test_a_rollgate_file_with_a_rollout_section_stays_a_rollgate_file() -> None:
    text = """
admin_key: ${ADMIN}
dataproxy:
  refresh_timeout_s: 7
rollout:
  batch_size: 4
"""
    config = load_config(text=text, environ={"ADMIN": "rg-admin-x"})
    assert config.style == "rollgate"
    assert config.admin_key == "rg-admin-x"
    assert config.dataproxy.refresh_timeout_s == 7
    assert config.rollout.batch_size == 4


def test_a_typo_in_rollout_is_reported() -> None:
    with pytest.raises(ConfigError, match=r"rollout\.batchsize"):
        load_config(text="worker: {}\nrollout:\n  batchsize: 4\n", environ={})


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("http://127.0.0.1:8000", "http://127.0.0.1:8000/v1"),
        ("http://127.0.0.1:8000/v1/", "http://127.0.0.1:8000/v1"),
        ("https://open.bigmodel.cn/api/paas/v4", "https://open.bigmodel.cn/api/paas/v4"),
        (
            "https://generativelanguage.googleapis.com/v1beta/openai/",
            "https://generativelanguage.googleapis.com/v1beta/openai",
        ),
    ],
)
def test_base_urls_get_v1_only_when_they_have_no_path(given: str, expected: str) -> None:
    assert normalize_base_url(given) == expected


def test_credentials_in_a_base_url_are_refused_without_echoing_them() -> None:
    with pytest.raises(ConfigError) as caught:
        normalize_base_url("https://user:hunter2@api.example.com/v1")
    assert "hunter2" not in str(caught.value)
    assert "api_key" in str(caught.value)


def test_the_gateway_edge_limits_come_from_the_gateway_section() -> None:
    overrides = [
        "gateway.header_timeout_s=3",
        "gateway.body_timeout_s=20",
        "gateway.keepalive_timeout_s=30",
        "gateway.max_header_bytes=16384",
        "gateway.max_headers=64",
    ]
    settings = GatewaySettings.load(sources("gateway", *overrides))
    assert (settings.header_timeout_s, settings.keepalive_timeout_s) == (3.0, 30.0)
    assert settings.body_timeout_s == 20.0
    assert (settings.max_header_bytes, settings.max_headers) == (16384, 64)


def test_the_stop_notice_is_read_by_every_grpc_service_and_may_be_zero() -> None:
    for settings in (RouterSettings, DataProxySettings, WorkerSettings):
        assert settings.from_env(_minimal_env()).stop_notice_s == 1.5
        notice = settings.from_env({**_minimal_env(), "ROLLGATE_STOP_NOTICE_S": "0"})
        assert notice.stop_notice_s == 0.0
    with pytest.raises(ValueError, match="ROLLGATE_STOP_NOTICE_S"):
        RouterSettings.from_env({"ROLLGATE_STOP_NOTICE_S": "soon"})


def _minimal_env() -> dict[str, str]:
    """What the dataproxy and the worker require (an admin key, an upstream)."""
    return {
        "ROLLGATE_ADMIN_KEY": "admin-" + "k" * 24,
        "ROLLGATE_UPSTREAM_BASE_URL": "http://127.0.0.1:9/v1",
    }
