"""The Redis client every Redis-using service opens once, with explicit timeouts."""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

# Reads of the stream block for at most this long, well under socket_timeout (redis-py#2807).
SOCKET_TIMEOUT_S = 5.0


def open_redis(url: str) -> aioredis.Redis:
    """A pooled async client. Retries only reconnects: scripts are idempotent by design."""
    return aioredis.Redis.from_url(
        url,
        socket_timeout=SOCKET_TIMEOUT_S,
        socket_connect_timeout=5.0,
        health_check_interval=30,
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=3),
        retry_on_error=[RedisConnectionError],
        max_connections=256,
        decode_responses=False,
    )
