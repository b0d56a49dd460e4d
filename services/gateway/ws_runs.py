"""WebSocket runs: per-conversation queues (collect / followup), the turn lease, one run.

A run is one upstream call over the conversation's stored history (the configured system
prompt, no tools) on the chat path, so it is recorded as an interaction of the key's current
episode. Messages that arrive while a run of the same conversation is going are queued in this
process; `collect` merges every queued message into one follow-up run, `followup` runs them one
by one. Across gateway replicas the dataproxy's turn lease keeps runs of one conversation from
overlapping: a run starts only once it holds the lease; and an idempotencyKey is claimed in
Redis (`ClaimRun`) before its run starts, so a retry through another replica starts nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson
from aiohttp import web

from services.gateway.backends import RELAY
from services.gateway.header_mode import TurnTags, turn_tags
from services.gateway.relay import Delta, Done, bridge_spec
from services.gateway.responses_store import ConversationsClient
from services.gateway.ws_protocol import WsConfig, now_ms
from services.runtime.errors import RollgateError, UpstreamTimeout
from services.runtime.logs import get_logger

log = get_logger(__name__)

QUEUE_MODES = ("collect", "followup")
# Finished runs remembered for idempotencyKey dedupe, per process.
MAX_REMEMBERED_RUNS = 10_000
# How long an idempotencyKey stays claimed in Redis, for every replica.
RUN_CLAIM_TTL_MS = 24 * 3600 * 1000
_LEASE_POLL_MAX_S = 0.5


class Sink(Protocol):
    """Where a run's events go: the connection that asked for it."""

    async def emit(self, name: str, payload: dict[str, Any]) -> None:
        """Sends one event frame."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunResult:
    """How a run ended."""

    status: str  # "ok" | "aborted" | "error"
    text: str
    stop_reason: str = ""
    error: RollgateError | None = None
    interaction_id: str = ""


@dataclass(slots=True, kw_only=True)
class Message:
    """One queued user message and who waits for its run."""

    run_id: str
    text: str
    mode: str
    sink: Sink
    done: asyncio.Future[RunResult]
    # The upgrade request of the connection that sent it (its app holds the chat relay).
    request: web.Request
    agent_id: str = "main"


@dataclass(slots=True, kw_only=True)
class Lane:
    """The queue and the current run of one (key, conversation) in this process."""

    digest: str
    conversation: str
    queue: deque[Message] = field(default_factory=deque)
    running: list[Message] = field(default_factory=list)
    task: asyncio.Task[None] | None = None
    generation: asyncio.Task[RunResult] | None = None
    abort_requested: bool = False
    # The worker running the current generation ("" until its stream is open).
    worker_address: str = ""


ModelPicker = Callable[[], Awaitable[str]]
# (key digest, worker address, request id) → whether the worker had that turn running.
TurnAborter = Callable[[str, str, str], Awaitable[bool]]


class Runs:
    """Every lane of this gateway process, and the idempotency memory of its runs."""

    def __init__(
        self,
        *,
        store: ConversationsClient,
        config: WsConfig,
        pick_model: ModelPicker,
        abort_turn: TurnAborter | None = None,
    ) -> None:
        self._store = store
        self._config = config
        self._pick_model = pick_model
        self._abort_turn = abort_turn
        self._lanes: dict[tuple[str, str], Lane] = {}
        self._known: OrderedDict[tuple[str, str], asyncio.Future[RunResult]] = OrderedDict()

    def known_run(self, digest: str, run_id: str) -> asyncio.Future[RunResult] | None:
        """The run already started under this idempotency key, if any."""
        return self._known.get((digest, run_id))

    async def claim(self, digest: str, conversation: str, run_id: str) -> str:
        """Claims the run's idempotencyKey across replicas: "" when this run is the first,
        else the first run's id (this process may not know that run)."""
        claimed, first = await self._store.claim_run(
            digest, conversation, idempotency_key=run_id, run_id=run_id, ttl_ms=RUN_CLAIM_TTL_MS
        )
        return "" if claimed else first

    def submit(self, digest: str, conversation: str, message: Message) -> None:
        """Queues a message; starts the lane when it is idle."""
        self._known[(digest, message.run_id)] = message.done
        while len(self._known) > MAX_REMEMBERED_RUNS:
            self._known.popitem(last=False)
        lane = self._lanes.setdefault(
            (digest, conversation), Lane(digest=digest, conversation=conversation)
        )
        lane.queue.append(message)
        if lane.task is None or lane.task.done():
            lane.task = asyncio.create_task(self._drain(lane))

    async def abort(self, digest: str, conversation: str, run_id: str = "") -> list[str]:
        """Stops the running generation (and drops queued messages) of a conversation.

        The running turn is stopped through the worker (Worker.Abort), so its stream ends normally
        and the partial turn is recorded; when that fails the run's task is cancelled instead
        (nothing recorded).
        """
        lane = self._lanes.get((digest, conversation))
        if lane is None:
            return []
        aborted = []
        for message in list(lane.queue):
            if not run_id or message.run_id == run_id:
                lane.queue.remove(message)
                message.done.set_result(RunResult(status="aborted", text=""))
                aborted.append(message.run_id)
        running_ids = [m.run_id for m in lane.running]
        generation = lane.generation
        if generation is not None and (not run_id or run_id in running_ids):
            lane.abort_requested = True
            if not await self._stopped_by_worker(lane, digest):
                generation.cancel()
            aborted += running_ids
        return aborted

    async def _stopped_by_worker(self, lane: Lane, digest: str) -> bool:
        if self._abort_turn is None or not lane.worker_address or not lane.running:
            return False
        run_id = lane.running[0].run_id
        try:
            found = await self._abort_turn(digest, lane.worker_address, run_id)
        except RollgateError as err:
            log.warning("ws_abort_turn_failed", run_id=run_id, code=err.code, message=err.message)
            return False
        return found

    async def close(self) -> None:
        """Stops every lane (gateway shutdown)."""
        tasks = [lane.task for lane in self._lanes.values() if lane.task is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _drain(self, lane: Lane) -> None:
        while lane.queue:
            batch = [lane.queue.popleft()]
            if batch[0].mode == "collect":
                while lane.queue and lane.queue[0].mode == "collect":
                    batch.append(lane.queue.popleft())
            lane.running = batch
            try:
                result = await self._run(lane, batch)
            except asyncio.CancelledError:
                for message in batch:
                    if not message.done.done():
                        message.done.cancel()
                raise
            finally:
                lane.running = []
            for message in batch:
                if not message.done.done():
                    message.done.set_result(result)
        self._lanes.pop((lane.digest, lane.conversation), None)

    async def _run(self, lane: Lane, batch: list[Message]) -> RunResult:
        primary = batch[0]
        holder = f"{primary.run_id}/{uuid.uuid4().hex[:8]}"
        # One event stream per run: its `seq` rises across every event, a failure's included.
        stream = _EventStream(primary, lane.conversation, _unique_sinks(batch), self._config)
        deadline = time.monotonic() + self._config.run_timeout_s
        try:
            await self._acquire(lane, holder, deadline)
        except RollgateError as err:
            return await self._failed(batch, stream, err)
        renew = asyncio.create_task(self._renew(lane, holder))
        try:
            return await self._generate(lane, batch, stream, holder, deadline)
        except RollgateError as err:
            return await self._failed(batch, stream, err)
        finally:
            renew.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renew
            with contextlib.suppress(RollgateError):
                await self._store.release(lane.digest, lane.conversation, holder=holder)

    async def _acquire(self, lane: Lane, holder: str, deadline: float) -> None:
        while True:
            granted, retry_ms = await self._store.acquire(
                lane.digest, lane.conversation, holder=holder, lease_ms=self._config.lease_ms
            )
            if granted:
                return
            if time.monotonic() + 0.05 > deadline:
                raise UpstreamTimeout(
                    "another run of this conversation held it until the deadline",
                    code="conversation_busy",
                )
            # Waiting for another replica's run of this conversation to end.
            await asyncio.sleep(min(retry_ms / 1000, _LEASE_POLL_MAX_S))

    async def _renew(self, lane: Lane, holder: str) -> None:
        interval_s = self._config.lease_ms / 3000
        while True:
            await asyncio.sleep(interval_s)
            with contextlib.suppress(RollgateError):
                await self._store.acquire(
                    lane.digest, lane.conversation, holder=holder, lease_ms=self._config.lease_ms
                )

    async def _generate(
        self,
        lane: Lane,
        batch: list[Message],
        stream: _EventStream,
        holder: str,
        deadline: float,
    ) -> RunResult:
        primary = batch[0]
        history, _ = await self._store.messages(lane.digest, lane.conversation)
        user = {"role": "user", "content": "\n\n".join(m.text for m in batch)}
        messages = [{"role": "system", "content": self._config.system_prompt}]
        messages += [orjson.loads(entry)["message"] for entry in history]
        messages.append(user)
        body = {"model": await self._pick_model(), "messages": messages}
        await stream.lifecycle("start", startedAt=now_ms())
        lane.abort_requested = False
        lane.worker_address = ""
        lane.generation = asyncio.create_task(
            self._consume(lane, primary, body, stream, deadline - time.monotonic())
        )
        try:
            result = await lane.generation
            if lane.abort_requested:
                # Stopped by the worker: the partial turn was recorded under the runId.
                result = dataclasses.replace(result, status="aborted", stop_reason="aborted")
        except asyncio.CancelledError:
            if not lane.abort_requested:
                raise
            result = RunResult(status="aborted", text=stream.text, stop_reason="aborted")
        finally:
            lane.generation = None
            lane.worker_address = ""
        entry_meta = {"runId": primary.run_id, "ts": now_ms()}
        assistant: dict[str, Any] = {"role": "assistant", "content": result.text}
        if result.status == "aborted":
            entry_meta["aborted"] = True
        entries = [
            orjson.dumps({"message": user} | entry_meta),
            orjson.dumps({"message": assistant} | entry_meta),
        ]
        await self._store.append(lane.digest, lane.conversation, entries, holder=holder)
        await stream.finish(result, batch)
        log.info(
            "ws_run_finished",
            run_id=primary.run_id,
            status=result.status,
            merged=len(batch),
            interaction_id=result.interaction_id,
        )
        return result

    async def _consume(
        self,
        lane: Lane,
        primary: Message,
        body: dict[str, Any],
        stream: _EventStream,
        timeout_s: float,
    ) -> RunResult:
        def routed(address: str) -> None:
            lane.worker_address = address

        spec = bridge_spec(
            digest=lane.digest,
            body=body,
            request_id=stream.run_id,
            timeout_s=max(timeout_s, 0.001),
            # The run is the interaction the client saw: set_reward takes the runId.
            interaction_id=stream.run_id,
            # OpenClaw-RL's session headers of the connection's upgrade request, if it sent any.
            tags=turn_tags(primary.request.headers, TurnTags()),
        )
        upstream = primary.request.app[RELAY].stream(spec, on_routed=routed)
        async with contextlib.aclosing(upstream) as items:
            async for item in items:
                if isinstance(item, Delta):
                    await stream.delta(item.content)
                elif isinstance(item, Done):
                    if item.tail_delta is not None:
                        await stream.delta(item.tail_delta.content)
                    return _ok(item)
        raise AssertionError("unreachable: the relay ends with Done")

    async def _failed(
        self, batch: list[Message], stream: _EventStream, err: RollgateError
    ) -> RunResult:
        log.info("ws_run_failed", run_id=batch[0].run_id, code=err.code, message=err.message)
        result = RunResult(status="error", text="", error=err)
        await stream.finish(result, batch)
        return result


def _ok(done: Done) -> RunResult:
    return RunResult(
        status="ok",
        text=done.content,
        stop_reason=done.finish_reason,
        interaction_id=done.interaction_id,
    )


def _unique_sinks(batch: list[Message]) -> list[Sink]:
    sinks: list[Sink] = []
    for message in batch:
        if all(message.sink is not s for s in sinks):
            sinks.append(message.sink)
    return sinks


class _EventStream:
    """The `agent` and `chat` events of one run (chat deltas cumulative and throttled)."""

    def __init__(
        self, primary: Message, session_key: str, sinks: list[Sink], config: WsConfig
    ) -> None:
        self.run_id = primary.run_id
        self.agent_id = primary.agent_id
        self.session_key = session_key
        self.sinks = sinks
        self.interval_s = config.chat_delta_interval_s
        self.seq = 0
        self.parts: list[str] = []
        self.sent_len = 0
        self.last_chat_at = 0.0

    @property
    def text(self) -> str:
        """The text so far."""
        return "".join(self.parts)

    async def _emit(self, name: str, payload: dict[str, Any]) -> None:
        self.seq += 1
        base = {"runId": self.run_id, "sessionKey": self.session_key, "agentId": self.agent_id}
        for sink in self.sinks:
            await sink.emit(name, base | payload | {"seq": self.seq})

    async def lifecycle(self, phase: str, **data: Any) -> None:
        """An `agent` lifecycle event."""
        await self._emit(
            "agent", {"stream": "lifecycle", "data": {"phase": phase} | data, "ts": now_ms()}
        )

    async def delta(self, text: str) -> None:
        """An assistant delta: an `agent` event now, a cumulative `chat` delta at most every 150 ms."""
        if not text:
            return
        self.parts.append(text)
        await self._emit(
            "agent",
            {"stream": "assistant", "data": {"text": self.text, "delta": text}, "ts": now_ms()},
        )
        if time.monotonic() - self.last_chat_at >= self.interval_s:
            await self._chat_delta()

    async def _chat_delta(self) -> None:
        text = self.text
        if len(text) == self.sent_len:
            return
        delta_text = text[self.sent_len :]
        self.sent_len = len(text)
        self.last_chat_at = time.monotonic()
        await self._emit(
            "chat", {"state": "delta", "deltaText": delta_text, "message": _assistant(text)}
        )

    async def finish(self, result: RunResult, batch: list[Message]) -> None:
        """The closing events: lifecycle end/error, then chat final/aborted/error per run id."""
        if result.status == "error" and result.error is not None:
            err = result.error
            retry_ms = None if err.retry_after_s is None else int(err.retry_after_s * 1000)
            await self.lifecycle("error", error=err.message, code=err.code)
            payload: dict[str, Any] = {"state": "error", "errorMessage": err.message}
            payload["errorCode"] = err.code
            if retry_ms is not None:
                payload["retryable"] = True
                payload["retryAfterMs"] = retry_ms
        else:
            await self._chat_delta()
            aborted = result.status == "aborted"
            await self.lifecycle(
                "end", aborted=aborted, stopReason=result.stop_reason, endedAt=now_ms()
            )
            payload = {"state": "aborted" if aborted else "final", "message": _assistant(self.text)}
            payload["stopReason"] = result.stop_reason
        for message in batch:
            self.seq += 1
            base = {"runId": message.run_id, "sessionKey": self.session_key}
            await message.sink.emit(
                "chat", base | {"agentId": self.agent_id, "seq": self.seq} | payload
            )


def _assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": [{"type": "text", "text": text}], "timestamp": now_ms()}
