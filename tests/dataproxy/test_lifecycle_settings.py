"""Lifecycle settings: defaults, parsing, and the gateway waiting longer than a refresh."""

from __future__ import annotations

import pytest

from services.dataproxy.settings import DataProxySettings
from services.gateway.settings import START_SESSION_MARGIN_S, GatewaySettings

BASE = {"ROLLGATE_ADMIN_KEY": "admin-key-for-settings-tests"}


def test_lifecycle_defaults_are_the_documented_ones() -> None:
    settings = DataProxySettings.from_env(BASE)
    assert settings.refresh_timeout_s == 120.0
    assert settings.max_head_offpolicyness is None and settings.batch_size == 1
    assert (settings.pause_wait_s, settings.pause_drain_timeout_s) == (30.0, 60.0)
    assert settings.session_idle_timeout_s == 3600.0
    assert settings.late_reward_timeout_s == 0.0
    assert settings.refresh_lock_s > settings.refresh_timeout_s


def test_lifecycle_settings_are_read_from_the_environment() -> None:
    settings = DataProxySettings.from_env(
        BASE
        | {
            "ROLLGATE_REFRESH_TIMEOUT_S": "5",
            "ROLLGATE_MAX_HEAD_OFFPOLICYNESS": "0",
            "ROLLGATE_BATCH_SIZE": "16",
            "ROLLGATE_PAUSE_WAIT_S": "2.5",
            "ROLLGATE_SESSION_IDLE_TIMEOUT_S": "60",
            "ROLLGATE_LATE_REWARD_TIMEOUT_S": "300",
            "ROLLGATE_REAPER_INTERVAL_S": "0.5",
        }
    )
    assert settings.refresh_timeout_s == 5.0
    assert (settings.max_head_offpolicyness, settings.batch_size) == (0, 16)
    assert settings.pause_wait_s == 2.5
    assert settings.session_idle_timeout_s == 60.0
    assert settings.late_reward_timeout_s == 300.0
    assert settings.reaper_interval_s == 0.5


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("ROLLGATE_MAX_HEAD_OFFPOLICYNESS", "-1"),
        ("ROLLGATE_BATCH_SIZE", "0"),
        ("ROLLGATE_REFRESH_TIMEOUT_S", "0"),
        ("ROLLGATE_SESSION_IDLE_TIMEOUT_S", "-5"),
        ("ROLLGATE_MAX_HEAD_OFFPOLICYNESS", "two"),
    ],
)
def test_invalid_lifecycle_settings_are_refused_naming_the_variable(name: str, value: str) -> None:
    with pytest.raises(ValueError, match=name):
        DataProxySettings.from_env(BASE | {name: value})


def test_the_gateway_waits_for_start_session_longer_than_the_refresh_timeout() -> None:
    settings = GatewaySettings.from_env(BASE | {"ROLLGATE_REFRESH_TIMEOUT_S": "200"})
    assert settings.start_session_timeout_s == 200.0 + START_SESSION_MARGIN_S
    assert GatewaySettings.from_env(BASE).start_session_timeout_s == 120.0 + START_SESSION_MARGIN_S


async def test_every_configured_admin_and_trainer_key_opens_the_trainer_service() -> None:
    from services.dataproxy.trainer_auth import TrainerAuth
    from services.runtime.errors import Unauthenticated

    settings = DataProxySettings.from_env(
        {"ROLLGATE_ADMIN_KEY": "a-new,a-old", "ROLLGATE_TRAINER_KEY": "t-new,t-old"}
    )
    auth = TrainerAuth(admin_key=settings.admin_key, trainer_key=settings.trainer_key)
    for key in ("a-new", "a-old", "t-new", "t-old"):
        assert await auth.check((("authorization", f"Bearer {key}"),)) == ""
    with pytest.raises(Unauthenticated):
        await auth.check((("authorization", "Bearer a-new,a-old"),))
