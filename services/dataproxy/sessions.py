"""The session store: start, refresh, end, resolve, reward and publish episodes in Redis.

Every transition is one Lua script that checks the key's state and epoch (docs/internals.md),
so a late turn never lands in the next episode and a retried publication never adds a second
stream entry.
"""

from __future__ import annotations

import math
import secrets
import time
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from services.dataproxy.redis_keys import ENDED_EPISODE_TTL_S, RedisKeys
from services.dataproxy.scripts import Scripts
from services.dataproxy.trajectory import (
    CODEC,
    EpisodeInfo,
    build_trajectory,
    encode_trajectory,
)
from services.dataproxy.turns import decode_turn, history_entry
from services.runtime.errors import (
    Conflict,
    InternalError,
    InvalidRequest,
    NotFound,
    TooManyRequests,
    Unauthenticated,
    Unavailable,
)
from services.runtime.keys import constant_time_equals, key_digest, key_id_of, new_session_key
from services.runtime.logs import get_logger

log = get_logger(__name__)

DEFAULT_TASK_ID = "default"
# A publication re-reads the episode when a turn lands between its read and its script.
MAX_PUBLISH_ATTEMPTS = 5

NO_ACTIVE_EPISODE = "no active episode on this key; start one with /rl/start_session"
UNKNOWN_KEY = "unknown session key: use the sk-sess-… key returned by /rl/start_session"
BETWEEN_EPISODES = (
    "no active episode on this key: the last one ended or is being refreshed; "
    "call /rl/start_session with this key to start the next one"
)
EPISODE_ENDED = "the episode ended while this turn was running; the turn was not recorded"


@dataclass(frozen=True, slots=True, kw_only=True)
class KeyState:
    """What the key hash says: the key's id, whether an episode is active, and which."""

    digest: str
    key_id: str
    active: bool
    episode: str
    epoch: int
    task_id: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class ActiveEpisode:
    """The key's current episode as a turn sees it when it starts."""

    digest: str
    key_id: str
    episode: str
    epoch: int
    weight_version: int

    @property
    def session_id(self) -> str:
        """With per-episode keys the episode name is the session id."""
        return self.episode


@dataclass(frozen=True, slots=True, kw_only=True)
class Publication:
    """How an episode ended: published (with its stream entry) or empty (not published)."""

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


@dataclass(frozen=True, slots=True, kw_only=True)
class History:
    """The completed interactions of the key's current episode, as JSON."""

    session_id: str
    entries: list[tuple[str, bytes]]


def _text(value: bytes | None) -> str:
    return value.decode() if value else ""


class SessionStore:
    """Sessions, episodes and their turns in Redis, under one key prefix."""

    def __init__(
        self,
        *,
        redis: aioredis.Redis,
        keys: RedisKeys,
        scripts: Scripts,
        admin_key: str,
        refresh_lock_s: float,
    ) -> None:
        self._redis = redis
        self._keys = keys
        self._scripts = scripts
        self._admin_key = admin_key
        self._refresh_lock_s = refresh_lock_s

    # -- start / refresh ---------------------------------------------------------------

    async def start(self, *, task_id: str, api_key: str) -> StartedSession:
        """A new key with its first episode, or a refresh when `api_key` is a known key."""
        task_id = task_id.strip()
        if api_key and self._admin_key and constant_time_equals(api_key, self._admin_key):
            raise InvalidRequest("the admin key cannot be used as a session key")
        if api_key:
            digest = key_digest(api_key)
            if await self._redis.exists(self._keys.key(digest)):
                return await self._refresh(api_key, digest, task_id)
            # AReaL behaviour: a key never issued here is not honoured; mint a new one.
            log.info("unknown_key_replaced", task_id=task_id)
        return await self._start_new(task_id or DEFAULT_TASK_ID)

    async def _start_new(self, task_id: str) -> StartedSession:
        api_key = new_session_key()
        digest = key_digest(api_key)
        session_id = await self._bind(digest, task_id, mode="new")
        log.info("session_started", session_id=session_id, key_id=key_id_of(digest))
        return StartedSession(
            session_id=session_id, api_key=api_key, refreshed=False, ended_trajectory_id=""
        )

    async def _refresh(self, api_key: str, digest: str, task_id: str) -> StartedSession:
        """Ends the key's active episode (if any) and binds the next; no task_id: the key's."""
        marker = self._keys.refreshing(digest)
        token = secrets.token_hex(8)
        lock_s = max(1, math.ceil(self._refresh_lock_s))
        if not await self._redis.set(marker, token, nx=True, ex=lock_s):
            raise TooManyRequests("a refresh of this key is already in progress", retry_after_s=1.0)
        try:
            key = await self._read_key(digest)
            ended: Publication | None = None
            if key is not None and key.active:
                ended = await self.publish(key, end_reason="refresh")
            task_id = task_id or (key.task_id if key else "") or DEFAULT_TASK_ID
            session_id = await self._bind(digest, task_id, mode="next")
        finally:
            await self._scripts.release_marker.run(self._redis, [marker], [token])
        log.info(
            "session_refreshed",
            session_id=session_id,
            key_id=key_id_of(digest),
            ended_session_id=ended.session_id if ended else "",
        )
        return StartedSession(
            session_id=session_id,
            api_key=api_key,
            refreshed=ended is not None,
            ended_trajectory_id=ended.trajectory_id if ended else "",
        )

    async def _bind(self, digest: str, task_id: str, *, mode: str) -> str:
        """Binds a new episode (named by a fresh session id) to the key; returns its name."""
        key_id = key_id_of(digest)
        session_id = f"{task_id}-{await self._redis.incr(self._keys.session_seq)}"
        trajectory_id = "traj-" + secrets.token_hex(12)
        status, _epoch = await self._scripts.bind_episode.run(
            self._redis,
            [self._keys.key(digest), self._keys.episode(key_id, session_id)],
            [mode, key_id, task_id, session_id, trajectory_id, repr(time.time())],
        )
        if status == b"busy":
            raise Conflict("another episode was bound to this key meanwhile; retry")
        if status != b"ok":
            raise InternalError(f"binding an episode failed: {_text(status)}")
        return session_id

    # -- end / publish -----------------------------------------------------------------

    async def end(self, digest: str) -> Publication:
        """Ends the key's active episode and publishes it (end_reason `end_session`)."""
        key = await self._require_active(digest)
        return await self.publish(key, end_reason="end_session")

    async def publish(self, key: KeyState, *, end_reason: str) -> Publication:
        """Publishes the episode `key` names, once: a retry returns the stored ids."""
        ep_key = self._keys.episode(key.key_id, key.episode)
        episode_keys = [
            self._keys.key(key.digest),
            ep_key,
            self._keys.turns(key.key_id, key.episode),
            self._keys.rewards(key.key_id, key.episode),
            self._keys.interaction_index(key.key_id, key.episode),
            self._keys.trajectories,
            self._keys.stats,
        ]
        for _ in range(MAX_PUBLISH_ATTEMPTS):
            pipe = self._redis.pipeline(transaction=False)
            pipe.hgetall(ep_key)
            pipe.lrange(episode_keys[2], 0, -1)
            pipe.hgetall(episode_keys[3])
            ep, turns, rewards = await pipe.execute()
            now = time.time()
            data = b""
            if turns and ep.get(b"state") == b"active":
                data = self._encode(key, ep, turns, rewards, end_reason=end_reason, now=now)
            result = await self._scripts.publish.run(
                self._redis,
                episode_keys,
                [
                    key.episode,
                    key.epoch,
                    len(turns),
                    _text(ep.get(b"trajectory_id")),
                    CODEC,
                    data,
                    repr(now),
                    end_reason,
                    ENDED_EPISODE_TTL_S,
                ],
            )
            status = _text(result[0])
            if status == "retry":
                continue
            if status in {"published", "empty"}:
                publication = Publication(
                    status=status,
                    session_id=key.episode,
                    stream_id=_text(result[1]),
                    trajectory_id=_text(result[2]),
                    interaction_count=int(result[3]),
                )
                log.info(
                    "episode_ended",
                    status=status,
                    session_id=key.episode,
                    trajectory_id=publication.trajectory_id,
                    turns=publication.interaction_count,
                    end_reason=end_reason,
                )
                return publication
            if status == "missing":
                raise Conflict(f"episode {key.episode} no longer exists")
            raise Conflict(f"episode {key.episode} is no longer the key's active episode")
        raise Unavailable(
            "turns kept landing while the episode was being published; retry",
            code="publish_contended",
            retry_after_s=1.0,
        )

    def _encode(
        self,
        key: KeyState,
        ep: dict[bytes, bytes],
        turns: list[bytes],
        rewards: dict[bytes, bytes],
        *,
        end_reason: str,
        now: float,
    ) -> bytes:
        info = EpisodeInfo(
            trajectory_id=_text(ep.get(b"trajectory_id")),
            session_id=_text(ep.get(b"session_id")) or key.episode,
            task_id=_text(ep.get(b"task_id")),
            key_id=key.key_id,
            episode=key.episode,
            started_at=float(ep.get(b"started_at") or now),
            ended_at=now,
            end_reason=end_reason,
        )
        parsed = {k.decode(): float(v) for k, v in rewards.items()}
        return encode_trajectory(build_trajectory(info, turns, parsed))

    # -- rewards -----------------------------------------------------------------------

    async def set_reward(self, digest: str, *, reward: float, interaction_id: str) -> str:
        """Stores the reward of the named (or last) interaction; returns its id."""
        if not math.isfinite(reward):
            raise InvalidRequest(f"reward must be a finite number, got {reward!r}")
        key = await self._require_active(digest)
        status, found = await self._scripts.set_reward.run(
            self._redis,
            [
                self._keys.key(digest),
                self._keys.episode(key.key_id, key.episode),
                self._keys.rewards(key.key_id, key.episode),
                self._keys.interaction_index(key.key_id, key.episode),
            ],
            [key.episode, key.epoch, interaction_id, repr(float(reward))],
        )
        if status == b"not_active":
            raise Conflict(NO_ACTIVE_EPISODE)
        if status == b"no_interaction":
            raise Conflict("no completed interaction yet: chat first, then set the reward")
        if status == b"not_found":
            raise NotFound(f"interaction {interaction_id} not found in the current episode")
        log.info("reward_set", session_id=key.episode, interaction_id=_text(found))
        return _text(found)

    # -- resolve / turns / history ------------------------------------------------------

    async def resolve(self, digest: str) -> KeyState:
        """The key's state; unknown keys are Unauthenticated."""
        key = await self._read_key(digest)
        if key is None:
            raise Unauthenticated(UNKNOWN_KEY)
        return key

    async def active_episode(self, digest: str) -> ActiveEpisode:
        """The key's active episode and the weight version, in one round trip."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.hmget(self._keys.key(digest), "key_id", "state", "episode", "epoch")
        pipe.get(self._keys.weight_version)
        (key_id, state, episode, epoch), weight_version = await pipe.execute()
        if key_id is None:
            raise Unauthenticated(UNKNOWN_KEY)
        if state != b"active":
            raise Unavailable(BETWEEN_EPISODES, code="episode_not_active", retry_after_s=1.0)
        return ActiveEpisode(
            digest=digest,
            key_id=key_id.decode(),
            episode=_text(episode),
            epoch=int(epoch or 0),
            weight_version=int(weight_version or 0),
        )

    async def append_turn(
        self, episode: ActiveEpisode, *, interaction_id: str, record: bytes
    ) -> int:
        """Appends a completed turn if its episode is still active; returns its index."""
        status, index = await self._scripts.append_turn.run(
            self._redis,
            [
                self._keys.key(episode.digest),
                self._keys.episode(episode.key_id, episode.episode),
                self._keys.turns(episode.key_id, episode.episode),
                self._keys.interaction_index(episode.key_id, episode.episode),
            ],
            [episode.episode, episode.epoch, interaction_id, record, repr(time.time())],
        )
        if status == b"ended":
            raise Unavailable(EPISODE_ENDED, code="episode_ended", retry_after_s=1.0)
        if status == b"duplicate":
            log.warning(
                "turn_already_recorded", session_id=episode.episode, interaction_id=interaction_id
            )
        return int(index)

    async def history(self, digest: str) -> History:
        """The completed interactions of the key's current episode (none between episodes)."""
        key = await self.resolve(digest)
        if not key.active:
            return History(session_id="", entries=[])
        pipe = self._redis.pipeline(transaction=False)
        pipe.lrange(self._keys.turns(key.key_id, key.episode), 0, -1)
        pipe.hgetall(self._keys.rewards(key.key_id, key.episode))
        turns, rewards = await pipe.execute()
        entries = []
        for raw in turns:
            turn = decode_turn(raw)
            reward = rewards.get(turn["interaction_id"].encode())
            entries.append(
                (turn["interaction_id"], history_entry(turn, float(reward) if reward else None))
            )
        return History(session_id=key.episode, entries=entries)

    async def _require_active(self, digest: str) -> KeyState:
        key = await self.resolve(digest)
        if not key.active:
            raise Conflict(NO_ACTIVE_EPISODE)
        return key

    async def _read_key(self, digest: str) -> KeyState | None:
        fields: list[Any] = await self._redis.hmget(
            self._keys.key(digest), "key_id", "state", "episode", "epoch", "task_id"
        )
        key_id, state, episode, epoch, task_id = fields
        if key_id is None:
            return None
        return KeyState(
            digest=digest,
            key_id=key_id.decode(),
            active=state == b"active",
            episode=_text(episode),
            epoch=int(epoch or 0),
            task_id=_text(task_id),
        )
