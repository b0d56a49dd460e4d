"""Publication is exactly once even when the publishing script's reply is lost or late.

A small asyncio TCP fault proxy (reliability.md §3.5) sits between the SessionStore's Redis
client and the real redis-server. It forwards everything, except that the reply to the
EVALSHA of the publish script is dropped (or held past the client's timeout) once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any, Literal
from urllib.parse import urlparse

import orjson
import pytest
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.dataproxy.redis_keys import RedisKeys
from services.dataproxy.scripts import Scripts
from services.dataproxy.sessions import SessionStore
from services.dataproxy.turns import encode_turn
from services.runtime.keys import key_digest
from services.runtime.secret import Secret
from tests.dataproxy.turn_records import turn_record

ADMIN_KEY = "admin-exactly-once-0123456789"
# Shorter than production's 5 s so a held reply times out quickly.
SOCKET_TIMEOUT_S = 0.5

Fault = Literal["drop", "delay"]


class FaultProxy:
    """Forwards TCP to Redis; loses or delays the reply to the first command holding `trigger`."""

    def __init__(self, target: tuple[str, int], *, trigger: bytes, fault: Fault) -> None:
        self._target = target
        self._trigger = trigger
        self._fault = fault
        self._faults_left = 1
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.triggered = 0  # how many times the trigger command went through

    async def __aenter__(self) -> FaultProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    @property
    def url(self) -> str:
        assert self._server is not None
        port = self._server.sockets[0].getsockname()[1]
        return f"redis://127.0.0.1:{port}/0"

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        upstream_reader, upstream_writer = await asyncio.open_connection(*self._target)
        faulty = asyncio.Event()
        try:
            await asyncio.gather(
                self._requests(reader, upstream_writer, faulty),
                self._replies(upstream_reader, writer, faulty),
            )
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            for w in (writer, upstream_writer):
                w.close()
            self._tasks.discard(task)

    async def _requests(
        self, reader: asyncio.StreamReader, upstream: asyncio.StreamWriter, faulty: asyncio.Event
    ) -> None:
        while data := await reader.read(65536):
            if self._trigger in data:
                self.triggered += 1
                if self._faults_left > 0:
                    self._faults_left -= 1
                    faulty.set()
            upstream.write(data)
            await upstream.drain()
        upstream.close()

    async def _replies(
        self, upstream: asyncio.StreamReader, writer: asyncio.StreamWriter, faulty: asyncio.Event
    ) -> None:
        while data := await upstream.read(65536):
            if faulty.is_set():
                if self._fault == "drop":
                    continue  # the connection is dead to the client from here on
                await asyncio.sleep(SOCKET_TIMEOUT_S * 3)  # arrives after the client gave up
            writer.write(data)
            with contextlib.suppress(ConnectionError):
                await writer.drain()


def client_via(url: str, *, retries: int) -> aioredis.Redis:
    """A client configured like services.runtime.redis_conn.open_redis, with a short timeout."""
    backoff = ExponentialBackoff(cap=0.2, base=0.01) if retries else NoBackoff()
    return aioredis.Redis.from_url(
        url,
        socket_timeout=SOCKET_TIMEOUT_S,
        socket_connect_timeout=2.0,
        retry=Retry(backoff, retries=retries),
        retry_on_error=[RedisConnectionError],
        decode_responses=False,
    )


def store_over(redis: aioredis.Redis, keys: RedisKeys) -> SessionStore:
    return SessionStore(
        redis=redis,
        keys=keys,
        scripts=Scripts.load(),
        admin_key=Secret(ADMIN_KEY),
        refresh_lock_s=30.0,
    )


async def record_turn(store: SessionStore, api_key: str, interaction_id: str) -> None:
    episode = await store.active_episode(key_digest(api_key))
    record = turn_record(
        interaction_id=interaction_id,
        upstream_model="mock",
        finish_reason="stop",
        prompt_token_ids=[1, 2, 3],
        output_token_ids=[7, 8],
        output_logprobs=[-0.5, -0.25],
        exact_tokens=True,
        assistant_message_json=orjson.dumps({"role": "assistant", "content": "hi"}),
        upstream_kind="vllm",
    )
    data = encode_turn(
        record,
        request_json=orjson.dumps({"messages": [{"role": "user", "content": "hi"}]}),
        weight_version=episode.weight_version,
        now=time.time(),
    )
    await store.append_turn(episode, interaction_id=interaction_id, record=data)


@pytest.fixture
def keys(key_prefix: str) -> RedisKeys:
    return RedisKeys(key_prefix)


@contextlib.asynccontextmanager
async def faulty_store(
    redis_url: str, redis_client: aioredis.Redis, keys: RedisKeys, *, fault: Fault, retries: int
) -> AsyncIterator[tuple[SessionStore, FaultProxy]]:
    publish = Scripts.load().publish.lua
    # Cached up front: the EVALSHA itself must run the script (no NOSCRIPT round first).
    await redis_client.script_load(publish.source)
    target = urlparse(redis_url)
    assert target.hostname and target.port
    proxy = FaultProxy((target.hostname, target.port), trigger=publish.sha.encode(), fault=fault)
    async with proxy:
        redis = client_via(proxy.url, retries=retries)
        try:
            yield store_over(redis, keys), proxy
        finally:
            await redis.aclose()


async def stream_ids(redis: aioredis.Redis, keys: RedisKeys) -> list[str]:
    entries: Any = await redis.xrange(keys.trajectories)
    return [entry_id.decode() for entry_id, _fields in entries]


@pytest.mark.parametrize("fault", ["drop", "delay"])
async def test_a_lost_or_late_publish_reply_is_retried_by_the_client_into_one_entry(
    redis_url: str, redis_client: aioredis.Redis, keys: RedisKeys, fault: Fault
) -> None:
    async with faulty_store(redis_url, redis_client, keys, fault=fault, retries=3) as (
        store,
        proxy,
    ):
        started = await store.start(task_id="t", api_key="")
        await record_turn(store, started.api_key, "c1")
        publication = await store.end(key_digest(started.api_key))

    assert proxy.triggered == 2  # redis-py re-sent the script after the timeout
    assert publication.status == "published"
    assert await stream_ids(redis_client, keys) == [publication.stream_id]
    entries: Any = await redis_client.xrange(keys.trajectories)
    assert entries[0][1][b"trajectory_id"].decode() == publication.trajectory_id


@pytest.mark.parametrize("fault", ["drop", "delay"])
async def test_a_caller_retrying_a_failed_publication_gets_the_same_trajectory_id(
    redis_url: str, redis_client: aioredis.Redis, keys: RedisKeys, fault: Fault
) -> None:
    async with faulty_store(redis_url, redis_client, keys, fault=fault, retries=0) as (
        store,
        proxy,
    ):
        started = await store.start(task_id="t", api_key="")
        await record_turn(store, started.api_key, "c1")
        key = await store.resolve(key_digest(started.api_key))
        with pytest.raises((RedisTimeoutError, RedisConnectionError, TimeoutError)):
            await store.publish(key, end_reason="end_session")
        # The script ran although its reply never came: the entry exists already.
        assert len(await stream_ids(redis_client, keys)) == 1
        retried = await store.publish(key, end_reason="end_session")

    assert proxy.triggered == 2
    assert retried.status == "published"
    entries: Any = await redis_client.xrange(keys.trajectories)
    assert len(entries) == 1
    assert entries[0][0].decode() == retried.stream_id
    assert entries[0][1][b"trajectory_id"].decode() == retried.trajectory_id
    stats: Any = await redis_client.hget(keys.stats, "published")
    assert int(stats) == 1


async def test_many_concurrent_publications_of_one_episode_add_one_entry(
    redis_client: aioredis.Redis, keys: RedisKeys
) -> None:
    store = store_over(redis_client, keys)
    started = await store.start(task_id="t", api_key="")
    await record_turn(store, started.api_key, "c1")
    key = await store.resolve(key_digest(started.api_key))

    async with asyncio.timeout(30):
        results = await asyncio.gather(
            *(store.publish(key, end_reason="end_session") for _ in range(10))
        )

    assert {r.trajectory_id for r in results} == {results[0].trajectory_id}
    assert {r.stream_id for r in results} == {results[0].stream_id}
    assert await redis_client.xlen(keys.trajectories) == 1
