"""The Console gRPC service: the operator's read-only view of the deployment (glue only)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any, TypeAlias

import grpc

from protos import console_pb2, console_pb2_grpc
from services.dataproxy.overview import Counters, GroupState, Overview, SessionState
from services.dataproxy.trainer_auth import TrainerAuth
from services.runtime.errors import NotFound

Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"

MAX_SESSIONS = 500
MAX_ERRORS = 200
MAX_TRAJECTORIES = 200
MAX_HISTORY_S = 24 * 3600.0


class ConsoleServicer(console_pb2_grpc.ConsoleServicer):
    """Overview, ListTrajectories and GetTrajectory, all read from Redis."""

    def __init__(self, *, overview: Overview, auth: TrainerAuth) -> None:
        self._overview = overview
        self._auth = auth

    async def Overview(
        self, request: console_pb2.OverviewRequest, context: Context
    ) -> console_pb2.OverviewResponse:
        """Counters, groups, sessions, history and errors."""
        async with _guarded(context, self._auth):
            now = time.time()
            counters = await self._overview.counters()
            sessions, total = await self._overview.sessions(
                limit=_bounded(request.max_sessions, 100, MAX_SESSIONS)
            )
            history_s = min(max(request.history_s, 0.0), MAX_HISTORY_S)
            history = await self._overview.history(since=now - history_s) if history_s else []
            errors = await self._overview.errors(limit=_bounded(request.max_errors, 20, MAX_ERRORS))
        return console_pb2.OverviewResponse(
            counters=_counters(counters),
            groups=[_group(g) for g in counters.groups],
            sessions=[_session(s) for s in sessions],
            sessions_total=total,
            history=[_point(p) for p in history],
            errors=[
                console_pb2.ErrorEvent(
                    t_unix=float(e.get("t", 0.0)),
                    method=str(e.get("method", "")),
                    code=str(e.get("code", "")),
                    message=str(e.get("message", "")),
                )
                for e in errors
            ],
            now_unix=now,
        )

    async def ListTrajectories(
        self, request: console_pb2.ListTrajectoriesRequest, context: Context
    ) -> console_pb2.ListTrajectoriesResponse:
        """The newest published trajectories' summaries."""
        async with _guarded(context, self._auth):
            recent = await self._overview.recent(
                limit=_bounded(request.limit, 50, MAX_TRAJECTORIES), offset=max(0, request.offset)
            )
        return console_pb2.ListTrajectoriesResponse(
            trajectories=[_summary(stream_id, s) for stream_id, s in recent]
        )

    async def GetTrajectory(
        self, request: console_pb2.GetTrajectoryRequest, context: Context
    ) -> console_pb2.GetTrajectoryResponse:
        """One stream entry, as published."""
        async with _guarded(context, self._auth):
            found = await self._overview.trajectory(request.stream_id)
            if found is None:
                raise NotFound(
                    f"no trajectory {request.stream_id[:64]!r} on the stream (trimmed after "
                    "every consumer group acked it, or never published)",
                    code="trajectory_not_found",
                )
        trajectory_id, data, codec = found
        return console_pb2.GetTrajectoryResponse(
            stream_id=request.stream_id, trajectory_id=trajectory_id, codec=codec, data=data
        )


@contextlib.asynccontextmanager
async def _guarded(context: Context, auth: TrainerAuth) -> AsyncIterator[None]:
    """The admin (or trainer) key first; errors are mapped by the server's interceptor."""
    await auth.check(context.invocation_metadata())
    yield


def _bounded(value: int, default: int, cap: int) -> int:
    return default if value <= 0 else min(value, cap)


def _counters(c: Counters) -> console_pb2.Counters:
    return console_pb2.Counters(
        open_episodes=c.open_episodes,
        awaiting_reward=c.awaiting_reward,
        published=c.published,
        consumed=c.consumed,
        empty_episodes=c.empty_episodes,
        interactions=c.interactions,
        joined=c.joined,
        output_tokens=c.output_tokens,
        exact_interactions=c.exact_interactions,
        length_mismatches=c.length_mismatches,
        reward_sum=c.reward_sum,
        errors=c.errors,
        weight_version=c.weight_version,
        in_flight=c.in_flight,
        paused=c.paused,
        paused_since_unix=c.paused_since,
        capacity_left=c.capacity_left,
        capacity_granted=-1 if c.capacity_granted is None else c.capacity_granted,
        capacity_used=c.capacity_used,
        capacity_bound=-1 if c.capacity_bound is None else c.capacity_bound,
        stream_length=c.stream_length,
        join_rate=c.join_rate,
        exact_token_ratio=c.exact_token_ratio,
    )


def _group(g: GroupState) -> console_pb2.ConsumerGroup:
    return console_pb2.ConsumerGroup(
        name=g.name,
        consumers=g.consumers,
        pending=g.pending,
        backlog=g.backlog,
        oldest_pending_age_s=g.oldest_pending_age_s,
        oldest_undelivered_age_s=g.oldest_undelivered_age_s,
    )


def _session(s: SessionState) -> console_pb2.SessionState:
    return console_pb2.SessionState(
        session_id=s.session_id,
        task_id=s.task_id,
        key_id=s.key_id,
        state=s.state,
        turns=s.turns,
        started_at_unix=s.started_at,
        last_active_at_unix=s.last_active_at,
        deadline_unix=s.deadline,
    )


def _point(p: dict[str, Any]) -> console_pb2.HistoryPoint:
    return console_pb2.HistoryPoint(
        t_unix=float(p.get("t", 0.0)),
        published=int(p.get("published", 0)),
        consumed=int(p.get("consumed", 0)),
        interactions=int(p.get("interactions", 0)),
        output_tokens=int(p.get("output_tokens", 0)),
        reward_sum=float(p.get("reward_sum", 0.0)),
        errors=int(p.get("errors", 0)),
        weight_version=int(p.get("weight_version", 0)),
        paused=bool(p.get("paused", 0)),
        in_flight=int(p.get("in_flight", 0)),
        open_episodes=int(p.get("open_episodes", 0)),
        backlog=int(p.get("backlog", 0)),
        pending=int(p.get("pending", 0)),
        exact_interactions=int(p.get("exact_interactions", 0)),
        joined=int(p.get("joined", 0)),
    )


def _summary(stream_id: str, s: dict[str, Any]) -> console_pb2.TrajectorySummary:
    return console_pb2.TrajectorySummary(
        stream_id=stream_id,
        trajectory_id=str(s.get("trajectory_id", "")),
        session_id=str(s.get("session_id", "")),
        task_id=str(s.get("task_id", "")),
        turns=int(s.get("turns", 0)),
        final_reward=float(s.get("final_reward", 0.0)),
        output_tokens=int(s.get("output_tokens", 0)),
        exact_interactions=int(s.get("exact_interactions", 0)),
        length_mismatches=int(s.get("length_mismatches", 0)),
        min_version=int(s.get("min_version", 0)),
        max_version=int(s.get("max_version", 0)),
        started_at_unix=float(s.get("started_at", 0.0)),
        ended_at_unix=float(s.get("ended_at", 0.0)),
        end_reason=str(s.get("end_reason", "")),
    )
