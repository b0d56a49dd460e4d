"""What the whole deployment looks like right now, read from Redis: the counters behind the
global metrics, the console's live page and `rollgate status`. Every value is global (the same
from any replica): nothing here comes from process memory."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from services.dataproxy.control import UNLIMITED, CapacityPolicy, capacity_left
from services.dataproxy.redis_keys import (
    CapacityFields,
    EpisodeFields,
    KeyFields,
    RedisKeys,
    StatsFields,
)
from services.dataproxy.scripts import StreamGroups, StreamGroupsCall
from services.runtime.redis_scripts import Script, text_of

READ_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupState:
    """One consumer group of the trajectories stream."""

    name: str
    consumers: int
    # Delivered to a consumer, not acked yet.
    pending: int
    # Published, not yet delivered to any consumer of the group.
    backlog: int
    # Seconds since the oldest pending / the oldest undelivered entry was published (0: none).
    oldest_pending_age_s: float
    oldest_undelivered_age_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Counters:
    """The deployment's counters and state, as one consistent-enough read."""

    open_episodes: int
    awaiting_reward: int
    published: int
    consumed: int
    empty_episodes: int
    interactions: int
    joined: int
    output_tokens: int
    exact_interactions: int
    length_mismatches: int
    reward_sum: float
    # The sum of the positive final rewards, and of the negative ones' magnitudes.
    reward_positive: float
    reward_negative: float
    errors: int
    weight_version: int
    in_flight: int
    paused: bool
    # Unix time the current pause began (0 when not paused).
    paused_since: float
    # Episodes that may still start (-1: unlimited), grants not yet taken (None: never
    # granted), what the staleness bound counts (open + published) and the bound (None: none).
    capacity_left: int
    capacity_granted: int | None
    capacity_used: int
    capacity_bound: int | None
    stream_length: int
    groups: tuple[GroupState, ...]

    @property
    def join_rate(self) -> float:
        """Share of interactions after each episode's first whose parent was found."""
        could_join = self.interactions - self.published
        return self.joined / could_join if could_join > 0 else 0.0

    @property
    def exact_token_ratio(self) -> float:
        """Share of published interactions whose token ids are the engine's own."""
        return self.exact_interactions / self.interactions if self.interactions else 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionState:
    """One episode that is running (active) or held for a late reward."""

    session_id: str
    task_id: str
    key_id: str
    state: str
    turns: int
    started_at: float
    last_active_at: float
    # When the reaper ends it (idle deadline, or the late-reward deadline when held).
    deadline: float


def stream_seq(stream_id: str) -> int:
    """The n of a numbered stream id `<ms>-<n>` (the publish script numbers them)."""
    _, _, seq = stream_id.partition("-")
    return int(seq) if seq.isdigit() else 0


def stream_ms(stream_id: str) -> int:
    """The millisecond part of a stream id."""
    ms, _, _ = stream_id.partition("-")
    return int(ms) if ms.isdigit() else 0


class Overview:
    """Reads the deployment's state from Redis (a few pipelined round trips per call)."""

    def __init__(self, *, redis: aioredis.Redis, keys: RedisKeys, policy: CapacityPolicy):
        self._redis = redis
        self._keys = keys
        self._policy = policy
        self._groups = Script.load(StreamGroupsCall, StreamGroups.parse)

    async def counters(self) -> Counters:
        """Stats, control state and the stream's consumer groups."""
        keys = self._keys
        async with asyncio.timeout(READ_TIMEOUT_S):
            pipe = self._redis.pipeline(transaction=False)
            pipe.hgetall(keys.stats)
            pipe.get(keys.weight_version)
            pipe.hget(keys.capacity, CapacityFields.GRANTS)
            pipe.get(keys.paused)
            pipe.zcount(keys.in_flight, f"({time.time()!r}", "+inf")
            pipe.zcard(keys.awaiting_reward)
            stats, version, grants, paused, running, awaiting = await pipe.execute()
            stream = await self._groups.run(self._redis, StreamGroupsCall(stream=keys.trajectories))
        fields = {text_of(k): _number(v) for k, v in stats.items()}
        published = int(fields.get(StatsFields.PUBLISHED, 0))
        open_episodes = int(fields.get(StatsFields.OPEN_EPISODES, 0))
        weight_version = int(_number(version))
        granted = None if grants is None else int(_number(grants))
        bound = None
        if self._policy.max_head_offpolicyness is not None:
            bound = (self._policy.max_head_offpolicyness + weight_version + 1) * (
                self._policy.batch_size
            )
        now = time.time()
        return Counters(
            open_episodes=open_episodes,
            awaiting_reward=int(awaiting),
            published=published,
            consumed=int(fields.get(StatsFields.CONSUMED, 0)),
            empty_episodes=int(fields.get(StatsFields.EMPTY_EPISODES, 0)),
            interactions=int(fields.get(StatsFields.INTERACTIONS, 0)),
            joined=int(fields.get(StatsFields.JOINED, 0)),
            output_tokens=int(fields.get(StatsFields.OUTPUT_TOKENS, 0)),
            exact_interactions=int(fields.get(StatsFields.EXACT_INTERACTIONS, 0)),
            length_mismatches=int(fields.get(StatsFields.LENGTH_MISMATCHES, 0)),
            reward_sum=fields.get(StatsFields.REWARD_MICROS, 0) / 1_000_000,
            reward_positive=fields.get(StatsFields.REWARD_POSITIVE_MICROS, 0) / 1_000_000,
            reward_negative=fields.get(StatsFields.REWARD_NEGATIVE_MICROS, 0) / 1_000_000,
            errors=int(fields.get(StatsFields.ERRORS, 0)),
            weight_version=weight_version,
            in_flight=int(running),
            paused=paused is not None,
            paused_since=_number(paused) if paused is not None else 0.0,
            capacity_left=capacity_left(
                self._policy,
                open_episodes=open_episodes,
                published=published,
                version=weight_version,
                grants=granted,
            ),
            capacity_granted=granted,
            capacity_used=open_episodes + published,
            capacity_bound=bound,
            stream_length=stream.length,
            groups=tuple(_group(raw, published, stream.length, now) for raw in stream.groups),
        )

    async def sessions(self, *, limit: int) -> tuple[list[SessionState], int]:
        """Up to `limit` active and held episodes (most recently active first) and how many
        there are in all."""
        keys = self._keys
        async with asyncio.timeout(READ_TIMEOUT_S):
            pipe = self._redis.pipeline(transaction=False)
            pipe.zcard(keys.idle)
            pipe.zrevrange(keys.idle, 0, limit - 1, withscores=True)
            pipe.zcard(keys.awaiting_reward)
            pipe.zrevrange(keys.awaiting_reward, 0, limit - 1, withscores=True)
            active_n, active, held_n, held = await pipe.execute()
            members = [(text_of(m), float(s)) for m, s in [*active, *held]][:limit]
            digests = [m.partition("/")[0] for m, _ in members]
            pipe = self._redis.pipeline(transaction=False)
            for digest in digests:
                pipe.hget(keys.key(digest), KeyFields.KEY_ID)
            key_ids = [text_of(k) for k in await pipe.execute()]
            pipe = self._redis.pipeline(transaction=False)
            for (member, _), key_id in zip(members, key_ids, strict=True):
                episode = member.partition("/")[2]
                pipe.hmget(
                    keys.episode(key_id, episode),
                    EpisodeFields.SESSION_ID,
                    EpisodeFields.TASK_ID,
                    EpisodeFields.STATE,
                    EpisodeFields.STARTED_AT,
                    EpisodeFields.LAST_ACTIVE_AT,
                )
                pipe.llen(keys.turns(key_id, episode))
            replies = await pipe.execute()
        sessions = []
        for i, ((member, deadline), key_id) in enumerate(zip(members, key_ids, strict=True)):
            (session_id, task_id, state, started, last), turns = replies[2 * i : 2 * i + 2]
            if state is None:  # published between the two reads
                continue
            sessions.append(
                SessionState(
                    session_id=text_of(session_id) or member.partition("/")[2],
                    task_id=text_of(task_id),
                    key_id=key_id,
                    state=text_of(state),
                    turns=int(turns),
                    started_at=_number(started),
                    last_active_at=_number(last) or _number(started),
                    deadline=deadline,
                )
            )
        return sessions, int(active_n) + int(held_n)

    async def history(self, *, since: float) -> list[dict[str, Any]]:
        """The counter snapshots taken since `since` (oldest first)."""
        async with asyncio.timeout(READ_TIMEOUT_S):
            raw: Any = await self._redis.zrangebyscore(self._keys.history, since, "+inf")
        return [orjson.loads(item) for item in raw]

    async def errors(self, *, limit: int) -> list[dict[str, Any]]:
        """The last failed RPCs, newest first."""
        async with asyncio.timeout(READ_TIMEOUT_S):
            raw: Any = await self._redis.lrange(self._keys.errors, 0, limit - 1)
        return [orjson.loads(item) for item in raw]

    async def recent(self, *, limit: int, offset: int = 0) -> list[tuple[str, dict[str, Any]]]:
        """(stream id, summary) of the last published trajectories, newest first."""
        async with asyncio.timeout(READ_TIMEOUT_S):
            raw: Any = await self._redis.lrange(
                self._keys.recent_trajectories, offset, offset + limit - 1
            )
        items = []
        for item in raw:
            stream_id, _, summary = bytes(item).partition(b" ")
            items.append((stream_id.decode(), orjson.loads(summary)))
        return items

    async def trajectory(self, stream_id: str) -> tuple[str, bytes, str] | None:
        """(trajectory id, data, codec) of one stream entry, None when it is not (or no
        longer) on the stream."""
        async with asyncio.timeout(READ_TIMEOUT_S):
            try:
                items: Any = await self._redis.xrange(
                    self._keys.trajectories, stream_id, stream_id, count=1
                )
            except ResponseError:  # not a stream id
                return None
        if not items:
            return None
        fields = {text_of(k): v for k, v in items[0][1].items()}
        return (
            text_of(fields.get("trajectory_id", b"")),
            bytes(fields.get("data", b"")),
            text_of(fields.get("codec", b"msgpack")),
        )


def _group(raw: Sequence[Any], published: int, length: int, now: float) -> GroupState:
    name, pending, last_delivered, consumers, oldest, first_undelivered = raw
    # Every entry after a group's last-delivered id is still on the stream (trimming keeps
    # them), and ids count publications: the backlog is a difference, bounded by the length.
    backlog = max(0, min(published - stream_seq(text_of(last_delivered)), length))
    if not text_of(first_undelivered):
        backlog = 0
    return GroupState(
        name=text_of(name),
        consumers=int(consumers),
        pending=int(pending),
        backlog=backlog,
        oldest_pending_age_s=_age(text_of(oldest), now),
        oldest_undelivered_age_s=_age(text_of(first_undelivered), now),
    )


def _age(stream_id: str, now: float) -> float:
    ms = stream_ms(stream_id) if stream_id else 0
    return max(0.0, now - ms / 1000) if ms else 0.0


def capacity_text(left: int) -> str:
    """`unlimited` or the number of episodes that may still start."""
    return "unlimited" if left == UNLIMITED else str(left)


def _number(value: Any) -> float:
    if value is None or value in (b"", ""):
        return 0.0
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0
