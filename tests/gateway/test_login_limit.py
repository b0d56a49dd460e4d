"""Refused console logins per client address: a bucket of `failures_per_min` that refills over
a minute, bounded in memory however many addresses try."""

from __future__ import annotations

import pytest

from services.gateway.login_limit import LoginLimiter


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_an_address_is_held_back_after_its_refused_logins_and_refills_over_a_minute() -> None:
    clock = Clock()
    limiter = LoginLimiter(failures_per_min=3, clock=clock)
    for _ in range(3):
        assert limiter.retry_after_s("10.0.0.1") is None
        limiter.refused("10.0.0.1")
    # The fourth attempt waits for one refused login to refill: 60 s / 3.
    assert limiter.retry_after_s("10.0.0.1") == pytest.approx(20.0)
    # Other addresses are not held back.
    assert limiter.retry_after_s("10.0.0.2") is None
    clock.now += 10
    assert limiter.retry_after_s("10.0.0.1") == pytest.approx(10.0)
    clock.now += 10
    assert limiter.retry_after_s("10.0.0.1") is None
    limiter.refused("10.0.0.1")
    assert limiter.retry_after_s("10.0.0.1") == pytest.approx(20.0)
    # A minute later the whole budget is back.
    clock.now += 60
    for _ in range(3):
        assert limiter.retry_after_s("10.0.0.1") is None
        limiter.refused("10.0.0.1")
    assert limiter.retry_after_s("10.0.0.1") is not None


def test_the_limiter_remembers_a_bounded_number_of_addresses() -> None:
    clock = Clock()
    limiter = LoginLimiter(failures_per_min=1, max_addresses=100, clock=clock)
    for i in range(1000):
        limiter.refused(f"10.0.{i // 256}.{i % 256}")
        assert len(limiter) <= 100
    # The most recent ones are still held back.
    assert limiter.retry_after_s("10.0.3.231") is not None


def test_a_limit_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="ROLLGATE_CONSOLE_LOGIN_FAILURES_PER_MIN"):
        LoginLimiter(failures_per_min=0)
