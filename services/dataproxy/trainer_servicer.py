"""The Trainer gRPC service: how training code pulls and acks trajectories (glue only)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, TypeAlias

import grpc
from redis.asyncio import Redis

from protos import trainer_pb2, trainer_pb2_grpc
from services.dataproxy.redis_keys import RedisKeys
from services.dataproxy.settings import DataProxySettings
from services.dataproxy.trainer_auth import TrainerAuth
from services.dataproxy.trajectory import TrajectoryStream
from services.runtime.errors import InvalidRequest, RollgateError, Unavailable, abort_with

Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"

_SHUTTING_DOWN = "the dataproxy is shutting down; pull again (another replica will serve you)"


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    """PullTrajectories, Ack, SetWeightVersion, GetStats over the trajectories stream."""

    def __init__(
        self,
        *,
        redis: Redis,
        keys: RedisKeys,
        settings: DataProxySettings,
        reclaim_idle_s: float = 60.0,
    ) -> None:
        self._auth = TrainerAuth(admin_key=settings.admin_key, trainer_key=settings.trainer_key)
        self._stream = TrajectoryStream(redis=redis, keys=keys, reclaim_idle_s=reclaim_idle_s)
        self._stopping = asyncio.Event()

    async def close(self) -> None:
        """Ends open pulls at their next read (≤ 2 s); call before stopping the server."""
        self._stopping.set()

    async def PullTrajectories(
        self, request: trainer_pb2.PullTrajectoriesRequest, context: Context
    ) -> AsyncIterator[trainer_pb2.TrajectoryMessage]:
        """Streams trajectories to one consumer of a group until a limit or cancellation."""
        await self._authorize(context)
        if self._stopping.is_set():
            await abort_with(context, Unavailable(_SHUTTING_DOWN, retry_after_s=1.0))
        if not request.group or not request.consumer:
            await abort_with(context, InvalidRequest("group and consumer are required"))
        try:
            async for entry in self._stream.pull(
                request.group,
                request.consumer,
                max_count=request.max_count,
                idle_timeout_s=request.idle_timeout_s,
                stopping=self._stopping,
            ):
                yield trainer_pb2.TrajectoryMessage(
                    stream_id=entry.stream_id,
                    trajectory_id=entry.trajectory_id,
                    data=entry.data,
                    codec=entry.codec,
                )
        except RollgateError as err:
            await abort_with(context, err)
        if self._stopping.is_set():
            await abort_with(context, Unavailable(_SHUTTING_DOWN, retry_after_s=1.0))

    async def Ack(
        self, request: trainer_pb2.AckRequest, context: Context
    ) -> trainer_pb2.AckResponse:
        """Acknowledges trained-on entries; they count as consumed."""
        await self._authorize(context)
        if not request.group:
            await abort_with(context, InvalidRequest("group is required"))
        acked = await self._stream.ack(request.group, list(request.stream_ids))
        return trainer_pb2.AckResponse(acked=acked)

    async def SetWeightVersion(
        self, request: trainer_pb2.SetWeightVersionRequest, context: Context
    ) -> trainer_pb2.SetWeightVersionResponse:
        """Stamps later tokens with this weight version (never lower than the current one)."""
        await self._authorize(context)
        try:
            version = await self._stream.set_weight_version(request.version)
        except RollgateError as err:
            await abort_with(context, err)
        return trainer_pb2.SetWeightVersionResponse(version=version)

    async def GetStats(
        self, request: trainer_pb2.GetStatsRequest, context: Context
    ) -> trainer_pb2.GetStatsResponse:
        """Counters: published, consumed, pending, empty episodes, weight version."""
        await self._authorize(context)
        stats = await self._stream.stats()
        return trainer_pb2.GetStatsResponse(
            open_episodes=stats.open_episodes,
            published=stats.published,
            consumed=stats.consumed,
            pending=stats.pending,
            weight_version=stats.weight_version,
            empty_episodes=stats.empty_episodes,
        )

    async def _authorize(self, context: Context) -> None:
        try:
            self._auth.check(context.invocation_metadata())
        except RollgateError as err:
            await abort_with(context, err)
