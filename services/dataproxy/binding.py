"""Episode binding: a new key's first episode, a group of keys, a refresh of a key (its
episode published, the next bound), a header-mode session's episode; capacity is taken in
the bind script."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from services.dataproxy.episode_state import (
    CAPACITY_POLL_MAX_S,
    CAPACITY_POLL_MIN_S,
    DEFAULT_TASK_ID,
    HEADER_KEY_NO_START,
    HEADER_MODE,
    MARKER_TTL_S,
    MAX_GROUP_SIZE,
    NO_CAPACITY,
    IssuedKey,
    KeyLookup,
    Member,
    Publication,
    StartedSession,
    StoreContext,
    StorePart,
)
from services.dataproxy.publication import Publisher
from services.dataproxy.redis_keys import ENDED_EPISODE_TTL_S, KeyFields, KeyStatus
from services.dataproxy.scripts import (
    BindEpisode,
    BindEpisodeCall,
    BindMember,
    EpisodeBound,
    ExtendMarkerCall,
    ReleaseMarkerCall,
)
from services.runtime.errors import (
    Conflict,
    InternalError,
    InvalidRequest,
    TooManyRequests,
)
from services.runtime.keys import key_digest, key_id_of, new_session_key
from services.runtime.logs import get_logger
from services.runtime.redis_scripts import text_of
from services.runtime.tasks import cancel_and_wait

log = get_logger(__name__)


class EpisodeBinder(StorePart):
    """Binds episodes to keys (and to header-mode sessions) once capacity allows."""

    def __init__(self, ctx: StoreContext, *, lookup: KeyLookup, publisher: Publisher) -> None:
        super().__init__(ctx)
        self._lookup = lookup
        self._publisher = publisher

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
            mode = await self._redis.hget(self._keys.key(digest), KeyFields.MODE)
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
        await self.bind(members, mode="new", what="Retry the call.")
        session_id = members[0].session_id
        log.info("session_started", session_id=session_id, key_id=key_id_of(digest))
        return StartedSession(
            session_id=session_id, api_key=api_key, refreshed=False, ended_trajectory_id=""
        )

    async def _start_group(self, task_id: str, group_size: int) -> StartedSession:
        api_keys = [new_session_key() for _ in range(group_size)]
        members = [await self._member(key_digest(k), task_id) for k in api_keys]
        group_id = "grp-" + secrets.token_hex(12)
        await self.bind(members, mode="new", group_id=group_id, what="Retry the call.")
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
            key = await self._lookup.read_key(digest)
            ended: Publication | None = None
            if key is not None and key.active:
                ended = await self._publisher.publish(key, end_reason="refresh")
            task_id = task_id or (key.task_id if key else "") or DEFAULT_TASK_ID
            members = [await self._member(digest, task_id)]
            what = "The previous episode is already published; retry with the same api_key."
            await self.bind(members, mode="next", what=what)
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
            await self._scripts.release_marker.run(
                self._redis, ReleaseMarkerCall(marker=marker, token=token)
            )

    async def _keep_marker(self, marker: str, token: str, ttl_s: float) -> None:
        while True:
            await asyncio.sleep(ttl_s / 3)
            with contextlib.suppress(Exception):
                await self._scripts.extend_marker.run(
                    self._redis,
                    ExtendMarkerCall(marker=marker, token=token, ttl_ms=max(1, int(ttl_s * 1000))),
                )

    async def _member(self, digest: str, task_id: str) -> Member:
        seq = await self._redis.incr(self._keys.session_seq)
        return Member(
            digest=digest,
            task_id=task_id,
            session_id=f"{task_id}-{seq}",
            trajectory_id="traj-" + secrets.token_hex(12),
        )

    async def bind(self, members: list[Member], *, mode: str, what: str, group_id: str = "") -> int:
        """Binds the members' episodes once capacity allows (≤ refresh_timeout_s); their epoch."""
        started = time.monotonic()
        deadline = started + self._policy.refresh_timeout_s
        delay = CAPACITY_POLL_MIN_S
        while True:
            bound = await self._bind_once(members, mode=mode, group_id=group_id)
            if bound.status is BindEpisode.OK:
                return bound.value
            if bound.status is BindEpisode.BUSY:
                raise Conflict("another episode was bound to this key meanwhile; retry")
            if bound.status is BindEpisode.EXISTS and mode == HEADER_MODE:
                # The session's next name was taken (an expired pointer): pick a fresh one.
                taken = members[0]
                members[0] = replace(taken, episode=f"{taken.name}-{secrets.token_hex(3)}")
                continue
            if bound.status is BindEpisode.UNKNOWN and mode != "new":
                # The key hash is gone: revoked while this start waited.
                raise await self._revoker.refusal(members[0].digest)
            if bound.status is not BindEpisode.FULL:
                raise InternalError(f"binding an episode failed: {bound.status.value}")
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

    async def _bind_once(self, members: list[Member], *, mode: str, group_id: str) -> EpisodeBound:
        slot = self._keys.group(group_id) if group_id else self._keys.stats
        if mode == HEADER_MODE:
            slot = self._keys.session(key_id_of(members[0].digest), members[0].session_id)
        ofp, batch_size = self._policy.capacity.bound_args
        return await self._scripts.bind_episode.run(
            self._redis,
            BindEpisodeCall(
                stats=self._keys.stats,
                capacity=self._keys.capacity,
                weight_version=self._keys.weight_version,
                idle=self._keys.idle,
                slot=slot,
                mode=mode,
                now=time.time(),
                max_head_offpolicyness=ofp,
                batch_size=batch_size,
                idle_timeout_s=self._policy.session_idle_timeout_s,
                group_id=group_id,
                group_size=len(members) if group_id else 0,
                group_ttl_s=ENDED_EPISODE_TTL_S,
                members=[self._bind_member(m) for m in members],
            ),
        )

    def _bind_member(self, m: Member) -> BindMember:
        key_id = key_id_of(m.digest)
        return BindMember(
            key=self._keys.key(m.digest),
            episode_hash=self._keys.episode(key_id, m.name),
            key_id=key_id,
            task_id=m.task_id,
            episode=m.name,
            trajectory_id=m.trajectory_id,
            digest=m.digest,
            session_id=m.session_id,
        )

    async def start_header_episode(self, digest: str, session_id: str, count: int) -> None:
        task_id: Any = await self._redis.hget(self._keys.key(digest), KeyFields.TASK_ID)
        member = Member(
            digest=digest,
            task_id=text_of(task_id) or DEFAULT_TASK_ID,
            session_id=session_id,
            trajectory_id="traj-" + secrets.token_hex(12),
            episode=session_id if count == 0 else f"{session_id}#{count + 1}",
        )
        what = "Retry the call with the same X-Session-Id."
        await self.bind([member], mode=HEADER_MODE, what=what)
        log.info("header_episode_started", session_id=session_id, episode=member.name)

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
                KeyFields.KEY_ID: key_id,
                KeyFields.TASK_ID: task_id.strip() or DEFAULT_TASK_ID,
                KeyFields.MODE: HEADER_MODE,
                KeyFields.STATE: KeyStatus.IDLE,
                KeyFields.EPISODE: "",
                KeyFields.EPOCH: 0,
                KeyFields.CREATED_AT: repr(time.time()),
            },
        )
        log.info("key_issued", key_id=key_id, mode=mode)
        return IssuedKey(api_key=api_key, key_id=key_id, mode=mode)
