"""The ledger's pipelined connection: scripts asked for together are one socket write, each
still gets its own answer, and a lost connection is reopened."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from typing import cast

import pytest
import redis.asyncio as aioredis
import uvloop
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from rollgate.redis_server import free_port
from services.runtime.redis_pipeline import PipelinedScripts
from services.runtime.redis_scripts import LuaScript
from tests.harness.poll import eventually

# Sets KEYS[1] to ARGV[1] and answers it; ARGV[1] == "bad" is a script error.
SOURCE = """
if ARGV[1] == 'bad' then return redis.error_reply('ERR refused ' .. ARGV[1]) end
redis.call('SET', KEYS[1], ARGV[1])
return ARGV[1]
"""
SCRIPT = LuaScript(name="set_echo", source=SOURCE, sha=hashlib.sha1(SOURCE.encode()).hexdigest())


class CountingRedis(aioredis.Redis):
    """A client whose pipelined connection's socket writes are counted."""

    scripts: PipelinedScripts | None = None

    @property
    def pipelines(self) -> int:
        assert self.scripts is not None
        return self.scripts.writes


@pytest.fixture
async def counting(redis_url: str) -> AsyncIterator[CountingRedis]:
    client = cast(CountingRedis, CountingRedis.from_url(redis_url))
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture
async def scripts(counting: CountingRedis) -> AsyncIterator[PipelinedScripts]:
    pipelined = counting.scripts = PipelinedScripts(counting)
    try:
        yield pipelined
    finally:
        await pipelined.aclose()


async def test_scripts_asked_together_are_one_round_trip_each_with_its_answer(
    counting: CountingRedis, scripts: PipelinedScripts, key_prefix: str
) -> None:
    await counting.script_load(SOURCE)
    keys = [f"{key_prefix}k{i}" for i in range(8)]
    replies = await asyncio.gather(
        *(SCRIPT.run(scripts, [k], [f"v{i}"]) for i, k in enumerate(keys))
    )
    assert replies == [f"v{i}".encode() for i in range(8)]
    assert counting.pipelines == 1
    assert await counting.mget(keys) == [f"v{i}".encode() for i in range(8)]

    # Asked one after the other: a round trip each.
    assert await SCRIPT.run(scripts, [keys[0]], ["again"]) == b"again"
    assert await SCRIPT.run(scripts, [keys[1]], ["again"]) == b"again"
    assert counting.pipelines == 3


async def test_a_script_error_is_that_calls_alone(
    counting: CountingRedis, scripts: PipelinedScripts, key_prefix: str
) -> None:
    await counting.script_load(SOURCE)
    good, bad, other = (
        SCRIPT.run(scripts, [f"{key_prefix}{n}"], [v])
        for n, v in (("a", "x"), ("b", "bad"), ("c", "y"))
    )
    replies = await asyncio.gather(good, bad, other, return_exceptions=True)
    assert replies[0] == b"x"
    assert isinstance(replies[1], ResponseError)
    assert "refused bad" in str(replies[1])
    assert replies[2] == b"y"
    assert counting.pipelines == 1


async def test_a_call_with_then_answers_what_then_made_of_the_reply(
    counting: CountingRedis, scripts: PipelinedScripts, key_prefix: str
) -> None:
    await counting.script_load(SOURCE)

    def then(reply: bytes) -> str:
        if reply == b"boom":
            raise ValueError("then refused it")
        return reply.decode().upper()

    def call(value: str, or_none: type[BaseException] | tuple[()] = ()) -> asyncio.Future[object]:
        key = f"{key_prefix}{value}"
        return scripts.evalsha(SCRIPT.sha, 1, key, value, then=then, or_none=or_none)

    answers = await asyncio.gather(
        call("x"),
        call("boom"),
        call("bad"),  # a script error, not one of or_none: the error
        call("bad", or_none=ResponseError),  # one of or_none: None
        return_exceptions=True,
    )
    assert answers[0] == "X"
    assert isinstance(answers[1], ValueError)
    assert isinstance(answers[2], ResponseError)
    assert answers[3] is None
    assert counting.pipelines == 1


async def test_a_failed_connection_is_none_for_a_call_that_takes_any_error_as_not_now() -> None:
    client = aioredis.Redis(port=free_port(), socket_connect_timeout=1.0)
    try:
        pipelined = PipelinedScripts(client)
        answers: list[object] = await asyncio.gather(
            pipelined.evalsha(SCRIPT.sha, 1, "k", "v", then=bytes.decode, or_none=Exception),
            pipelined.evalsha(SCRIPT.sha, 1, "k", "v", then=bytes.decode),
            return_exceptions=True,
        )
        await pipelined.aclose()
    finally:
        await client.aclose()
    taken, plain = answers
    assert taken is None
    assert isinstance(plain, RedisConnectionError)


async def test_scripts_redis_forgot_run_with_eval_and_stay_cached(
    counting: CountingRedis, scripts: PipelinedScripts, key_prefix: str
) -> None:
    await counting.script_flush()
    replies = await asyncio.gather(
        *(SCRIPT.run(scripts, [f"{key_prefix}n{i}"], [str(i)]) for i in range(4))
    )
    assert replies == [b"0", b"1", b"2", b"3"]
    # EVALSHA for all four (NOSCRIPT each), then EVAL for all four: two round trips.
    assert counting.pipelines == 2
    assert await counting.script_exists(SCRIPT.sha) == [True]


async def test_a_caller_that_gives_up_leaves_the_others_alone(
    counting: CountingRedis, scripts: PipelinedScripts, key_prefix: str
) -> None:
    await counting.script_load(SOURCE)
    given_up = asyncio.ensure_future(SCRIPT.run(scripts, [f"{key_prefix}gone"], ["no"]))
    kept = asyncio.ensure_future(SCRIPT.run(scripts, [f"{key_prefix}kept"], ["yes"]))
    await asyncio.sleep(0)  # both queued, the round trip not sent yet
    given_up.cancel()
    assert await kept == b"yes"
    assert given_up.cancelled()
    # The command given up before it was sent was never sent.
    assert await counting.get(f"{key_prefix}gone") is None


async def test_a_round_trip_that_fails_fails_every_call_in_it() -> None:
    # Nothing listens there: every queued call gets the connection error.
    client = aioredis.Redis(port=free_port(), socket_connect_timeout=1.0)
    try:
        pipelined = PipelinedScripts(client)
        replies = await asyncio.gather(
            *(SCRIPT.run(pipelined, [f"k{i}"], ["v"]) for i in range(3)), return_exceptions=True
        )
        await pipelined.aclose()
    finally:
        await client.aclose()
    assert all(isinstance(r, RedisConnectionError) for r in replies), replies


async def test_a_lost_connection_is_opened_again(
    counting: CountingRedis, scripts: PipelinedScripts, key_prefix: str
) -> None:
    await counting.script_load(SOURCE)
    assert await SCRIPT.run(scripts, [f"{key_prefix}a"], ["1"]) == b"1"
    # Redis drops the connection (a restart, a failover, a proxy's idle timeout).
    killed = await counting.client_kill_filter(_type="normal", skipme=True)
    assert killed >= 1
    assert await SCRIPT.run(scripts, [f"{key_prefix}b"], ["2"]) == b"2"


async def _after_an_idle_close(redis_url: str, key_prefix: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    pipelined = PipelinedScripts(client)
    try:
        await client.script_load(SOURCE)
        assert await SCRIPT.run(pipelined, [f"{key_prefix}a"], ["1"]) == b"1"
        # The one connection it holds is closed while nothing is outstanding: as after Redis
        # went away, where a write fails and the loop closes the transport, and the next
        # call is written to a closed transport.
        held = pipelined._transport
        assert held is not None
        held.abort()
        await eventually(held.is_closing, timeout_s=10.0, what="closed")
        async with asyncio.timeout(10.0):  # before the fix: never answered
            replies = await asyncio.gather(
                *(SCRIPT.run(pipelined, [f"{key_prefix}b{i}"], [str(i)]) for i in range(3))
            )
        assert replies == [b"0", b"1", b"2"]
        assert await client.get(f"{key_prefix}b2") == b"2"
    finally:
        await pipelined.aclose()
        await client.aclose()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_calls_after_the_idle_connection_closed_are_sent_on_a_new_one(
    redis_url: str, key_prefix: str, loop: str
) -> None:
    # uvloop (what the services run) refuses a write to a closed transport with RuntimeError;
    # the calls of that write were lost and their callers waited forever (a Redis restart
    # froze the ledger: tests/end_to_end/test_redis_outage.py).
    run = uvloop.run if loop == "uvloop" else asyncio.run
    run(_after_an_idle_close(redis_url, key_prefix))


async def test_a_reply_that_does_not_come_in_time_fails_the_calls_waiting(
    redis_url: str, key_prefix: str
) -> None:
    client = aioredis.Redis.from_url(redis_url, socket_timeout=0.3)
    other = aioredis.Redis.from_url(redis_url)
    pipelined = PipelinedScripts(client)
    try:
        await client.script_load(SOURCE)
        assert await SCRIPT.run(pipelined, [f"{key_prefix}a"], ["1"]) == b"1"
        # Another client holds every client's commands for 1 s (a stuck Redis: a slow script,
        # a fork, a partition): no reply comes within 0.3 s.
        assert await other.execute_command("CLIENT", "PAUSE", 1000)
        started = asyncio.get_running_loop().time()
        replies = await asyncio.gather(
            *(SCRIPT.run(pipelined, [f"{key_prefix}b{i}"], [str(i)]) for i in range(2)),
            return_exceptions=True,
        )
        waited = asyncio.get_running_loop().time() - started
        assert all(isinstance(r, RedisTimeoutError) for r in replies), replies
        assert waited < 0.9  # the deadline, not the end of the pause
        assert await other.execute_command("CLIENT", "UNPAUSE")
        # The connection that timed out was dropped (a late reply would answer the wrong
        # caller); the next call goes out on a new one and is answered.
        assert await SCRIPT.run(pipelined, [f"{key_prefix}c"], ["2"]) == b"2"
    finally:
        await pipelined.aclose()
        await client.aclose()
        await other.aclose()
