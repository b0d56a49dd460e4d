"""In-process stacks for tests: real gRPC servers on port 0, a real Redis, the mock LLM upstream.

One `async with` per kind: a dataproxy chain (worker over the mock LLM, one or more dataproxy
replicas), the full chain behind a gateway (router, dataproxy, workers, gateway), and a lone
Trainer server.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import orjson
import redis.asyncio as aioredis

from protos import dataproxy_pb2_grpc, trainer_pb2_grpc
from rollgate.mock_llm import MockLLM
from services.dataproxy.__main__ import serving as dataproxy_serving
from services.dataproxy.redis_keys import RedisKeys
from services.dataproxy.settings import DataProxySettings
from services.dataproxy.trainer_servicer import TrainerServicer
from services.dataproxy.turns import decode_turns
from services.gateway.app import GatewayServer
from services.gateway.header_mode import TurnTags
from services.gateway.ledger import LedgerClient
from services.gateway.relay import Chunks, Done, Event, TurnRelay, TurnSpec, split_body
from services.gateway.routing import WorkerChoice
from services.router.__main__ import serving as router_serving
from services.router.settings import RouterSettings
from services.runtime.grpc_client import ChannelPool, open_channel
from services.runtime.grpc_server import GrpcServer, ServerSpec
from services.runtime.keys import key_id_of
from services.runtime.secret import Secret
from services.runtime.tracing import NO_TRACING, TracingSettings
from services.worker.__main__ import serving as worker_serving
from services.worker.settings import WorkerSettings
from services.worker.upstream import RequestPolicy
from tests.gateway.conftest import gateway_settings
from tests.harness.poll import eventually
from tests.worker.harness import NO_STOP_NOTICE_S, running_worker

# The admin key of the dataproxy chain.
ADMIN_KEY = "admin-test-key-0123456789"
RPC_TIMEOUT_S = 10.0
GATEWAY_READY_DEADLINE_S = 15.0
MOCK_MODEL = "rollgate-mock"

ChainT = TypeVar("ChainT", bound="DataproxyChain")


# -- dataproxy chain ------------------------------------------------------------------------


def dataproxy_settings(redis_url: str, key_prefix: str, **overrides: Any) -> DataProxySettings:
    """Port 0, the test's Redis prefix, ADMIN_KEY, a 30 s turn timeout and a 2 s grace."""
    base: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": 0,
        "redis_url": redis_url,
        "redis_prefix": key_prefix,
        "admin_key": Secret(ADMIN_KEY),
        "turn_timeout_s": 30.0,
        "grace_s": 2.0,
        "stop_notice_s": NO_STOP_NOTICE_S,
    }
    return DataProxySettings(**(base | overrides))


@dataclass(frozen=True, slots=True, kw_only=True)
class DataproxyChain:
    """Dataproxy replicas and a worker over the mock LLM, with stubs and a Redis client."""

    # DataProxy stub on the first replica.
    dataproxy: dataproxy_pb2_grpc.DataProxyStub
    # Trainer stub on the last replica (with two, the first learns of control only via Redis).
    trainer: trainer_pb2_grpc.TrainerStub
    dataproxy_servers: tuple[GrpcServer, ...]
    worker_address: str
    mock: MockLLM
    redis: aioredis.Redis
    keys: RedisKeys
    # The gateway's relay (ledger stream to the first replica, Generate to the worker).
    relay: TurnRelay
    ledger: LedgerClient

    @property
    def dataproxy_server(self) -> GrpcServer:
        """The first replica's server."""
        return self.dataproxy_servers[0]

    def spec(
        self,
        digest: str,
        text: str,
        *,
        request_id: str = "req-1",
        interaction_id: str = "",
        tags: TurnTags | None = None,
        timeout_s: float = RPC_TIMEOUT_S,
        **body: Any,
    ) -> TurnSpec:
        """A turn of one user message `text` to the mock model (plus `body`), as the gateway
        hands it to its relay."""
        payload = {"model": MOCK_MODEL, "messages": [{"role": "user", "content": text}]}
        request_json, params_json = split_body(payload | body)
        return TurnSpec(
            digest=digest,
            model=MOCK_MODEL,
            request_json=request_json,
            params_json=params_json,
            request_id=request_id,
            deadline=time.monotonic() + timeout_s,
            interaction_id=interaction_id,
            tags=tags or TurnTags(),
        )

    async def complete(self, digest: str, text: str, **spec: Any) -> tuple[dict[str, Any], Done]:
        """One non-streaming turn through the relay: the client's body and the recorded end."""
        body, done = await self.relay.complete(self.spec(digest, text, **spec))
        return orjson.loads(body), done

    def call(self, digest: str, text: str, **spec: Any) -> TurnCall:
        """A streamed turn through the relay, not started until read (like a gRPC call)."""
        return TurnCall(self.relay.stream(self.spec(digest, text, stream=True, **spec)))

    async def stream(self, digest: str, text: str, **spec: Any) -> list[Event]:
        """Every event of one streamed turn through the relay (chunks, then Done)."""
        events = self.relay.stream(self.spec(digest, text, stream=True, **spec))
        async with contextlib.aclosing(events):
            return [event async for event in events]

    async def turns(self, digest: str) -> list[dict[str, Any]]:
        """The recorded turn records of the key's current episode."""
        key: Any = await self.redis.hgetall(self.keys.key(digest))
        episode = key[b"episode"].decode()
        raw: Any = await self.redis.lrange(self.keys.turns(key_id_of(digest), episode), 0, -1)
        return decode_turns(raw)


@contextlib.asynccontextmanager
async def running_dataproxy_chain(
    redis_url: str,
    key_prefix: str,
    *,
    chain_type: type[ChainT],
    replicas: int = 1,
    token_interval_ms: float = 0.0,
    latency_ms: float = 0.0,
    worker_timeout_s: float = 30.0,
    policy: RequestPolicy | None = None,
    **settings: Any,
) -> AsyncIterator[ChainT]:
    """Mock LLM, a worker (vllm kind) and `replicas` dataproxies (`settings` override
    dataproxy_settings), all on port 0; yields a `chain_type` over them."""
    async with contextlib.AsyncExitStack() as stack:
        mock = await stack.enter_async_context(
            MockLLM(port=0, token_interval_ms=token_interval_ms, latency_ms=latency_ms)
        )
        worker = await stack.enter_async_context(
            running_worker(mock.base_url, kind="vllm", timeout_s=worker_timeout_s, policy=policy)
        )
        servers = []
        channels = []
        for _ in range(replicas):
            server = await stack.enter_async_context(
                dataproxy_serving(dataproxy_settings(redis_url, key_prefix, **settings))
            )
            channel = open_channel(f"127.0.0.1:{server.port}")
            stack.push_async_callback(channel.close)
            servers.append(server)
            channels.append(channel)
        redis = aioredis.Redis.from_url(redis_url)
        stack.push_async_callback(redis.aclose)
        stub: Any = dataproxy_pb2_grpc.DataProxyStub(channels[0])
        ledger = LedgerClient(stub)
        stack.push_async_callback(ledger.close)
        workers = await stack.enter_async_context(ChannelPool())
        relay = TurnRelay(
            routes=FixedWorker(worker.address), ledger=ledger, workers=workers, rpc_timeout_s=10
        )
        yield chain_type(
            relay=relay,
            ledger=ledger,
            dataproxy=dataproxy_pb2_grpc.DataProxyStub(channels[0]),
            trainer=trainer_pb2_grpc.TrainerStub(channels[-1]),
            dataproxy_servers=tuple(servers),
            worker_address=worker.address,
            mock=mock,
            redis=redis,
            keys=RedisKeys(key_prefix),
        )


class TurnCall:
    """A streamed turn through the relay, read event by event."""

    def __init__(self, events: AsyncGenerator[Event, None]) -> None:
        self.events = events

    async def read(self) -> Event:
        """The next event (the turn's first read runs its admission and opens the worker)."""
        return await anext(self.events)


async def collect(call: TurnCall) -> list[Event]:
    """Every remaining event of a streamed turn (a test may read some first)."""
    async with contextlib.aclosing(call.events):
        return [event async for event in call.events]


class FixedWorker:
    """The router's role in a dataproxy chain: every turn goes to its one worker."""

    def __init__(self, address: str) -> None:
        self.address = address

    async def choose(
        self, route_key: str, model: str, *, timeout_s: float, avoid_worker_id: str = ""
    ) -> WorkerChoice:
        """The chain's worker."""
        return WorkerChoice(worker_id="worker-under-test", address=self.address)

    def forget(self, route_key: str, model: str) -> None:
        """Nothing to forget."""


def chunk_payloads(events: list[Event]) -> list[bytes]:
    """Every chat chunk of a streamed turn's events, in order (the end's tail included)."""
    payloads: list[bytes] = []
    for event in events:
        if isinstance(event, Chunks):
            payloads += event.payloads
        elif isinstance(event, Done):
            payloads += event.tail
    return payloads


# -- full chain through the gateway -----------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Upstream:
    """One worker and the mock LLM behind it."""

    worker_id: str
    model: str = MOCK_MODEL
    aliases: tuple[tuple[str, str], ...] = ()
    # The worker's upstream kind: `vllm` records the mock's exact token ids.
    kind: str = "openai"


@dataclass(frozen=True, slots=True, kw_only=True)
class FullChain:
    """A ready gateway over router, dataproxy, workers and mock LLMs, and an HTTP client."""

    url: str
    http: aiohttp.ClientSession
    router_addr: str
    dataproxy_addr: str
    # One mock LLM per upstream, in the order given.
    mocks: tuple[MockLLM, ...]
    trainer: trainer_pb2_grpc.TrainerStub


@contextlib.asynccontextmanager
async def running_full_chain(
    redis_url: str,
    key_prefix: str,
    *,
    admin_key: str,
    upstreams: Sequence[Upstream],
    tracing: TracingSettings = NO_TRACING,
    **dataproxy: Any,
) -> AsyncIterator[FullChain]:
    """Router, dataproxy (`dataproxy` overrides its settings), one worker per upstream on its
    own mock LLM, and a gateway; all on port 0 and ready when yielded. `tracing` applies to
    every service."""
    async with contextlib.AsyncExitStack() as exits:
        router = await exits.enter_async_context(
            router_serving(
                RouterSettings(
                    port=0,
                    redis_url=redis_url,
                    redis_prefix=key_prefix,
                    grace_s=1.0,
                    stop_notice_s=NO_STOP_NOTICE_S,
                    tracing=tracing,
                )
            )
        )
        router_addr = f"127.0.0.1:{router.port}"
        proxy = await exits.enter_async_context(
            dataproxy_serving(
                DataProxySettings(
                    port=0,
                    redis_url=redis_url,
                    redis_prefix=key_prefix,
                    admin_key=Secret(admin_key),
                    grace_s=1.0,
                    stop_notice_s=NO_STOP_NOTICE_S,
                    tracing=tracing,
                    **dataproxy,
                )
            )
        )
        proxy_addr = f"127.0.0.1:{proxy.port}"
        mocks = []
        for index, upstream in enumerate(upstreams):
            mock = await exits.enter_async_context(MockLLM(port=0, model=upstream.model))
            await exits.enter_async_context(
                worker_serving(
                    WorkerSettings(
                        port=0,
                        router_addr=router_addr,
                        worker_id=upstream.worker_id,
                        upstream_base_url=mock.base_url,
                        upstream_models=(mock.model,),
                        upstream_aliases=upstream.aliases,
                        # As a configuration file does it: `default` is the first upstream's.
                        serve_default_model=index == 0,
                        upstream_kind=upstream.kind,
                        grace_s=1.0,
                        stop_notice_s=NO_STOP_NOTICE_S,
                        tracing=tracing,
                    )
                )
            )
            mocks.append(mock)
        settings = dataclasses.replace(
            gateway_settings(router_addr=router_addr, dataproxy_addr=proxy_addr), tracing=tracing
        )
        server = await exits.enter_async_context(GatewayServer(settings))
        http = await exits.enter_async_context(aiohttp.ClientSession())
        channel = open_channel(proxy_addr)
        exits.push_async_callback(channel.close)
        url = f"http://127.0.0.1:{server.port}"
        await wait_ready(http, url)
        yield FullChain(
            url=url,
            http=http,
            router_addr=router_addr,
            dataproxy_addr=proxy_addr,
            mocks=tuple(mocks),
            trainer=trainer_pb2_grpc.TrainerStub(channel),
        )


async def wait_ready(http: aiohttp.ClientSession, url: str) -> None:
    """Polls the gateway's /ready until 200; fails after GATEWAY_READY_DEADLINE_S."""

    async def ready() -> bool:
        async with http.get(url + "/ready") as resp:
            return resp.status == 200

    await eventually(ready, timeout_s=GATEWAY_READY_DEADLINE_S, what="gateway /ready 200")


# -- trainer service --------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def serving_trainer(servicer: TrainerServicer) -> AsyncIterator[str]:
    """`servicer` on a real Trainer gRPC server (port 0); yields its host:port."""
    server = GrpcServer(
        ServerSpec(
            name="dataproxy",
            host="127.0.0.1",
            port=0,
            service_names=["rollgate.v1.Trainer"],
            grace_s=1.0,
            stop_notice_s=NO_STOP_NOTICE_S,
        )
    )
    trainer_pb2_grpc.add_TrainerServicer_to_server(servicer, server.server)
    await server.__aenter__()
    try:
        yield f"127.0.0.1:{server.port}"
    finally:
        await servicer.close()
        await server.stop()


def scripted_dataproxy(servicer: dataproxy_pb2_grpc.DataProxyServicer) -> GrpcServer:
    """A real gRPC server (port 0) serving a test's own DataProxy servicer — a dataproxy that
    misbehaves on purpose; use it with `async with`."""
    server = GrpcServer(
        ServerSpec(
            name="dataproxy", host="127.0.0.1", port=0, service_names=[], stop_notice_s=0.0,
            grace_s=0.5,
        )
    )  # fmt: skip
    dataproxy_pb2_grpc.add_DataProxyServicer_to_server(servicer, server.server)
    return server
