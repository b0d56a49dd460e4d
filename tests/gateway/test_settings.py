"""Gateway settings from the environment."""

from __future__ import annotations

import pytest

from services.gateway.settings import GatewaySettings


def test_settings_require_the_admin_key() -> None:
    with pytest.raises(ValueError, match="ROLLGATE_ADMIN_KEY is not set"):
        GatewaySettings.from_env({})


def test_settings_read_the_documented_variables() -> None:
    settings = GatewaySettings.from_env(
        {
            "ROLLGATE_ADMIN_KEY": "adm",
            "ROLLGATE_ROUTER_ADDR": "r:1",
            "ROLLGATE_DATAPROXY_ADDR": "d:2",
            "ROLLGATE_MAX_BODY_BYTES": "1000",
            "ROLLGATE_REQUEST_TIMEOUT_S": "7.5",
        },
        host="0.0.0.0",
        port=0,
    )
    assert (settings.admin_key.reveal(), settings.host, settings.port) == ("adm", "0.0.0.0", 0)
    assert (settings.router_addr, settings.dataproxy_addr) == ("r:1", "d:2")
    assert (settings.max_body_bytes, settings.request_timeout_s) == (1000, 7.5)


def test_settings_defaults_match_the_contract() -> None:
    settings = GatewaySettings.from_env({"ROLLGATE_ADMIN_KEY": "adm"})
    assert (settings.host, settings.port) == ("127.0.0.1", 8080)
    assert settings.router_addr == "127.0.0.1:50051"
    assert settings.dataproxy_addr == "127.0.0.1:50052"
    assert settings.max_body_bytes == 32 * 1024 * 1024
    assert settings.request_timeout_s == 600.0


def test_settings_refuse_a_non_numeric_body_limit() -> None:
    with pytest.raises(ValueError, match="ROLLGATE_MAX_BODY_BYTES"):
        GatewaySettings.from_env({"ROLLGATE_ADMIN_KEY": "a", "ROLLGATE_MAX_BODY_BYTES": "big"})


def test_refused_console_logins_per_address_default_to_ten_a_minute_and_must_be_positive() -> None:
    base = {"ROLLGATE_ADMIN_KEY": "k"}
    assert GatewaySettings.from_env(base).console_login_failures_per_min == 10
    five = {**base, "ROLLGATE_CONSOLE_LOGIN_FAILURES_PER_MIN": "5"}
    assert GatewaySettings.from_env(five).console_login_failures_per_min == 5
    with pytest.raises(ValueError, match="ROLLGATE_CONSOLE_LOGIN_FAILURES_PER_MIN=0"):
        GatewaySettings.from_env({**base, "ROLLGATE_CONSOLE_LOGIN_FAILURES_PER_MIN": "0"})


def test_several_admin_keys_are_all_accepted_and_the_first_is_current() -> None:
    from services.gateway.console_auth import ConsoleCookies, CookieRefused
    from services.runtime.secret import Keys

    settings = GatewaySettings.from_env({"ROLLGATE_ADMIN_KEY": " new-key , old-key "})
    keys = settings.admin_key
    assert isinstance(keys, Keys) and len(keys) == 2
    assert keys.matches("new-key") and keys.matches("old-key") and not keys.matches("new-key,")
    assert keys.reveal() == "new-key"
    assert "new-key" not in repr(settings) and "old-key" not in f"{keys} {keys!r}"
    # A cookie signed by a pod on `old-key` is accepted by one on `new-key,old-key`, not by
    # one on `new-key` alone; the current key signs.
    old_pod = ConsoleCookies(Keys.parse("old-key", "K"), session_s=60, max_login_s=600)
    both = ConsoleCookies(keys, session_s=60, max_login_s=600)
    new_pod = ConsoleCookies(Keys.parse("new-key", "K"), session_s=60, max_login_s=600)
    assert both.check(old_pod.issue("configured")).subject == "configured"
    assert new_pod.check(both.issue("configured")).subject == "configured"
    with pytest.raises(CookieRefused, match="another admin key"):
        new_pod.check(old_pod.issue("configured"))


@pytest.mark.parametrize("raw", ["new-key,,old-key", "new-key,", ", old-key"])
def test_an_empty_entry_in_the_admin_keys_names_the_setting_not_a_key(raw: str) -> None:
    with pytest.raises(ValueError, match=r"ROLLGATE_ADMIN_KEY.*empty entry") as refused:
        GatewaySettings.from_env({"ROLLGATE_ADMIN_KEY": raw})
    assert "new-key" not in str(refused.value) and "old-key" not in str(refused.value)
