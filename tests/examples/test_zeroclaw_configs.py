"""Both ZeroClaw example files, read the way ZeroClaw reads them (tests/examples/zeroclaw_facts)."""

from __future__ import annotations

from tests.examples import zeroclaw_facts as zeroclaw
from tests.examples.conftest import EXAMPLES_DIR

GATEWAY_V1 = "http://127.0.0.1:8080/v1"
GATEWAY_CHAT = GATEWAY_V1 + "/chat/completions"


def test_v3_file_gives_the_agent_a_custom_provider_at_the_gateway() -> None:
    config = zeroclaw.load(EXAMPLES_DIR / "zeroclaw.config.toml")
    assert config["schema_version"] == 3
    provider = zeroclaw.agent_provider(config)
    assert provider is not None and provider.slot == "custom"
    assert provider.chat_completions_url() == GATEWAY_CHAT
    assert provider.wire_api == "chat_completions"
    assert provider.api_key.startswith("sk-sess-")
    assert provider.model == "rollgate-mock"
    assert provider.extra_headers == {}
    assert config["agents"]["main"]["risk_profile"] in config["risk_profiles"]


def test_v3_file_has_a_header_mode_provider_sending_the_session_id_on_every_request() -> None:
    config = zeroclaw.load(EXAMPLES_DIR / "zeroclaw.config.toml")
    header = zeroclaw.providers(config)["custom.rollgate-header"]
    assert header.chat_completions_url() == GATEWAY_CHAT
    assert header.api_key.startswith("sk-sess-")
    assert header.extra_headers["X-Session-Id"]
    assert header.extra_headers.get("X-Turn-Type", "main") in ("main", "side")
    _, headers, _ = zeroclaw.chat_request(header, "hi")
    assert headers["X-Session-Id"] == header.extra_headers["X-Session-Id"]


def test_legacy_file_migrates_to_a_custom_provider_at_the_gateway() -> None:
    legacy = zeroclaw.load(EXAMPLES_DIR / "zeroclaw.legacy.config.toml")
    assert "schema_version" not in legacy
    assert legacy["default_provider"] == "custom:" + GATEWAY_V1
    provider = zeroclaw.agent_provider(zeroclaw.migrate_legacy(legacy))
    assert provider is not None and provider.slot == "custom"
    assert provider.chat_completions_url() == GATEWAY_CHAT
    assert provider.api_key == legacy["api_key"] and provider.api_key.startswith("sk-sess-")
    assert provider.model == legacy["default_model"] == "rollgate-mock"


def test_the_named_profile_form_areals_readme_shows_is_dropped_by_schema_v3() -> None:
    # Why the legacy file does not use it: the profile migrates to a slot v3 does not know.
    named = {
        "default_provider": "localhost",
        "default_model": "rollgate-mock",
        "api_key": "sk-sess-x",
        "model_providers": {"localhost": {"base_url": GATEWAY_V1, "wire_api": "chat_completions"}},
    }
    migrated = zeroclaw.migrate_legacy(named)
    assert "localhost" in migrated["providers"]["models"]
    assert zeroclaw.agent_provider(migrated) is None


def test_no_file_says_a_named_profile_migrates() -> None:
    for name in ("zeroclaw.config.toml", "zeroclaw.legacy.config.toml"):
        text = (EXAMPLES_DIR / name).read_text(encoding="utf-8")
        assert "[model_providers." not in text.replace("`[model_providers.localhost]`", "")
