"""Per-token weight versions: a real worker over the mock LLM and two real dataproxy replicas.

Turns stream through replica A; the trainer moves the version through replica B's Trainer
service, so A learns of it only through Redis (its WeightVersionView).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any

import msgpack  # type: ignore[import-untyped]
import orjson
import redis.asyncio as aioredis

from protos import dataproxy_pb2, dataproxy_pb2_grpc, trainer_pb2
from schema.packing import unpack_int32
from schema.trajectory import VERSIONS_UNCOUNTED
from services.dataproxy.control import WeightVersionView
from services.dataproxy.redis_keys import RedisKeys
from services.dataproxy.trajectory import EpisodeInfo, build_trajectory
from services.dataproxy.trajectory_stream import TrajectoryStream
from services.dataproxy.turns import encode_turn, per_token_versions
from services.gateway.relay import Chunks, Done, Event
from services.runtime.keys import key_digest
from tests.dataproxy.turn_records import turn_record
from tests.harness.inprocess import (
    ADMIN_KEY,
    RPC_TIMEOUT_S,
    DataproxyChain,
    chunk_payloads,
    collect,
    running_dataproxy_chain,
)
from tests.harness.poll import eventually

AUTH = (("authorization", f"Bearer {ADMIN_KEY}"),)
# Long enough that the reply streams for about a second at the token interval below.
LONG_TEXT = " ".join(f"word{i}" for i in range(20))
TOKEN_INTERVAL_MS = 40.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Replicas(DataproxyChain):
    """Replica A (DataProxy: the turns), replica B (Trainer), one worker, and Redis."""

    @property
    def chat(self) -> dataproxy_pb2_grpc.DataProxyStub:
        """Replica A's DataProxy stub."""
        return self.dataproxy

    async def start(self) -> str:
        started = await self.chat.StartSession(
            dataproxy_pb2.StartSessionRequest(task_id="versions"), timeout=RPC_TIMEOUT_S
        )
        return key_digest(started.api_key)

    async def set_version(self, version: int) -> None:
        await self.trainer.SetWeightVersion(
            trainer_pb2.SetWeightVersionRequest(version=version), metadata=AUTH, timeout=5
        )

    async def published(self, digest: str) -> dict[str, Any]:
        """Ends the episode and returns its published trajectory."""
        ended = await self.chat.EndSession(
            dataproxy_pb2.EndSessionRequest(key_digest=digest), timeout=RPC_TIMEOUT_S
        )
        entries: Any = await self.redis.xrange(self.keys.trajectories)
        for _, fields in entries:
            if fields[b"trajectory_id"] == ended.trajectory_id.encode():
                trajectory: dict[str, Any] = msgpack.unpackb(fields[b"data"], raw=False)
                return trajectory
        raise AssertionError("the trajectory was not published")


def replicas(
    redis_url: str, key_prefix: str, *, latency_ms: float = 0.0
) -> contextlib.AbstractAsyncContextManager[Replicas]:
    return running_dataproxy_chain(
        redis_url,
        key_prefix,
        chain_type=Replicas,
        replicas=2,
        token_interval_ms=TOKEN_INTERVAL_MS,
        latency_ms=latency_ms,
    )


def tokens_in(event: Event) -> int:
    """Sampled tokens the client saw in one event (one logprob entry per token)."""
    count = 0
    for raw in chunk_payloads([event]):
        for choice in orjson.loads(raw).get("choices") or []:
            logprobs = choice.get("logprobs") or {}
            count += len(logprobs.get("content") or [])
    return count


async def test_a_version_change_mid_stream_stamps_early_tokens_old_and_later_tokens_new(
    redis_url: str, key_prefix: str
) -> None:
    async with replicas(redis_url, key_prefix) as stack:
        await stack.set_version(3)
        digest = await stack.start()
        call = stack.call(digest, LONG_TEXT, logprobs=True, request_id="req-versions")
        seen_before = 0
        while seen_before < 3:
            message = await call.read()
            assert isinstance(message, Chunks)
            seen_before += tokens_in(message)
        # Not paused first: the version moves under the running turn, through the other replica.
        await stack.set_version(4)
        rest = await collect(call)

        assert isinstance(rest[-1], Done)
        (turn,) = await stack.turns(digest)
        output_ids = unpack_int32(turn["output_token_ids"])
        versions = unpack_int32(turn["output_versions"])
        trajectory = await stack.published(digest)

    assert turn["output_versions_source"] == "chunks"
    assert len(versions) == len(output_ids)
    old = versions.count(3)
    # In order: the old version on a prefix, the new one on the rest, nothing else.
    assert versions == [3] * old + [4] * (len(versions) - old)
    # Every token the client saw before SetWeightVersion was sampled under the old weights...
    assert old >= seen_before
    # ...and the tokens streamed well after it carry the new one.
    assert versions[-1] == 4
    assert (turn["weight_version"], turn["weight_version_end"]) == (3, 4)
    (interaction,) = trajectory["interactions"]
    assert unpack_int32(interaction["output_versions"]) == versions
    assert interaction["output_versions_source"] == "chunks"
    assert trajectory["weight_versions"] == [3, 4]


async def test_a_streamed_turn_without_a_version_change_records_one_version_throughout(
    redis_url: str, key_prefix: str
) -> None:
    async with replicas(redis_url, key_prefix) as stack:
        await stack.set_version(5)
        digest = await stack.start()
        await stack.stream(digest, LONG_TEXT, request_id="req-versions")
        (turn,) = await stack.turns(digest)
        trajectory = await stack.published(digest)

    output_ids = unpack_int32(turn["output_token_ids"])
    assert output_ids
    assert turn["output_versions_source"] == "chunks"
    assert unpack_int32(turn["output_versions"]) == [5] * len(output_ids)
    (interaction,) = trajectory["interactions"]
    assert unpack_int32(interaction["output_versions"]) == [5] * len(output_ids)
    assert trajectory["weight_versions"] == [5]


async def test_a_non_streaming_turn_keeps_the_admission_version_and_records_the_end_version(
    redis_url: str, key_prefix: str
) -> None:
    async with replicas(redis_url, key_prefix, latency_ms=400.0) as stack:
        await stack.set_version(1)
        digest = await stack.start()
        running = asyncio.ensure_future(
            stack.complete(digest, LONG_TEXT, request_id="req-versions")
        )

        # Admitted (its in-flight lease exists) while the mock still holds the answer back.
        async def admitted() -> int:
            assert not running.done()
            return int(await stack.redis.zcard(stack.keys.in_flight))

        await eventually(admitted, what="the turn admitted")
        await stack.set_version(2)
        await running
        (turn,) = await stack.turns(digest)
        trajectory = await stack.published(digest)

    assert "output_versions" not in turn
    assert turn["output_versions_source"] == "admission"
    assert (turn["weight_version"], turn["weight_version_end"]) == (1, 2)
    (interaction,) = trajectory["interactions"]
    n_output = len(unpack_int32(interaction["output_token_ids"]))
    assert n_output > 0
    assert unpack_int32(interaction["output_versions"]) == [1] * n_output
    assert interaction["output_versions_source"] == "admission"
    assert interaction["weight_version_end"] == 2


async def test_the_view_follows_set_weight_version_from_any_client(
    redis_client: aioredis.Redis, key_prefix: str
) -> None:
    keys = RedisKeys(key_prefix)
    # A long re-read interval: only the published message can move the view in time.
    async with WeightVersionView(redis=redis_client, keys=keys, reread_s=60.0) as view:
        assert view.current == 0
        await TrajectoryStream(redis=redis_client, keys=keys).set_weight_version(7)
        await eventually(lambda: view.current == 7, timeout_s=2.0)


async def test_the_view_catches_a_change_it_was_not_told_about_by_rereading(
    redis_client: aioredis.Redis, key_prefix: str
) -> None:
    keys = RedisKeys(key_prefix)
    await redis_client.set(keys.weight_version, 2)
    async with WeightVersionView(redis=redis_client, keys=keys, reread_s=0.05) as view:
        assert view.current == 2  # read on entry
        await redis_client.set(keys.weight_version, 9)  # no message published
        await eventually(lambda: view.current == 9, timeout_s=2.0)


def test_the_view_never_moves_backwards() -> None:
    view = WeightVersionView(redis=aioredis.Redis(), keys=RedisKeys("unused:"))
    view.advance(4)
    view.advance(2)
    assert view.current == 4
    # Only a rollback (a later epoch) moves it down, and an old reply never undoes that.
    view.advance(1, epoch=1)
    assert view.current == 1
    view.advance(4, epoch=0)  # a reply read before the rollback
    assert view.current == 1


async def test_the_view_follows_a_rollback_by_message_and_by_rereading(
    redis_client: aioredis.Redis, key_prefix: str
) -> None:
    keys = RedisKeys(key_prefix)
    stream = TrajectoryStream(redis=redis_client, keys=keys)
    await stream.set_weight_version(8)
    async with WeightVersionView(redis=redis_client, keys=keys, reread_s=60.0) as view:
        assert view.current == 8
        await stream.set_weight_version(3, allow_rollback=True)
        await eventually(lambda: view.current == 3, timeout_s=2.0)  # the published message
        await stream.set_weight_version(4)
        await eventually(lambda: view.current == 4, timeout_s=2.0)
    async with WeightVersionView(redis=redis_client, keys=keys, reread_s=0.05) as view:
        assert view.current == 4
        await stream.set_weight_version(2, allow_rollback=True)
        await eventually(lambda: view.current == 2, timeout_s=2.0)


def test_chunk_counts_that_do_not_add_up_fall_back_to_the_admission_version() -> None:
    assert per_token_versions([(2, 3), (1, 4)], 3) == [3, 3, 4]
    assert per_token_versions([(2, 3), (1, 4)], 4) is None
    assert per_token_versions([], 3) is None
    record = turn_record(
        interaction_id="chatcmpl-1",
        output_token_ids=[11, 12, 13],
        output_logprobs=[-0.1, -0.2, -0.3],
        exact_tokens=True,
    )
    raw = encode_turn(
        record,
        request_json=b'{"messages":[]}',
        weight_version=3,
        weight_version_end=4,
        now=time.time(),
        output_versions=None,
        output_versions_source=VERSIONS_UNCOUNTED,
    )
    info = EpisodeInfo(
        trajectory_id="t-1",
        session_id="s-1",
        task_id="task",
        key_id="k",
        episode="s-1",
        started_at=0.0,
        ended_at=1.0,
        end_reason="end_session",
    )

    (interaction,) = build_trajectory(info, [raw], {})["interactions"]

    assert unpack_int32(interaction["output_versions"]) == [3, 3, 3]
    assert interaction["output_versions_source"] == VERSIONS_UNCOUNTED
    assert interaction["weight_version_end"] == 4
