"""The turn ledger's storage: a turn's start (episode, lease, version in one script) and its
append (one script), and the completed interactions of an episode."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, TypeVar

from redis.exceptions import NoScriptError

from services.dataproxy.binding import EpisodeBinder
from services.dataproxy.episode_state import (
    BETWEEN_EPISODES,
    EPISODE_ENDED,
    HEADER_MODE,
    MAX_PUBLISH_ATTEMPTS,
    MAX_RECORD_ATTEMPTS,
    NEEDS_SESSION,
    ActiveEpisode,
    History,
    KeyLookup,
    StoreContext,
    StorePart,
    session_name,
)
from services.dataproxy.redis_keys import KeyFields, KeyStatus
from services.dataproxy.scripts import (
    AppendedTurn,
    AppendTurn,
    AppendTurnCall,
    BeganTurn,
    BeginTurn,
    BeginTurnCall,
)
from services.dataproxy.turns import decode_turns, history_entry
from services.runtime.errors import (
    InvalidRequest,
    Unavailable,
)
from services.runtime.keys import key_id_of
from services.runtime.logs import get_logger
from services.runtime.redis_pipeline import PipelinedScripts
from services.runtime.redis_scripts import text_of

log = get_logger(__name__)

T = TypeVar("T")


class TurnStore(StorePart):
    """Begins and appends turns of active episodes (on the ledger's pipelined connection when
    there is one: the scripts of the turns that start or end together share a socket write)."""

    def __init__(
        self,
        ctx: StoreContext,
        *,
        lookup: KeyLookup,
        binder: EpisodeBinder,
        pipelined: PipelinedScripts | None = None,
    ) -> None:
        super().__init__(ctx)
        self._lookup = lookup
        self._binder = binder
        self._turn_scripts = pipelined or ctx.redis

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
            began = await self._scripts.begin_turn.run(
                self._turn_scripts,
                self._begin_call(
                    digest, session_id=session_id, token=token, lease_until=lease_until
                ),
            )
            if began.status is BeginTurn.OK:
                return self._episode(began, digest, session_id=session_id, token=token)
            if began.status is BeginTurn.PAUSED:
                return None
            if began.status is BeginTurn.UNKNOWN:
                raise await self._revoker.refusal(digest)
            if began.status is BeginTurn.NOT_ACTIVE:
                raise Unavailable(BETWEEN_EPISODES, code="episode_not_active", retry_after_s=1.0)
            if began.status is BeginTurn.NEEDS_SESSION:
                raise InvalidRequest(NEEDS_SESSION, code="session_id_required")
            await self._binder.start_header_episode(digest, session_name(session_id), began.epoch)
        raise Unavailable(
            "the session's episode kept ending while this turn started; retry",
            code="session_contended",
            retry_after_s=1.0,
        )

    def send_begin(
        self,
        digest: str,
        *,
        session_id: str,
        token: str,
        lease_until: float,
        then: Callable[[ActiveEpisode], T],
    ) -> asyncio.Future[T | None] | None:
        """`begin_turn`'s first attempt sent now on the pipelined connection, without a task:
        the future of `then(the episode it admitted the turn to)`, resolved as the reply is
        read; of None when it did not admit it at once (paused, between episodes, an unknown
        key, a header-mode session to bind, NOSCRIPT...: nothing was taken, and `begin_turn`
        decides). None without a pipelined connection."""
        if not isinstance(self._turn_scripts, PipelinedScripts):
            return None
        script = self._scripts.begin_turn

        def began(reply: Any) -> T | None:
            began = script.parse(reply)
            if began.status is not BeginTurn.OK:
                return None
            return then(self._episode(began, digest, session_id=session_id, token=token))

        return script.send(
            self._turn_scripts,
            self._begin_call(digest, session_id=session_id, token=token, lease_until=lease_until),
            then=began,
            or_none=NoScriptError,
        )

    def _begin_call(
        self, digest: str, *, session_id: str, token: str, lease_until: float
    ) -> BeginTurnCall:
        return BeginTurnCall(
            key=self._keys.key(digest),
            paused=self._keys.paused,
            in_flight=self._keys.in_flight,
            weight_version=self._keys.weight_version,
            session=self._keys.session(key_id_of(digest), session_id)
            if session_id
            else self._keys.paused,
            idle=self._keys.idle,
            episode_turns=self._keys.episode_turns,
            token=token,
            lease_until=lease_until,
            now=time.time(),
            session_id=session_id,
            digest=digest,
        )

    @staticmethod
    def _episode(began: BeganTurn, digest: str, *, session_id: str, token: str) -> ActiveEpisode:
        header = began.mode == HEADER_MODE
        return ActiveEpisode(
            digest=digest,
            key_id=began.key_id,
            episode=began.episode,
            epoch=began.epoch,
            weight_version=began.weight_version,
            mode=began.mode,
            client_session_id=session_id if header else "",
            lease_token=token,
        )

    def send_append(
        self,
        episode: ActiveEpisode,
        *,
        interaction_id: str,
        record: bytes,
        then: Callable[[int], T],
    ) -> asyncio.Future[T | None] | None:
        """`record_turn`'s first attempt (at the admission's weight version) sent now on the
        pipelined connection: the future of `then(the index it appended the turn at)`,
        resolved as the reply is read; of None when it was not appended at once (the weight
        version moved meanwhile: `record_turn` re-encodes it; NOSCRIPT, a failed call:
        appending is idempotent by interaction id). Unavailable when the episode ended.
        None without a pipelined connection."""
        if not isinstance(self._turn_scripts, PipelinedScripts):
            return None
        script = self._scripts.append_turn

        def appended(reply: Any) -> T | None:
            appended = script.parse(reply)
            if appended.status is AppendTurn.VERSION:
                return None
            return then(self._appended(episode, interaction_id, appended))

        return script.send(
            self._turn_scripts,
            self._append_call(
                episode,
                interaction_id=interaction_id,
                record=record,
                expected=episode.weight_version,
            ),
            then=appended,
            or_none=Exception,
        )

    async def record_turn(
        self, episode: ActiveEpisode, *, interaction_id: str, encode: Callable[[int], bytes]
    ) -> int:
        """Appends the turn `encode(weight_version_end)` and releases its lease, in one round
        trip (a second only when the weight version moved while the turn ran)."""
        version = episode.weight_version
        for _ in range(MAX_RECORD_ATTEMPTS):
            appended = await self._append(
                episode, interaction_id=interaction_id, record=encode(version), expected=version
            )
            if appended.status is not AppendTurn.VERSION:
                return self._appended(episode, interaction_id, appended)
            version = appended.value
        raise Unavailable(
            "the weight version kept changing while this turn was recorded; retry",
            code="version_contended",
            retry_after_s=1.0,
        )

    async def active_episode(self, digest: str) -> ActiveEpisode:
        """The key's active episode and the weight version, in one round trip."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.hmget(
            self._keys.key(digest),
            KeyFields.KEY_ID,
            KeyFields.STATE,
            KeyFields.EPISODE,
            KeyFields.EPOCH,
        )
        pipe.get(self._keys.weight_version)
        (key_id, state, episode, epoch), weight_version = await pipe.execute()
        if key_id is None:
            raise await self._revoker.refusal(digest)
        if text_of(state) != KeyStatus.ACTIVE:
            raise Unavailable(BETWEEN_EPISODES, code="episode_not_active", retry_after_s=1.0)
        return ActiveEpisode(
            digest=digest,
            key_id=key_id.decode(),
            episode=text_of(episode),
            epoch=int(epoch or 0),
            weight_version=int(weight_version or 0),
        )

    async def append_turn(
        self, episode: ActiveEpisode, *, interaction_id: str, record: bytes
    ) -> int:
        """Appends a completed turn if its episode is still active; returns its index."""
        appended = await self._append(
            episode, interaction_id=interaction_id, record=record, expected=-1
        )
        return self._appended(episode, interaction_id, appended)

    async def _append(
        self, episode: ActiveEpisode, *, interaction_id: str, record: bytes, expected: int
    ) -> AppendedTurn:
        return await self._scripts.append_turn.run(
            self._turn_scripts,
            self._append_call(
                episode, interaction_id=interaction_id, record=record, expected=expected
            ),
        )

    def _append_call(
        self, episode: ActiveEpisode, *, interaction_id: str, record: bytes, expected: int
    ) -> AppendTurnCall:
        now = time.time()
        return AppendTurnCall(
            key=self._keys.key(episode.digest),
            episode_hash=self._keys.episode(episode.key_id, episode.episode),
            turns=self._keys.turns(episode.key_id, episode.episode),
            interaction_index=self._keys.interaction_index(episode.key_id, episode.episode),
            idle=self._keys.idle,
            in_flight=self._keys.in_flight,
            weight_version=self._keys.weight_version,
            episode_turns=self._keys.episode_turns,
            episode=episode.episode,
            epoch=episode.epoch,
            interaction_id=interaction_id,
            record=record,
            now=now,
            idle_until=now + self._policy.session_idle_timeout_s,
            idle_member=episode.idle_member,
            lease_token=episode.lease_token,
            expected_version=expected,
            mode=episode.mode,
        )

    def _appended(self, episode: ActiveEpisode, interaction_id: str, appended: AppendedTurn) -> int:
        if appended.status is AppendTurn.ENDED:
            raise Unavailable(EPISODE_ENDED, code="episode_ended", retry_after_s=1.0)
        if appended.status is AppendTurn.DUPLICATE:
            log.warning(
                "turn_already_recorded", session_id=episode.episode, interaction_id=interaction_id
            )
        return appended.value

    async def history(self, digest: str) -> History:
        """The completed interactions of the key's current episode (none between episodes)."""
        key = await self._lookup.resolve(digest)
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
