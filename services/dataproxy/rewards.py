"""Rewards: the reward of an interaction of the active episode, or of an ended episode held
for a late reward (which its last interaction's reward publishes)."""

from __future__ import annotations

import math

from services.dataproxy.episode_state import (
    HEADER_MODE,
    HELD,
    NO_ACTIVE_EPISODE,
    KeyLookup,
    KeyState,
    StoreContext,
    StorePart,
    held_state,
    session_name,
)
from services.dataproxy.publication import Publisher
from services.dataproxy.redis_keys import EpisodeFields
from services.dataproxy.scripts import SetReward, SetRewardCall
from services.runtime.errors import (
    Conflict,
    InvalidRequest,
    NotFound,
)
from services.runtime.logs import get_logger

log = get_logger(__name__)


class Rewards(StorePart):
    """Sets rewards by interaction id (or the last interaction)."""

    def __init__(self, ctx: StoreContext, *, lookup: KeyLookup, publisher: Publisher) -> None:
        super().__init__(ctx)
        self._lookup = lookup
        self._publisher = publisher

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
        key = await self._lookup.resolve(digest)
        target, mode = await self._reward_target(key, session_id)
        result = await self._scripts.set_reward.run(
            self._redis,
            SetRewardCall(
                key=self._keys.key(digest),
                episode_hash=self._keys.episode(key.key_id, target.episode),
                rewards=self._keys.rewards(key.key_id, target.episode),
                interaction_index=self._keys.interaction_index(key.key_id, target.episode),
                episode=target.episode,
                epoch=target.epoch,
                interaction_id=interaction_id,
                reward=float(reward),
                mode=mode,
            ),
        )
        if result.status is SetReward.NOT_ACTIVE:
            raise Conflict(NO_ACTIVE_EPISODE)
        if result.status is SetReward.NO_INTERACTION:
            raise Conflict("no completed interaction yet: chat first, then set the reward")
        if result.status is SetReward.NOT_FOUND:
            raise NotFound(f"interaction {interaction_id} not found in the current episode")
        log.info(
            "reward_set", session_id=target.episode, interaction_id=result.interaction_id, mode=mode
        )
        if mode == "held" and result.is_last:
            await self._publisher.publish(target, end_reason="")
        return result.interaction_id

    async def _reward_target(self, key: KeyState, session_id: str) -> tuple[KeyState, str]:
        if key.mode == HEADER_MODE:
            return await self._header_reward_target(key, session_name(session_id))
        if session_id and not (key.active and key.episode == session_id):
            state, epoch = await self._redis.hmget(
                self._keys.episode(key.key_id, session_id), EpisodeFields.STATE, EpisodeFields.EPOCH
            )
            if state is None:
                raise NotFound(f"episode {session_id} not found for this key")
            if state != HELD.encode():
                raise Conflict(f"episode {session_id} has ended and was published already")
            return held_state(key, session_id, int(epoch or 0)), "held"
        if not session_id and not key.active and key.held:
            epoch = await self._redis.hget(
                self._keys.episode(key.key_id, key.held), EpisodeFields.EPOCH
            )
            return held_state(key, key.held, int(epoch or 0)), "held"
        if not key.active:
            raise Conflict(NO_ACTIVE_EPISODE)
        return key, "active"

    async def _header_reward_target(self, key: KeyState, session_id: str) -> tuple[KeyState, str]:
        target = await self._lookup.session_episode(key, session_id)
        if target.active:
            return target, "episode"
        state = await self._redis.hget(
            self._keys.episode(key.key_id, target.episode), EpisodeFields.STATE
        )
        if state != HELD.encode():
            raise Conflict(f"session {session_id} has no active episode (its last one ended)")
        return target, "held"
