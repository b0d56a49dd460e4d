"""The router's Lua scripts (`lua/*.lua`), one typed wrapper each: a call dataclass in (its KEYS
and ARGV by name, in the script's order), a parsed reply out (services/runtime/redis_scripts.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from services.runtime.redis_scripts import EACH, KEY, ScriptCall, text_of


@dataclass(frozen=True, slots=True, kw_only=True)
class HeartbeatCall(ScriptCall):
    """heartbeat.lua: 1 when the worker is registered and its heartbeat recorded, else 0."""

    SCRIPT = "heartbeat"
    workers: str = field(metadata=KEY)
    heartbeats: str = field(metadata=KEY)
    in_flight: str = field(metadata=KEY)
    worker_id: str
    now: str  # unix seconds, 6 decimals
    in_flight_turns: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RoutedSession(ScriptCall):
    """The affinity snapshot.lua reads and refreshes (Route only)."""

    affinity: str = field(metadata=KEY)


@dataclass(frozen=True, slots=True, kw_only=True)
class SnapshotCall(ScriptCall):
    """snapshot.lua: forgets silent workers, then reads the registry (and the affinity)."""

    SCRIPT = "snapshot"
    workers: str = field(metadata=KEY)
    heartbeats: str = field(metadata=KEY)
    in_flight: str = field(metadata=KEY)
    sessions_prefix: str  # a worker's session set is this followed by its id
    affinity_ttl_ms: int
    member: str  # `{session}:{model}` ('' outside Route)
    forget_before: str  # unix seconds, 6 decimals
    routed: Sequence[RoutedSession] = field(metadata=EACH)  # none or one


@dataclass(frozen=True, slots=True, kw_only=True)
class Snapshot:
    """snapshot.lua's reply: the affinity's worker id ("" when none), flat [field, value, …]
    lists of the workers hash, the heartbeats, the in-flight counts and the session counts,
    and the ids of the workers it forgot."""

    affinity: str
    workers: Sequence[Any]
    heartbeats: Sequence[Any]
    in_flight: Sequence[Any]
    sessions: Sequence[Any]
    forgotten: list[str]

    @classmethod
    def parse(cls, reply: list[Any]) -> Snapshot:
        """From `{affinity, workers, heartbeats, in_flight, sessions, forgotten}`."""
        affinity, workers, heartbeats, in_flight, sessions, forgotten = reply
        return cls(
            affinity=text_of(affinity),
            workers=workers,
            heartbeats=heartbeats,
            in_flight=in_flight,
            sessions=sessions,
            forgotten=[text_of(raw) for raw in forgotten],
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ClaimAffinityCall(ScriptCall):
    """claim_affinity.lua: compare-and-set of a session's affinity; 1 when set."""

    SCRIPT = "claim_affinity"
    affinity: str = field(metadata=KEY)
    workers: str = field(metadata=KEY)
    chosen_sessions: str = field(metadata=KEY)
    current_sessions: str = field(metadata=KEY)
    current: str  # the worker id this router read ("" for none)
    chosen: str
    ttl_ms: int
    member: str
