"""The console's error list: failed RPCs of every replica and failed turns (the gateway
reports the worker's failures with the turn's release), newest first, in Redis (`P errors`).

Recording never blocks an RPC: events go through a small queue that a background task writes
out; when Redis is slow the queue fills and further events are only counted, not stored."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from types import TracebackType

import grpc
import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from services.dataproxy.redis_keys import RedisKeys, StatsFields
from services.runtime.logs import get_logger
from services.runtime.secret import mask_addresses, scrub
from services.runtime.tasks import cancel_and_wait

log = get_logger(__name__)

ERRORS_KEPT = 200
QUEUE_SIZE = 256
# Messages are client-facing texts (no secrets by construction), bounded so one huge value
# never fills the list.
MESSAGE_CHARS = 300
WRITE_TIMEOUT_S = 5.0
# Codes that are not failures of the system: a client that went away.
IGNORED_CODES = frozenset({"OK", "CANCELLED"})
# The calls a gateway reports a turn's failure for (anything else is shown as "turn").
FAILED_CALLS = frozenset({"Worker.Generate", "Worker.Complete", "Ledger.record"})
STATUS_NAMES = frozenset(code.name for code in grpc.StatusCode)
# Messages are meant for clients, but the list is read by people who are not the client:
# whatever looks like an address (a URL, host:port, an IP) is masked as well as secrets.
_CODE = re.compile(r"[^a-z0-9_]")


def clean_message(message: str) -> str:
    """`message` bounded, without secrets or addresses."""
    return mask_addresses(scrub(message[: MESSAGE_CHARS * 2]))[:MESSAGE_CHARS]


class ErrorLog:
    """`async with ErrorLog(...)`: `record()` queues an event; a task writes it to Redis."""

    def __init__(self, *, redis: aioredis.Redis, keys: RedisKeys) -> None:
        self._redis = redis
        self._keys = keys
        self._queue: asyncio.Queue[bytes] = asyncio.Queue(maxsize=QUEUE_SIZE)
        self._task: asyncio.Task[None] | None = None
        self.dropped = 0

    def record(self, method: str, code: str, message: str) -> None:
        """Queues one failed RPC (`/pkg.Service/Method`, status code name, details)."""
        if code in IGNORED_CODES:
            return
        event = {
            "t": time.time(),
            "method": method.rpartition("/")[2],
            "code": code,
            "message": clean_message(message),
        }
        try:
            self._queue.put_nowait(orjson.dumps(event))
        except asyncio.QueueFull:
            self.dropped += 1

    def record_turn_failure(self, *, call: str, status: str, code: str, message: str) -> None:
        """Queues a turn's failure a gateway reported (the call, the error's gRPC status name,
        its rollgate code and the client's message); each value is checked, not trusted."""
        call = call if call in FAILED_CALLS else "turn"
        status = status if status in STATUS_NAMES else "UNKNOWN"
        code = _CODE.sub("", code.lower())[:64] or "error"
        self.record(f"/{call}", status, f"{code}: {message}")

    async def _write(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while not self._queue.empty() and len(batch) < QUEUE_SIZE:
                batch.append(self._queue.get_nowait())
            try:
                async with asyncio.timeout(WRITE_TIMEOUT_S):
                    pipe = self._redis.pipeline(transaction=False)
                    pipe.lpush(self._keys.errors, *batch)
                    pipe.ltrim(self._keys.errors, 0, ERRORS_KEPT - 1)
                    pipe.hincrby(self._keys.stats, StatsFields.ERRORS, len(batch))
                    await pipe.execute()
            except (RedisError, TimeoutError, OSError) as err:
                self.dropped += len(batch)
                log.warning("error_log_write_failed", error=type(err).__name__, events=len(batch))
            finally:
                for _ in batch:
                    self._queue.task_done()

    async def flush(self, timeout_s: float = WRITE_TIMEOUT_S) -> None:
        """Waits until every queued event was written (or given up on)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._queue.join()

    async def __aenter__(self) -> ErrorLog:
        self._task = asyncio.create_task(self._write(), name="error-log")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.flush(timeout_s=1.0)
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
