"""Publication: ending an episode once (end_session, a refresh, X-Session-Done, the idle
reaper, a late reward) and putting its trajectory on the stream."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from schema.trajectory import CODEC
from services.dataproxy.episode_state import (
    END_RETRY_WINDOW_S,
    HEADER_MODE,
    HELD,
    MAX_PUBLISH_ATTEMPTS,
    NO_ACTIVE_EPISODE,
    ActiveEpisode,
    KeyLookup,
    KeyState,
    Publication,
    StoreContext,
    StorePart,
    session_name,
)
from services.dataproxy.redis_keys import (
    ENDED_EPISODE_TTL_S,
    EpisodeFields,
    EpisodeStatus,
    KeyFields,
)
from services.dataproxy.scripts import ClaimDueCall, Publish, PublishCall, Published
from services.dataproxy.summaries import RECENT_KEPT, trajectory_summary
from services.dataproxy.trajectory import EpisodeInfo, build_trajectory, encode_trajectory
from services.runtime.errors import (
    Conflict,
    Unavailable,
)
from services.runtime.keys import key_id_of
from services.runtime.logs import get_logger
from services.runtime.redis_scripts import text_of

log = get_logger(__name__)

# What publish.lua answers when the episode has ended (also for a retry of an ended one).
ENDED = frozenset({Publish.PUBLISHED, Publish.EMPTY, Publish.HELD})


# (status, end reason, seconds from the episode's end to this outcome) of an ended episode.
EndedHook = Callable[[str, str, float], None]


class Publisher(StorePart):
    """Ends and publishes episodes; each at most once (a retry returns the stored ids)."""

    def __init__(self, ctx: StoreContext, *, lookup: KeyLookup) -> None:
        super().__init__(ctx)
        self._lookup = lookup
        # Every episode this replica ended (docs/metrics.md); None: not counted.
        self.on_ended: EndedHook | None = None

    async def end(self, digest: str, *, session_id: str = "") -> Publication:
        """Ends the key's active episode (header mode: the session's) and publishes it.

        A retry on an idle key whose last episode ended within END_RETRY_WINDOW_S gets that
        publication again (the first reply may have been lost); nothing is published twice.
        """
        key = await self._lookup.resolve(digest)
        if key.mode == HEADER_MODE:
            return await self._end_session(key, session_name(session_id))
        if key.active:
            return await self.publish(key, end_reason="end_session")
        last = await self._last_publication(digest)
        if last is None:
            raise Conflict(NO_ACTIVE_EPISODE)
        return last

    async def _last_publication(self, digest: str) -> Publication | None:
        fields: list[Any] = await self._redis.hmget(
            self._keys.key(digest),
            KeyFields.LAST_EPISODE,
            KeyFields.LAST_STATUS,
            KeyFields.LAST_TRAJECTORY_ID,
            KeyFields.LAST_STREAM_ID,
            KeyFields.LAST_TURNS,
            KeyFields.LAST_ENDED_AT,
        )
        episode, status, trajectory_id, stream_id, turns, ended_at = fields
        if not episode or time.time() - float(ended_at or 0) > END_RETRY_WINDOW_S:
            return None
        # `last_status` is the status publish.lua ended that episode with.
        ended = Publish.parse(status)
        return Publication(
            status=ended.value,
            session_id=text_of(episode),
            trajectory_id=text_of(trajectory_id) if ended is not Publish.EMPTY else "",
            stream_id=text_of(stream_id),
            interaction_count=int(turns or 0),
        )

    async def _end_session(self, key: KeyState, session_id: str) -> Publication:
        """Ends a header-mode session's active episode; a retry gets its last one again."""
        target = await self._lookup.session_episode(key, session_id)
        if target.active:
            return await self.publish(target, end_reason="end_session")
        ep: list[Any] = await self._redis.hmget(
            self._keys.episode(key.key_id, target.episode),
            EpisodeFields.STATE,
            EpisodeFields.TRAJECTORY_ID,
            EpisodeFields.STREAM_ID,
            EpisodeFields.TURNS,
            EpisodeFields.ENDED_AT,
        )
        state, trajectory_id, stream_id, turns, ended_at = ep
        if state is None or time.time() - float(ended_at or 0) > END_RETRY_WINDOW_S:
            raise Conflict(f"session {session_id} has no active episode")
        return Publication(
            status="held" if text_of(state) == HELD else text_of(state),
            session_id=session_id,
            trajectory_id=text_of(trajectory_id) if text_of(state) != EpisodeStatus.EMPTY else "",
            stream_id=text_of(stream_id),
            interaction_count=int(turns or 0),
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
            raw_ep, turns, rewards = await pipe.execute()
            ep = {text_of(name): value for name, value in raw_ep.items()}
            now = time.time()
            state = text_of(ep.get(EpisodeFields.STATE))
            reason = (
                text_of(ep.get(EpisodeFields.END_REASON)) or end_reason
                if state == HELD
                else end_reason
            )
            hold_until = 0.0
            if self._should_hold(state, ep, turns, rewards):
                hold_until = now + self._policy.late_reward_timeout_s
            data, stats, summary = b"", {"interactions": 0, "joined": 0}, b""
            if turns and state in {EpisodeStatus.ACTIVE, HELD} and not hold_until:
                data, stats, summary = self._encode(
                    key, ep, turns, rewards, end_reason=reason, now=now
                )
            group_id = text_of(ep.get(EpisodeFields.GROUP_ID))
            trajectory_id = text_of(ep.get(EpisodeFields.TRAJECTORY_ID))
            result = await self._scripts.publish.run(
                self._redis,
                PublishCall(
                    key=self._keys.key(key.digest),
                    episode_hash=ep_key,
                    turns=self._keys.turns(key.key_id, key.episode),
                    rewards=self._keys.rewards(key.key_id, key.episode),
                    interaction_index=self._keys.interaction_index(key.key_id, key.episode),
                    trajectories=self._keys.trajectories,
                    stats=self._keys.stats,
                    idle=self._keys.idle,
                    awaiting_reward=self._keys.awaiting_reward,
                    trajectory_group=self._keys.trajectory_group(trajectory_id),
                    group=self._keys.group(group_id) if group_id else self._keys.stats,
                    session=self._keys.session(key.key_id, key.session_id)
                    if key.mode == HEADER_MODE
                    else self._keys.stats,
                    episode_turns=self._keys.episode_turns,
                    recent_trajectories=self._keys.recent_trajectories,
                    episode=key.episode,
                    epoch=key.epoch,
                    turn_count=len(turns),
                    trajectory_id=trajectory_id,
                    codec=CODEC,
                    data=data,
                    now=now,
                    end_reason=reason,
                    ttl_s=ENDED_EPISODE_TTL_S,
                    member=member,
                    interactions=stats["interactions"],
                    joined=stats["joined"],
                    hold_until=hold_until,
                    group_id=group_id,
                    group_size=int(ep.get(EpisodeFields.GROUP_SIZE) or 0),
                    mode=key.mode,
                    summary=summary,
                    recent_kept=RECENT_KEPT,
                ),
            )
            if result.status is Publish.RETRY:
                continue
            if result.status in ENDED:
                status = result.status.value
                if self.on_ended is not None and state in {EpisodeStatus.ACTIVE, HELD}:
                    # Counted once: an episode this call found already ended is a retry.
                    since = float(ep.get(EpisodeFields.ENDED_AT) or now) if state == HELD else now
                    self.on_ended(status, reason, max(0.0, time.time() - since))
                return self._ended(key, result, end_reason=reason)
            if result.status is Publish.MISSING:
                raise Conflict(f"episode {key.episode} no longer exists")
            raise Conflict(f"episode {key.episode} is no longer the key's active episode")
        raise Unavailable(
            "turns kept landing while the episode was being published; retry",
            code="publish_contended",
            retry_after_s=1.0,
        )

    def _should_hold(
        self, state: str, ep: dict[str, bytes], turns: list[bytes], rewards: dict[bytes, bytes]
    ) -> bool:
        if self._policy.late_reward_timeout_s <= 0 or state != EpisodeStatus.ACTIVE or not turns:
            return False
        return ep.get(EpisodeFields.LAST_INTERACTION, b"") not in rewards

    def _ended(self, key: KeyState, result: Published, *, end_reason: str) -> Publication:
        publication = Publication(
            status=result.status.value,
            session_id=key.session_id or key.episode,
            stream_id=result.stream_id,
            trajectory_id=result.trajectory_id,
            interaction_count=result.turns,
        )
        log.info(
            "episode_ended",
            status=publication.status,
            session_id=key.episode,
            trajectory_id=publication.trajectory_id,
            turns=publication.interaction_count,
            end_reason=end_reason,
        )
        return publication

    def _encode(
        self,
        key: KeyState,
        ep: dict[str, bytes],
        turns: list[bytes],
        rewards: dict[bytes, bytes],
        *,
        end_reason: str,
        now: float,
    ) -> tuple[bytes, dict[str, int], bytes]:
        ended_at = float(ep[EpisodeFields.ENDED_AT]) if ep.get(EpisodeFields.ENDED_AT) else now
        info = EpisodeInfo(
            trajectory_id=text_of(ep.get(EpisodeFields.TRAJECTORY_ID)),
            session_id=text_of(ep.get(EpisodeFields.SESSION_ID)) or key.episode,
            task_id=text_of(ep.get(EpisodeFields.TASK_ID)),
            key_id=key.key_id,
            episode=key.episode,
            started_at=float(ep.get(EpisodeFields.STARTED_AT) or now),
            ended_at=ended_at,
            end_reason=end_reason,
            group_id=text_of(ep.get(EpisodeFields.GROUP_ID)) or None,
            group_size=int(ep.get(EpisodeFields.GROUP_SIZE) or 0) or None,
        )
        parsed = {k.decode(): float(v) for k, v in rewards.items()}
        trajectory = build_trajectory(info, turns, parsed)
        stats = trajectory.get("stats", {})
        counts = {
            "interactions": int(stats.get("interactions", len(turns))),
            "joined": int(stats.get("joined", 0)),
        }
        return encode_trajectory(trajectory), counts, trajectory_summary(trajectory)

    async def claim_due(self, *, held: bool, lease_s: float, limit: int) -> list[str]:
        """Claims due `digest/episode` members: idle active episodes, or held ones (held)."""
        zset = self._keys.awaiting_reward if held else self._keys.idle
        return await self._scripts.claim_due.run(
            self._redis, ClaimDueCall(zset=zset, now=time.time(), lease_s=lease_s, limit=limit)
        )

    async def reap_idle(self, member: str) -> Publication | None:
        """Ends the idle episode `digest/episode` if it is still active and still idle."""
        digest, _, episode = member.partition("/")
        key = await self._lookup.read_key(digest)
        if key is not None and key.mode == HEADER_MODE:
            key = await self._lookup.header_episode(key, episode)
        if key is None or not key.active or key.episode != episode:
            await self._redis.zrem(self._keys.idle, member)
            return None
        last = await self._redis.hget(
            self._keys.episode(key.key_id, episode), EpisodeFields.LAST_ACTIVE_AT
        )
        due = float(last or 0) + self._policy.session_idle_timeout_s
        if due > time.time():
            # GT: a turn that started since the claim raised the deadline to its lease's,
            # which must hold; XX: a member published meanwhile stays gone.
            await self._redis.zadd(self._keys.idle, {member: due}, xx=True, gt=True)
            return None
        return await self.publish(key, end_reason="idle")

    async def release_held(self, member: str) -> Publication | None:
        """Publishes the held episode `digest/episode` whose late reward never came (0)."""
        digest, _, episode = member.partition("/")
        key_id = key_id_of(digest)
        state, epoch = await self._redis.hmget(
            self._keys.episode(key_id, episode), EpisodeFields.STATE, EpisodeFields.EPOCH
        )
        if text_of(state) != HELD:
            await self._redis.zrem(self._keys.awaiting_reward, member)
            return None
        held = KeyState(
            digest=digest, key_id=key_id, active=False, episode=episode, epoch=int(epoch or 0)
        )
        return await self.publish(held, end_reason="")
