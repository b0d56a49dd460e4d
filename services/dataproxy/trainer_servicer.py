"""The Trainer gRPC service: how training code pulls and acks trajectories (glue only)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, TypeAlias

import grpc
from redis.asyncio import Redis

from protos import trainer_pb2, trainer_pb2_grpc
from services.dataproxy.access_keys import AccessKeyStore
from services.dataproxy.control import CapacityPolicy, Control, ControlSnapshot, PauseMetrics
from services.dataproxy.groups import GroupDirectory, GroupTag, complete_groups, tagged
from services.dataproxy.redis_keys import RedisKeys
from services.dataproxy.scripts import Scripts
from services.dataproxy.settings import DataProxySettings
from services.dataproxy.trainer_auth import TrainerAuth
from services.dataproxy.trajectory_stream import StreamEntry, TrainerStats, TrajectoryStream
from services.runtime.errors import InvalidRequest, Unavailable
from services.runtime.logs import get_logger
from services.runtime.redis_pipeline import PipelinedScripts

Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"

log = get_logger(__name__)

# Initial metadata of a pull, sent once its consumer group exists.
GROUP_READY_METADATA_KEY = "rollgate-group-ready"
_SHUTTING_DOWN = "the dataproxy is shutting down; pull again (another replica will serve you)"


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    """Pulls, acks, weight version, stats, pause/resume and capacity grants."""

    def __init__(
        self,
        *,
        redis: Redis,
        keys: RedisKeys,
        settings: DataProxySettings,
        reclaim_idle_s: float = 60.0,
        control: Control | None = None,
    ) -> None:
        self._auth = TrainerAuth(
            admin_key=settings.admin_key,
            trainer_key=settings.trainer_key,
            lookup=AccessKeyStore(redis=redis, keys=keys).lookup,
        )
        self._stream = TrajectoryStream(redis=redis, keys=keys, reclaim_idle_s=reclaim_idle_s)
        self._control = control or build_control(redis=redis, keys=keys, settings=settings)
        self._groups = GroupDirectory(redis=redis, keys=keys)
        self._stopping = asyncio.Event()

    async def close(self) -> None:
        """Ends open pulls at their next read (≤ 2 s); call before stopping the server."""
        self._stopping.set()

    async def PullTrajectories(
        self, request: trainer_pb2.PullTrajectoriesRequest, context: Context
    ) -> AsyncIterator[trainer_pb2.TrajectoryMessage]:
        """Streams trajectories to one consumer of a group until a limit or cancellation."""
        issued = await self._authorize(context)
        await self._check_pull(request, context)
        await self._stream.ensure_group(request.group, include_history=request.include_history)
        # The group exists: a client may now let agents run without missing an episode.
        await context.send_initial_metadata(((GROUP_READY_METADATA_KEY, "1"),))
        async for entry, tag in self._pull(request):
            # A pull outlives many revocations: an issued key revoked meanwhile gets nothing
            # more (the entry stays pending for the group, another consumer takes it over).
            await self._auth.still_valid(issued)
            yield _message(entry, tag)
        if self._stopping.is_set():
            raise Unavailable(_SHUTTING_DOWN, retry_after_s=1.0)

    def _pull(
        self, request: trainer_pb2.PullTrajectoriesRequest
    ) -> AsyncIterator[tuple[StreamEntry, GroupTag | None]]:
        grouped = request.complete_groups_only
        source = self._stream.pull(
            request.group,
            request.consumer,
            # Grouped pulls count what they deliver themselves (a group is never split).
            max_count=0 if grouped else request.max_count,
            idle_timeout_s=request.idle_timeout_s,
            stopping=self._stopping,
            include_history=request.include_history,
        )
        if grouped:
            return complete_groups(source, self._groups, max_count=request.max_count)
        return tagged(source, self._groups)

    async def Ack(
        self, request: trainer_pb2.AckRequest, context: Context
    ) -> trainer_pb2.AckResponse:
        """Acknowledges trained-on entries; they count as consumed."""
        await self._authorize(context)
        if not request.group:
            raise InvalidRequest("group is required")
        acked = await self._stream.ack(request.group, list(request.stream_ids))
        return trainer_pb2.AckResponse(acked=acked)

    async def SetWeightVersion(
        self, request: trainer_pb2.SetWeightVersionRequest, context: Context
    ) -> trainer_pb2.SetWeightVersionResponse:
        """Stamps later tokens with this weight version (lower: only with allow_rollback)."""
        await self._authorize(context)
        version = await self._stream.set_weight_version(
            request.version, allow_rollback=request.allow_rollback
        )
        return trainer_pb2.SetWeightVersionResponse(version=version)

    async def GetStats(
        self, request: trainer_pb2.GetStatsRequest, context: Context
    ) -> trainer_pb2.GetStatsResponse:
        """Counters, capacity left, paused, turns in flight and the join rate."""
        await self._authorize(context)
        stats = await self._stream.stats()
        control = await self._control.snapshot()
        return _stats(stats, control, self._control.policy)

    async def PauseSubmission(
        self, request: trainer_pb2.PauseSubmissionRequest, context: Context
    ) -> trainer_pb2.PauseSubmissionResponse:
        """New turns wait (then 503); returns once running turns finished or the timeout."""
        await self._authorize(context)
        result = await self._control.pause(request.timeout_s)
        return trainer_pb2.PauseSubmissionResponse(
            drained=result.drained, in_flight=result.in_flight
        )

    async def ResumeSubmission(
        self, request: trainer_pb2.ResumeSubmissionRequest, context: Context
    ) -> trainer_pb2.ResumeSubmissionResponse:
        """Releases the turns waiting for a resume."""
        await self._authorize(context)
        await self._control.resume()
        return trainer_pb2.ResumeSubmissionResponse()

    async def GrantCapacity(
        self, request: trainer_pb2.GrantCapacityRequest, context: Context
    ) -> trainer_pb2.GrantCapacityResponse:
        """Adds capacity for `episodes` more episodes (capacity is finite from then on)."""
        await self._authorize(context)
        capacity = await self._control.grant(request.episodes)
        return trainer_pb2.GrantCapacityResponse(capacity=capacity)

    async def _check_pull(
        self, request: trainer_pb2.PullTrajectoriesRequest, context: Context
    ) -> None:
        if self._stopping.is_set():
            raise Unavailable(_SHUTTING_DOWN, retry_after_s=1.0)
        if not request.group or not request.consumer:
            raise InvalidRequest("group and consumer are required")

    async def _authorize(self, context: Context) -> str:
        """The caller's issued-key digest ("" for a configured key), or Unauthenticated."""
        return await self._auth.check(context.invocation_metadata())


def build_control(
    *,
    redis: Redis,
    keys: RedisKeys,
    settings: DataProxySettings,
    metrics: PauseMetrics | None = None,
    pipelined: PipelinedScripts | None = None,
) -> Control:
    """The control layer with the settings' capacity policy and pause timings."""
    return Control(
        redis=redis,
        keys=keys,
        scripts=Scripts.load(),
        policy=CapacityPolicy(
            max_head_offpolicyness=settings.max_head_offpolicyness,
            batch_size=settings.batch_size,
        ),
        turn_timeout_s=settings.turn_timeout_s,
        pause_wait_s=settings.pause_wait_s,
        pause_drain_timeout_s=settings.pause_drain_timeout_s,
        metrics=metrics,
        pipelined=pipelined,
    )


def _stats(
    stats: TrainerStats, control: ControlSnapshot, policy: CapacityPolicy
) -> trainer_pb2.GetStatsResponse:
    return trainer_pb2.GetStatsResponse(
        open_episodes=stats.open_episodes,
        published=stats.published,
        consumed=stats.consumed,
        pending=stats.pending,
        weight_version=stats.weight_version,
        empty_episodes=stats.empty_episodes,
        capacity=control.capacity,
        paused=control.paused,
        join_rate=control.join_rate,
        in_flight=control.in_flight,
        max_head_offpolicyness=policy.max_head_offpolicyness,
        staleness_batch_size=policy.batch_size,
    )


def _message(entry: StreamEntry, tag: GroupTag | None) -> trainer_pb2.TrajectoryMessage:
    return trainer_pb2.TrajectoryMessage(
        stream_id=entry.stream_id,
        trajectory_id=entry.trajectory_id,
        data=entry.data,
        codec=entry.codec,
        group_id=tag.group_id if tag else "",
        group_size=tag.group_size if tag else 0,
    )
