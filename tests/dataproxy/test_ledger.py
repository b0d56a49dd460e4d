"""The turn ledger: begin and record as messages on one stream, against a real dataproxy."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import orjson
import pytest

from protos import dataproxy_pb2, dataproxy_pb2_grpc, trainer_pb2
from services.gateway.ledger import Admitted, LedgerClient, Replica
from services.gateway.relay import Chunks, Done
from services.runtime import grpc_server
from services.runtime.errors import InvalidRequest, RollgateError, Unavailable, UpstreamTimeout
from services.runtime.grpc_client import open_channel
from services.runtime.keys import key_digest
from tests.dataproxy.turn_records import turn_record
from tests.harness.inprocess import (
    ADMIN_KEY,
    RPC_TIMEOUT_S,
    DataproxyChain,
    collect,
    running_dataproxy_chain,
)
from tests.harness.poll import eventually

AUTH = (("authorization", f"Bearer {ADMIN_KEY}"),)
REQUEST = orjson.dumps({"messages": [{"role": "user", "content": "hi"}]})


@dataclass(frozen=True, slots=True, kw_only=True)
class Chain(DataproxyChain):
    """A dataproxy and a worker; the tests drive the ledger like a gateway."""

    async def start(self) -> str:
        started = await self.dataproxy.StartSession(
            dataproxy_pb2.StartSessionRequest(task_id="ledger"), timeout=RPC_TIMEOUT_S
        )
        return key_digest(started.api_key)

    async def begin(self, ledger: LedgerClient, digest: str) -> Admitted:
        return await ledger.begin(
            route_key=digest, digest=digest, session_id="", request_id="r", timeout_s=5
        )

    async def record(self, ledger: LedgerClient, digest: str, ticket: bytes) -> str:
        recorded = await ledger.record(
            route_key=digest,
            ticket=ticket,
            record=turn_record(interaction_id="chatcmpl-ledger", output_token_ids=[5, 6]),
            request_json=REQUEST,
            interaction_id="",
            turn_type="main",
            session_done=False,
            request_id="r",
            spans=None,
            timeout_s=5,
        )
        return recorded.interaction_id

    async def in_flight(self) -> int:
        return int(await self.redis.zcard(self.keys.in_flight))


@pytest.fixture
async def chain(redis_url: str, key_prefix: str) -> AsyncIterator[Chain]:
    async with running_dataproxy_chain(
        redis_url, key_prefix, chain_type=Chain, token_interval_ms=30.0
    ) as running:
        yield running


def fresh_ledger(chain: Chain) -> LedgerClient:
    """Another gateway's ledger client (its own stream)."""
    stub: Any = chain.dataproxy
    return LedgerClient(stub)


async def test_a_record_sent_twice_is_recorded_once(chain: Chain) -> None:
    digest = await chain.start()
    admitted = await chain.begin(chain.ledger, digest)
    assert await chain.in_flight() == 1

    first = await chain.record(chain.ledger, digest, admitted.ticket)
    again = await chain.record(chain.ledger, digest, admitted.ticket)

    assert first == again == "chatcmpl-ledger"
    assert [t["interaction_id"] for t in await chain.turns(digest)] == ["chatcmpl-ledger"]
    assert await chain.in_flight() == 0


async def test_a_ticket_the_dataproxy_did_not_issue_is_refused(chain: Chain) -> None:
    digest = await chain.start()

    with pytest.raises(InvalidRequest, match="ticket"):
        await chain.record(chain.ledger, digest, b"not a ticket")

    assert await chain.turns(digest) == []


async def test_turns_of_a_gateway_that_went_away_are_released(chain: Chain) -> None:
    digest = await chain.start()
    gateway = fresh_ledger(chain)
    await chain.begin(gateway, digest)
    await chain.begin(gateway, digest)
    assert await chain.in_flight() == 2

    await gateway.close()

    await eventually(chain.in_flight, want=0, what="the lease released")
    assert await chain.redis.hlen(chain.keys.episode_turns) == 0


async def test_a_stopping_dataproxy_refuses_new_turns_and_records_the_running_one(
    chain: Chain,
) -> None:
    digest = await chain.start()
    running = chain.call(digest, "one two three four five six seven eight nine ten")
    assert isinstance(await running.read(), Chunks)

    stopping = asyncio.create_task(chain.dataproxy_server.stop())
    await eventually(lambda: chain.dataproxy_server.draining)
    with pytest.raises(Unavailable) as refused:
        await chain.begin(fresh_ledger(chain), digest)
    rest = await collect(running)
    await stopping

    assert refused.value.code == "dataproxy_stopping"
    assert isinstance(rest[-1], Done)
    [turn] = await chain.turns(digest)
    assert turn["interaction_id"] == rest[-1].interaction_id
    assert await chain.in_flight() == 0


async def test_an_answer_carries_the_error_the_dataproxy_raised(chain: Chain) -> None:
    with pytest.raises(RollgateError) as caught:
        await chain.begin(chain.ledger, key_digest("sk-sess-" + "q" * 43))
    assert caught.value.http_status == 401
    assert "unknown session key" in caught.value.message


class CountingStub:
    """The dataproxy stub, with every message the gateway's ledger writes kept; while `gate`
    is cleared, each write waits at it after it was kept."""

    def __init__(self, stub: Any) -> None:
        self._stub = stub
        self.written: list[dataproxy_pb2.LedgerRequests] = []
        self.gate = asyncio.Event()
        self.gate.set()

    def Ledger(self) -> Any:  # the stub's method name
        call = self._stub.Ledger()
        real_write = call.write

        async def write(message: dataproxy_pb2.LedgerRequests) -> None:
            self.written.append(message)
            await self.gate.wait()
            await real_write(message)

        call.write = write
        return call


async def test_ops_asked_together_travel_in_one_message(chain: Chain) -> None:
    digests = [await chain.start() for _ in range(6)]
    counting = CountingStub(chain.dataproxy)
    gateway = LedgerClient(counting)  # type: ignore[arg-type]
    try:
        admitted = await asyncio.gather(*(chain.begin(gateway, d) for d in digests))
        assert [len(m.ops) for m in counting.written] == [6]
        assert await chain.in_flight() == 6

        recorded = await asyncio.gather(
            *(chain.record(gateway, d, a.ticket) for d, a in zip(digests, admitted, strict=True))
        )
        assert [len(m.ops) for m in counting.written] == [6, 6]
        assert recorded == ["chatcmpl-ledger"] * 6
        for digest in digests:
            assert [t["interaction_id"] for t in await chain.turns(digest)] == ["chatcmpl-ledger"]
        assert await chain.in_flight() == 0
    finally:
        await gateway.close()


@pytest.mark.parametrize("gives_up", ["cancelled", "deadline"])
async def test_an_admission_that_comes_after_its_caller_gave_up_is_released_at_once(
    chain: Chain, gives_up: str
) -> None:
    digest = await chain.start()
    counting = CountingStub(chain.dataproxy)
    gateway = LedgerClient(counting)  # type: ignore[arg-type]
    try:
        await chain.record(gateway, digest, (await chain.begin(gateway, digest)).ticket)
        # The next begin is held on its way out; its caller gives up meanwhile.
        counting.gate.clear()
        if gives_up == "cancelled":
            waiting = asyncio.create_task(chain.begin(gateway, digest))
            await eventually(lambda: ops_of(counting), want=["begin", "record", "begin"])
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
        else:
            with pytest.raises(UpstreamTimeout):
                await gateway.begin(
                    route_key=digest, digest=digest, session_id="", request_id="r", timeout_s=0.2
                )
        counting.gate.set()

        # Admitted after all, and released at once: no lease held until it expires.
        await eventually(lambda: ops_of(counting), want=["begin", "record", "begin", "release"])
        await eventually(chain.in_flight, want=0, what="the late admission released")
        # The session takes its next turn as usual.
        admitted = await chain.begin(gateway, digest)
        assert await chain.record(gateway, digest, admitted.ticket) == "chatcmpl-ledger"
        assert await chain.in_flight() == 0
    finally:
        counting.gate.set()
        await gateway.close()


async def test_each_op_of_a_message_gets_its_own_answer(chain: Chain) -> None:
    digest = await chain.start()
    call: Any = chain.dataproxy.Ledger()
    try:
        await call.write(
            dataproxy_pb2.LedgerRequests(
                ops=[
                    dataproxy_pb2.LedgerRequest(
                        id=7, timeout_s=5, begin=dataproxy_pb2.BeginTurn(key_digest=digest)
                    ),
                    dataproxy_pb2.LedgerRequest(
                        id=8,
                        timeout_s=5,
                        begin=dataproxy_pb2.BeginTurn(key_digest=key_digest("sk-sess-" + "q" * 43)),
                    ),
                    dataproxy_pb2.LedgerRequest(
                        id=9, timeout_s=5, release=dataproxy_pb2.ReleaseTurn(ticket=b"not one")
                    ),
                ]
            )
        )
        answers: dict[int, dataproxy_pb2.LedgerResponse] = {}
        async with asyncio.timeout(RPC_TIMEOUT_S):
            while len(answers) < 3:
                message = await call.read()
                answers.update({a.id: a for a in message.answers if a.id != 0})
    finally:
        call.cancel()

    assert answers[7].WhichOneof("result") == "admitted"
    assert answers[7].admitted.ticket
    assert b"unknown session key" in answers[8].error_json
    assert b"ticket" in answers[9].error_json
    await eventually(chain.in_flight, want=0, what="the lease of the cancelled stream released")


async def test_a_turn_after_redis_lost_its_scripts_is_begun_and_recorded(chain: Chain) -> None:
    # A restarted (or failed-over) Redis has no cached scripts: the begin and the record sent
    # at once get NOSCRIPT, and their ops go on as EVAL in their own tasks.
    digest = await chain.start()
    await chain.redis.script_flush()

    admitted = await chain.begin(chain.ledger, digest)
    assert await chain.in_flight() == 1
    await chain.redis.script_flush()
    assert await chain.record(chain.ledger, digest, admitted.ticket) == "chatcmpl-ledger"

    assert [t["interaction_id"] for t in await chain.turns(digest)] == ["chatcmpl-ledger"]
    assert await chain.in_flight() == 0


async def test_an_op_past_its_deadline_answers_that_it_timed_out(
    redis_url: str, key_prefix: str
) -> None:
    # Paused for longer than the op may take: the begin waits, then its deadline ends it.
    async with running_dataproxy_chain(
        redis_url, key_prefix, chain_type=Chain, pause_wait_s=60.0
    ) as chain:
        digest = await chain.start()
        paused = await chain.trainer.PauseSubmission(
            trainer_pb2.PauseSubmissionRequest(timeout_s=1), metadata=AUTH, timeout=5
        )
        assert paused.drained
        call: Any = chain.dataproxy.Ledger()
        try:
            await call.write(
                dataproxy_pb2.LedgerRequests(
                    ops=[
                        dataproxy_pb2.LedgerRequest(
                            id=3, timeout_s=0.3, begin=dataproxy_pb2.BeginTurn(key_digest=digest)
                        )
                    ]
                )
            )
            # Far less than the pause wait: only the op's own deadline answers it this soon.
            async with asyncio.timeout(RPC_TIMEOUT_S):
                answer = None
                while answer is None:
                    message = await call.read()
                    answer = next((a for a in message.answers if a.id == 3), None)
        finally:
            call.cancel()

        error = orjson.loads(answer.error_json)
        assert error["code"] == "dataproxy_timeout", error
        await chain.trainer.ResumeSubmission(
            trainer_pb2.ResumeSubmissionRequest(), metadata=AUTH, timeout=5
        )
        # Nothing was taken: the next turn is admitted and recorded, no lease left over.
        admitted = await chain.begin(chain.ledger, digest)
        assert await chain.record(chain.ledger, digest, admitted.ticket) == "chatcmpl-ledger"
        assert await chain.in_flight() == 0


@pytest.fixture
async def two_replicas(redis_url: str, key_prefix: str) -> AsyncIterator[Chain]:
    async with running_dataproxy_chain(
        redis_url, key_prefix, chain_type=Chain, replicas=2, grace_s=20.0
    ) as running:
        yield running


def ops_of(stub: CountingStub) -> list[str]:
    return [op.WhichOneof("op") or "" for message in stub.written for op in message.ops]


async def test_a_begin_a_stopping_replica_refused_is_admitted_by_the_other(
    two_replicas: Chain,
) -> None:
    chain = two_replicas
    channels = [open_channel(f"127.0.0.1:{s.port}") for s in chain.dataproxy_servers]
    stubs = [CountingStub(dataproxy_pb2_grpc.DataProxyStub(c)) for c in channels]
    gateway = LedgerClient(*(Replica(stub) for stub in stubs))  # type: ignore[arg-type]
    try:
        digest = await chain.start()
        # A turn admitted and not recorded holds its replica's drain open.
        held = await chain.begin(gateway, digest)
        [home] = [i for i, stub in enumerate(stubs) if ops_of(stub) == ["begin"]]
        other = 1 - home
        stopping = asyncio.create_task(chain.dataproxy_servers[home].stop())
        await eventually(lambda: chain.dataproxy_servers[home].draining)

        moved = await chain.begin(gateway, digest)
        assert ops_of(stubs[home]) == ["begin", "begin"]  # refused there ...
        assert ops_of(stubs[other]) == ["begin"]  # ... and admitted here
        # The refused replica takes no more begins while it drains.
        another = await chain.begin(gateway, digest)
        assert ops_of(stubs[home]) == ["begin", "begin"]
        assert ops_of(stubs[other]) == ["begin", "begin"]

        # Each turn is recorded where it was admitted: the draining replica's drain ends as
        # its turn is recorded, long before its 20 s grace.
        assert await chain.record(gateway, digest, held.ticket) == "chatcmpl-ledger"
        assert ops_of(stubs[home]) == ["begin", "begin", "record"]
        async with asyncio.timeout(10):
            await stopping
        for admitted in (moved, another):
            await chain.record(gateway, digest, admitted.ticket)
        assert ops_of(stubs[other]) == ["begin", "begin", "record", "record"]
        assert await chain.in_flight() == 0
        assert len(await chain.turns(digest)) == 1  # the same interaction id, appended once
    finally:
        await gateway.close()
        for channel in channels:
            await channel.close()


async def test_with_one_replica_a_stopping_dataproxy_answers_503_with_retry_after(
    chain: Chain,
) -> None:
    digest = await chain.start()
    gateway = fresh_ledger(chain)
    held = await chain.begin(gateway, digest)
    stopping = asyncio.create_task(chain.dataproxy_server.stop())
    try:
        await eventually(lambda: chain.dataproxy_server.draining)
        with pytest.raises(Unavailable) as refused:
            await chain.begin(gateway, digest)
        assert refused.value.code == "dataproxy_stopping"
        assert refused.value.http_status == 503
        assert refused.value.retry_after_s == 1.0
        await chain.record(gateway, digest, held.ticket)
    finally:
        await stopping
        await gateway.close()


@pytest.fixture
async def long_grace(redis_url: str, key_prefix: str) -> AsyncIterator[Chain]:
    async with running_dataproxy_chain(
        redis_url, key_prefix, chain_type=Chain, grace_s=20.0, stop_notice_s=6.0
    ) as running:
        yield running


async def test_a_stream_opened_while_the_dataproxy_stops_does_not_hold_its_stop(
    long_grace: Chain, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A stopping server serves until its clients went quiet; long here, so the late stream
    # surely opens in that window, after the drain ended the streams there were.
    monkeypatch.setattr(grpc_server, "QUIET_S", 3.0)
    chain = long_grace
    digest = await chain.start()
    stopping = asyncio.create_task(chain.dataproxy_server.stop())
    late = fresh_ledger(chain)  # another gateway's
    try:
        await eventually(lambda: chain.dataproxy_server.draining)
        with pytest.raises(Unavailable, match="shutting down"):
            await chain.begin(late, digest)
        # The late stream ended after its refused begin: the stop does not wait it out for
        # the 20 s grace (before, it did, and then cut it).
        async with asyncio.timeout(12):
            await stopping
        # ... and the gateway's side of it stopped writing too (its writer task is not left
        # pending, to be destroyed with the stream).
        [stream] = [s for s in late._streams if s is not None]
        await eventually(stream._writer.done, what="the writer stopped")
    finally:
        await late.close()


async def test_a_stream_that_sends_nothing_while_the_dataproxy_stops_ends_when_idle(
    long_grace: Chain, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(grpc_server, "QUIET_S", 3.0)  # the stop's window stays open
    chain = long_grace
    await chain.start()
    stopping = asyncio.create_task(chain.dataproxy_server.stop())
    await eventually(lambda: chain.dataproxy_server.draining)
    call = chain.dataproxy.Ledger()  # opened after the drain, and no op on it
    try:
        async with asyncio.timeout(10):  # before: open until the 20 s grace ran out
            while await call.read() is not grpc.aio.EOF:
                pass  # the weight version every stream starts with
            await stopping
    finally:
        call.cancel()
