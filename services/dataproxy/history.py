"""History for the console's charts: every `interval_s`, one replica writes a snapshot of the
counters to `P history` (a sorted set by time). Any replica then draws the same curves, and a
restart loses nothing: rates are differences between snapshots."""

from __future__ import annotations

import asyncio
import time
from types import TracebackType

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from services.dataproxy.overview import Counters, Overview
from services.dataproxy.redis_keys import RedisKeys
from services.dataproxy.scripts import WriteHistoryCall
from services.runtime.logs import get_logger
from services.runtime.redis_scripts import Script, as_bool
from services.runtime.tasks import cancel_and_wait

log = get_logger(__name__)

DEFAULT_INTERVAL_S = 10.0
# 24 hours of 10-second points is 8,640 snapshots of ~300 bytes.
KEEP_S = 24 * 3600.0


def snapshot(counters: Counters, now: float) -> dict[str, float]:
    """The counters a chart needs, at time `now`."""
    return {
        "t": round(now, 3),
        "published": counters.published,
        "consumed": counters.consumed,
        "interactions": counters.interactions,
        "joined": counters.joined,
        "output_tokens": counters.output_tokens,
        "exact_interactions": counters.exact_interactions,
        "length_mismatches": counters.length_mismatches,
        "reward_sum": round(counters.reward_sum, 6),
        "errors": counters.errors,
        "weight_version": counters.weight_version,
        "paused": 1 if counters.paused else 0,
        "in_flight": counters.in_flight,
        "open_episodes": counters.open_episodes,
        "backlog": sum(g.backlog for g in counters.groups),
        "pending": sum(g.pending for g in counters.groups),
    }


class HistorySampler:
    """`async with`: writes a snapshot every `interval_s` (if no replica has for that slot)."""

    def __init__(
        self,
        *,
        redis: aioredis.Redis,
        keys: RedisKeys,
        overview: Overview,
        interval_s: float = DEFAULT_INTERVAL_S,
    ) -> None:
        self._redis = redis
        self._keys = keys
        self._overview = overview
        self._interval_s = interval_s
        self._script = Script.load(WriteHistoryCall, as_bool)
        self._task: asyncio.Task[None] | None = None

    async def sample_once(self, now: float | None = None) -> bool:
        """Writes this interval's snapshot unless one exists; True if this call wrote it."""
        now = time.time() if now is None else now
        counters = await self._overview.counters()
        slot = int(now // self._interval_s)
        return await self._script.run(
            self._redis,
            WriteHistoryCall(
                history=self._keys.history,
                slot_key=self._keys.history_slot,
                slot=slot,
                now=now,
                snapshot=orjson.dumps(snapshot(counters, now)),
                keep_after=now - KEEP_S,
            ),
        )

    async def _run(self) -> None:
        while True:
            try:
                await self.sample_once()
            except (RedisError, TimeoutError, OSError) as err:
                log.warning("history_sample_failed", error=type(err).__name__)
            # Wake at the start of the next slot, so snapshots are evenly spaced.
            await asyncio.sleep(self._interval_s - time.time() % self._interval_s + 0.01)

    async def __aenter__(self) -> HistorySampler:
        self._task = asyncio.create_task(self._run(), name="history-sampler")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
