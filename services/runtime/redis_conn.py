"""The Redis client every Redis-using service opens once, with explicit timeouts."""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

# A command that gets no answer within this long fails (RedisError: the RPC answers 503
# "state store unavailable"): below the gateway's 5 s deadline for an RPC
# (GatewaySettings.rpc_timeout_s), so a hung Redis (a partition, a stuck fork) is named as the cause
# instead of the gateway timing out on the dataproxy. Reads of the stream block for at most
# 2 s, under this (redis-py#2807).
SOCKET_TIMEOUT_S = 3.0
# Reconnects are retried (scripts are idempotent by design); a timeout is not: a Redis that
# did not answer once will not answer a retry in time either.
RECONNECT_RETRIES = 3


def open_redis(url: str) -> aioredis.Redis:
    """A pooled async client. Retries only reconnects: scripts are idempotent by design."""
    return aioredis.Redis.from_url(
        url,
        socket_timeout=SOCKET_TIMEOUT_S,
        socket_connect_timeout=SOCKET_TIMEOUT_S,
        health_check_interval=30,
        retry=Retry(
            ExponentialBackoff(cap=1.0, base=0.05),
            retries=RECONNECT_RETRIES,
            supported_errors=(RedisConnectionError,),
        ),
        retry_on_error=[RedisConnectionError],
        max_connections=256,
        decode_responses=False,
    )
