"""Where the trainer adapters get episodes: the live stream (a consumer group) or an export file.

Both sources hand out *units*: one episode, or (episode groups) every published member of one
`start_session(group_size=G)` group. Delivery is at-least-once, said precisely:

- a unit is acked only once the adapter calls `taken` (the trainer has it); a unit given back
  (the trainer's call was cancelled) is handed out again first, in this life;
- a source never hands out the same `trajectory_id` twice in its life;
- after a crash, everything delivered to the consumer and not yet acked is delivered again to
  the restarted consumer of the same name (or, after the reclaim idle time, to another
  consumer of the group), so a restarted trainer may see again what it took just before the
  crash (its ack had not reached rollgate): deduplicate by `trajectory_id` across restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

import grpc

from rollgate.trainer_client import PulledTrajectory, TrainerClient, TrainerError
from rollgate.trajectories_cli import export_line
from rollgate.trajectory import Trajectory, TrajectoryDecodeError, trajectory_from_json

# How often the live source looks at GetStats for episodes that ended empty while calls wait.
EMPTY_POLL_S = 1.0
# Members of a complete episode group arrive together: a group still short of its size this
# long after its last member is handed out as it is (a member that ended empty never comes).
GROUP_SETTLE_S = 1.0
# Reconnect backoff when the pull stream breaks (dataproxy restart, network).
RECONNECT_MIN_S = 0.2
RECONNECT_MAX_S = 5.0
# How long `LiveSource.start` waits for the Trainer service to open the stream.
JOIN_TIMEOUT_S = 30.0
# How many handed-out trajectory ids a source remembers to never hand one out twice (about
# 100 bytes each: ~10 MB). A copy arrives soon after the original (a retried publication, a
# redelivery on reconnect), so the most recent ids are the ones that matter; the oldest are
# forgotten (docs/training.md, *Delivery*).
HANDED_LIMIT = 100_000
# Errors that retrying cannot fix: the caller is told instead.
_FATAL = frozenset(
    {
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)


class ReplayFinished(EOFError):
    """An export file has no episode left to hand out."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Episode:
    """One published episode and where it came from."""

    trajectory: Trajectory
    # The stream id to ack (the export line's `stream_id` when replaying a file).
    stream_id: str
    # The episode group (`start_session(group_size=G)`); "" and 0 without one.
    group_id: str = ""
    group_size: int = 0


Unit = tuple[Episode, ...]


class EpisodeSource(Protocol):
    """What the adapters need from a source of episodes."""

    async def take(self) -> Unit | None:
        """The next unit; None when an episode this call granted ended empty (live only)."""
        ...

    def taken(self, unit: Unit) -> None:
        """The trainer has the unit: ack it (without waiting)."""
        ...

    def give_back(self, unit: Unit) -> None:
        """The unit did not reach the trainer: hand it out again first."""
        ...

    async def aclose(self) -> None:
        """Flushes pending acks and closes the connection or file."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class LiveOptions:
    """How a live source reads: its group and consumer, and whether it grants capacity."""

    group: str
    consumer: str
    # Episode groups: a unit is a whole group of this size (1: single episodes).
    episode_group_size: int = 1
    # Grant rollgate capacity for each unit a call waits for (AReaL's staleness manager).
    grant_capacity: bool = False
    # Where to append every unit handed out, as export lines (None: no dump).
    dump: str | None = None
    # A new consumer group starts at the beginning of the stream instead of now.
    include_history: bool = False
    # How many handed-out trajectory ids to remember (the oldest are forgotten).
    handed_limit: int = HANDED_LIMIT


class LiveSource:
    """Episodes from the Trainer service through one consumer of a consumer group."""

    def __init__(self, client: TrainerClient, options: LiveOptions) -> None:
        self._client = client
        self._options = options
        self._grouped = options.episode_group_size > 1
        self._ready: deque[Unit] = deque()
        self._waiters: deque[asyncio.Future[Unit | None]] = deque()
        self._handed = RecentIds(options.handed_limit)
        # Group id → members received so far (grouped mode).
        self._partial: OrderedDict[str, list[Episode]] = OrderedDict()
        self._partial_since: dict[str, float] = {}
        self._unacked: list[str] = []
        self._ack_wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._failure: BaseException | None = None
        # Grants made for calls that stopped waiting: the next calls use them up first.
        self._owed_grants = 0
        self._empty_seen: int | None = None
        self._dump = _Dump(options.dump) if options.dump else None
        self._joined = asyncio.Event()
        self.duplicates_dropped = 0
        self.acked = 0

    async def start(self) -> LiveSource:
        """Starts reading the stream (and, when granting, watching for empty episodes);
        returns once the consumer group exists, so no episode published after it is missed
        (a new group reads from now on: the grants and resumes that follow let agents run)."""
        if self._options.grant_capacity and not self._grouped:
            self._empty_seen = (await self._client.stats()).empty_episodes
            self._tasks.append(asyncio.create_task(self._watch_empty()))
        pull = asyncio.create_task(self._pull_forever())
        self._tasks.append(pull)
        self._tasks.append(asyncio.create_task(self._ack_forever()))
        if self._grouped:
            self._tasks.append(asyncio.create_task(self._settle_groups()))
        joined = asyncio.create_task(self._joined.wait())
        try:
            # The pull task ends only on a fatal error (a wrong key): then that is raised.
            await asyncio.wait(
                {joined, pull}, timeout=JOIN_TIMEOUT_S, return_when="FIRST_COMPLETED"
            )
        finally:
            joined.cancel()
            if not self._joined.is_set():
                await self.aclose()
        if not self._joined.is_set():
            self._raise_failure()
            raise TimeoutError(
                f"the Trainer service did not open the stream for group "
                f"{self._options.group!r} in {JOIN_TIMEOUT_S:g} s: is rollgate's dataproxy up?"
            )
        return self

    async def take(self) -> Unit | None:
        """Grants capacity for one unit (when granting), then waits for the next one. Calls
        are answered in the order they were made (the waiter queues before its grant)."""
        self._raise_failure()
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[Unit | None] = loop.create_future()
        self._waiters.append(waiter)
        granted = False
        try:
            if self._options.grant_capacity:
                await self._grant(self._options.episode_group_size)
                granted = True
            self._dispatch()
            return await waiter
        except BaseException:
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)
            if waiter.done() and not waiter.cancelled():
                unit = waiter.result() if waiter.exception() is None else None
                if unit:
                    self.give_back(unit)
            elif granted:  # the grant is used by the next call instead of granting again
                self._owed_grants += self._options.episode_group_size
            waiter.cancel()
            raise

    def taken(self, unit: Unit) -> None:
        """Acks the unit's entries in the background; a failed ack is retried."""
        if self._dump is not None:
            self._dump.write(unit)
        self._unacked.extend(episode.stream_id for episode in unit)
        self._ack_wake.set()

    def give_back(self, unit: Unit) -> None:
        """Back at the front of the queue, for the next call."""
        for episode in unit:
            self._handed.forget(episode.trajectory.trajectory_id)
        self._ready.appendleft(unit)
        self._dispatch()

    @property
    def remembered(self) -> int:
        """How many handed-out trajectory ids the source remembers (at most the limit)."""
        return len(self._handed)

    async def aclose(self) -> None:
        """Stops reading, acks what was taken (best effort), closes the client."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        with contextlib.suppress(TrainerError):
            await self._flush_acks()
        for waiter in self._waiters:
            waiter.cancel()
        if self._dump is not None:
            self._dump.close()

    @property
    def unacked(self) -> int:
        """Entries taken but not acked yet."""
        return len(self._unacked)

    async def _grant(self, episodes: int) -> None:
        owed = min(self._owed_grants, episodes)
        self._owed_grants -= owed
        if episodes - owed > 0:
            await self._client.grant_capacity(episodes - owed)

    def _dispatch(self) -> None:
        while self._waiters and self._ready:
            waiter = self._waiters.popleft()
            if waiter.done():
                continue
            unit = self._ready.popleft()
            for episode in unit:
                self._handed.add(episode.trajectory.trajectory_id)
            waiter.set_result(unit)

    def _receive(self, item: PulledTrajectory) -> None:
        episode = Episode(
            trajectory=item.trajectory,
            stream_id=item.stream_id,
            group_id=item.group_id,
            group_size=item.group_size,
        )
        if episode.trajectory.trajectory_id in self._handed:
            # Already with the trainer (a copy under another stream id): ack, never hand twice.
            self.duplicates_dropped += 1
            self._unacked.append(item.stream_id)
            self._ack_wake.set()
            return
        if not self._grouped or not item.group_id:
            self._ready.append((episode,))
        else:
            members = self._partial.setdefault(item.group_id, [])
            members.append(episode)
            self._partial_since[item.group_id] = asyncio.get_running_loop().time()
            # A later group's first member means earlier groups have all their members.
            for group_id in list(self._partial):
                if group_id == item.group_id:
                    break
                self._complete(group_id)
            if len(members) >= max(item.group_size, 1):
                self._complete(item.group_id)
        self._dispatch()

    def _complete(self, group_id: str) -> None:
        members = self._partial.pop(group_id, [])
        self._partial_since.pop(group_id, None)
        if members:
            self._ready.append(tuple(members))

    async def _settle_groups(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(GROUP_SETTLE_S / 4)
            now = loop.time()
            for group_id, since in list(self._partial_since.items()):
                if now - since >= GROUP_SETTLE_S:
                    self._complete(group_id)
            self._dispatch()

    async def _pull_forever(self) -> None:
        delay = RECONNECT_MIN_S
        while True:
            try:
                async for item in self._client.pull(
                    self._options.group,
                    self._options.consumer,
                    complete_groups_only=self._grouped,
                    include_history=self._options.include_history,
                    on_joined=self._joined.set,
                ):
                    delay = RECONNECT_MIN_S
                    self._receive(item)
            except TrainerError as err:
                if err.status in _FATAL:
                    self._fail(err)
                    return
            except TrajectoryDecodeError as err:
                self._fail(err)
                return
            # The stream ended (server shutdown) or broke: read again, after a pause.
            await asyncio.sleep(delay)
            delay = min(delay * 2, RECONNECT_MAX_S)

    async def _ack_forever(self) -> None:
        while True:
            await self._ack_wake.wait()
            self._ack_wake.clear()
            try:
                await self._flush_acks()
            except TrainerError:
                await asyncio.sleep(RECONNECT_MIN_S)
                self._ack_wake.set()

    async def _flush_acks(self) -> None:
        while self._unacked:
            batch = list(self._unacked)
            await self._client.ack(self._options.group, batch)
            del self._unacked[: len(batch)]
            self.acked += len(batch)

    async def _watch_empty(self) -> None:
        while True:
            await asyncio.sleep(EMPTY_POLL_S)
            if not self._waiters:
                continue
            try:
                empty = (await self._client.stats()).empty_episodes
            except TrainerError:
                continue
            grown = empty - (self._empty_seen or 0)
            self._empty_seen = empty
            # Each episode that ended empty used a grant some waiting call made: that call
            # gets None (AReaL rejects it and starts another, which grants again).
            while grown > 0 and self._waiters:
                waiter = self._waiters.popleft()
                if not waiter.done():
                    waiter.set_result(None)
                    grown -= 1

    def _fail(self, err: BaseException) -> None:
        self._failure = err
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(err)

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure


class RecentIds:
    """The last `limit` trajectory ids handed out, oldest forgotten first."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"handed_limit must be at least 1, not {limit}")
        self._limit = limit
        self._ids: OrderedDict[str, None] = OrderedDict()

    def add(self, trajectory_id: str) -> None:
        """Remembers the id (as the most recent); forgets the oldest past the limit."""
        self._ids[trajectory_id] = None
        self._ids.move_to_end(trajectory_id)
        while len(self._ids) > self._limit:
            self._ids.popitem(last=False)

    def forget(self, trajectory_id: str) -> None:
        """The id was given back: it may be handed out again."""
        self._ids.pop(trajectory_id, None)

    def __contains__(self, trajectory_id: object) -> bool:
        return trajectory_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)


class FileSource:
    """Episodes replayed from a `rollgate trajectories export` file (JSON Lines), in order."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        episode_group_size: int = 1,
        handed_limit: int = HANDED_LIMIT,
    ) -> None:
        self._path = Path(path)
        self._grouped = episode_group_size > 1
        self._lines: Iterator[Episode] | None = None
        self._ready: deque[Unit] = deque()
        self._partial: OrderedDict[str, list[Episode]] = OrderedDict()
        self._handed = RecentIds(handed_limit)
        self._lock = asyncio.Lock()
        self.duplicates_dropped = 0
        self.taken_count = 0

    async def take(self) -> Unit:
        """The next unit of the file; ReplayFinished once every episode was handed out."""
        async with self._lock:
            while not self._ready:
                if not self._read_one():
                    for group_id in list(self._partial):
                        self._ready.append(tuple(self._partial.pop(group_id)))
                    if not self._ready:
                        raise ReplayFinished(f"{self._path}: every episode was replayed")
            unit = self._ready.popleft()
            for episode in unit:
                self._handed.add(episode.trajectory.trajectory_id)
            return unit

    def taken(self, unit: Unit) -> None:
        """Counts the unit: nothing is acked when replaying."""
        self.taken_count += len(unit)

    def give_back(self, unit: Unit) -> None:
        """Replayed again first."""
        for episode in unit:
            self._handed.forget(episode.trajectory.trajectory_id)
        self._ready.appendleft(unit)

    @property
    def remembered(self) -> int:
        """How many handed-out trajectory ids the source remembers (at most the limit)."""
        return len(self._handed)

    async def aclose(self) -> None:
        """Nothing to close: the file is read line by line and closed at its end."""
        self._lines = None

    def _read_one(self) -> bool:
        if self._lines is None:
            self._lines = read_export(self._path)
        episode = next(self._lines, None)
        if episode is None:
            return False
        if episode.trajectory.trajectory_id in self._handed:
            self.duplicates_dropped += 1  # a file joined from overlapping exports
            return True
        if not self._grouped or not episode.group_id:
            self._ready.append((episode,))
            return True
        members = self._partial.setdefault(episode.group_id, [])
        members.append(episode)
        if len(members) >= max(episode.group_size, 1):
            self._ready.append(tuple(self._partial.pop(episode.group_id)))
        return True


def read_export(path: str | os.PathLike[str]) -> Iterator[Episode]:
    """The episodes of an export file, in file order; a bad line says which line and why."""
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
                trajectory = trajectory_from_json(data)
            except (ValueError, TrajectoryDecodeError) as err:
                raise TrajectoryDecodeError(
                    f"{path}:{number}: not a line of `rollgate trajectories export`: {err}"
                ) from err
            yield Episode(
                trajectory=trajectory,
                stream_id=str(data.get("stream_id", "")),
                group_id=trajectory.group_id or "",
                group_size=trajectory.group_size or 0,
            )


class _Dump:
    """Appends every unit handed to the trainer to a file, as export lines."""

    def __init__(self, path: str) -> None:
        self._file: IO[str] = open(path, "a", encoding="utf-8")  # noqa: SIM115 - owned here

    def write(self, unit: Sequence[Episode]) -> None:
        for episode in unit:
            self._file.write(export_line(episode.stream_id, episode.trajectory) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


# What tells two sources apart: ("live", trainer address, group, consumer) or ("replay", path).
SourceIdentity = tuple[str, ...]
Opener = Callable[[], Awaitable[tuple[EpisodeSource, Callable[[], Awaitable[None]]]]]


@dataclass(slots=True, kw_only=True)
class _Shared:
    loop: asyncio.AbstractEventLoop
    # How the source reads (grouping, grants, dump): one consumer cannot read two ways.
    how: tuple[Any, ...]
    opened: asyncio.Future[EpisodeSource]
    close: Callable[[], Awaitable[None]] | None = None
    users: int = 0


class SharedSources:
    """One source per consumer per process, shared by every adapter object that reads it.

    AReaL builds a new workflow object for every task (`RemoteInfEngine._resolve_workflow`
    instantiates the class from its import path on each submit), so a source owned by the
    object would be opened once per task: several readers of one consumer name each get the
    consumer's pending entries (duplicates), hold episodes another object's call waits for
    (hangs), and a replay file restarts from its first line for every task. Here the first
    object to need a source opens it, later ones reuse it; `release` closes it when the last
    object that acquired it lets go, `close_all` closes every one (the end of training).
    """

    def __init__(self) -> None:
        self._entries: dict[SourceIdentity, _Shared] = {}
        # Objects are built on the caller's thread, used on the event loop's thread.
        self._lock = threading.Lock()

    def is_open(self, identity: SourceIdentity) -> bool:
        """Whether a source for `identity` is open (or opening) on a running loop."""
        with self._lock:
            entry = self._entries.get(identity)
            return entry is not None and not entry.loop.is_closed()

    async def acquire(
        self, identity: SourceIdentity, how: tuple[Any, ...], opener: Opener
    ) -> EpisodeSource:
        """The source for `identity`, opened by `opener` on first use; counts one more user."""
        loop = asyncio.get_running_loop()
        with self._lock:
            entry = self._entries.get(identity)
            if entry is not None and entry.loop.is_closed():
                entry = None  # its loop ended without closing it: nothing left to close
            if entry is None:
                entry = _Shared(loop=loop, how=how, opened=loop.create_future())
                self._entries[identity] = entry
                opening = True
            else:
                opening = False
        if entry.loop is not loop:
            raise RuntimeError(
                f"the episode source {identity[0]} {'/'.join(identity[1:])} is already read on "
                "another event loop of this process; read each consumer from one loop"
            )
        if entry.how != how:
            raise ValueError(
                f"consumer {'/'.join(identity[1:])} is already read with other settings "
                f"({entry.how} here, {how} now); give the second reader its own consumer name"
            )
        if opening:
            try:
                source, close = await opener()
            except BaseException as err:
                with self._lock:
                    self._entries.pop(identity, None)
                entry.opened.set_exception(err)
                entry.opened.exception()  # retrieved: waiters get it, nobody else must
                raise
            entry.close = close
            entry.opened.set_result(source)
        source = await asyncio.shield(entry.opened)
        entry.users += 1
        return source

    async def release(self, identity: SourceIdentity) -> None:
        """One user less; the last one closes the source (acks what was taken)."""
        with self._lock:
            entry = self._entries.get(identity)
            if entry is None or entry.users == 0:
                return
            entry.users -= 1
            if entry.users > 0:
                return
            del self._entries[identity]
        if entry.close is not None:
            await entry.close()

    async def close_all(self) -> None:
        """Closes every source opened on the running loop, whoever still uses it."""
        loop = asyncio.get_running_loop()
        with self._lock:
            mine = {k: e for k, e in self._entries.items() if e.loop is loop}
            for identity in mine:
                del self._entries[identity]
        for entry in mine.values():
            if entry.close is not None:
                await entry.close()
