"""The gateway's ledger client against a dataproxy that reads every op and answers none: an op
fails at its deadline, and one given up before it was written is never sent."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from protos import dataproxy_pb2, dataproxy_pb2_grpc
from services.gateway.ledger import LedgerClient
from services.runtime.errors import UpstreamTimeout
from services.runtime.grpc_client import open_channel
from services.runtime.keys import key_digest, new_session_key
from tests.harness.inprocess import scripted_dataproxy
from tests.harness.poll import eventually

DIGEST = key_digest(new_session_key())


class _SilentDataproxy(dataproxy_pb2_grpc.DataProxyServicer):
    """Keeps every ledger op it reads; answers none (a message without answers per batch)."""

    def __init__(self) -> None:
        self.ops: list[dataproxy_pb2.LedgerRequest] = []

    async def Ledger(
        self,
        request_iterator: AsyncIterator[dataproxy_pb2.LedgerRequests],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[dataproxy_pb2.LedgerResponses]:
        async for batch in request_iterator:
            self.ops.extend(batch.ops)
            yield dataproxy_pb2.LedgerResponses()


class _GatedStub:
    """The dataproxy stub, each write of its ledger stream held until `gate` is set (the
    messages held are kept in `held`)."""

    def __init__(self, stub: Any) -> None:
        self._stub = stub
        self.gate = asyncio.Event()
        self.held: list[dataproxy_pb2.LedgerRequests] = []

    def Ledger(self) -> Any:  # the stub's method name
        call = self._stub.Ledger()
        real_write = call.write

        async def write(message: dataproxy_pb2.LedgerRequests) -> None:
            self.held.append(message)
            await self.gate.wait()
            await real_write(message)

        call.write = write
        return call


@pytest.fixture
async def silent() -> AsyncIterator[tuple[_SilentDataproxy, Any]]:
    servicer = _SilentDataproxy()
    server = scripted_dataproxy(servicer)
    async with server, open_channel(f"127.0.0.1:{server.port}") as channel:
        yield servicer, dataproxy_pb2_grpc.DataProxyStub(channel)


async def _begin(ledger: LedgerClient, timeout_s: float) -> None:
    await ledger.begin(
        route_key=DIGEST, digest=DIGEST, session_id="", request_id="r", timeout_s=timeout_s
    )


async def test_an_op_the_dataproxy_does_not_answer_fails_at_its_deadline(
    silent: tuple[_SilentDataproxy, Any],
) -> None:
    servicer, stub = silent
    ledger = LedgerClient(stub)
    try:
        with pytest.raises(UpstreamTimeout) as caught:
            await _begin(ledger, timeout_s=0.2)
        assert caught.value.code == "dataproxy_timeout"
        assert [op.WhichOneof("op") for op in servicer.ops] == ["begin"]
    finally:
        await ledger.close()


async def test_an_op_that_timed_out_before_it_was_written_is_never_sent(
    silent: tuple[_SilentDataproxy, Any],
) -> None:
    servicer, stub = silent
    gated = _GatedStub(stub)
    ledger = LedgerClient(gated)  # type: ignore[arg-type]
    first = asyncio.create_task(_begin(ledger, timeout_s=30))
    try:
        # The first begin is being written (held at the gate); the second waits behind it and
        # times out meanwhile.
        await eventually(lambda: len(gated.held), want=1, what="the first begin held")
        with pytest.raises(UpstreamTimeout):
            await _begin(ledger, timeout_s=0.1)
        gated.gate.set()
        # An op asked after it goes out next: the timed-out one did not go before it.
        release = asyncio.create_task(ledger.release(route_key=DIGEST, ticket=b"t", timeout_s=30))
        await eventually(lambda: len(servicer.ops), want=2, what="two ops arrived")
        assert [op.WhichOneof("op") for op in servicer.ops] == ["begin", "release"]
        assert [len(message.ops) for message in gated.held] == [1, 1]
    finally:
        first.cancel()
        release.cancel()
        await asyncio.gather(first, release, return_exceptions=True)
        await ledger.close()
