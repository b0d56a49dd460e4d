"""The worker registry and session affinities in Redis: every router key name and operation.

Nothing that matters for correctness lives in process memory, so routers can be replicated
against one Redis. Heartbeat stamps are wall-clock seconds because several routers share them;
a worker's session count is the size of its set of live affinities, stamped on Redis's clock
(the one that expires the affinities) and pruned of the expired ones whenever it is read.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack  # type: ignore[import-untyped]
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from services.router.placement import WorkerState, choose, is_live, keeps_affinity
from services.router.scripts import (
    ClaimAffinityCall,
    HeartbeatCall,
    RoutedSession,
    Snapshot,
    SnapshotCall,
)
from services.runtime.errors import InvalidRequest, Unavailable, state_store_unavailable
from services.runtime.logs import get_logger
from services.runtime.redis_scripts import Script, as_bool

log = get_logger(__name__)

# Two routers placing the same new session race at most once each; three rounds is plenty.
_PLACE_ATTEMPTS = 3


@dataclass(frozen=True, slots=True)
class RouterKeys:
    """Key names under one prefix (default `rg:`); see docs/internals.md."""

    prefix: str = "rg:"

    @property
    def workers(self) -> str:
        """Hash worker id → msgpack {address, models, registered_at}."""
        return f"{self.prefix}workers"

    @property
    def heartbeats(self) -> str:
        """Sorted set worker id → unix time of its last heartbeat."""
        return f"{self.prefix}workers:hb"

    @property
    def in_flight(self) -> str:
        """Hash worker id → in-flight turns at its last heartbeat."""
        return f"{self.prefix}workers:inflight"

    def worker_sessions(self, worker_id: str) -> str:
        """Sorted set of the worker's live affinities: `{session}:{model}` → last use (ms)."""
        return f"{self.prefix}workers:sessions:{worker_id}"

    @property
    def metrics_exporter(self) -> str:
        """String: which router replica exports the global metrics (a lease; docs/metrics.md)."""
        return f"{self.prefix}metrics:exporter:router"

    def affinity(self, session: str, model: str) -> str:
        """String holding the worker id of (session, model), expiring when unused."""
        return f"{self.prefix}aff:{session}:{model}"


class Registry:
    """Registers workers, records heartbeats and places sessions, all in Redis."""

    def __init__(
        self,
        redis: aioredis.Redis,
        *,
        keys: RouterKeys,
        lease_s: float,
        affinity_ttl_s: float,
        forget_after_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._redis = redis
        self._keys = keys
        self._lease_s = lease_s
        self._forget_after_s = forget_after_s
        self._affinity_ttl_ms = max(1, round(affinity_ttl_s * 1000))
        self._clock = clock
        self._heartbeat = Script.load(HeartbeatCall, as_bool)
        self._snapshot = Script.load(SnapshotCall, Snapshot.parse)
        self._claim = Script.load(ClaimAffinityCall, as_bool)

    async def register(
        self, *, worker_id: str, address: str, models: Sequence[str], timeout_s: float
    ) -> None:
        """Stores the worker (replacing an earlier registration) and counts as a heartbeat."""
        if not worker_id or not address:
            raise InvalidRequest("RegisterWorker needs a worker_id and an address (host:port)")
        now = self._clock()
        record = msgpack.packb({"address": address, "models": list(models), "registered_at": now})
        k = self._keys
        async with (
            _redis_deadline(timeout_s, "register"),
            self._redis.pipeline(transaction=True) as pipe,
        ):
            pipe.hset(k.workers, worker_id, record)
            pipe.zadd(k.heartbeats, {worker_id: now})
            # A worker that registers again keeps its sessions.
            pipe.hset(k.in_flight, worker_id, 0)
            await pipe.execute()
        log.info("worker_registered", worker_id=worker_id, address=address, models=list(models))

    async def heartbeat(self, *, worker_id: str, in_flight: int, timeout_s: float) -> bool:
        """Records a heartbeat; False when the worker is not registered (it must register)."""
        if not worker_id:
            raise InvalidRequest("Heartbeat needs a worker_id")
        k = self._keys
        async with _redis_deadline(timeout_s, "heartbeat"):
            known = await self._heartbeat.run(
                self._redis,
                HeartbeatCall(
                    workers=k.workers,
                    heartbeats=k.heartbeats,
                    in_flight=k.in_flight,
                    worker_id=worker_id,
                    now=f"{self._clock():.6f}",
                    in_flight_turns=max(0, in_flight),
                ),
            )
        if not known:
            log.info("heartbeat_from_unknown_worker", worker_id=worker_id)
        return known

    async def deregister(self, *, worker_id: str, timeout_s: float) -> bool:
        """Forgets the worker so it is chosen for nothing; True when it was registered."""
        k = self._keys
        async with (
            _redis_deadline(timeout_s, "deregister"),
            self._redis.pipeline(transaction=True) as pipe,
        ):
            pipe.hdel(k.workers, worker_id)
            pipe.zrem(k.heartbeats, worker_id)
            pipe.hdel(k.in_flight, worker_id)
            # Its sessions are placed afresh, and counted, wherever they go next.
            pipe.delete(k.worker_sessions(worker_id))
            removed, *_ = await pipe.execute()
        log.info("worker_deregistered", worker_id=worker_id, known=bool(removed))
        return bool(removed)

    async def list_workers(self, *, timeout_s: float) -> list[WorkerState]:
        """Every registered worker, live or not, ordered by worker id."""
        async with _redis_deadline(timeout_s, "list_workers"):
            snapshot = await self._read()
        return self._workers_from(snapshot)

    async def route(
        self, *, session: str, model: str, avoid_worker_id: str, timeout_s: float
    ) -> WorkerState:
        """The worker for (session, model): sticky while it is live, else placed afresh."""
        if not session:
            raise InvalidRequest("Route needs a session (the session key's digest)")
        affinity_key = self._keys.affinity(session, model)
        member = f"{session}:{model}"
        async with _redis_deadline(timeout_s, "route"):
            for _ in range(_PLACE_ATTEMPTS):
                snapshot = await self._read(
                    routed=RoutedSession(affinity=affinity_key), member=member
                )
                workers = self._workers_from(snapshot)
                current_id = snapshot.affinity
                current = next((w for w in workers if w.worker_id == current_id), None)
                if current is not None and keeps_affinity(
                    current, model=model, avoid_worker_id=avoid_worker_id
                ):
                    return current
                chosen = choose(workers, model=model, avoid_worker_id=avoid_worker_id)
                claimed = await self._claim.run(
                    self._redis,
                    ClaimAffinityCall(
                        affinity=affinity_key,
                        workers=self._keys.workers,
                        chosen_sessions=self._keys.worker_sessions(chosen.worker_id),
                        current_sessions=self._keys.worker_sessions(current_id),
                        current=current_id,
                        chosen=chosen.worker_id,
                        ttl_ms=self._affinity_ttl_ms,
                        member=member,
                    ),
                )
                if claimed:
                    log.info(
                        "session_placed",
                        session=session[:12],
                        model=model,
                        worker_id=chosen.worker_id,
                        previous_worker_id=current_id,
                    )
                    return chosen
        raise Unavailable(
            "the router could not settle where this session goes; retry",
            code="routing_contention",
            retry_after_s=0.1,
        )

    async def _read(self, *, routed: RoutedSession | None = None, member: str = "") -> Snapshot:
        """One snapshot script (with the affinity of `routed`), after forgetting the workers
        silent for longer than `forget_after_s`."""
        k = self._keys
        forget_before = self._clock() - self._forget_after_s
        snapshot = await self._snapshot.run(
            self._redis,
            SnapshotCall(
                workers=k.workers,
                heartbeats=k.heartbeats,
                in_flight=k.in_flight,
                sessions_prefix=k.worker_sessions(""),
                affinity_ttl_ms=self._affinity_ttl_ms,
                member=member,
                forget_before=f"{forget_before:.6f}",
                routed=[routed] if routed else [],
            ),
        )
        for worker_id in snapshot.forgotten:
            log.info(
                "worker_forgotten",
                worker_id=worker_id,
                silent_for_more_than_s=self._forget_after_s,
            )
        return snapshot

    def _workers_from(self, snapshot: Snapshot) -> list[WorkerState]:
        raw_workers, heartbeats, in_flight, sessions = (
            _pairs(reply)
            for reply in (
                snapshot.workers,
                snapshot.heartbeats,
                snapshot.in_flight,
                snapshot.sessions,
            )
        )
        last_seen = {wid.decode(): float(at) for wid, at in heartbeats.items()}
        load = {wid.decode(): int(n) for wid, n in in_flight.items()}
        assigned = {wid.decode(): int(n) for wid, n in sessions.items()}
        now = self._clock()
        workers = []
        for raw_id, raw_record in sorted(raw_workers.items()):
            worker_id = raw_id.decode()
            record = msgpack.unpackb(raw_record)
            seen_at = last_seen.get(worker_id)
            workers.append(
                WorkerState(
                    worker_id=worker_id,
                    address=str(record["address"]),
                    models=tuple(str(m) for m in record.get("models", ())),
                    live=is_live(seen_at, now=now, lease_s=self._lease_s),
                    in_flight=load.get(worker_id, 0),
                    sessions=max(0, assigned.get(worker_id, 0)),
                    last_heartbeat_age_s=-1.0 if seen_at is None else max(0.0, now - seen_at),
                )
            )
        return workers


def _pairs(flat: Sequence[Any]) -> dict[bytes, Any]:
    """A flat [field, value, …] script reply as a dict."""
    return dict(zip(flat[::2], flat[1::2], strict=True))


@contextlib.asynccontextmanager
async def _redis_deadline(timeout_s: float, op: str) -> AsyncIterator[None]:
    """Bounds Redis work by `timeout_s` and reports a failure as Unavailable."""
    try:
        async with asyncio.timeout(timeout_s):
            yield
    except (TimeoutError, RedisError) as err:
        log.warning("redis_failed", op=op, timeout_s=timeout_s, error=repr(err))
        raise state_store_unavailable() from err
