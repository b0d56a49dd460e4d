"""Refused console logins per client address: each address may be refused `failures_per_min`
times, a budget that refills evenly over a minute; once it is spent, the next login from that
address (even with the right key) waits, so the admin key cannot be guessed at speed."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

# However many addresses try, the limiter remembers this many (the least recently refused
# are forgotten first: an attacker with that many addresses gains nothing from it).
MAX_ADDRESSES = 10_000
_REFILL_WINDOW_S = 60.0


@dataclass(slots=True)
class _Bucket:
    tokens: float
    at: float


class LoginLimiter:
    """Per client address, how many refused logins are left and when the next one comes."""

    def __init__(
        self,
        *,
        failures_per_min: int,
        max_addresses: int = MAX_ADDRESSES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if failures_per_min < 1:
            raise ValueError(
                f"ROLLGATE_CONSOLE_LOGIN_FAILURES_PER_MIN={failures_per_min} must be at least 1"
            )
        self._capacity = float(failures_per_min)
        self._per_s = failures_per_min / _REFILL_WINDOW_S
        self._max_addresses = max_addresses
        self._clock = clock
        # Insertion order is the order of the last refusal: the first entry is the oldest.
        self._buckets: dict[str, _Bucket] = {}

    def __len__(self) -> int:
        return len(self._buckets)

    def _tokens(self, bucket: _Bucket, now: float) -> float:
        return min(self._capacity, bucket.tokens + (now - bucket.at) * self._per_s)

    def retry_after_s(self, address: str) -> float | None:
        """None when `address` may try to log in now, else the seconds until it may."""
        bucket = self._buckets.get(address)
        if bucket is None:
            return None
        tokens = self._tokens(bucket, self._clock())
        return None if tokens >= 1.0 else (1.0 - tokens) / self._per_s

    def refused(self, address: str) -> None:
        """Spends one refused login of `address`."""
        now = self._clock()
        bucket = self._buckets.pop(address, None)
        tokens = self._capacity if bucket is None else self._tokens(bucket, now)
        self._buckets[address] = _Bucket(tokens=max(0.0, tokens - 1.0), at=now)
        while len(self._buckets) > self._max_addresses:
            del self._buckets[next(iter(self._buckets))]
