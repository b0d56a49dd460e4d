"""The session store: start, refresh, end, resolve, reward and publish episodes in Redis.

Every transition is one Lua script that checks the key's state and epoch (docs/internals.md),
so a late turn never lands in the next episode and a retried publication never adds a second
stream entry.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import redis.asyncio as aioredis

from services.dataproxy.control import CapacityPolicy
from services.dataproxy.redis_keys import ENDED_EPISODE_TTL_S, RedisKeys
from services.dataproxy.revocation import SessionKeyRevoker
from services.dataproxy.scripts import Scripts
from services.dataproxy.summaries import RECENT_KEPT, trajectory_summary
from services.dataproxy.trajectory import (
    CODEC,
    EpisodeInfo,
    build_trajectory,
    encode_trajectory,
)
from services.dataproxy.turns import decode_turns, history_entry
from services.runtime.errors import (
    Conflict,
    InternalError,
    InvalidRequest,
    NotFound,
    TooManyRequests,
    Unavailable,
)
from services.runtime.keys import key_digest, key_id_of, new_session_key
from services.runtime.logs import get_logger
from services.runtime.secret import Secret
from services.runtime.tasks import cancel_and_wait

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
HELD = "ended_awaiting_reward"
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
class _Member:
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
        admin_key: Secret,
        refresh_lock_s: float,
        policy: EpisodePolicy | None = None,
    ) -> None:
        self._redis = redis
        self._keys = keys
        self._scripts = scripts
        self._admin_key = admin_key
        self._refresh_lock_s = refresh_lock_s
        self._policy = policy or EpisodePolicy()
        self._revoker = SessionKeyRevoker(redis=redis, keys=keys)
        # (status, end reason, seconds from the episode's end to this outcome) of every episode
        # this replica ended (docs/metrics.md); None: not counted.
        self.on_ended: Callable[[str, str, float], None] | None = None

    @property
    def policy(self) -> EpisodePolicy:
        """The lifecycle settings in force."""
        return self._policy

    # -- start / refresh ---------------------------------------------------------------

    async def start(self, *, task_id: str, api_key: str, group_size: int = 0) -> StartedSession:
        """A new key with its first episode, a group of new keys, or a refresh of `api_key`."""
        task_id = task_id.strip()
        if api_key and self._admin_key.matches(api_key):
            raise InvalidRequest("the admin key cannot be used as a session key")
        if group_size < 0 or group_size > MAX_GROUP_SIZE:
            raise InvalidRequest(f"group_size must be between 1 and {MAX_GROUP_SIZE}")
        if group_size > 1:
            if api_key:
                raise InvalidRequest(
                    "group_size > 1 starts new keys: omit api_key (a refresh is per key)",
                    code="group_with_api_key",
                )
            return await self._start_group(task_id or DEFAULT_TASK_ID, group_size)
        if api_key:
            digest = key_digest(api_key)
            mode = await self._redis.hget(self._keys.key(digest), "mode")
            if mode == HEADER_MODE.encode():
                raise InvalidRequest(HEADER_KEY_NO_START, code="header_mode_key")
            if await self._redis.exists(self._keys.key(digest)):
                return await self._refresh(api_key, digest, task_id)
            if await self._redis.exists(self._keys.revoked(digest)):
                raise await self._revoker.refusal(digest)
            # AReaL behaviour: a key never issued here is not honoured; mint a new one.
            log.info("unknown_key_replaced", task_id=task_id)
        return await self._start_new(task_id or DEFAULT_TASK_ID)

    async def _start_new(self, task_id: str) -> StartedSession:
        api_key = new_session_key()
        digest = key_digest(api_key)
        members = [await self._member(digest, task_id)]
        await self._bind(members, mode="new", what="Retry the call.")
        session_id = members[0].session_id
        log.info("session_started", session_id=session_id, key_id=key_id_of(digest))
        return StartedSession(
            session_id=session_id, api_key=api_key, refreshed=False, ended_trajectory_id=""
        )

    async def _start_group(self, task_id: str, group_size: int) -> StartedSession:
        api_keys = [new_session_key() for _ in range(group_size)]
        members = [await self._member(key_digest(k), task_id) for k in api_keys]
        group_id = "grp-" + secrets.token_hex(12)
        await self._bind(members, mode="new", group_id=group_id, what="Retry the call.")
        log.info("group_started", group_id=group_id, group_size=group_size, task_id=task_id)
        pairs = tuple((m.session_id, k) for m, k in zip(members, api_keys, strict=True))
        return StartedSession(
            session_id=pairs[0][0],
            api_key=pairs[0][1],
            refreshed=False,
            ended_trajectory_id="",
            group_id=group_id,
            members=pairs,
        )

    async def _refresh(self, api_key: str, digest: str, task_id: str) -> StartedSession:
        """Ends the key's active episode (if any) and binds the next; no task_id: the key's."""
        async with self._refresh_marker(digest):
            key = await self._read_key(digest)
            ended: Publication | None = None
            if key is not None and key.active:
                ended = await self.publish(key, end_reason="refresh")
            task_id = task_id or (key.task_id if key else "") or DEFAULT_TASK_ID
            members = [await self._member(digest, task_id)]
            what = "The previous episode is already published; retry with the same api_key."
            await self._bind(members, mode="next", what=what)
        session_id = members[0].session_id
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

    @contextlib.asynccontextmanager
    async def _refresh_marker(self, digest: str) -> AsyncIterator[None]:
        """Holds the key's refresh marker: short-lived, kept alive while the refresh runs.

        A second refresh meanwhile gets 429; a holder that dies leaves it for at most
        MARKER_TTL_S (never longer than refresh_lock_s).
        """
        marker = self._keys.refreshing(digest)
        token = secrets.token_hex(8)
        ttl_s = min(MARKER_TTL_S, self._refresh_lock_s)
        if not await self._redis.set(marker, token, nx=True, px=max(1, int(ttl_s * 1000))):
            raise TooManyRequests("a refresh of this key is already in progress", retry_after_s=1.0)
        keeper = asyncio.create_task(self._keep_marker(marker, token, ttl_s))
        try:
            yield
        finally:
            await cancel_and_wait(keeper)
            await self._scripts.release_marker.run(self._redis, [marker], [token])

    async def _keep_marker(self, marker: str, token: str, ttl_s: float) -> None:
        while True:
            await asyncio.sleep(ttl_s / 3)
            with contextlib.suppress(Exception):
                await self._scripts.extend_marker.run(
                    self._redis, [marker], [token, max(1, int(ttl_s * 1000))]
                )

    async def _member(self, digest: str, task_id: str) -> _Member:
        seq = await self._redis.incr(self._keys.session_seq)
        return _Member(
            digest=digest,
            task_id=task_id,
            session_id=f"{task_id}-{seq}",
            trajectory_id="traj-" + secrets.token_hex(12),
        )

    async def _bind(
        self, members: list[_Member], *, mode: str, what: str, group_id: str = ""
    ) -> int:
        """Binds the members' episodes once capacity allows (≤ refresh_timeout_s); their epoch."""
        started = time.monotonic()
        deadline = started + self._policy.refresh_timeout_s
        delay = CAPACITY_POLL_MIN_S
        while True:
            status, value = await self._bind_once(members, mode=mode, group_id=group_id)
            if status == "ok":
                return value
            if status == "busy":
                raise Conflict("another episode was bound to this key meanwhile; retry")
            if status == "exists" and mode == HEADER_MODE:
                # The session's next name was taken (an expired pointer): pick a fresh one.
                taken = members[0]
                members[0] = replace(taken, episode=f"{taken.name}-{secrets.token_hex(3)}")
                continue
            if status == "unknown" and mode != "new":
                # The key hash is gone: revoked while this start waited.
                raise await self._revoker.refusal(members[0].digest)
            if status != "full":
                raise InternalError(f"binding an episode failed: {status}")
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning("capacity_wait_timed_out", episodes=len(members), mode=mode)
                raise TooManyRequests(
                    NO_CAPACITY.format(waited=time.monotonic() - started, what=what),
                    code="no_capacity",
                    retry_after_s=5.0,
                )
            await asyncio.sleep(min(delay, left))
            delay = min(delay * 2, CAPACITY_POLL_MAX_S)

    async def _bind_once(
        self, members: list[_Member], *, mode: str, group_id: str
    ) -> tuple[str, int]:
        slot = self._keys.group(group_id) if group_id else self._keys.stats
        if mode == HEADER_MODE:
            slot = self._keys.session(key_id_of(members[0].digest), members[0].session_id)
        keys = [
            self._keys.stats,
            self._keys.capacity,
            self._keys.weight_version,
            self._keys.idle,
            slot,
        ]
        ofp, batch_size = self._policy.capacity.bound_args
        args: list[Any] = [
            mode,
            repr(time.time()),
            ofp,
            batch_size,
            repr(self._policy.session_idle_timeout_s),
            group_id,
            len(members) if group_id else 0,
            ENDED_EPISODE_TTL_S,
        ]
        for m in members:
            key_id = key_id_of(m.digest)
            keys += [self._keys.key(m.digest), self._keys.episode(key_id, m.name)]
            args += [key_id, m.task_id, m.name, m.trajectory_id, m.digest, m.session_id]
        status, value = await self._scripts.bind_episode.run(self._redis, keys, args)
        return _text(status), int(value)

    # -- end / publish -----------------------------------------------------------------

    async def end(self, digest: str, *, session_id: str = "") -> Publication:
        """Ends the key's active episode (header mode: the session's) and publishes it.

        A retry on an idle key whose last episode ended within END_RETRY_WINDOW_S gets that
        publication again (the first reply may have been lost); nothing is published twice.
        """
        key = await self.resolve(digest)
        if key.mode == HEADER_MODE:
            return await self._end_session(key, _session_name(session_id))
        if key.active:
            return await self.publish(key, end_reason="end_session")
        last = await self._last_publication(digest)
        if last is None:
            raise Conflict(NO_ACTIVE_EPISODE)
        return last

    async def _last_publication(self, digest: str) -> Publication | None:
        fields: list[Any] = await self._redis.hmget(
            self._keys.key(digest),
            "last_episode",
            "last_status",
            "last_trajectory_id",
            "last_stream_id",
            "last_turns",
            "last_ended_at",
        )
        episode, status, trajectory_id, stream_id, turns, ended_at = fields
        if not episode or time.time() - float(ended_at or 0) > END_RETRY_WINDOW_S:
            return None
        return Publication(
            status=_text(status),
            session_id=_text(episode),
            trajectory_id=_text(trajectory_id) if status != b"empty" else "",
            stream_id=_text(stream_id),
            interaction_count=int(turns or 0),
        )

    async def _end_session(self, key: KeyState, session_id: str) -> Publication:
        """Ends a header-mode session's active episode; a retry gets its last one again."""
        target = await self._session_episode(key, session_id)
        if target.active:
            return await self.publish(target, end_reason="end_session")
        ep: list[Any] = await self._redis.hmget(
            self._keys.episode(key.key_id, target.episode),
            "state",
            "trajectory_id",
            "stream_id",
            "turns",
            "ended_at",
        )
        state, trajectory_id, stream_id, turns, ended_at = ep
        if state is None or time.time() - float(ended_at or 0) > END_RETRY_WINDOW_S:
            raise Conflict(f"session {session_id} has no active episode")
        return Publication(
            status="held" if state == HELD.encode() else _text(state),
            session_id=session_id,
            trajectory_id=_text(trajectory_id) if state != b"empty" else "",
            stream_id=_text(stream_id),
            interaction_count=int(turns or 0),
        )

    async def _session_episode(self, key: KeyState, session_id: str) -> KeyState:
        """The session's active episode (active=True), else its last one; 404 when none."""
        fields: list[Any] = await self._redis.hmget(
            self._keys.session(key.key_id, session_id), "episode", "epoch", "last"
        )
        current, epoch, last = fields
        episode, active = _text(current), bool(current)
        if not episode:
            episode = _text(last)
            if not episode:
                raise NotFound(f"session {session_id} not found for this key")
            epoch = await self._redis.hget(self._keys.episode(key.key_id, episode), "epoch")
        return replace(
            key, active=active, episode=episode, epoch=int(epoch or 0), session_id=session_id
        )

    async def end_after_turn(self, episode: ActiveEpisode) -> Publication | None:
        """`X-Session-Done`: ends the header-mode episode the turn ran in (None: ended already)."""
        key = KeyState(
            digest=episode.digest,
            key_id=episode.key_id,
            active=True,
            episode=episode.episode,
            epoch=episode.epoch,
            mode=HEADER_MODE,
            session_id=episode.client_session_id,
        )
        try:
            return await self.publish(key, end_reason="session_done")
        except (Conflict, Unavailable) as err:
            # Ended meanwhile, or contended: the idle reaper ends it if it is still active.
            log.warning("session_done_not_ended", session_id=key.session_id, reason=err.message)
            return None

    async def publish(self, key: KeyState, *, end_reason: str) -> Publication:
        """Ends the episode `key` names, once: a retry returns the stored ids.

        An active episode is published, or held for a late reward when that option is on and
        its last interaction has none; a held one (`key.active` False) is published.
        """
        ep_key = self._keys.episode(key.key_id, key.episode)
        member = f"{key.digest}/{key.episode}"
        for _ in range(MAX_PUBLISH_ATTEMPTS):
            pipe = self._redis.pipeline(transaction=False)
            pipe.hgetall(ep_key)
            pipe.lrange(self._keys.turns(key.key_id, key.episode), 0, -1)
            pipe.hgetall(self._keys.rewards(key.key_id, key.episode))
            ep, turns, rewards = await pipe.execute()
            now = time.time()
            state = _text(ep.get(b"state"))
            reason = _text(ep.get(b"end_reason")) or end_reason if state == HELD else end_reason
            hold_until = 0.0
            if self._should_hold(state, ep, turns, rewards):
                hold_until = now + self._policy.late_reward_timeout_s
            data, stats, summary = b"", {"interactions": 0, "joined": 0}, b""
            if turns and state in {"active", HELD} and not hold_until:
                data, stats, summary = self._encode(
                    key, ep, turns, rewards, end_reason=reason, now=now
                )
            group_id = _text(ep.get(b"group_id"))
            trajectory_id = _text(ep.get(b"trajectory_id"))
            result = await self._scripts.publish.run(
                self._redis,
                [
                    self._keys.key(key.digest),
                    ep_key,
                    self._keys.turns(key.key_id, key.episode),
                    self._keys.rewards(key.key_id, key.episode),
                    self._keys.interaction_index(key.key_id, key.episode),
                    self._keys.trajectories,
                    self._keys.stats,
                    self._keys.idle,
                    self._keys.awaiting_reward,
                    self._keys.trajectory_group(trajectory_id),
                    self._keys.group(group_id) if group_id else self._keys.stats,
                    self._keys.session(key.key_id, key.session_id)
                    if key.mode == HEADER_MODE
                    else self._keys.stats,
                    self._keys.episode_turns,
                    self._keys.recent_trajectories,
                ],
                [
                    key.episode,
                    key.epoch,
                    len(turns),
                    trajectory_id,
                    CODEC,
                    data,
                    repr(now),
                    reason,
                    ENDED_EPISODE_TTL_S,
                    member,
                    stats["interactions"],
                    stats["joined"],
                    repr(hold_until),
                    group_id,
                    int(ep.get(b"group_size") or 0),
                    key.mode,
                    summary,
                    RECENT_KEPT,
                ],
            )
            status = _text(result[0])
            if status == "retry":
                continue
            if status in {"published", "empty", "held"}:
                if self.on_ended is not None and state in {"active", HELD}:
                    # Counted once: an episode this call found already ended is a retry.
                    since = float(ep.get(b"ended_at") or now) if state == HELD else now
                    self.on_ended(status, reason, max(0.0, time.time() - since))
                return self._ended(key, result, status=status, end_reason=reason)
            if status == "missing":
                raise Conflict(f"episode {key.episode} no longer exists")
            raise Conflict(f"episode {key.episode} is no longer the key's active episode")
        raise Unavailable(
            "turns kept landing while the episode was being published; retry",
            code="publish_contended",
            retry_after_s=1.0,
        )

    def _should_hold(
        self, state: str, ep: dict[bytes, bytes], turns: list[bytes], rewards: dict[bytes, bytes]
    ) -> bool:
        if self._policy.late_reward_timeout_s <= 0 or state != "active" or not turns:
            return False
        return ep.get(b"last_interaction", b"") not in rewards

    def _ended(self, key: KeyState, result: Any, *, status: str, end_reason: str) -> Publication:
        publication = Publication(
            status=status,
            session_id=key.session_id or key.episode,
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

    def _encode(
        self,
        key: KeyState,
        ep: dict[bytes, bytes],
        turns: list[bytes],
        rewards: dict[bytes, bytes],
        *,
        end_reason: str,
        now: float,
    ) -> tuple[bytes, dict[str, int], bytes]:
        ended_at = float(ep[b"ended_at"]) if ep.get(b"ended_at") else now
        info = EpisodeInfo(
            trajectory_id=_text(ep.get(b"trajectory_id")),
            session_id=_text(ep.get(b"session_id")) or key.episode,
            task_id=_text(ep.get(b"task_id")),
            key_id=key.key_id,
            episode=key.episode,
            started_at=float(ep.get(b"started_at") or now),
            ended_at=ended_at,
            end_reason=end_reason,
            group_id=_text(ep.get(b"group_id")) or None,
            group_size=int(ep.get(b"group_size") or 0) or None,
        )
        parsed = {k.decode(): float(v) for k, v in rewards.items()}
        trajectory = build_trajectory(info, turns, parsed)
        stats = trajectory.get("stats", {})
        counts = {
            "interactions": int(stats.get("interactions", len(turns))),
            "joined": int(stats.get("joined", 0)),
        }
        return encode_trajectory(trajectory), counts, trajectory_summary(trajectory)

    # -- reaper entry points ------------------------------------------------------------

    async def claim_due(self, *, held: bool, lease_s: float, limit: int) -> list[str]:
        """Claims due `digest/episode` members: idle active episodes, or held ones (held)."""
        zset = self._keys.awaiting_reward if held else self._keys.idle
        members = await self._scripts.claim_due.run(
            self._redis, [zset], [repr(time.time()), repr(lease_s), limit]
        )
        return [_text(m) for m in members]

    async def reap_idle(self, member: str) -> Publication | None:
        """Ends the idle episode `digest/episode` if it is still active and still idle."""
        digest, _, episode = member.partition("/")
        key = await self._read_key(digest)
        if key is not None and key.mode == HEADER_MODE:
            key = await self._header_episode(key, episode)
        if key is None or not key.active or key.episode != episode:
            await self._redis.zrem(self._keys.idle, member)
            return None
        last = await self._redis.hget(self._keys.episode(key.key_id, episode), "last_active_at")
        due = float(last or 0) + self._policy.session_idle_timeout_s
        if due > time.time():
            # GT: a turn that started since the claim raised the deadline to its lease's,
            # which must hold; XX: a member published meanwhile stays gone.
            await self._redis.zadd(self._keys.idle, {member: due}, xx=True, gt=True)
            return None
        return await self.publish(key, end_reason="idle")

    async def _header_episode(self, key: KeyState, episode: str) -> KeyState | None:
        """A header-mode key's episode as a KeyState (active as its hash says); None: gone."""
        fields: list[Any] = await self._redis.hmget(
            self._keys.episode(key.key_id, episode), "state", "epoch", "session_id"
        )
        state, epoch, session_id = fields
        if state is None:
            return None
        return replace(
            key,
            active=state == b"active",
            episode=episode,
            epoch=int(epoch or 0),
            session_id=_text(session_id),
        )

    async def release_held(self, member: str) -> Publication | None:
        """Publishes the held episode `digest/episode` whose late reward never came (0)."""
        digest, _, episode = member.partition("/")
        key_id = key_id_of(digest)
        state, epoch = await self._redis.hmget(
            self._keys.episode(key_id, episode), "state", "epoch"
        )
        if state != HELD.encode():
            await self._redis.zrem(self._keys.awaiting_reward, member)
            return None
        held = KeyState(
            digest=digest, key_id=key_id, active=False, episode=episode, epoch=int(epoch or 0)
        )
        return await self.publish(held, end_reason="")

    # -- rewards -----------------------------------------------------------------------

    async def set_reward(
        self, digest: str, *, reward: float, interaction_id: str, session_id: str = ""
    ) -> str:
        """Stores the reward of the named (or last) interaction; returns its id.

        The target episode: `session_id` when given; else the key's episode held for a late
        reward when the key has no active episode; else the active one. A reward for the last
        interaction of a held episode publishes it.
        """
        if not math.isfinite(reward):
            raise InvalidRequest(f"reward must be a finite number, got {reward!r}")
        key = await self.resolve(digest)
        target, mode = await self._reward_target(key, session_id)
        status, found, is_last = await self._scripts.set_reward.run(
            self._redis,
            [
                self._keys.key(digest),
                self._keys.episode(key.key_id, target.episode),
                self._keys.rewards(key.key_id, target.episode),
                self._keys.interaction_index(key.key_id, target.episode),
            ],
            [target.episode, target.epoch, interaction_id, repr(float(reward)), mode],
        )
        if status == b"not_active":
            raise Conflict(NO_ACTIVE_EPISODE)
        if status == b"no_interaction":
            raise Conflict("no completed interaction yet: chat first, then set the reward")
        if status == b"not_found":
            raise NotFound(f"interaction {interaction_id} not found in the current episode")
        log.info("reward_set", session_id=target.episode, interaction_id=_text(found), mode=mode)
        if mode == "held" and int(is_last):
            await self.publish(target, end_reason="")
        return _text(found)

    async def _reward_target(self, key: KeyState, session_id: str) -> tuple[KeyState, str]:
        if key.mode == HEADER_MODE:
            return await self._header_reward_target(key, _session_name(session_id))
        if session_id and not (key.active and key.episode == session_id):
            state, epoch = await self._redis.hmget(
                self._keys.episode(key.key_id, session_id), "state", "epoch"
            )
            if state is None:
                raise NotFound(f"episode {session_id} not found for this key")
            if state != HELD.encode():
                raise Conflict(f"episode {session_id} has ended and was published already")
            return _held(key, session_id, int(epoch or 0)), "held"
        if not session_id and not key.active and key.held:
            epoch = await self._redis.hget(self._keys.episode(key.key_id, key.held), "epoch")
            return _held(key, key.held, int(epoch or 0)), "held"
        if not key.active:
            raise Conflict(NO_ACTIVE_EPISODE)
        return key, "active"

    async def _header_reward_target(self, key: KeyState, session_id: str) -> tuple[KeyState, str]:
        target = await self._session_episode(key, session_id)
        if target.active:
            return target, "episode"
        state = await self._redis.hget(self._keys.episode(key.key_id, target.episode), "state")
        if state != HELD.encode():
            raise Conflict(f"session {session_id} has no active episode (its last one ended)")
        return target, "held"

    # -- header-mode keys ----------------------------------------------------------------

    async def issue_key(self, *, task_id: str = "", mode: str = HEADER_MODE) -> IssuedKey:
        """A long-lived header-mode key: each X-Session-Id it sends names an episode."""
        if mode != HEADER_MODE:
            raise InvalidRequest(
                f"mode must be {HEADER_MODE!r} (per-episode keys come from /rl/start_session)",
                code="invalid_key_mode",
            )
        api_key = new_session_key()
        digest = key_digest(api_key)
        key_id = key_id_of(digest)
        await self._redis.hset(
            self._keys.key(digest),
            mapping={
                "key_id": key_id,
                "task_id": task_id.strip() or DEFAULT_TASK_ID,
                "mode": HEADER_MODE,
                "state": "idle",
                "episode": "",
                "epoch": 0,
                "created_at": repr(time.time()),
            },
        )
        log.info("key_issued", key_id=key_id, mode=mode)
        return IssuedKey(api_key=api_key, key_id=key_id, mode=mode)

    # -- turns -------------------------------------------------------------------------

    async def begin_turn(
        self, digest: str, *, session_id: str, token: str, lease_until: float
    ) -> ActiveEpisode | None:
        """Resolves the key's (or session's) episode, takes the in-flight lease and keeps the
        episode's idle deadline at least until the lease's, in one round trip; None while
        submission is paused (nothing taken).

        A header-mode key's first call with a new session id binds an episode for it first
        (waiting for capacity like any start); other keys ignore `session_id`.
        """
        for _ in range(MAX_PUBLISH_ATTEMPTS):
            status, key_id, episode, epoch, version, mode = await self._scripts.begin_turn.run(
                self._redis,
                [
                    self._keys.key(digest),
                    self._keys.paused,
                    self._keys.in_flight,
                    self._keys.weight_version,
                    self._keys.session(key_id_of(digest), session_id)
                    if session_id
                    else self._keys.paused,
                    self._keys.idle,
                    self._keys.episode_turns,
                ],
                [token, repr(lease_until), repr(time.time()), session_id, digest],
            )
            if status == b"ok":
                header = mode == HEADER_MODE.encode()
                return ActiveEpisode(
                    digest=digest,
                    key_id=_text(key_id),
                    episode=_text(episode),
                    epoch=int(epoch),
                    weight_version=int(version),
                    mode=_text(mode),
                    client_session_id=session_id if header else "",
                    lease_token=token,
                )
            if status == b"paused":
                return None
            if status == b"unknown":
                raise await self._revoker.refusal(digest)
            if status == b"not_active":
                raise Unavailable(BETWEEN_EPISODES, code="episode_not_active", retry_after_s=1.0)
            if status == b"needs_session":
                raise InvalidRequest(NEEDS_SESSION, code="session_id_required")
            await self._start_header_episode(digest, _session_name(session_id), int(epoch))
        raise Unavailable(
            "the session's episode kept ending while this turn started; retry",
            code="session_contended",
            retry_after_s=1.0,
        )

    async def _start_header_episode(self, digest: str, session_id: str, count: int) -> None:
        task_id: Any = await self._redis.hget(self._keys.key(digest), "task_id")
        member = _Member(
            digest=digest,
            task_id=_text(task_id) or DEFAULT_TASK_ID,
            session_id=session_id,
            trajectory_id="traj-" + secrets.token_hex(12),
            episode=session_id if count == 0 else f"{session_id}#{count + 1}",
        )
        what = "Retry the call with the same X-Session-Id."
        await self._bind([member], mode=HEADER_MODE, what=what)
        log.info("header_episode_started", session_id=session_id, episode=member.name)

    async def record_turn(
        self, episode: ActiveEpisode, *, interaction_id: str, encode: Callable[[int], bytes]
    ) -> int:
        """Appends the turn `encode(weight_version_end)` and releases its lease, in one round
        trip (a second only when the weight version moved while the turn ran)."""
        version = episode.weight_version
        for _ in range(MAX_RECORD_ATTEMPTS):
            status, value = await self._append(
                episode, interaction_id=interaction_id, record=encode(version), expected=version
            )
            if status != b"version":
                return self._appended(episode, interaction_id, status, value)
            version = int(value)
        raise Unavailable(
            "the weight version kept changing while this turn was recorded; retry",
            code="version_contended",
            retry_after_s=1.0,
        )

    async def resolve(self, digest: str) -> KeyState:
        """The key's state; unknown keys are Unauthenticated."""
        key = await self._read_key(digest)
        if key is None:
            raise await self._revoker.refusal(digest)
        return key

    async def active_episode(self, digest: str) -> ActiveEpisode:
        """The key's active episode and the weight version, in one round trip."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.hmget(self._keys.key(digest), "key_id", "state", "episode", "epoch")
        pipe.get(self._keys.weight_version)
        (key_id, state, episode, epoch), weight_version = await pipe.execute()
        if key_id is None:
            raise await self._revoker.refusal(digest)
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
        status, index = await self._append(
            episode, interaction_id=interaction_id, record=record, expected=-1
        )
        return self._appended(episode, interaction_id, status, index)

    async def _append(
        self, episode: ActiveEpisode, *, interaction_id: str, record: bytes, expected: int
    ) -> tuple[bytes, int]:
        now = time.time()
        status, index = await self._scripts.append_turn.run(
            self._redis,
            [
                self._keys.key(episode.digest),
                self._keys.episode(episode.key_id, episode.episode),
                self._keys.turns(episode.key_id, episode.episode),
                self._keys.interaction_index(episode.key_id, episode.episode),
                self._keys.idle,
                self._keys.in_flight,
                self._keys.weight_version,
                self._keys.episode_turns,
            ],
            [
                episode.episode,
                episode.epoch,
                interaction_id,
                record,
                repr(now),
                repr(now + self._policy.session_idle_timeout_s),
                episode.idle_member,
                episode.lease_token,
                expected,
                episode.mode,
            ],
        )
        return status, int(index)

    def _appended(
        self, episode: ActiveEpisode, interaction_id: str, status: bytes, index: int
    ) -> int:
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
        for turn in decode_turns(turns):
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
            self._keys.key(digest), "key_id", "state", "episode", "epoch", "task_id", "held", "mode"
        )
        key_id, state, episode, epoch, task_id, held, mode = fields
        if key_id is None:
            return None
        return KeyState(
            digest=digest,
            key_id=key_id.decode(),
            active=state == b"active",
            episode=_text(episode),
            epoch=int(epoch or 0),
            task_id=_text(task_id),
            held=_text(held),
            mode=_text(mode) or KEY_MODE,
        )


def _session_name(session_id: str) -> str:
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


def _held(key: KeyState, episode: str, epoch: int) -> KeyState:
    return KeyState(
        digest=key.digest, key_id=key.key_id, active=False, episode=episode, epoch=epoch
    )
