"""The stream of published trajectories as the Trainer service reads it: consumer groups,
pulls (own pending, reclaimed, new), acks, the weight version and the counters."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from schema.trajectory import CODEC
from services.dataproxy.redis_keys import RedisKeys, StatsFields
from services.dataproxy.scripts import AckCall, SetVersionCall, VersionSet
from services.runtime.errors import InvalidRequest
from services.runtime.logs import get_logger
from services.runtime.redis_scripts import Script, as_int, text_of

log = get_logger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamEntry:
    """One entry of the trajectories stream."""

    stream_id: str
    trajectory_id: str
    codec: str
    data: bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerStats:
    """The counters `GetStats` reports."""

    open_episodes: int
    published: int
    consumed: int
    pending: int
    weight_version: int
    empty_episodes: int
    # Interactions published, and those whose parent was found (`P stats` counters).
    interactions: int = 0
    joined: int = 0

    @property
    def join_rate(self) -> float:
        """Share of interactions after each episode's first whose parent was found."""
        could_join = self.interactions - self.published
        return self.joined / could_join if could_join > 0 else 0.0


# Lua's unpack() has a stack limit of a few thousand values: ack in chunks.
_ACK_CHUNK = 1000
_READ_BATCH = 64


class TrajectoryStream:
    """Reads the trajectories stream through consumer groups; acks; version; counters."""

    def __init__(
        self,
        *,
        redis: Redis,
        keys: RedisKeys,
        reclaim_idle_s: float = 60.0,
        block_s: float = 2.0,
        command_timeout_s: float = 5.0,
    ) -> None:
        self._redis = redis
        self._keys = keys
        self._reclaim_idle_ms = max(1, int(reclaim_idle_s * 1000))
        self._block_ms = max(1, int(block_s * 1000))
        self._timeout_s = command_timeout_s
        self._ack = Script.load(AckCall, as_int)
        self._set_version = Script.load(SetVersionCall, VersionSet.parse)

    async def ensure_group(self, group: str, *, include_history: bool = False) -> None:
        """Creates the consumer group unless it exists: reading what is published from now on
        (`$`), or with `include_history` everything still in the stream (`0`). A trainer that
        starts for the first time wants the former: the history is earlier runs' episodes."""
        try:
            async with asyncio.timeout(self._timeout_s):
                await self._redis.xgroup_create(
                    self._keys.trajectories,
                    group,
                    id="0" if include_history else "$",
                    mkstream=True,
                )
        except ResponseError as err:
            if "BUSYGROUP" not in str(err):
                raise

    async def pull(
        self,
        group: str,
        consumer: str,
        *,
        max_count: int = 0,
        idle_timeout_s: float = 0.0,
        stopping: asyncio.Event | None = None,
        include_history: bool = False,
    ) -> AsyncIterator[StreamEntry]:
        """Own pending entries first, then reclaimed and new ones, until a limit is reached."""
        await self.ensure_group(group, include_history=include_history)
        budget = _Budget(max_count=max_count, idle_timeout_s=idle_timeout_s, stopping=stopping)
        async for entry in self._own_pending(group, consumer, budget):
            yield entry
        next_reclaim, reclaim_cursor = 0.0, "0-0"
        while not budget.done():
            if time.monotonic() >= next_reclaim:
                reclaimed, reclaim_cursor = await self._reclaim(
                    group, consumer, reclaim_cursor, budget.batch()
                )
                for entry in reclaimed:
                    budget.delivered()
                    yield entry
                if reclaim_cursor == "0-0":  # the whole group's PEL was scanned
                    next_reclaim = time.monotonic() + self._reclaim_idle_ms / 4000
                continue
            block_ms = min(self._block_ms, budget.idle_left_ms())
            entries = await self._read(group, consumer, ">", budget.batch(), block_ms)
            for entry in entries:
                budget.delivered()
                yield entry

    async def ack(self, group: str, stream_ids: Sequence[str]) -> int:
        """XACKs `stream_ids` in `group` and counts them as consumed; the number acked."""
        acked = 0
        for start in range(0, len(stream_ids), _ACK_CHUNK):
            chunk = stream_ids[start : start + _ACK_CHUNK]
            async with asyncio.timeout(self._timeout_s):
                acked += await self._ack.run(
                    self._redis,
                    AckCall(
                        stream=self._keys.trajectories,
                        stats=self._keys.stats,
                        group=group,
                        stream_ids=chunk,
                    ),
                )
        return acked

    async def set_weight_version(self, version: int, *, allow_rollback: bool = False) -> int:
        """Sets the weight version; a lower one than the current only with `allow_rollback`."""
        if version < 0:
            raise InvalidRequest(f"weight version {version} is negative", code="invalid_version")
        async with asyncio.timeout(self._timeout_s):
            reply = await self._set_version.run(
                self._redis,
                SetVersionCall(
                    weight_version=self._keys.weight_version,
                    epoch=self._keys.weight_version_epoch,
                    version=version,
                    allow_rollback=allow_rollback,
                ),
            )
        if not reply.moved:
            raise InvalidRequest(
                f"weight version {version} is older than the current one ({reply.current}); "
                "versions only move forward unless the trainer says it went back (restarted "
                "from an older checkpoint): SetWeightVersion with allow_rollback=true",
                code="weight_version_decreased",
            )
        previous = reply.previous
        if version < previous:
            log.warning("weight_version_rolled_back", version=version, previous=previous)
        return version

    async def stats(self) -> TrainerStats:
        """Counters from the stats hash, pending entries over all groups, the weight version."""
        async with asyncio.timeout(self._timeout_s):
            pipe = self._redis.pipeline(transaction=False)
            pipe.hgetall(self._keys.stats)
            pipe.get(self._keys.weight_version)
            counters, version = await pipe.execute()
            groups = await self._groups()
        fields = {text_of(k): _int(v) for k, v in counters.items()}
        return TrainerStats(
            # Maintained by the session code only if it can do so cheaply; else 0.
            open_episodes=fields.get(StatsFields.OPEN_EPISODES, 0),
            published=fields.get(StatsFields.PUBLISHED, 0),
            consumed=fields.get(StatsFields.CONSUMED, 0),
            pending=sum(_int(g.get("pending", 0)) for g in groups),
            weight_version=_int(version),
            empty_episodes=fields.get(StatsFields.EMPTY_EPISODES, 0),
            interactions=fields.get(StatsFields.INTERACTIONS, 0),
            joined=fields.get(StatsFields.JOINED, 0),
        )

    async def _groups(self) -> list[dict[str, Any]]:
        try:
            groups = await self._redis.xinfo_groups(self._keys.trajectories)
        except ResponseError as err:
            if "no such key" in str(err).lower():
                return []
            raise
        return [{text_of(k): v for k, v in group.items()} for group in groups]

    async def _own_pending(
        self, group: str, consumer: str, budget: _Budget
    ) -> AsyncIterator[StreamEntry]:
        cursor = "0-0"
        while not budget.done():
            entries, cursor = await self._read_pending(group, consumer, cursor, budget.batch())
            if cursor == "":
                return
            for entry in entries:
                budget.delivered()
                yield entry

    async def _read_pending(
        self, group: str, consumer: str, cursor: str, count: int
    ) -> tuple[list[StreamEntry], str]:
        async with asyncio.timeout(self._timeout_s):
            reply = await self._redis.xreadgroup(
                group, consumer, {self._keys.trajectories: cursor}, count=count
            )
        raw = _stream_items(reply)
        if not raw:
            return [], ""
        return await self._usable(group, raw), text_of(raw[-1][0])

    async def _read(
        self, group: str, consumer: str, cursor: str, count: int, block_ms: int
    ) -> list[StreamEntry]:
        async with asyncio.timeout(self._timeout_s + block_ms / 1000):
            reply = await self._redis.xreadgroup(
                group, consumer, {self._keys.trajectories: cursor}, count=count, block=block_ms
            )
        return await self._usable(group, _stream_items(reply))

    async def _reclaim(
        self, group: str, consumer: str, cursor: str, count: int
    ) -> tuple[list[StreamEntry], str]:
        """Claims entries left unacked for long (a dead consumer's); the next scan cursor."""
        async with asyncio.timeout(self._timeout_s):
            reply = await self._redis.xautoclaim(
                self._keys.trajectories,
                group,
                consumer,
                self._reclaim_idle_ms,
                start_id=cursor,
                count=count,
            )
        cursor, items = text_of(reply[0]), list(reply[1])
        entries = await self._usable(group, items)
        if entries:
            log.info("trajectories_reclaimed", group=group, consumer=consumer, count=len(entries))
        return entries, cursor

    async def _usable(self, group: str, items: Sequence[Any]) -> list[StreamEntry]:
        """Entries with their data; pending ids whose entry was trimmed away are acked."""
        entries: list[StreamEntry] = []
        gone: list[str] = []
        for stream_id, fields in items:
            if not fields:
                gone.append(text_of(stream_id))
                continue
            values = {text_of(k): v for k, v in fields.items()}
            entries.append(
                StreamEntry(
                    stream_id=text_of(stream_id),
                    trajectory_id=text_of(values.get("trajectory_id", b"")),
                    codec=text_of(values.get("codec", CODEC.encode())),
                    data=bytes(values.get("data", b"")),
                )
            )
        if gone:
            async with asyncio.timeout(self._timeout_s):
                await self._redis.xack(self._keys.trajectories, group, *gone)
            log.warning("trajectories_gone_from_stream", group=group, count=len(gone))
        return entries


class _Budget:
    """When a pull stops: a count, an idle time since the last delivery, or shutdown."""

    def __init__(
        self, *, max_count: int, idle_timeout_s: float, stopping: asyncio.Event | None
    ) -> None:
        self._left = max_count if max_count > 0 else None
        self._idle_s = idle_timeout_s if idle_timeout_s > 0 else None
        self._stopping = stopping
        self._last = time.monotonic()

    def delivered(self) -> None:
        if self._left is not None:
            self._left -= 1
        self._last = time.monotonic()

    def batch(self) -> int:
        return _READ_BATCH if self._left is None else max(1, min(_READ_BATCH, self._left))

    def idle_left_ms(self) -> int:
        if self._idle_s is None:
            return 1 << 30
        return max(1, int((self._idle_s - (time.monotonic() - self._last)) * 1000))

    def done(self) -> bool:
        if self._left is not None and self._left <= 0:
            return True
        if self._stopping is not None and self._stopping.is_set():
            return True
        return self._idle_s is not None and time.monotonic() - self._last >= self._idle_s


def _stream_items(reply: Any) -> list[Any]:
    """The (id, fields) pairs of a one-stream XREAD/XREADGROUP reply (RESP2 or RESP3)."""
    if not reply:
        return []
    if isinstance(reply, dict):
        return [item for items in reply.values() for item in (items[0] if items else [])]
    return [item for _name, items in reply for item in items]


def _int(value: Any) -> int:
    if value is None or value == b"" or value == "":
        return 0
    return int(float(value))
