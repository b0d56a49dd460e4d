"""Trainer control in Redis, shared by every replica: capacity, pause/resume, in-flight turns."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from services.dataproxy.redis_keys import CapacityFields, RedisKeys, StatsFields
from services.dataproxy.scripts import ReleaseTurnCall, Scripts
from services.runtime.errors import InvalidRequest, Unavailable
from services.runtime.logs import get_logger
from services.runtime.redis_pipeline import PipelinedScripts
from services.runtime.tasks import cancel_and_wait

log = get_logger(__name__)

PAUSED_MESSAGE = "submission paused for weight update"
# A turn's lease outlives its deadline by this much; a crashed replica's leases then expire.
LEASE_MARGIN_S = 5.0
# Polling backoff while waiting for a resume or for running turns to finish.
POLL_MIN_S = 0.02
POLL_MAX_S = 0.25
# Every call that leaves the process has a deadline.
COMMAND_TIMEOUT_S = 5.0
UNLIMITED = -1
# The weight-version view re-reads the key this often even when no message arrives (a
# message lost while the subscription reconnected is then late by at most this much).
VERSION_REREAD_S = 1.0
# After a failed subscription or read, wait this long before trying again.
VERSION_RETRY_S = 0.5


@dataclass(frozen=True, slots=True, kw_only=True)
class CapacityPolicy:
    """How many episodes may be open or published: AReaL's staleness bound, if configured."""

    max_head_offpolicyness: int | None = None
    batch_size: int = 1

    @property
    def bound_args(self) -> tuple[int, int]:
        """(offpolicyness, batch size) as the bind script takes them; -1: no bound."""
        ofp = -1 if self.max_head_offpolicyness is None else self.max_head_offpolicyness
        return ofp, self.batch_size


class PauseMetrics(Protocol):
    """Where pauses are counted (the dataproxy's metrics)."""

    def paused(self) -> None:
        """Submission was paused."""
        ...

    def resumed(self, paused_s: float) -> None:
        """Submission resumed after `paused_s` seconds."""
        ...


class Admitted(Protocol):
    """What a turn's start returns once admitted: at least the version it is stamped with."""

    @property
    def weight_version(self) -> int:
        """The weight version when the turn was admitted."""
        ...

    @property
    def idle_member(self) -> str:
        """The turn's episode as `P idle` and `P epturns` name it (`digest/episode`)."""
        ...


AdmittedT = TypeVar("AdmittedT", bound=Admitted)
# begin(token, lease deadline): the admitted turn, or None while submission is paused.
Begin = Callable[[str, float], Awaitable[AdmittedT | None]]


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnLease:
    """An admitted turn: its in-flight token, the weight version when it was admitted and its
    episode's `digest/episode` (whose running-turn count the release decrements)."""

    token: str
    weight_version: int
    member: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class PauseResult:
    """What PauseSubmission reports: whether running turns drained, and how many still run."""

    drained: bool
    in_flight: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ControlSnapshot:
    """The control half of GetStats."""

    capacity: int
    paused: bool
    in_flight: int
    join_rate: float


def capacity_left(
    policy: CapacityPolicy, *, open_episodes: int, published: int, version: int, grants: int | None
) -> int:
    """Episodes that may still start (UNLIMITED = -1), as the bind script computes it."""
    if policy.max_head_offpolicyness is None and grants is None:
        return UNLIMITED
    headroom = 0
    if policy.max_head_offpolicyness is not None:
        bound = (policy.max_head_offpolicyness + version + 1) * policy.batch_size
        headroom = max(0, bound - open_episodes - published)
    return headroom + (grants or 0)


class Control:
    """Pause, resume, admission of turns, grants and the control counters, all in Redis."""

    def __init__(
        self,
        *,
        redis: aioredis.Redis,
        keys: RedisKeys,
        scripts: Scripts,
        policy: CapacityPolicy,
        turn_timeout_s: float = 600.0,
        pause_wait_s: float = 30.0,
        pause_drain_timeout_s: float = 60.0,
        metrics: PauseMetrics | None = None,
        pipelined: PipelinedScripts | None = None,
    ) -> None:
        self._metrics = metrics
        self._redis = redis
        # A turn's release runs on the ledger's pipelined connection when there is one.
        self._turn_scripts = pipelined or redis
        self._keys = keys
        self._scripts = scripts
        self._policy = policy
        self._lease_s = turn_timeout_s + LEASE_MARGIN_S
        self._pause_wait_s = pause_wait_s
        self._pause_drain_timeout_s = pause_drain_timeout_s

    @property
    def policy(self) -> CapacityPolicy:
        """The capacity policy: rollgate's own staleness bound, if one is configured."""
        return self._policy

    # -- turns -------------------------------------------------------------------------

    async def admit(self, begin: Begin[AdmittedT]) -> tuple[AdmittedT, TurnLease]:
        """Runs `begin` (which resolves the turn's episode and registers its in-flight lease
        in one script) until submission is not paused: waits up to pause_wait_s, then 503."""
        token, _ = self.new_lease()
        deadline = time.monotonic() + self._pause_wait_s
        delay = POLL_MIN_S
        while True:
            admitted = await begin(token, time.time() + self._lease_s)
            if admitted is not None:
                lease = TurnLease(
                    token=token,
                    weight_version=admitted.weight_version,
                    member=admitted.idle_member,
                )
                return admitted, lease
            left = deadline - time.monotonic()
            if left <= 0:
                raise Unavailable(
                    PAUSED_MESSAGE, code="submission_paused", retry_after_s=self._pause_wait_s
                )
            await asyncio.sleep(min(delay, left))
            delay = min(delay * 2, POLL_MAX_S)

    def new_lease(self) -> tuple[str, float]:
        """A new turn's in-flight token and the lease's deadline if it is taken now."""
        return secrets.token_hex(12), time.time() + self._lease_s

    async def release(self, lease: TurnLease) -> None:
        """The turn finished (recorded or not): it no longer counts as in flight, nor among its
        episode's running turns (once: a lease its append already released is not counted)."""
        async with asyncio.timeout(COMMAND_TIMEOUT_S):
            await self._scripts.release_turn.run(
                self._turn_scripts,
                ReleaseTurnCall(
                    in_flight=self._keys.in_flight,
                    episode_turns=self._keys.episode_turns,
                    token=lease.token,
                    member=lease.member,
                ),
            )

    async def in_flight(self) -> int:
        """Turns running over all replicas (expired leases of dead replicas not counted)."""
        async with asyncio.timeout(COMMAND_TIMEOUT_S):
            return int(await self._redis.zcount(self._keys.in_flight, f"({time.time()!r}", "+inf"))

    async def weight_version(self) -> int:
        """The current weight version."""
        async with asyncio.timeout(COMMAND_TIMEOUT_S):
            return int(await self._redis.get(self._keys.weight_version) or 0)

    # -- pause / resume ----------------------------------------------------------------

    async def pause(self, timeout_s: float = 0.0) -> PauseResult:
        """Pauses new turns, then waits for running ones (timeout 0: the configured default)."""
        wait_s = timeout_s if timeout_s > 0 else self._pause_drain_timeout_s
        async with asyncio.timeout(COMMAND_TIMEOUT_S):
            await self._redis.set(self._keys.paused, repr(time.time()))
        log.info("submission_paused", timeout_s=wait_s)
        if self._metrics is not None:
            self._metrics.paused()
        deadline = time.monotonic() + wait_s
        delay = POLL_MIN_S
        while (running := await self.in_flight()) > 0:
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning("pause_timed_out", in_flight=running)
                return PauseResult(drained=False, in_flight=running)
            await asyncio.sleep(min(delay, left))
            delay = min(delay * 2, POLL_MAX_S)
        return PauseResult(drained=True, in_flight=0)

    async def resume(self) -> None:
        """Releases waiting turns (they poll the flag)."""
        async with asyncio.timeout(COMMAND_TIMEOUT_S):
            since = await self._redis.getdel(self._keys.paused)
        log.info("submission_resumed")
        if self._metrics is not None and since is not None:
            self._metrics.resumed(max(0.0, time.time() - float(since)))

    # -- capacity ----------------------------------------------------------------------

    async def grant(self, episodes: int) -> int:
        """Adds `episodes` to the capacity (capacity is finite from then on); what is left."""
        if episodes < 0:
            raise InvalidRequest(f"cannot grant {episodes} episodes", code="invalid_grant")
        async with asyncio.timeout(COMMAND_TIMEOUT_S):
            await self._redis.hincrby(self._keys.capacity, CapacityFields.GRANTS, episodes)
        log.info("capacity_granted", episodes=episodes)
        return (await self.snapshot()).capacity

    async def snapshot(self) -> ControlSnapshot:
        """Capacity left, paused, turns in flight and the share of joined interactions."""
        async with asyncio.timeout(COMMAND_TIMEOUT_S):
            pipe = self._redis.pipeline(transaction=False)
            pipe.hmget(
                self._keys.stats,
                StatsFields.OPEN_EPISODES,
                StatsFields.PUBLISHED,
                StatsFields.INTERACTIONS,
                StatsFields.JOINED,
            )
            pipe.get(self._keys.weight_version)
            pipe.hget(self._keys.capacity, CapacityFields.GRANTS)
            pipe.exists(self._keys.paused)
            pipe.zcount(self._keys.in_flight, f"({time.time()!r}", "+inf")
            (
                (open_, published, interactions, joined),
                version,
                grants,
                paused,
                running,
            ) = await pipe.execute()
        capacity = capacity_left(
            self._policy,
            open_episodes=int(open_ or 0),
            published=int(published or 0),
            version=int(version or 0),
            grants=None if grants is None else int(grants),
        )
        # Each episode's first interaction cannot have a parent (docs/trajectory-schema.md).
        could_join = int(interactions or 0) - int(published or 0)
        return ControlSnapshot(
            capacity=capacity,
            paused=bool(paused),
            in_flight=int(running),
            join_rate=int(joined or 0) / could_join if could_join > 0 else 0.0,
        )


class WeightVersionView:
    """This process's view of `P weight_version`, following every replica's SetWeightVersion.

    Streamed turns stamp each chunk's tokens with `current`, so reading it must cost nothing
    per chunk. SetWeightVersion publishes the new version on the channel named like the key
    (pub/sub channels and keys are separate namespaces) in the same script that sets it; one
    background task per process subscribes, so a change reaches every replica within a
    round trip instead of a poll interval (a 50 ms poll would mis-stamp up to 50 ms of tokens
    and cost 20 reads a second per replica). Pub/sub is fire-and-forget, so the task also
    re-reads the key every `reread_s` and after each (re)subscription: a message missed while
    reconnecting is caught within a second. Versions move forward except when a trainer rolls
    back on purpose (SetWeightVersion's allow_rollback), which bumps `P weight_version_epoch`:
    the view keeps the highest (epoch, version) it has seen, so an old reply can never move it
    back and a rollback always does.
    """

    def __init__(
        self,
        *,
        redis: aioredis.Redis,
        keys: RedisKeys,
        reread_s: float = VERSION_REREAD_S,
        retry_s: float = VERSION_RETRY_S,
    ) -> None:
        self._redis = redis
        self._key = keys.weight_version
        self._epoch_key = keys.weight_version_epoch
        self._epoch = 0
        self._reread_s = reread_s
        self._retry_s = retry_s
        self._current = 0
        self._task: asyncio.Task[None] | None = None
        self._listeners: set[Callable[[int], None]] = set()

    @property
    def current(self) -> int:
        """The highest weight version seen (no I/O)."""
        return self._current

    def advance(self, version: int, epoch: int | None = None) -> None:
        """Moves the view to `version` (of rollback `epoch`, default: the view's) unless it
        already holds a later one: a higher epoch, or the same epoch and a higher version."""
        epoch = self._epoch if epoch is None else epoch
        if (epoch, version) > (self._epoch, self._current):
            moved = version != self._current
            log.info("weight_version_seen", version=version, previous=self._current, epoch=epoch)
            self._epoch, self._current = epoch, version
            if moved:
                for listener in list(self._listeners):
                    listener(version)

    def listen(self, listener: Callable[[int], None]) -> Callable[[], None]:
        """Calls `listener(version)` on every move (no I/O in it); returns the unsubscribe."""
        self._listeners.add(listener)
        return lambda: self._listeners.discard(listener)

    async def __aenter__(self) -> WeightVersionView:
        await self._reread()
        self._task = asyncio.create_task(self._follow(), name="weight-version-view")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None

    async def _reread(self) -> None:
        async with asyncio.timeout(COMMAND_TIMEOUT_S):
            raw, epoch = await self._redis.mget(self._key, self._epoch_key)
        self.advance(int(raw or 0), int(epoch or 0))

    async def _follow(self) -> None:
        while True:
            try:
                await self._subscribed()
            except (RedisError, OSError, TimeoutError, ValueError) as err:
                log.warning("weight_version_view_retry", error=f"{type(err).__name__}: {err}")
                await asyncio.sleep(self._retry_s)

    async def _subscribed(self) -> None:
        async with self._redis.pubsub(ignore_subscribe_messages=True) as pubsub:
            async with asyncio.timeout(COMMAND_TIMEOUT_S):
                await pubsub.subscribe(self._key)
            # Anything set before the subscription took effect is read here.
            await self._reread()
            next_read = time.monotonic() + self._reread_s
            while True:
                left = max(0.0, next_read - time.monotonic())
                async with asyncio.timeout(left + COMMAND_TIMEOUT_S):
                    message = await pubsub.get_message(timeout=left)
                if message is not None and message.get("type") == "message":
                    self.advance(*_version_message(message["data"]))
                if time.monotonic() >= next_read:
                    await self._reread()
                    next_read = time.monotonic() + self._reread_s


def _version_message(data: bytes | str) -> tuple[int, int | None]:
    """`<epoch>:<version>` as SetWeightVersion publishes it (a bare version: the view's epoch)."""
    text = data.decode() if isinstance(data, bytes) else str(data)
    epoch, _, version = text.rpartition(":")
    return int(version), (int(epoch) if epoch else None)
