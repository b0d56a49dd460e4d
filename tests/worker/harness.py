"""A real Worker gRPC server in-process against a real mock LLM, both on port 0."""

from __future__ import annotations

import contextlib
from array import array
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc

from chatml.tokenizer import LocalTokenizer
from protos import worker_pb2, worker_pb2_grpc
from rollgate.mock_llm import MockLLM
from services.runtime.framed import TURNS_PREAMBLE, serve_framed
from services.runtime.grpc_client import open_channel
from services.runtime.grpc_server import GrpcServer, ServerSpec
from services.runtime.secret import Secret
from services.worker.adapters import adapter_for
from services.worker.servicer import WorkerServicer
from services.worker.turn_streams import TurnStreams
from services.worker.turns import TurnRunner
from services.worker.upstream import RequestPolicy, UpstreamClient

# In-process chains stop at once: waiting for their clients to go quiet (what a deployed
# service does, ROLLGATE_STOP_NOTICE_S) would add up to a second to every test's teardown.
# The tests of stopping that need it set it (tests/runtime/test_grpc_client.py,
# tests/dataproxy/test_ledger.py), and the real-process tests run with the default.
NO_STOP_NOTICE_S = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerUnderTest:
    """A worker's stub and its runner (for the in-flight count)."""

    stub: worker_pb2_grpc.WorkerStub
    runner: TurnRunner
    channel: grpc.aio.Channel
    # host:port the worker listens on.
    address: str = ""
    # The worker's Turns streams (what a gateway's turns run on).
    streams: TurnStreams | None = None


@contextlib.asynccontextmanager
async def running_worker(
    base_url: str,
    *,
    kind: str = "vllm",
    api_key: str = "",
    timeout_s: float = 10.0,
    key_var: str = "ROLLGATE_UPSTREAM_API_KEY",
    policy: RequestPolicy | None = None,
    tokenizer: LocalTokenizer | None = None,
    sglang_path: str = "chat",
    framed: bool = True,
) -> AsyncIterator[WorkerUnderTest]:
    """A Worker servicer on a real gRPC server (port 0) calling `base_url`; its Turns also
    served framed, as the worker process serves them, unless `framed` is False."""
    async with (
        contextlib.AsyncExitStack() as stack,
        UpstreamClient(base_url=base_url, api_key=Secret(api_key), key_var=key_var) as upstream,
    ):
        adapter = adapter_for(kind, sglang_path=sglang_path, tokenizer=tokenizer)
        runner = TurnRunner(upstream=upstream, adapter=adapter, policy=policy, tokenizer=tokenizer)
        server = GrpcServer(
            ServerSpec(
                name="worker",
                host="127.0.0.1",
                port=0,
                service_names=("rollgate.v1.Worker",),
                grace_s=1.0,
                stop_notice_s=NO_STOP_NOTICE_S,
            )
        )
        servicer = WorkerServicer(runner, upstream_timeout_s=timeout_s)
        worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server.server)
        servicer.framed_port = await serve_framed(
            stack,
            servicer.streams.serve,
            host="127.0.0.1",
            port=0 if framed else None,
            preamble=TURNS_PREAMBLE,
            parse=worker_pb2.TurnOps.FromString,
            name="worker-turns",
            sends=True,
        )
        async with server:
            await server.set_serving()
            address = f"127.0.0.1:{server.port}"
            channel = open_channel(address)
            try:
                yield WorkerUnderTest(
                    stub=worker_pb2_grpc.WorkerStub(channel),
                    runner=runner,
                    channel=channel,
                    address=address,
                    streams=servicer.streams,
                )
            finally:
                await channel.close()


@contextlib.asynccontextmanager
async def mock_and_worker(
    *,
    kind: str = "vllm",
    token_interval_ms: float = 0.0,
    mock_key: str | None = None,
    worker_key: str = "",
    timeout_s: float = 10.0,
    framed: bool = True,
) -> AsyncIterator[tuple[MockLLM, WorkerUnderTest]]:
    """A fresh mock LLM and a worker in front of it."""
    async with (
        MockLLM(port=0, token_interval_ms=token_interval_ms, api_key=mock_key) as mock,
        running_worker(
            mock.base_url, kind=kind, api_key=worker_key, timeout_s=timeout_s, framed=framed
        ) as worker,
    ):
        yield mock, worker


class Unpacked:
    """A TurnRecord (or TurnSample) whose packed arrays read as lists (ids, logprobs)."""

    def __init__(self, message: Any) -> None:
        self._message = message

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._message, name)
        if name in ("prompt_token_ids", "output_token_ids"):
            return array("i", value).tolist()
        if name == "output_logprobs":
            return array("f", value).tolist()
        if name == "extra_samples":
            return [Unpacked(s) for s in value]
        return value


def unpacked(message: Any) -> Any:
    """`message` with its packed int32 / float32 arrays as lists."""
    return Unpacked(message)
