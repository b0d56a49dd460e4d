"""What the session store works with: key and episode states, the lifecycle policy, the
messages callers see, and reading a key's state from Redis (`KeyLookup`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import redis.asyncio as aioredis

from services.dataproxy.control import CapacityPolicy
from services.dataproxy.redis_keys import (
    EpisodeFields,
    EpisodeStatus,
    KeyFields,
    KeyStatus,
    RedisKeys,
    SessionFields,
)
from services.dataproxy.revocation import SessionKeyRevoker
from services.dataproxy.scripts import Scripts
from services.runtime.errors import (
    Conflict,
    InvalidRequest,
    NotFound,
)
from services.runtime.logs import get_logger
from services.runtime.redis_scripts import text_of
from services.runtime.secret import Keys

log = get_logger(__name__)

DEFAULT_TASK_ID = "default"
# A publication re-reads the episode when a turn lands between its read and its script.
MAX_PUBLISH_ATTEMPTS = 5

NO_ACTIVE_EPISODE = "no active episode on this key; start one with /rl/start_session"
BETWEEN_EPISODES = (
    "no active episode on this key: the last one ended or is being refreshed; "
    "call /rl/start_session with this key to start the next one"
)
EPISODE_ENDED = "the episode ended while this turn was running; the turn was not recorded"
NO_CAPACITY = (
    "no capacity for a new episode after waiting {waited:.0f} s: the trainer has not caught "
    "up (open and published episodes reached its staleness bound or grants). {what}"
)
HELD = EpisodeStatus.HELD
# Key modes: one episode at a time started by start_session, or many named by X-Session-Id.
KEY_MODE = "key"
HEADER_MODE = "header"
MAX_SESSION_ID_LEN = 256
NEEDS_SESSION = (
    "this key is a header-mode key: send X-Session-Id (or `session_id` in the body) to name "
    "the episode"
)
HEADER_KEY_NO_START = (
    "this is a header-mode key: its episodes start with the first call that names a new "
    "X-Session-Id, not with /rl/start_session"
)
# end_session on an idle key returns the key's last publication when it ended this recently
# (a retry whose first reply was lost); older ones answer 409.
END_RETRY_WINDOW_S = 300.0
# record_turn re-encodes a turn whose weight version moved while it was being appended.
MAX_RECORD_ATTEMPTS = 5
MAX_GROUP_SIZE = 1024
# A refresh marker lives this long unless its holder keeps it alive (a dead holder's expires).
MARKER_TTL_S = 10.0
# Capacity polling backoff while a start or refresh waits.
CAPACITY_POLL_MIN_S = 0.02
CAPACITY_POLL_MAX_S = 0.5


@dataclass(frozen=True, slots=True, kw_only=True)
class EpisodePolicy:
    """The lifecycle settings the store applies (docs/lifecycle.md)."""

    refresh_timeout_s: float = 120.0
    capacity: CapacityPolicy = field(default_factory=CapacityPolicy)
    session_idle_timeout_s: float = 3600.0
    # > 0: hold an ended episode whose last interaction has no reward this long.
    late_reward_timeout_s: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class KeyState:
    """What the key hash says: the key's id, whether an episode is active, and which."""

    digest: str
    key_id: str
    active: bool
    episode: str
    epoch: int
    task_id: str = ""
    # The latest ended episode of this key still held for a late reward ("" when none).
    held: str = ""
    # KEY_MODE, or HEADER_MODE (then `episode` is one session's episode, `session_id` its name).
    mode: str = KEY_MODE
    session_id: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class ActiveEpisode:
    """The key's current episode as a turn sees it when it starts."""

    digest: str
    key_id: str
    episode: str
    epoch: int
    weight_version: int
    mode: str = KEY_MODE
    # Header mode: the X-Session-Id that names the episode.
    client_session_id: str = ""
    # The in-flight lease the turn holds ("" when none); the append releases it.
    lease_token: str = ""

    @property
    def session_id(self) -> str:
        """The X-Session-Id in header mode; with per-episode keys the episode name."""
        return self.client_session_id or self.episode

    @property
    def idle_member(self) -> str:
        """The episode as `P idle` and `P epturns` name it: `digest/episode`."""
        return f"{self.digest}/{self.episode}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Publication:
    """How an episode ended: published (with its stream entry), empty, or held for a reward."""

    status: str
    session_id: str
    trajectory_id: str
    stream_id: str
    interaction_count: int


@dataclass(frozen=True, slots=True, kw_only=True)
class StartedSession:
    """The answer to start_session."""

    session_id: str
    api_key: str
    refreshed: bool
    ended_trajectory_id: str
    group_id: str = ""
    members: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class IssuedKey:
    """A long-lived key issued by the admin (`POST /rl/keys`)."""

    api_key: str
    key_id: str
    mode: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Member:
    """One episode a bind creates: its key's digest, its task, its names."""

    digest: str
    task_id: str
    session_id: str
    trajectory_id: str
    # The episode's name when it differs from session_id (header mode).
    episode: str = ""

    @property
    def name(self) -> str:
        """The episode name (`ep:{key_id}:{name}`)."""
        return self.episode or self.session_id


@dataclass(frozen=True, slots=True, kw_only=True)
class History:
    """The completed interactions of the key's current episode, as JSON."""

    session_id: str
    entries: list[tuple[str, bytes]]


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreContext:
    """What every part of the session store shares: Redis, its key names and scripts, the
    lifecycle policy and the settings bindings need."""

    redis: aioredis.Redis
    keys: RedisKeys
    scripts: Scripts
    admin_key: Keys
    refresh_lock_s: float
    policy: EpisodePolicy
    revoker: SessionKeyRevoker


class StorePart:
    """A part of the session store over the shared context."""

    def __init__(self, ctx: StoreContext) -> None:
        self._ctx = ctx
        self._redis = ctx.redis
        self._keys = ctx.keys
        self._scripts = ctx.scripts
        self._admin_key = ctx.admin_key
        self._refresh_lock_s = ctx.refresh_lock_s
        self._policy = ctx.policy
        self._revoker = ctx.revoker


class KeyLookup(StorePart):
    """A key's state, its sessions' episodes (header mode), read from Redis."""

    async def resolve(self, digest: str) -> KeyState:
        """The key's state; unknown keys are Unauthenticated."""
        key = await self.read_key(digest)
        if key is None:
            raise await self._revoker.refusal(digest)
        return key

    async def require_active(self, digest: str) -> KeyState:
        key = await self.resolve(digest)
        if not key.active:
            raise Conflict(NO_ACTIVE_EPISODE)
        return key

    async def read_key(self, digest: str) -> KeyState | None:
        fields: list[Any] = await self._redis.hmget(
            self._keys.key(digest),
            KeyFields.KEY_ID,
            KeyFields.STATE,
            KeyFields.EPISODE,
            KeyFields.EPOCH,
            KeyFields.TASK_ID,
            KeyFields.HELD,
            KeyFields.MODE,
        )
        key_id, state, episode, epoch, task_id, held, mode = fields
        if key_id is None:
            return None
        return KeyState(
            digest=digest,
            key_id=key_id.decode(),
            active=text_of(state) == KeyStatus.ACTIVE,
            episode=text_of(episode),
            epoch=int(epoch or 0),
            task_id=text_of(task_id),
            held=text_of(held),
            mode=text_of(mode) or KEY_MODE,
        )

    async def session_episode(self, key: KeyState, session_id: str) -> KeyState:
        """The session's active episode (active=True), else its last one; 404 when none."""
        fields: list[Any] = await self._redis.hmget(
            self._keys.session(key.key_id, session_id),
            SessionFields.EPISODE,
            SessionFields.EPOCH,
            SessionFields.LAST,
        )
        current, epoch, last = fields
        episode, active = text_of(current), bool(current)
        if not episode:
            episode = text_of(last)
            if not episode:
                raise NotFound(f"session {session_id} not found for this key")
            epoch = await self._redis.hget(
                self._keys.episode(key.key_id, episode), EpisodeFields.EPOCH
            )
        return replace(
            key, active=active, episode=episode, epoch=int(epoch or 0), session_id=session_id
        )

    async def header_episode(self, key: KeyState, episode: str) -> KeyState | None:
        """A header-mode key's episode as a KeyState (active as its hash says); None: gone."""
        fields: list[Any] = await self._redis.hmget(
            self._keys.episode(key.key_id, episode),
            EpisodeFields.STATE,
            EpisodeFields.EPOCH,
            EpisodeFields.SESSION_ID,
        )
        state, epoch, session_id = fields
        if state is None:
            return None
        return replace(
            key,
            active=text_of(state) == EpisodeStatus.ACTIVE,
            episode=episode,
            epoch=int(epoch or 0),
            session_id=text_of(session_id),
        )


def session_name(session_id: str) -> str:
    """A header-mode session id as given, or InvalidRequest saying what is wrong with it."""
    name = session_id.strip()
    if not name:
        raise InvalidRequest(NEEDS_SESSION, code="session_id_required")
    if len(name) > MAX_SESSION_ID_LEN or not name.isprintable():
        raise InvalidRequest(
            f"X-Session-Id must be printable and at most {MAX_SESSION_ID_LEN} characters",
            code="invalid_session_id",
        )
    return name


def held_state(key: KeyState, episode: str, epoch: int) -> KeyState:
    """The key's ended `episode` (held for a late reward) as a KeyState."""
    return KeyState(
        digest=key.digest, key_id=key.key_id, active=False, episode=episode, epoch=epoch
    )
