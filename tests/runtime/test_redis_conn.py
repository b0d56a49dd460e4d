"""The services' Redis client: replies parsed by hiredis (C), not redis-py's Python parser."""

from __future__ import annotations

from redis._parsers import _AsyncHiredisParser
from redis.asyncio.connection import DefaultParser

from services.runtime.redis_conn import open_redis


def test_replies_are_parsed_in_c() -> None:
    # hiredis installed (a dependency) makes it redis-py's default; open_redis keeps it.
    client = open_redis("redis://127.0.0.1:1/0")
    parser = client.connection_pool.connection_kwargs.get("parser_class", DefaultParser)
    assert parser is _AsyncHiredisParser
