"""The gateway's turns on one `Worker.Turns` stream per worker, against a real worker and the
mock LLM: many turns share it, a turn's window holds only that turn, cancel stops the
upstream call, a stopping worker refuses new turns as not started, an unreachable one fails
them as not started. Each test runs on the framed stream and on the gRPC one."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from protos import worker_pb2
from rollgate.redis_server import free_port
from services.gateway import worker_calls
from services.gateway.worker_calls import WorkerTurn, WorkerTurns
from services.runtime.errors import RollgateError
from services.runtime.framed import FramedCall
from services.runtime.grpc_client import ChannelPool
from tests.harness.poll import eventually
from tests.worker.harness import mock_and_worker


@pytest.fixture(params=["framed", "grpc"])
def framed(request: pytest.FixtureRequest) -> bool:
    """Whether the gateway's side uses the worker's framed stream (else its gRPC stream)."""
    return bool(request.param == "framed")


LONG_TEXT = " ".join(f"word{i}" for i in range(40))


def request(text: str, *, stream: bool) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(
        request_json=orjson.dumps({"messages": [{"role": "user", "content": text}]}),
        params_json=orjson.dumps({"model": "rollgate-mock", "stream": stream}),
        request_id=f"req-{text[:8]}",
    )


async def read_all(turn: WorkerTurn) -> tuple[str, worker_pb2.TurnEvent]:
    """The text of a streamed turn's chunks and its last event."""
    text: list[str] = []
    while True:
        for event in await turn.events():
            for chunk in event.generated.chunks.chunks:
                for choice in orjson.loads(chunk).get("choices") or ():
                    text.append((choice.get("delta") or {}).get("content") or "")
            if event.generated.HasField("record"):
                return "".join(text), event


def streamed(turns: WorkerTurns, address: str, text: str) -> WorkerTurn:
    """A streamed turn whose answer is many tokens long (it repeats `text` and LONG_TEXT)."""
    return turns.start(
        address, request(f"{text} {LONG_TEXT}", stream=True), stream=True, timeout_s=10
    )


def answer(record: Any) -> str:
    return str(orjson.loads(record.assistant_message_json)["content"])


async def test_many_turns_share_one_stream_and_each_gets_its_own_answer(framed: bool) -> None:
    async with mock_and_worker(token_interval_ms=1) as (mock, worker), ChannelPool() as pool:
        turns = WorkerTurns(pool, framed=framed)
        streamed = [
            turns.start(worker.address, request(f"stream {i} {LONG_TEXT}", stream=True),
                        stream=True, timeout_s=10)
            for i in range(6)
        ]  # fmt: skip
        unary = [
            turns.start(worker.address, request(f"unary {i}", stream=False),
                        stream=False, timeout_s=10)
            for i in range(4)
        ]  # fmt: skip
        results = await asyncio.gather(*(read_all(t) for t in streamed))
        answers = [(await t.events())[0] for t in unary]
        assert len(turns._streams) == 1
        (opened,) = turns._streams.values()
        assert opened.call.transport == ("framed" if framed else "grpc")
        await turns.close()
    for i, (text, last) in enumerate(results):
        assert f"you said stream {i} " in text
        assert answer(last.generated.record) == text
    for i, event in enumerate(answers):
        assert f"you said unary {i}" in answer(event.completed.record)
    assert mock.stats.requests == 10


async def test_turns_started_together_go_out_as_one_message_without_a_task(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    writes: list[str] = []
    for name in ("send_now", "write"):
        original = getattr(FramedCall, name)

        def counted(self: Any, message: Any, _name: str = name, _original: Any = original) -> Any:
            # What goes on the wire: a TurnOps (the direct write hands over a Batch of ops).
            ops = worker_pb2.TurnOps.FromString(message.SerializeToString()).ops
            writes.append(f"{_name}:{len(ops)}")
            return _original(self, message)

        monkeypatch.setattr(FramedCall, name, counted)
    async with mock_and_worker() as (_, worker), ChannelPool() as pool:
        turns = WorkerTurns(pool, framed=True)
        first = turns.start(
            worker.address, request("first", stream=False), stream=False, timeout_s=10
        )
        await first.events()  # the stream is open (its first start waited for it)
        writes.clear()
        together = [
            turns.start(worker.address, request(f"together {i}", stream=False),
                        stream=False, timeout_s=10)
            for i in range(5)
        ]  # fmt: skip
        answers = [(await t.events())[0] for t in together]
        await turns.close()
    # The five starts of one turn of the loop: one message, written by the flush callback
    # (send_now), not the writer task (write).
    assert writes == ["send_now:5"]
    for i, event in enumerate(answers):
        assert f"you said together {i}" in answer(event.completed.record)


async def test_a_turn_that_is_not_read_waits_at_its_window_while_others_go_on(
    framed: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(worker_calls, "WINDOW_BYTES", 600)
    async with mock_and_worker(token_interval_ms=2) as (_, worker), ChannelPool() as pool:
        turns = WorkerTurns(pool, framed=framed)
        slow = streamed(turns, worker.address, "slow")
        first = await slow.events()
        # The slow turn's reader takes nothing more: the worker stops at its window.
        fast = streamed(turns, worker.address, "fast")
        text, _ = await read_all(fast)
        assert "you said fast " in text
        # What the worker sent of it is within its window (plus the one event that crossed it).
        sent = [*first, *slow._inbox]
        assert sum(e.size for e in sent) <= 600 + max(e.size for e in sent)
        assert not any(e.generated.HasField("record") for e in sent)
        # Read on: credits let the rest come, and the answer is whole.
        rest, last = await read_all(slow)
        await turns.close()
    whole = "".join(
        (choice.get("delta") or {}).get("content") or ""
        for event in first
        for chunk in event.generated.chunks.chunks
        for choice in orjson.loads(chunk).get("choices") or ()
    )
    assert whole + rest == answer(last.generated.record)
    assert "you said slow " in answer(last.generated.record)


async def test_a_cancelled_turn_stops_its_upstream_call(framed: bool) -> None:
    async with mock_and_worker(token_interval_ms=50) as (mock, worker), ChannelPool() as pool:
        turns = WorkerTurns(pool, framed=framed)
        turn = turns.start(
            worker.address, request(LONG_TEXT, stream=True), stream=True, timeout_s=10
        )
        await turn.events()
        turn.cancel()
        await eventually(lambda: worker.runner.in_flight, want=0, what="the turn stopped")
        await eventually(lambda: mock.stats.disconnects, want=1, what="the upstream call closed")
        assert mock.stats.streams_finished == 0
        # The stream stays usable for the next turn.
        text, _ = await read_all(
            turns.start(worker.address, request("next", stream=True), stream=True, timeout_s=10)
        )
        assert "you said next" in text
        await turns.close()


async def test_a_stopping_worker_refuses_new_turns_as_not_started_and_finishes_the_running(
    framed: bool,
) -> None:
    async with mock_and_worker(token_interval_ms=20) as (_, worker), ChannelPool() as pool:
        assert worker.streams is not None
        turns = WorkerTurns(pool, framed=framed)
        running = turns.start(
            worker.address, request(LONG_TEXT, stream=True), stream=True, timeout_s=10
        )
        await running.events()
        closing = asyncio.create_task(worker.streams.close(10.0))
        await eventually(lambda: worker.streams is not None and worker.streams._closing)
        refused = turns.start(worker.address, request("late", stream=False), stream=False,
                              timeout_s=10)  # fmt: skip
        with pytest.raises(RollgateError) as caught:
            await refused.events()
        assert caught.value.code == "worker_stopping"
        assert not refused.received
        _, last = await read_all(running)
        assert "you said word0" in answer(last.generated.record)
        assert last.generated.HasField("record")
        await closing
        await turns.close()


async def test_an_unreachable_worker_fails_the_turn_as_not_started(framed: bool) -> None:
    async with ChannelPool() as pool:
        turns = WorkerTurns(pool, framed=framed)
        turn = turns.start(
            f"127.0.0.1:{free_port()}", request("hi", stream=False), stream=False, timeout_s=5
        )
        with pytest.raises(RollgateError) as caught:
            await turn.events()
        await turns.close()
    assert caught.value.code == "worker_unavailable"
    assert not turn.received


async def test_a_stream_opened_after_a_worker_began_stopping_ends_after_its_refusal(
    framed: bool,
) -> None:
    # Else the worker's stop waits it out for its whole grace period, then cuts it.
    async with mock_and_worker() as (_, worker), ChannelPool() as pool:
        streams = worker.streams
        assert streams is not None
        await streams.close(10.0)  # nothing running: drained at once, no stream left
        turns = WorkerTurns(pool, framed=framed)  # a gateway that opens its stream now
        try:
            refused = turns.start(
                worker.address, request("late", stream=False), stream=False, timeout_s=10
            )
            with pytest.raises(RollgateError) as caught:
                await refused.events()
            assert caught.value.code == "worker_stopping"
            await eventually(lambda: not streams._streams, what="the late stream ended")
        finally:
            await turns.close()


def _text(events: list[worker_pb2.TurnEvent]) -> str:
    return "".join(
        (choice.get("delta") or {}).get("content") or ""
        for event in events
        for chunk in event.generated.chunks.chunks
        for choice in orjson.loads(chunk).get("choices") or ()
    )


async def test_a_sink_takes_each_event_as_it_is_read_and_credits_it(
    framed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A small window: the answer is many windows long, so it completes only if what the sink
    # takes is credited back to the worker.
    monkeypatch.setattr(worker_calls, "WINDOW_BYTES", 600)
    async with mock_and_worker(token_interval_ms=2) as (_, worker), ChannelPool() as pool:
        turns = WorkerTurns(pool, framed=framed)
        turn = streamed(turns, worker.address, "sunk")
        sunk: list[worker_pb2.TurnEvent] = []

        def take(event: worker_pb2.TurnEvent) -> bool:
            sunk.append(event)
            return True

        turn.sink = take
        # The caller wakes once: for the last event, which never goes to the sink.
        woken = await turn.events()
        await turns.close()
    assert len(woken) == 1 and woken[0].generated.HasField("record")
    assert sum(event.size for event in sunk) > 3 * 600
    assert _text(sunk) == answer(woken[0].generated.record)


async def test_what_a_sink_leaves_comes_by_events_in_order(framed: bool) -> None:
    async with mock_and_worker(token_interval_ms=2) as (_, worker), ChannelPool() as pool:
        turns = WorkerTurns(pool, framed=framed)
        turn = streamed(turns, worker.address, "left")
        seen: list[worker_pb2.TurnEvent] = []
        asked = 0

        def every_third_left(event: worker_pb2.TurnEvent) -> bool:
            nonlocal asked
            asked += 1
            if asked % 3 == 0:
                return False
            seen.append(event)
            return True

        turn.sink = every_third_left
        by_events = 0
        while True:
            events = await turn.events()
            by_events += len(events)
            seen += events  # in the same step: no read callback runs in between
            if events[-1].generated.HasField("record"):
                break
        await turns.close()
    assert by_events > 1 and len(seen) > by_events  # both ways were taken
    assert _text(seen) == answer(seen[-1].generated.record)
    assert "you said left " in _text(seen)


async def test_a_sink_that_fails_is_dropped_and_the_turn_goes_on(framed: bool) -> None:
    async with mock_and_worker(token_interval_ms=2) as (_, worker), ChannelPool() as pool:
        turns = WorkerTurns(pool, framed=framed)
        turn = streamed(turns, worker.address, "bug")
        seen: list[worker_pb2.TurnEvent] = []

        def fails_second(event: worker_pb2.TurnEvent) -> bool:
            if seen:
                raise RuntimeError("a bug in the sink")
            seen.append(event)
            return True

        turn.sink = fails_second
        text, last = await read_all(turn)
        await turns.close()
    assert turn.sink is None
    assert _text(seen) + text == answer(last.generated.record)
