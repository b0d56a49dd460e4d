"""Trims the trajectories stream below what every consumer group has acked, periodically.

Redis 7.0 trims without looking at consumer groups (`XTRIM ... ACKED` needs 8.2), so one Lua
script computes, atomically, the smallest id any group still needs — its oldest pending entry,
or the entry after its last-delivered id when nothing is pending — and `XTRIM MINID`s below it.
With no consumer group at all nothing is trimmed (nobody has acked anything), unless the
stream is longer than `max_len_without_groups` (0: never). Several dataproxies may each run
a trimmer: the script is idempotent.
"""

from __future__ import annotations

import asyncio
from types import TracebackType

from redis.asyncio import Redis
from redis.exceptions import RedisError

from services.dataproxy.redis_keys import RedisKeys
from services.dataproxy.scripts import TrimResult, TrimStreamCall
from services.runtime.logs import get_logger
from services.runtime.redis_scripts import Script
from services.runtime.tasks import cancel_and_wait

log = get_logger(__name__)

DEFAULT_INTERVAL_S = 30.0


class StreamTrimmer:
    """`async with StreamTrimmer(...)`: trims the stream every `interval_s` until left."""

    def __init__(
        self,
        *,
        redis: Redis,
        keys: RedisKeys,
        interval_s: float = DEFAULT_INTERVAL_S,
        max_len_without_groups: int = 0,
        command_timeout_s: float = 5.0,
    ) -> None:
        self._redis = redis
        self._keys = keys
        self._interval_s = interval_s
        self._max_len = max(0, max_len_without_groups)
        self._timeout_s = command_timeout_s
        self._script = Script.load(TrimStreamCall, TrimResult.parse)
        self._task: asyncio.Task[None] | None = None
        # Passes run by `run()`, and how many of them failed (Redis unreachable, timeout).
        self.passes = 0
        self.failures = 0

    async def __aenter__(self) -> StreamTrimmer:
        self._task = asyncio.create_task(self.run(), name="stream-trimmer")
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

    async def run(self) -> None:
        """Trims now and then every `interval_s`; a Redis failure is logged and retried."""
        while True:
            self.passes += 1
            try:
                result = await self.trim_once()
            except (RedisError, TimeoutError) as err:
                self.failures += 1
                log.warning("stream_trim_failed", error=type(err).__name__, detail=str(err))
            else:
                if result.trimmed:
                    log.info(
                        "stream_trimmed",
                        trimmed=result.trimmed,
                        min_id=result.min_id,
                        mode=result.mode,
                    )
            await asyncio.sleep(self._interval_s)

    async def trim_once(self) -> TrimResult:
        """One atomic pass over the groups; what it removed."""
        async with asyncio.timeout(self._timeout_s):
            return await self._script.run(
                self._redis,
                TrimStreamCall(
                    stream=self._keys.trajectories, max_len_without_groups=self._max_len
                ),
            )
