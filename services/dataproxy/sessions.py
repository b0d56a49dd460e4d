"""The session store: start, refresh, end, resolve, reward and publish episodes in Redis, and
the storage side of the turn ledger.

Every transition is one Lua script that checks the key's state and epoch (docs/internals.md),
so a late turn never lands in the next episode and a retried publication never adds a second
stream entry. The store is split by concern, and this class is what its callers use:
`episode_state` (states, messages, reading a key), `binding` (start, groups, refresh,
header-mode sessions, capacity), `publication` (ending and publishing, the reaper's entry
points), `rewards`, `turn_store` (a turn's begin and append, history).
"""

from __future__ import annotations

from collections.abc import Callable

import redis.asyncio as aioredis

from services.dataproxy.binding import EpisodeBinder
from services.dataproxy.episode_state import (
    HEADER_MODE,
    ActiveEpisode,
    EpisodePolicy,
    History,
    IssuedKey,
    KeyLookup,
    KeyState,
    Publication,
    StartedSession,
    StoreContext,
)
from services.dataproxy.publication import EndedHook, Publisher
from services.dataproxy.redis_keys import RedisKeys
from services.dataproxy.revocation import SessionKeyRevoker
from services.dataproxy.rewards import Rewards
from services.dataproxy.scripts import Scripts
from services.dataproxy.turn_store import TurnStore
from services.runtime.redis_pipeline import PipelinedScripts
from services.runtime.secret import Keys

__all__ = [
    "ActiveEpisode",
    "EpisodePolicy",
    "History",
    "IssuedKey",
    "KeyState",
    "Publication",
    "SessionStore",
    "StartedSession",
]


class SessionStore:
    """Sessions, episodes and their turns in Redis, under one key prefix."""

    def __init__(
        self,
        *,
        redis: aioredis.Redis,
        keys: RedisKeys,
        scripts: Scripts,
        admin_key: Keys,
        refresh_lock_s: float,
        policy: EpisodePolicy | None = None,
        pipelined: PipelinedScripts | None = None,
    ) -> None:
        ctx = StoreContext(
            redis=redis,
            keys=keys,
            scripts=scripts,
            admin_key=admin_key,
            refresh_lock_s=refresh_lock_s,
            policy=policy or EpisodePolicy(),
            revoker=SessionKeyRevoker(redis=redis, keys=keys),
        )
        self._policy = ctx.policy
        self._lookup = KeyLookup(ctx)
        self._publisher = Publisher(ctx, lookup=self._lookup)
        self._binder = EpisodeBinder(ctx, lookup=self._lookup, publisher=self._publisher)
        self._rewards = Rewards(ctx, lookup=self._lookup, publisher=self._publisher)
        self._turns = TurnStore(ctx, lookup=self._lookup, binder=self._binder, pipelined=pipelined)

    @property
    def policy(self) -> EpisodePolicy:
        """The lifecycle settings in force."""
        return self._policy

    @property
    def turns(self) -> TurnStore:
        """The turn ledger's storage (begin and append, also sent without a task)."""
        return self._turns

    @property
    def on_ended(self) -> EndedHook | None:
        """Called with (status, end reason, seconds from the episode's end to this outcome) of
        every episode this replica ended (docs/metrics.md); None: not counted."""
        return self._publisher.on_ended

    @on_ended.setter
    def on_ended(self, hook: EndedHook | None) -> None:
        self._publisher.on_ended = hook

    async def start(self, *, task_id: str, api_key: str, group_size: int = 0) -> StartedSession:
        """A new key with its first episode, a group of new keys, or a refresh of `api_key`."""
        return await self._binder.start(task_id=task_id, api_key=api_key, group_size=group_size)

    async def issue_key(self, *, task_id: str = "", mode: str = HEADER_MODE) -> IssuedKey:
        """A long-lived header-mode key: each X-Session-Id it sends names an episode."""
        return await self._binder.issue_key(task_id=task_id, mode=mode)

    async def end(self, digest: str, *, session_id: str = "") -> Publication:
        """Ends the key's active episode (header mode: the session's) and publishes it.

        A retry on an idle key whose last episode ended within END_RETRY_WINDOW_S gets that
        publication again (the first reply may have been lost); nothing is published twice.
        """
        return await self._publisher.end(digest, session_id=session_id)

    async def end_after_turn(self, episode: ActiveEpisode) -> Publication | None:
        """`X-Session-Done`: ends the header-mode episode the turn ran in (None: ended already)."""
        return await self._publisher.end_after_turn(episode)

    async def publish(self, key: KeyState, *, end_reason: str) -> Publication:
        """Ends the episode `key` names, once: a retry returns the stored ids.

        An active episode is published, or held for a late reward when that option is on and
        its last interaction has none; a held one (`key.active` False) is published.
        """
        return await self._publisher.publish(key, end_reason=end_reason)

    async def claim_due(self, *, held: bool, lease_s: float, limit: int) -> list[str]:
        """Claims due `digest/episode` members: idle active episodes, or held ones (held)."""
        return await self._publisher.claim_due(held=held, lease_s=lease_s, limit=limit)

    async def reap_idle(self, member: str) -> Publication | None:
        """Ends the idle episode `digest/episode` if it is still active and still idle."""
        return await self._publisher.reap_idle(member)

    async def release_held(self, member: str) -> Publication | None:
        """Publishes the held episode `digest/episode` whose late reward never came (0)."""
        return await self._publisher.release_held(member)

    async def set_reward(
        self, digest: str, *, reward: float, interaction_id: str, session_id: str = ""
    ) -> str:
        """Stores the reward of the named (or last) interaction; returns its id.

        The target episode: `session_id` when given; else the key's episode held for a late
        reward when the key has no active episode; else the active one. A reward for the last
        interaction of a held episode publishes it.
        """
        return await self._rewards.set_reward(
            digest, reward=reward, interaction_id=interaction_id, session_id=session_id
        )

    async def begin_turn(
        self, digest: str, *, session_id: str, token: str, lease_until: float
    ) -> ActiveEpisode | None:
        """Resolves the key's (or session's) episode, takes the in-flight lease and keeps the
        episode's idle deadline at least until the lease's, in one round trip; None while
        submission is paused (nothing taken).

        A header-mode key's first call with a new session id binds an episode for it first
        (waiting for capacity like any start); other keys ignore `session_id`.
        """
        return await self._turns.begin_turn(
            digest, session_id=session_id, token=token, lease_until=lease_until
        )

    async def record_turn(
        self, episode: ActiveEpisode, *, interaction_id: str, encode: Callable[[int], bytes]
    ) -> int:
        """Appends the turn `encode(weight_version_end)` and releases its lease, in one round
        trip (a second only when the weight version moved while the turn ran)."""
        return await self._turns.record_turn(episode, interaction_id=interaction_id, encode=encode)

    async def active_episode(self, digest: str) -> ActiveEpisode:
        """The key's active episode and the weight version, in one round trip."""
        return await self._turns.active_episode(digest)

    async def append_turn(
        self, episode: ActiveEpisode, *, interaction_id: str, record: bytes
    ) -> int:
        """Appends a completed turn if its episode is still active; returns its index."""
        return await self._turns.append_turn(episode, interaction_id=interaction_id, record=record)

    async def history(self, digest: str) -> History:
        """The completed interactions of the key's current episode (none between episodes)."""
        return await self._turns.history(digest)

    async def resolve(self, digest: str) -> KeyState:
        """The key's state; unknown keys are Unauthenticated."""
        return await self._lookup.resolve(digest)
