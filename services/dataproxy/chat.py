"""One chat turn: resolve the episode, call the worker, append the turn, then say done."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import grpc

from protos import common_pb2, worker_pb2, worker_pb2_grpc
from services.dataproxy.control import Control, TurnLease, WeightVersionView
from services.dataproxy.sessions import ActiveEpisode, SessionStore
from services.dataproxy.turns import (
    VERSIONS_AT_ADMISSION,
    VERSIONS_UNCOUNTED,
    PriorTurns,
    TurnEncoder,
    output_length,
    per_token_versions,
)
from services.runtime.errors import InvalidRequest, UpstreamError, from_rpc_error
from services.runtime.grpc_client import ChannelPool
from services.runtime.logs import get_logger

log = get_logger(__name__)

# Forwarding an abort is one small RPC to the worker.
ABORT_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnRequest:
    """A turn as the gateway asks for it."""

    key_digest: str
    worker_address: str
    body_json: bytes
    request_id: str
    # Record the turn under this id (the id the client saw) instead of the completion id.
    interaction_id: str = ""
    # OpenClaw-RL's headers: the session (header-mode keys only), main | side, and whether
    # to end the session's episode after this turn (header-mode keys only).
    session_id: str = ""
    turn_type: str = "main"
    session_done: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class RecordedTurn:
    """A turn that was appended to its episode."""

    interaction_id: str
    session_id: str
    index: int


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenVersions:
    """The version of each output token of a turn, or None: all carry the admission version."""

    versions: list[int] | None
    # Why `versions` is None: VERSIONS_AT_ADMISSION (non-streaming) or VERSIONS_UNCOUNTED.
    fallback: str = VERSIONS_AT_ADMISSION


class VersionSpans:
    """(tokens, version) of a streamed turn's chunks, in order, as they pass the dataproxy."""

    def __init__(self, *, view: WeightVersionView, admitted: int) -> None:
        self._view = view
        self._admitted = admitted
        self._spans: list[tuple[int, int]] = []

    def add(self, tokens: int) -> None:
        """Stamps `tokens` with the current version (never older than the admission one)."""
        if tokens <= 0:
            return
        version = max(self._view.current, self._admitted)
        if self._spans and self._spans[-1][1] == version:
            self._spans[-1] = (self._spans[-1][0] + tokens, version)
        else:
            self._spans.append((tokens, version))

    def for_record(self, record: common_pb2.TurnRecord) -> TokenVersions:
        """One version per output token, or the uncounted fallback if the counts disagree."""
        versions = per_token_versions(self._spans, output_length(record))
        return TokenVersions(versions=versions, fallback=VERSIONS_UNCOUNTED)


@dataclass(frozen=True, slots=True, kw_only=True)
class CompletedTurn:
    """A recorded non-streaming turn and the body the client gets."""

    body_json: bytes
    turn: RecordedTurn


class TurnRunner:
    """Runs turns against workers and records them; owns no connection of its own."""

    def __init__(
        self,
        *,
        store: SessionStore,
        channels: ChannelPool,
        turn_timeout_s: float,
        control: Control,
        versions: WeightVersionView,
    ) -> None:
        self._store = store
        self._channels = channels
        self._turn_timeout_s = turn_timeout_s
        self._control = control
        self._versions = versions
        # Each open episode's latest turn: the next one stores only what it adds to it.
        self._prior = PriorTurns()

    async def stream(
        self, request: TurnRequest
    ) -> AsyncGenerator[list[bytes] | RecordedTurn, None]:
        """Chunk batches as the worker sends them, then the RecordedTurn (after the append)."""
        episode, lease = await self._admit(request)
        recorded = False  # the append released the lease
        try:
            stub, generate = self._generate_request(request, episode)
            call = stub.Generate(generate, timeout=self._turn_timeout_s)
            record: common_pb2.TurnRecord | None = None
            spans = VersionSpans(view=self._versions, admitted=episode.weight_version)
            try:
                async for message in call:
                    if message.HasField("chunks"):
                        # Stamped as the batch passes, before the client sees it.
                        spans.add(message.chunks.output_tokens)
                        yield list(message.chunks.chunks)
                    elif message.HasField("record"):
                        record = message.record
            except grpc.aio.AioRpcError as err:
                raise from_rpc_error(err, hop="worker") from err
            finally:
                # A no-op once the call finished; stops the worker when our client went away.
                call.cancel()
            if record is None:
                raise UpstreamError("the worker ended the turn without a token record")
            turn = await self._record(episode, record, request, spans.for_record(record))
            recorded = True
            yield turn
        finally:
            if not recorded:
                await self._release(lease)

    async def complete(self, request: TurnRequest) -> CompletedTurn:
        """One non-streaming turn, recorded before its body is returned."""
        episode, lease = await self._admit(request)
        recorded = False  # the append released the lease
        try:
            stub, generate = self._generate_request(request, episode)
            call = stub.Complete(generate, timeout=self._turn_timeout_s)
            try:
                response = await call
            except grpc.aio.AioRpcError as err:
                raise from_rpc_error(err, hop="worker") from err
            except asyncio.CancelledError:
                call.cancel()
                raise
            # Nothing says where in the answer a version change fell: all tokens get admission's.
            turn = await self._record(
                episode, response.record, request, TokenVersions(versions=None)
            )
            recorded = True
        finally:
            if not recorded:
                await self._release(lease)
        return CompletedTurn(body_json=response.body_json, turn=turn)

    async def abort(self, *, key_digest: str, worker_address: str, request_id: str) -> bool:
        """Asks the worker running `request_id` to stop; the replica streaming it records it."""
        if not worker_address or not request_id:
            raise InvalidRequest("abort needs the worker address and the turn's request id")
        await self._store.resolve(key_digest)
        stub = worker_pb2_grpc.WorkerStub(self._channels.get(worker_address))
        try:
            answer = await stub.Abort(
                worker_pb2.AbortRequest(request_id=request_id), timeout=ABORT_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err, hop="worker") from err
        log.info("turn_abort_forwarded", request_id=request_id, found=answer.found)
        return bool(answer.found)

    async def _admit(self, request: TurnRequest) -> tuple[ActiveEpisode, TurnLease]:
        """The key's episode (401/503/400 first) and admission (waits while paused): one
        script per attempt, which also takes the in-flight lease."""
        if not request.worker_address:
            raise InvalidRequest("no worker address: the gateway must route the turn first")

        async def begin(token: str, lease_until: float) -> ActiveEpisode | None:
            return await self._store.begin_turn(
                request.key_digest,
                session_id=request.session_id,
                token=token,
                lease_until=lease_until,
            )

        return await self._control.admit(begin)

    async def _release(self, lease: TurnLease) -> None:
        # Shielded: a cancelled turn still stops counting as in flight (else its lease expires).
        with contextlib.suppress(Exception):
            await asyncio.shield(self._control.release(lease))

    def _generate_request(
        self, request: TurnRequest, episode: ActiveEpisode
    ) -> tuple[worker_pb2_grpc.WorkerStub, worker_pb2.GenerateRequest]:
        stub = worker_pb2_grpc.WorkerStub(self._channels.get(request.worker_address))
        generate = worker_pb2.GenerateRequest(
            body_json=request.body_json,
            weight_version=episode.weight_version,
            request_id=request.request_id,
        )
        return stub, generate

    async def _record(
        self,
        episode: ActiveEpisode,
        record: common_pb2.TurnRecord,
        request: TurnRequest,
        versions: TokenVersions,
    ) -> RecordedTurn:
        if request.interaction_id:
            record.interaction_id = request.interaction_id
        if not record.interaction_id:
            # Every interaction needs an id for set_reward; the worker should have sent one.
            record.interaction_id = "chatcmpl-rg-" + secrets.token_hex(12)
        now = time.time()
        memory_key = (episode.key_id, episode.episode, episode.epoch)
        encoder = TurnEncoder(record, prior=self._prior.get(memory_key))
        index = await self._store.record_turn(
            episode,
            interaction_id=record.interaction_id,
            encode=lambda version_end: encoder.encode(
                weight_version=episode.weight_version,
                weight_version_end=version_end,
                now=now,
                turn_type=request.turn_type,
                output_versions=versions.versions,
                output_versions_source=versions.fallback,
            ),
        )
        self._prior.put(memory_key, encoder.recorded_at(index))
        log.info(
            "turn_recorded",
            session_id=episode.session_id,
            interaction_id=record.interaction_id,
            index=index,
            request_id=request.request_id,
            output_tokens=len(record.output_token_ids),
            finish_reason=record.finish_reason,
            per_token_versions=versions.versions is not None,
        )
        if versions.versions is None and versions.fallback == VERSIONS_UNCOUNTED:
            log.warning(
                "turn_versions_uncounted",
                interaction_id=record.interaction_id,
                output_tokens=output_length(record),
            )
        if request.session_done and episode.client_session_id:
            await self._store.end_after_turn(episode)
        return RecordedTurn(
            interaction_id=record.interaction_id, session_id=episode.session_id, index=index
        )
