"""The turn ledger: a turn's start (admission) and its end (the record), as the gateway asks.

The gateway relays the worker's stream to its client itself; the dataproxy sees a turn twice:
`begin` resolves the key's episode, waits while submission is paused and takes the in-flight
lease (one script), and `record` appends the worker's record to the episode (one script)
before the gateway lets the client see the end. Between the two the gateway holds an opaque
ticket naming the episode and the lease, so any replica can record or release the turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack  # type: ignore[import-untyped]

from protos import common_pb2
from schema.trajectory import VERSIONS_AT_ADMISSION, VERSIONS_UNCOUNTED
from services.dataproxy.control import Control, TurnLease
from services.dataproxy.sessions import ActiveEpisode, SessionStore
from services.dataproxy.turns import PriorTurns, TurnEncoder, output_length, per_token_versions
from services.runtime.errors import InvalidRequest
from services.runtime.logs import get_logger

log = get_logger(__name__)


_TICKET_VERSION = 1


@dataclass(slots=True, kw_only=True)  # not frozen: built every turn (half the cost)
class Admission:
    """An admitted turn: the ticket the gateway hands back, its version and session."""

    ticket: bytes
    weight_version: int
    session_id: str
    # The lease token inside the ticket (the streams' bookkeeping of unfinished turns).
    token: str


@dataclass(slots=True, kw_only=True)  # not frozen: built every turn (half the cost)
class TurnEnd:
    """What the gateway sends when the worker's answer is complete."""

    record: common_pb2.TurnRecord
    # {"tools"?, "messages"} as forwarded.
    request_json: bytes
    # Record under this id (the id the client saw) instead of the completion id.
    interaction_id: str = ""
    turn_type: str = "main"
    # End and publish the header-mode session after this turn (X-Session-Done).
    session_done: bool = False
    request_id: str = ""
    # Streamed: (tokens, version) of each batch as it passed the gateway, in order.
    streamed: bool = False
    spans: Sequence[tuple[int, int]] = ()


@dataclass(slots=True, kw_only=True)  # not frozen: built every turn (half the cost)
class RecordedTurn:
    """A turn that was appended to its episode."""

    interaction_id: str
    session_id: str
    index: int


@dataclass(slots=True, kw_only=True)  # not frozen: built every turn (half the cost)
class TokenVersions:
    """The version of each output token of a turn, or None: all carry the admission version."""

    versions: list[int] | None
    # Why `versions` is None: VERSIONS_AT_ADMISSION (non-streaming) or VERSIONS_UNCOUNTED.
    fallback: str = VERSIONS_AT_ADMISSION


class _Turn:
    """A turn being recorded: what its append needs, encoded per attempt (`encode`)."""

    __slots__ = ("encoder", "end", "episode", "memory", "now", "record", "versions")

    def __init__(
        self,
        *,
        episode: ActiveEpisode,
        end: TurnEnd,
        record: common_pb2.TurnRecord,
        versions: TokenVersions,
        memory: tuple[str, str, int],
        encoder: TurnEncoder,
        now: float,
    ) -> None:
        self.episode = episode
        self.end = end
        self.record = record
        self.versions = versions
        self.memory = memory
        self.encoder = encoder
        self.now = now

    def encode(self, version_end: int) -> bytes:
        """The record with `version_end` as the version the turn finished under."""
        versions = self.versions
        return self.encoder.encode(
            weight_version=self.episode.weight_version,
            weight_version_end=version_end,
            now=self.now,
            turn_type=self.end.turn_type or "main",
            output_versions=versions.versions,
            output_versions_source=versions.fallback,
        )


def _admission(episode: ActiveEpisode) -> Admission:
    return Admission(
        ticket=encode_ticket(episode),
        weight_version=episode.weight_version,
        session_id=episode.session_id,
        token=episode.lease_token,
    )


def encode_ticket(episode: ActiveEpisode) -> bytes:
    """The opaque ticket of an admitted turn: its episode and lease."""
    return bytes(
        msgpack.packb(
            [
                _TICKET_VERSION,
                episode.digest,
                episode.key_id,
                episode.episode,
                episode.epoch,
                episode.weight_version,
                episode.mode,
                episode.client_session_id,
                episode.lease_token,
            ],
            use_bin_type=True,
        )
    )


def decode_ticket(ticket: bytes) -> ActiveEpisode:
    """The episode and lease a ticket names; InvalidRequest when it is not a ticket."""
    try:
        fields: Any = msgpack.unpackb(ticket, raw=False)
        version, digest, key_id, episode, epoch, weight_version, mode, session, token = fields
        if version != _TICKET_VERSION:
            raise ValueError(version)
        return ActiveEpisode(
            digest=str(digest),
            key_id=str(key_id),
            episode=str(episode),
            epoch=int(epoch),
            weight_version=int(weight_version),
            mode=str(mode),
            client_session_id=str(session),
            lease_token=str(token),
        )
    except (ValueError, TypeError, msgpack.UnpackException):
        raise InvalidRequest("the turn ticket is not one this dataproxy issued") from None


def _lease(episode: ActiveEpisode) -> TurnLease:
    return TurnLease(
        token=episode.lease_token,
        weight_version=episode.weight_version,
        member=episode.idle_member,
    )


class TurnLedger:
    """Admits and records turns; owns no connection of its own."""

    def __init__(self, *, store: SessionStore, control: Control) -> None:
        self._store = store
        self._control = control
        # Each open episode's latest turn: the next one stores only what it adds to it.
        self._prior = PriorTurns()

    async def begin(self, digest: str, *, session_id: str, request_id: str = "") -> Admission:
        """The key's episode (401/503/400 first) and admission (waits while paused): one
        script per attempt, which also takes the in-flight lease."""

        async def begin(token: str, lease_until: float) -> ActiveEpisode | None:
            return await self._store.begin_turn(
                digest, session_id=session_id, token=token, lease_until=lease_until
            )

        episode, _ = await self._control.admit(begin)
        return _admission(episode)

    def begin_now(self, digest: str, *, session_id: str) -> asyncio.Future[Admission | None] | None:
        """`begin`'s first attempt without a task or coroutine (the common turn: admitted at
        once): its script sent now, the future resolved from the reply's callback with the
        Admission, or with None when the turn was not admitted at once — paused, between
        episodes, an unknown key, a header-mode session to bind, NOSCRIPT: nothing was taken,
        and `begin` decides (it runs the script again). None without a pipelined connection."""
        token, lease_until = self._control.new_lease()
        return self._store.turns.send_begin(
            digest, session_id=session_id, token=token, lease_until=lease_until, then=_admission
        )

    async def release(self, ticket: bytes) -> None:
        """A turn that ends without a record: its lease goes (once; a second release and a
        release after the append change nothing)."""
        await self._control.release(_lease(decode_ticket(ticket)))

    async def record(self, ticket: bytes, end: TurnEnd) -> RecordedTurn:
        """Appends the turn to its episode (one script; a second only when the weight version
        moved meanwhile) and releases its lease; publishes first with `session_done`."""
        episode = decode_ticket(ticket)
        try:
            return await self._record(episode, end)
        except BaseException:
            # The append releases the lease on every path it reaches; this covers the rest.
            with contextlib.suppress(Exception):
                await asyncio.shield(self._control.release(_lease(episode)))
            raise

    async def _record(self, episode: ActiveEpisode, end: TurnEnd) -> RecordedTurn:
        turn = self._prepare(episode, end)
        index = await self._store.record_turn(
            episode, interaction_id=turn.record.interaction_id, encode=turn.encode
        )
        recorded = self._recorded(turn, index)
        if end.session_done and episode.client_session_id:
            await self._store.end_after_turn(episode)
        return recorded

    def record_now(
        self, episode: ActiveEpisode, end: TurnEnd
    ) -> asyncio.Future[RecordedTurn | None] | None:
        """`record`'s first attempt without a task or coroutine: the append sent now at the
        admission's weight version, the future resolved from the reply's callback with the
        recorded turn, or with None when it was not recorded at once — the version moved,
        NOSCRIPT, a failed call — for `record` to finish (appending is idempotent by
        interaction id: a retry of an append that did land finds it). Unavailable when the
        episode ended (the append released the lease). `episode` is the turn's ticket,
        decoded. None when the turn takes `record` from the start (it ends a header-mode
        session, there is no pipelined connection)."""
        if end.session_done and episode.client_session_id:
            return None
        turn = self._prepare(episode, end)
        return self._store.turns.send_append(
            episode,
            interaction_id=turn.record.interaction_id,
            record=turn.encode(episode.weight_version),
            then=lambda index: self._recorded(turn, index),
        )

    def _prepare(self, episode: ActiveEpisode, end: TurnEnd) -> _Turn:
        record = end.record
        if end.interaction_id:
            record.interaction_id = end.interaction_id
        if not record.interaction_id:
            # Every interaction needs an id for set_reward; the worker should have sent one.
            record.interaction_id = "chatcmpl-rg-" + secrets.token_hex(12)
        memory = (episode.key_id, episode.episode, episode.epoch)
        return _Turn(
            episode=episode,
            end=end,
            record=record,
            versions=self._versions(episode, end),
            memory=memory,
            encoder=TurnEncoder(
                record, request_json=end.request_json, prior=self._prior.get(memory)
            ),
            now=time.time(),
        )

    def _recorded(self, turn: _Turn, index: int) -> RecordedTurn:
        """What follows an append: the episode's latest turn remembered, the turn's log line."""
        self._prior.put(turn.memory, turn.encoder.recorded_at(index))
        record, versions = turn.record, turn.versions
        log.info(
            "turn_recorded",
            session_id=turn.episode.session_id,
            interaction_id=record.interaction_id,
            index=index,
            request_id=turn.end.request_id,
            output_tokens=output_length(record),
            finish_reason=record.finish_reason,
            per_token_versions=versions.versions is not None,
        )
        if versions.versions is None and versions.fallback == VERSIONS_UNCOUNTED:
            log.warning(
                "turn_versions_uncounted",
                interaction_id=record.interaction_id,
                output_tokens=output_length(record),
            )
        return RecordedTurn(
            interaction_id=turn.record.interaction_id,
            session_id=turn.episode.session_id,
            index=index,
        )

    @staticmethod
    def _versions(episode: ActiveEpisode, end: TurnEnd) -> TokenVersions:
        if not end.streamed:
            # Nothing says where in the answer a version change fell: all get admission's.
            return TokenVersions(versions=None)
        # Never older than the admission version, whatever the gateway's view said.
        spans = [(tokens, max(version, episode.weight_version)) for tokens, version in end.spans]
        versions = per_token_versions(spans, output_length(end.record))
        return TokenVersions(versions=versions, fallback=VERSIONS_UNCOUNTED)
