"""The reaper: ends idle episodes and releases held ones whose late reward never came.

Every replica runs one. Deadlines live in two Redis sorted sets (`P idle`, `P awaiting_reward`);
a claim script pushes each due member ahead atomically, so replicas do not end the same
episode twice at once, and ending goes through the same idempotent publish transition.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from redis.exceptions import RedisError

from services.dataproxy.sessions import Publication, SessionStore
from services.runtime.errors import RollgateError
from services.runtime.logs import get_logger

log = get_logger(__name__)

_Ender = Callable[[str], Awaitable[Publication | None]]

# A claimed member comes due again after this long if its claimer died before ending it.
CLAIM_LEASE_S = 60.0
CLAIM_BATCH = 100
COMMAND_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True, kw_only=True)
class SweepResult:
    """What one sweep ended."""

    idle: list[Publication]
    released: list[Publication]


class Reaper:
    """Sweeps the deadline sets every `interval_s` until stopped."""

    def __init__(self, *, store: SessionStore, interval_s: float = 1.0) -> None:
        self._store = store
        self._interval_s = interval_s

    async def run(self, stopping: asyncio.Event) -> None:
        """Sweeps until `stopping` is set; a failed sweep is logged and retried next time."""
        while not stopping.is_set():
            try:
                await self.sweep()
            except (RedisError, TimeoutError, RollgateError) as err:
                log.warning("reaper_sweep_failed", error=type(err).__name__, detail=str(err))
            except Exception:
                log.exception("reaper_sweep_crashed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), timeout=self._interval_s)

    async def sweep(self) -> SweepResult:
        """Ends every due idle episode and releases every due held one, once."""
        idle = [
            ended
            for member in await self._claim(held=False)
            if (ended := await self._end(self._store.reap_idle, member)) is not None
        ]
        released = [
            ended
            for member in await self._claim(held=True)
            if (ended := await self._end(self._store.release_held, member)) is not None
        ]
        return SweepResult(idle=idle, released=released)

    async def _claim(self, *, held: bool) -> list[str]:
        async with asyncio.timeout(COMMAND_TIMEOUT_S):
            return await self._store.claim_due(held=held, lease_s=CLAIM_LEASE_S, limit=CLAIM_BATCH)

    async def _end(self, end: _Ender, member: str) -> Publication | None:
        try:
            async with asyncio.timeout(COMMAND_TIMEOUT_S):
                return await end(member)
        except RollgateError as err:
            # Superseded meanwhile (a refresh or end won): nothing to do; the claim expires.
            log.info("reaper_skipped", member=member, reason=err.message)
            return None
