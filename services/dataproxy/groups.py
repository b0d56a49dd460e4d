"""Episode groups on the trainer side: tag pulled trajectories, hold groups until complete.

A group's members are published one by one; the publish script counts each member that ends
(`done` in `P group:{id}`, published or empty) and records the group of each published one
(`P trajgroup:{trajectory_id}`). An empty member counts as done and is never delivered.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import redis.asyncio as aioredis

from services.dataproxy.redis_keys import GroupFields, RedisKeys, TrajectoryGroupFields
from services.dataproxy.trajectory_stream import StreamEntry

# While members of an incomplete group wait, the group is checked again this often.
RECHECK_S = 0.25
COMMAND_TIMEOUT_S = 5.0
_QUEUE_SIZE = 64


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupTag:
    """The group a trajectory belongs to."""

    group_id: str
    group_size: int


class GroupDirectory:
    """Which group a trajectory belongs to, and whether every member of a group has ended."""

    def __init__(self, *, redis: aioredis.Redis, keys: RedisKeys) -> None:
        self._redis = redis
        self._keys = keys

    async def tag(self, trajectory_id: str) -> GroupTag | None:
        """The trajectory's group, or None when it has none."""
        async with asyncio.timeout(COMMAND_TIMEOUT_S):
            group_id, size = await self._redis.hmget(
                self._keys.trajectory_group(trajectory_id),
                TrajectoryGroupFields.GROUP_ID,
                TrajectoryGroupFields.GROUP_SIZE,
            )
        if not group_id:
            return None
        text = group_id.decode() if isinstance(group_id, bytes) else str(group_id)
        return GroupTag(group_id=text, group_size=int(size or 0))

    async def complete(self, group_id: str) -> bool:
        """True once every member has ended (a group record that expired counts as complete)."""
        async with asyncio.timeout(COMMAND_TIMEOUT_S):
            size, done = await self._redis.hmget(
                self._keys.group(group_id), GroupFields.SIZE, GroupFields.DONE
            )
        return size is None or int(done or 0) >= int(size)


async def tagged(
    source: AsyncIterator[StreamEntry], directory: GroupDirectory
) -> AsyncIterator[tuple[StreamEntry, GroupTag | None]]:
    """Every entry with its group, in stream order."""
    async for entry in source:
        yield entry, await directory.tag(entry.trajectory_id)


async def complete_groups(
    source: AsyncIterator[StreamEntry], directory: GroupDirectory, *, max_count: int = 0
) -> AsyncIterator[tuple[StreamEntry, GroupTag | None]]:
    """Entries without a group at once; a group's members only once all have ended.

    Never splits a group: with `max_count` it stops after the group that reaches the count.
    Members held back when the pull ends stay pending for this consumer (read again first on
    its next pull).
    """
    queue: asyncio.Queue[StreamEntry | BaseException | None] = asyncio.Queue(_QUEUE_SIZE)

    async def produce() -> None:
        try:
            async for entry in source:
                await queue.put(entry)
        except Exception as err:
            await queue.put(err)
            return
        await queue.put(None)

    producer = asyncio.create_task(produce())
    waiting: dict[str, list[tuple[StreamEntry, GroupTag]]] = {}
    delivered = 0
    try:
        while not (max_count and delivered >= max_count):
            item: StreamEntry | BaseException | object | None
            try:
                item = await asyncio.wait_for(queue.get(), timeout=RECHECK_S)
            except TimeoutError:
                item = _TICK
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, StreamEntry):
                tag = await directory.tag(item.trajectory_id)
                if tag is None:
                    delivered += 1
                    yield item, None
                    continue
                waiting.setdefault(tag.group_id, []).append((item, tag))
            for group_id in list(waiting):
                if await directory.complete(group_id):
                    for entry, entry_tag in waiting.pop(group_id):
                        delivered += 1
                        yield entry, entry_tag
            if item is None:
                return
    finally:
        producer.cancel()
        with contextlib.suppress(BaseException):
            await producer
        aclose = getattr(source, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()


_TICK = object()
