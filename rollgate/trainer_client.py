"""The Trainer service client: pull trajectories through a consumer group, ack, control."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import grpc
import orjson

from grpcpoller import unblock_grpc_poller
from protos import trainer_pb2, trainer_pb2_grpc
from rollgate.trajectory import Trajectory, decode_trajectory

# Trajectories exceed gRPC's default 4 MiB; the dataproxy allows 64 MiB.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
)
_ERROR_METADATA_KEY = "rollgate-error-bin"
# The dataproxy's initial metadata on a pull once the consumer group exists.
_GROUP_READY_METADATA_KEY = "rollgate-group-ready"
# How many (group, trajectory id) pairs a client remembers to drop duplicates.
SEEN_LIMIT = 100_000


class TrainerError(Exception):
    """A Trainer call failed; `status` is the gRPC status, `code` rollgate's error code."""

    def __init__(self, message: str, *, status: grpc.StatusCode, code: str) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code


@dataclass(frozen=True, slots=True, kw_only=True)
class PulledTrajectory:
    """A trajectory and the stream id to ack once trained on."""

    stream_id: str
    trajectory: Trajectory
    # The episode group (GRPO over whole episodes); "" and 0 when the episode has none.
    group_id: str = ""
    group_size: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerStats:
    """What `GetStats` reports."""

    open_episodes: int
    published: int
    consumed: int
    pending: int
    weight_version: int
    empty_episodes: int
    # Episodes that may still start; -1: unlimited.
    capacity: int = -1
    paused: bool = False
    # Share of interactions whose parent was found (0.0 before any was published).
    join_rate: float = 0.0
    in_flight: int = 0
    # rollgate's own staleness bound (AReaL's max_head_offpolicyness); None: not configured.
    max_head_offpolicyness: int | None = None
    staleness_batch_size: int = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class PauseResult:
    """What `PauseSubmission` reports: whether running turns finished, and how many still run."""

    drained: bool
    in_flight: int


class TrainerClient:
    """`async with TrainerClient("host:50052", admin_key) as tc:` then pull, ack, control."""

    def __init__(self, address: str, admin_key: str, *, timeout_s: float = 10.0) -> None:
        self._address = address
        self._metadata = (("authorization", f"Bearer {admin_key}"),)
        self._timeout_s = timeout_s
        self._channel: grpc.aio.Channel | None = None
        self._stub: trainer_pb2_grpc.TrainerAsyncStub | None = None
        # (group, trajectory id) → the stream id it first came with; the oldest are forgotten.
        self._seen: OrderedDict[tuple[str, str], str] = OrderedDict()
        # (group, consumer) → stream ids this client handed out and has not acked: the server
        # re-sends them first on the next pull, and the client drops them again.
        self._held: dict[tuple[str, str], set[str]] = {}

    async def __aenter__(self) -> TrainerClient:
        self._channel = grpc.aio.insecure_channel(self._address, options=_CHANNEL_OPTIONS)
        # A trainer busy between pulls must neither slow grpc.aio down nor hang at its exit.
        unblock_grpc_poller()
        stub = trainer_pb2_grpc.TrainerStub(self._channel)
        self._stub = cast("trainer_pb2_grpc.TrainerAsyncStub", stub)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Closes the channel."""
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None

    async def pull(
        self,
        group: str,
        consumer: str,
        max_count: int = 0,
        idle_timeout_s: float = 0.0,
        *,
        complete_groups_only: bool = False,
        include_history: bool = False,
        on_joined: Callable[[], None] | None = None,
    ) -> AsyncIterator[PulledTrajectory]:
        """Trajectories for `consumer` in `group`; duplicates (per group, by id) are dropped.

        A group this pull creates reads what is published from now on; `include_history`
        makes it start at the beginning of the stream instead (an existing group goes on
        where it was either way). `on_joined` is called once the server has the group: from
        then on no published trajectory is missed, so agents may start.

        Ends after `max_count` new trajectories (0: no limit) or `idle_timeout_s` without one
        (0: runs until the caller stops iterating). Trajectories this client already handed
        out and has not acked are not shown again. `complete_groups_only` asks for episode
        groups only once every member is published (a group is never split by `max_count`).
        """
        held = self._held.setdefault((group, consumer), set())
        request = trainer_pb2.PullTrajectoriesRequest(
            group=group,
            consumer=consumer,
            # The server re-sends our unacked entries first and counts them: ask for them too.
            max_count=max_count + len(held) if max_count > 0 else 0,
            idle_timeout_s=idle_timeout_s,
            complete_groups_only=complete_groups_only,
            include_history=include_history,
        )
        # No deadline on the stream itself: it ends by count or idle time; keepalive
        # pings detect a dead server.
        call = self._require_stub().PullTrajectories(request, metadata=self._metadata)
        shown = 0
        try:
            if on_joined is not None:
                ready = await call.initial_metadata()
                if any(key == _GROUP_READY_METADATA_KEY for key, _value in ready or ()):
                    on_joined()
            async for message in call:
                seen_key = (group, message.trajectory_id)
                first = self._seen.get(seen_key)
                if first is not None and first != message.stream_id:
                    # The same episode published twice: never shown twice, never left pending.
                    await self.ack(group, [message.stream_id])
                    continue
                if first is not None:
                    continue  # redelivered (still pending): the caller already has it
                if message.trajectory_id:
                    self._remember(seen_key, message.stream_id)
                held.add(message.stream_id)
                shown += 1
                yield PulledTrajectory(
                    stream_id=message.stream_id,
                    trajectory=decode_trajectory(message.data, message.codec or "msgpack"),
                    group_id=message.group_id,
                    group_size=message.group_size,
                )
                if max_count > 0 and shown >= max_count and not complete_groups_only:
                    return  # held entries taken elsewhere meanwhile: the server sent extra
        except grpc.aio.AioRpcError as err:
            raise _trainer_error(err) from None
        finally:
            call.cancel()

    async def ack(self, group: str, stream_ids: Sequence[str]) -> int:
        """Acknowledges entries trained on; the number newly acked."""
        request = trainer_pb2.AckRequest(group=group, stream_ids=list(stream_ids))
        response = await self._unary(self._require_stub().Ack, request)
        for (held_group, _consumer), held in self._held.items():
            if held_group == group:
                held.difference_update(stream_ids)
        return int(response.acked)

    async def set_weight_version(self, version: int, *, allow_rollback: bool = False) -> int:
        """Stamps tokens generated from now on with `version`; one lower than the current is
        refused unless `allow_rollback` (a trainer restarted from an older checkpoint)."""
        request = trainer_pb2.SetWeightVersionRequest(
            version=version, allow_rollback=allow_rollback
        )
        response = await self._unary(self._require_stub().SetWeightVersion, request)
        return int(response.version)

    async def stats(self) -> TrainerStats:
        """Published, consumed and pending counts, weight version, capacity, join rate."""
        response = await self._unary(self._require_stub().GetStats, trainer_pb2.GetStatsRequest())
        return _stats(response)

    async def pause_submission(self, timeout_s: float = 30.0) -> PauseResult:
        """New turns wait; returns once running turns finished or `timeout_s` passed."""
        request = trainer_pb2.PauseSubmissionRequest(timeout_s=timeout_s)
        # The call itself may take up to timeout_s: give it that plus the usual budget.
        response = await self._unary(
            self._require_stub().PauseSubmission, request, timeout_s=timeout_s + self._timeout_s
        )
        return PauseResult(drained=bool(response.drained), in_flight=int(response.in_flight))

    async def resume_submission(self) -> None:
        """Releases the turns waiting since `pause_submission`."""
        request = trainer_pb2.ResumeSubmissionRequest()
        await self._unary(self._require_stub().ResumeSubmission, request)

    async def grant_capacity(self, episodes: int) -> int:
        """Lets `episodes` more episodes start; the capacity now (-1: unlimited)."""
        request = trainer_pb2.GrantCapacityRequest(episodes=episodes)
        response = await self._unary(self._require_stub().GrantCapacity, request)
        return int(response.capacity)

    def _remember(self, seen_key: tuple[str, str], stream_id: str) -> None:
        self._seen[seen_key] = stream_id
        if len(self._seen) > SEEN_LIMIT:
            self._seen.popitem(last=False)

    async def _unary(self, method: Any, request: Any, *, timeout_s: float | None = None) -> Any:
        try:
            return await method(
                request, metadata=self._metadata, timeout=timeout_s or self._timeout_s
            )
        except grpc.aio.AioRpcError as err:
            raise _trainer_error(err) from None

    def _require_stub(self) -> trainer_pb2_grpc.TrainerAsyncStub:
        if self._stub is None:
            raise RuntimeError("use TrainerClient inside `async with`")
        return self._stub


class TrainerControl:
    """The Trainer's control calls from synchronous code (a trainer's weight-update step):
    `with TrainerControl(address, key) as control: control.pause_submission()`."""

    def __init__(self, address: str, admin_key: str, *, timeout_s: float = 10.0) -> None:
        self._metadata = (("authorization", f"Bearer {admin_key}"),)
        self._timeout_s = timeout_s
        self._channel = grpc.insecure_channel(address, options=_CHANNEL_OPTIONS)
        self._stub = trainer_pb2_grpc.TrainerStub(self._channel)

    def __enter__(self) -> TrainerControl:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Closes the channel."""
        self._channel.close()

    def stats(self) -> TrainerStats:
        """What `GetStats` reports."""
        return _stats(self._call(self._stub.GetStats, trainer_pb2.GetStatsRequest()))

    def set_weight_version(self, version: int, *, allow_rollback: bool = False) -> int:
        """Stamps tokens generated from now on with `version`; one lower than the current is
        refused unless `allow_rollback` (a trainer restarted from an older checkpoint)."""
        request = trainer_pb2.SetWeightVersionRequest(
            version=version, allow_rollback=allow_rollback
        )
        return int(self._call(self._stub.SetWeightVersion, request).version)

    def pause_submission(self, timeout_s: float = 30.0) -> PauseResult:
        """New turns wait; returns once running turns finished or `timeout_s` passed."""
        request = trainer_pb2.PauseSubmissionRequest(timeout_s=timeout_s)
        response = self._call(
            self._stub.PauseSubmission, request, timeout_s=timeout_s + self._timeout_s
        )
        return PauseResult(drained=bool(response.drained), in_flight=int(response.in_flight))

    def resume_submission(self) -> None:
        """Releases the turns waiting since `pause_submission`."""
        self._call(self._stub.ResumeSubmission, trainer_pb2.ResumeSubmissionRequest())

    def grant_capacity(self, episodes: int) -> int:
        """Lets `episodes` more episodes start; the capacity now (-1: unlimited)."""
        request = trainer_pb2.GrantCapacityRequest(episodes=episodes)
        return int(self._call(self._stub.GrantCapacity, request).capacity)

    def _call(self, method: Any, request: Any, *, timeout_s: float | None = None) -> Any:
        try:
            return method(request, metadata=self._metadata, timeout=timeout_s or self._timeout_s)
        except grpc.RpcError as err:
            raise _trainer_error(cast("grpc.aio.AioRpcError", err)) from None


def _stats(response: trainer_pb2.GetStatsResponse) -> TrainerStats:
    return TrainerStats(
        open_episodes=response.open_episodes,
        published=response.published,
        consumed=response.consumed,
        pending=response.pending,
        weight_version=response.weight_version,
        empty_episodes=response.empty_episodes,
        capacity=response.capacity,
        paused=response.paused,
        join_rate=response.join_rate,
        in_flight=response.in_flight,
        max_head_offpolicyness=(
            int(response.max_head_offpolicyness)
            if response.HasField("max_head_offpolicyness")
            else None
        ),
        staleness_batch_size=int(response.staleness_batch_size) or 1,
    )


def _trainer_error(err: grpc.aio.AioRpcError) -> TrainerError:
    code = err.code().name.lower()
    message = err.details() or code
    for key, value in err.trailing_metadata() or ():
        if key == _ERROR_METADATA_KEY and isinstance(value, bytes):
            payload = orjson.loads(value)
            message = str(payload.get("message", message))
            code = str(payload.get("code", code))
    return TrainerError(message, status=err.code(), code=code)
