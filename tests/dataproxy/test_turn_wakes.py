"""How often a relayed turn wakes its caller, through a real dataproxy and a real worker: once
the turn's worker is known and its streams are open, the worker is started from the ledger's
read callback as the admission is read, and the record sent from the worker stream's as the
last event is — the caller wakes at the worker's first events and at the record's answer only.
And an admission that comes after its caller gave up is released, not left to expire."""

from __future__ import annotations

import asyncio
import contextlib
import types
from collections.abc import AsyncIterator, Coroutine, Generator
from typing import Any

import orjson
import pytest

from services.gateway.ledger import LedgerClient
from services.gateway.relay import Chunks, Delta, Done, Event, TurnRelay
from services.runtime.grpc_client import ChannelPool
from tests.dataproxy.test_chat import Stack, running_stack
from tests.dataproxy.test_ledger import CountingStub, ops_of
from tests.harness.inprocess import FixedWorker, chunk_payloads
from tests.harness.poll import eventually


class Steps:
    """Runs coroutines, counting how often each is resumed: its first step, then one per
    wake-up of the task that runs it."""

    def __init__(self) -> None:
        self.count = 0

    @types.coroutine
    def run(self, coro: Coroutine[Any, Any, Any]) -> Generator[Any, Any, Any]:
        value: Any = None
        error: BaseException | None = None
        while True:
            self.count += 1
            try:
                yielded = coro.send(value) if error is None else coro.throw(error)
            except StopIteration as stop:
                return stop.value
            value, error = None, None
            try:
                value = yield yielded
            except BaseException as err:  # a cancellation, thrown on into the coroutine
                error = err


@pytest.fixture
async def stack(redis_url: str, key_prefix: str) -> AsyncIterator[Stack]:
    # Tokens 20 ms apart: a streamed answer's first batch comes on its own.
    async with running_stack(redis_url, key_prefix, token_interval_ms=20.0) as running:
        yield running


@contextlib.asynccontextmanager
async def counted_relay(stack: Stack) -> AsyncIterator[tuple[TurnRelay, CountingStub]]:
    """A relay of its own, with every ledger message it writes kept."""
    counting = CountingStub(stack.dataproxy)
    ledger = LedgerClient(counting)  # type: ignore[arg-type]
    async with ChannelPool() as workers:
        relay = TurnRelay(
            routes=FixedWorker(stack.worker_address),
            ledger=ledger,
            workers=workers,
            rpc_timeout_s=5,
        )
        try:
            yield relay, counting
        finally:
            await relay.close()
            await ledger.close()


async def test_a_unary_turn_wakes_its_caller_once_when_its_streams_are_open(
    stack: Stack,
) -> None:
    _, digest = await stack.start()
    first, second = Steps(), Steps()

    _, opening = await first.run(stack.relay.complete(stack.spec(digest, "one", request_id="a")))
    body, done = await second.run(stack.relay.complete(stack.spec(digest, "two", request_id="b")))

    # The first turn opens the ledger stream: its begin is waited for (start, admitted,
    # recorded); the record already goes from the worker stream's read callback.
    assert first.count == 3
    # Then: started, and woken once the record is answered.
    assert second.count == 2
    turns = await stack.turns(digest)
    assert [t["interaction_id"] for t in turns] == [opening.interaction_id, done.interaction_id]
    assert orjson.loads(body)["choices"][0]["message"]["content"] == done.content != ""
    assert await stack.in_flight() == 0


async def test_a_pushed_stream_wakes_its_caller_at_its_first_batch_and_at_its_record(
    stack: Stack,
) -> None:
    _, digest = await stack.start()
    await stack.complete(digest, "opens the streams")
    pushed: list[Chunks | Delta] = []

    def push(event: Chunks | Delta) -> bool:
        pushed.append(event)
        return True

    async def read() -> list[Event]:
        spec = stack.spec(digest, "a b c d e f g h", stream=True, request_id="s")
        events = stack.relay.stream(spec, push=push)
        async with contextlib.aclosing(events):
            return [event async for event in events]

    steps = Steps()
    events = await steps.run(read())

    # Started; the first batch (the worker started from the admission's callback); the
    # record's answer (sent from the last event's). The batches between were pushed.
    assert steps.count <= 3
    assert pushed, "the later batches should have been pushed"
    done = events[-1]
    assert isinstance(done, Done)
    # In order, whole: what was yielded first, what was pushed, the end's tail.
    payloads = chunk_payloads([*events[:-1], *pushed, done])
    streamed = "".join(
        (orjson.loads(p)["choices"] or [{}])[0].get("delta", {}).get("content") or ""
        for p in payloads
    )
    assert streamed == done.content != ""
    [_, turn] = await stack.turns(digest)
    assert turn["interaction_id"] == done.interaction_id
    assert await stack.in_flight() == 0


async def test_an_admission_that_comes_after_its_caller_gave_up_is_released(
    stack: Stack,
) -> None:
    _, digest = await stack.start()
    async with counted_relay(stack) as (relay, counting):
        await relay.complete(stack.spec(digest, "opens the streams", request_id="a"))
        assert ops_of(counting) == ["begin", "record"]
        calls = stack.mock.stats.requests

        # The begin is held on its way out; its caller gives up meanwhile.
        counting.gate.clear()
        turn = asyncio.create_task(
            relay.complete(stack.spec(digest, "never answered", request_id="b"))
        )
        await eventually(lambda: ops_of(counting), want=["begin", "record", "begin"])
        turn.cancel()
        with pytest.raises(asyncio.CancelledError):
            await turn
        counting.gate.set()

        # Admitted after all, then released at once: no lease left until it expires, and the
        # worker never called.
        await eventually(lambda: ops_of(counting), want=["begin", "record", "begin", "release"])
        await eventually(stack.in_flight, want=0, what="the late admission released")
        assert stack.mock.stats.requests == calls
        assert len(await stack.turns(digest)) == 1
