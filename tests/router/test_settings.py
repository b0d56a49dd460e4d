"""Router settings from the environment."""

from __future__ import annotations

import pytest

from services.router.settings import RouterSettings


def test_defaults_match_the_documented_ones() -> None:
    settings = RouterSettings.from_env({})
    assert (settings.port, settings.redis_prefix) == (50051, "rg:")
    assert (settings.lease_s, settings.heartbeat_interval_s) == (6.0, 2.0)
    assert settings.redis_url == "redis://127.0.0.1:6379/0"
    assert settings.log_json is None


def test_environment_and_command_line_override_the_defaults() -> None:
    settings = RouterSettings.from_env(
        {
            "ROLLGATE_REDIS_URL": "redis://r:1/2",
            "ROLLGATE_REDIS_PREFIX": "x:",
            "ROLLGATE_WORKER_LEASE_S": "3",
            "ROLLGATE_HEARTBEAT_INTERVAL_S": "0.5",
            "ROLLGATE_LOG_JSON": "0",
        },
        host="0.0.0.0",
        port=0,
    )
    assert (settings.host, settings.port, settings.redis_url) == ("0.0.0.0", 0, "redis://r:1/2")
    assert (settings.redis_prefix, settings.lease_s, settings.heartbeat_interval_s) == (
        "x:",
        3.0,
        0.5,
    )
    assert settings.log_json is False


def test_a_lease_not_longer_than_the_heartbeat_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="ROLLGATE_WORKER_LEASE_S"):
        RouterSettings.from_env(
            {"ROLLGATE_WORKER_LEASE_S": "1", "ROLLGATE_HEARTBEAT_INTERVAL_S": "1"}
        )


def test_a_silent_worker_is_forgotten_after_a_minute_unless_set() -> None:
    assert RouterSettings.from_env({}).forget_after_s == 60.0
    settings = RouterSettings.from_env({"ROLLGATE_WORKER_FORGET_AFTER_S": "20"})
    assert settings.forget_after_s == 20.0


def test_forgetting_a_worker_before_its_lease_ends_is_refused() -> None:
    with pytest.raises(
        ValueError, match=r"ROLLGATE_WORKER_FORGET_AFTER_S.*ROLLGATE_WORKER_LEASE_S"
    ):
        RouterSettings.from_env(
            {"ROLLGATE_WORKER_FORGET_AFTER_S": "5", "ROLLGATE_WORKER_LEASE_S": "6"}
        )
