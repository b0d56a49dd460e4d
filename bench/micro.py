"""One service's hot path in-process, for a quick loop while changing it: CPU per unit of work.

`ledger`: a dataproxy's `LedgerStreams` over a real Redis (REDIS_URL, else a redis-server of its
own), driven like a gateway drives it — `--batch` turns begun together, then recorded together
— CPU per turn (a begin and a record). `worker`: a worker's streamed turn (`StreamedTurn`, what
its turn stream runs) against the mock upstream in another process, `--clients` at once, the
mock's tokens `--interval-ms` apart (4: one chunk per read, as in the long-stream cell; 0:
many per read) — CPU per chunk, split user / system. `--stage` stops the worker's path early to
see what each layer costs: `raw` (the HTTP client's reads), `events` (+ SSE), `stream` (+ the
runner: JSON, record, client view), `turn` (the whole turn on the
worker's Turns stream, as a gateway runs it: + flow control and the TurnEvents it sends).
`framed`: a framed stream (`services/runtime/framed.py`) carrying ledger records the size of an
OpenClaw turn's (`--request-kb` of request, `--ids` prompt token ids), both ends in this process
over loopback, `--window` at once — CPU per message. A fresh process's malloc returns and
faults in the heap's top around every large message, which the long-running services do not
(docs/internals.md): compare its runs with each other only.

Both count this process's CPU (`getrusage`), so the client side the tool plays (the gateway's
ops, the reader of the turns) is included: compare runs of the same command before and after a
change, alternating (`--root` runs another checkout's code), not with the bench's numbers.
`--log-level warning` renders the services' logs as the bench runs them (the default, `info`,
adds the ledger's per-turn line).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import uvloop

_REQUEST = orjson.dumps({"messages": [{"role": "user", "content": "hi " * 40}]})


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def _redis_url() -> Any:
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    from rollgate.redis_server import RedisServer

    with RedisServer() as server:
        yield server.url


async def ledger(redis_url: str, *, turns: int, batch: int) -> float:
    """CPU µs per turn (begin + record) of LedgerStreams against `redis_url`."""
    from protos import dataproxy_pb2
    from schema.packing import pack_float32, pack_int32
    from services.dataproxy.__main__ import build_store, ledger_metrics
    from services.dataproxy.control import WeightVersionView
    from services.dataproxy.ledger_streams import LedgerStreams
    from services.dataproxy.redis_keys import RedisKeys
    from services.dataproxy.settings import DataProxySettings
    from services.dataproxy.trainer_servicer import build_control
    from services.dataproxy.turn_ledger import TurnLedger
    from services.runtime.keys import key_digest
    from services.runtime.metrics import RpcMetrics, ServiceMetrics
    from services.runtime.redis_conn import open_redis
    from services.runtime.redis_pipeline import PipelinedScripts

    prefix = f"micro{os.getpid()}:"
    settings = DataProxySettings(redis_url=redis_url, redis_prefix=prefix)
    redis = open_redis(redis_url)
    pipelined = PipelinedScripts(redis)
    keys = RedisKeys(prefix)
    store = build_store(redis=redis, settings=settings, pipelined=pipelined)
    control = build_control(redis=redis, keys=keys, settings=settings, pipelined=pipelined)
    try:
        async with WeightVersionView(redis=redis, keys=keys) as versions:
            rpc = RpcMetrics(ServiceMetrics("dataproxy").registry)
            streams = LedgerStreams(
                ledger=TurnLedger(store=store, control=control),
                versions=versions,
                on_op=ledger_metrics(rpc, lambda *_: None),
            )
            digests = []
            for _ in range(batch):
                started = await store.start(task_id="micro", api_key="")
                digests.append(key_digest(started.api_key))
            waiting: dict[int, asyncio.Future[dataproxy_pb2.LedgerResponse]] = {}

            def send(message: Any) -> None:
                # What the framed stream would write (a Batch of answers), as its bytes.
                raw = message.SerializeToString()
                for answer in dataproxy_pb2.LedgerResponses.FromString(raw).answers:
                    if answer.id:
                        waiting.pop(answer.id).set_result(answer)

            class Requests:
                """What a framed connection hands `serve`: each message from its read
                callback (`listen`), or iterated when the checkout predates that."""

                def __init__(self) -> None:
                    self.inbox: asyncio.Queue[Any] = asyncio.Queue()
                    self.on_message: Any = None
                    self.on_end: Any = None

                def __aiter__(self) -> AsyncIterator[Any]:
                    return self._iterate()

                async def _iterate(self) -> AsyncIterator[Any]:
                    while (message := await self.inbox.get()) is not None:
                        yield message

                def listen(self, on_message: Any, on_end: Any) -> None:
                    while not self.inbox.empty():  # what came first goes first
                        on_message(self.inbox.get_nowait())
                    self.on_message, self.on_end = on_message, on_end

                def put(self, message: Any) -> None:
                    if message is None and self.on_end is not None:
                        self.on_end()
                    elif self.on_message is not None:
                        self.on_message(message)
                    else:
                        self.inbox.put_nowait(message)

            inbox = Requests()

            async def serve() -> None:
                async for _ in streams.serve(inbox, send=send):  # type: ignore[arg-type]
                    pass

            serving = asyncio.create_task(serve())
            loop = asyncio.get_running_loop()
            ids = iter(range(1, 1 << 62))

            async def ops(
                each: list[dataproxy_pb2.LedgerRequest],
            ) -> list[dataproxy_pb2.LedgerResponse]:
                message = dataproxy_pb2.LedgerRequests()
                futures = []
                for op in each:
                    op.id = next(ids)
                    waiting[op.id] = future = loop.create_future()
                    futures.append(future)
                    message.ops.append(op)
                inbox.put(message)
                return list(await asyncio.gather(*futures))

            async def one_round() -> None:
                began = await ops(
                    [
                        dataproxy_pb2.LedgerRequest(
                            timeout_s=5, begin=dataproxy_pb2.BeginTurn(key_digest=d)
                        )
                        for d in digests
                    ]
                )
                records = []
                for answer in began:
                    if answer.WhichOneof("result") != "admitted":
                        raise RuntimeError(f"a begin failed: {answer}")
                    record = dataproxy_pb2.RecordTurn(
                        ticket=answer.admitted.ticket, request_json=_REQUEST
                    )
                    turn = record.record
                    turn.interaction_id = f"chatcmpl-micro-{next(ids)}"
                    turn.finish_reason = "stop"
                    turn.prompt_token_ids = pack_int32(range(40))
                    turn.output_token_ids = pack_int32(range(16))
                    turn.output_logprobs = pack_float32([-0.5] * 16)
                    turn.assistant_message_json = b'{"role":"assistant","content":"x"}'
                    turn.exact_tokens = True
                    records.append(dataproxy_pb2.LedgerRequest(timeout_s=5, record=record))
                for answer in await ops(records):
                    if answer.WhichOneof("result") != "recorded":
                        raise RuntimeError(f"a record failed: {answer}")

            for _ in range(20):  # warm-up
                await one_round()
            rounds = max(1, turns // batch)
            before = time.process_time()
            for _ in range(rounds):
                await one_round()
            spent = time.process_time() - before
            inbox.put(None)
            await serving
            return spent / (rounds * batch) * 1e6
    finally:
        async for key in redis.scan_iter(match=prefix + "*"):
            await redis.delete(key)
        await pipelined.aclose()
        await redis.aclose()


@contextlib.contextmanager
def _mock(tokens: int, interval_ms: float) -> Any:
    """The mock upstream in a process of its own; its port."""
    port = _free_port()
    mock = subprocess.Popen(
        [
            sys.executable, "-m", "rollgate.mock_llm", "--port", str(port),
            "--answer-tokens", str(tokens), "--token-interval-ms", str(interval_ms),
            "--model", "micro",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        yield port
    finally:
        mock.kill()
        mock.wait()


async def _drain(events: AsyncIterator[Any]) -> None:
    async for _ in events:
        pass


async def worker(*, port: int, streams: int, clients: int, stage: str) -> str:
    """CPU µs per streamed chunk of a worker's turn against the mock upstream at `port`."""
    from protos import worker_pb2
    from services.runtime.metrics import ServiceMetrics
    from services.runtime.secret import Secret
    from services.worker.adapters import adapter_for
    from services.worker.metrics import WorkerMetrics
    from services.worker.turn_streams import TurnStreams
    from services.worker.turns import StreamBatch, TurnRunner
    from services.worker.upstream import UpstreamClient
    from services.worker.wire import client_of

    for _ in range(200):
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            break
        except OSError:
            await asyncio.sleep(0.05)  # the mock starting
    base = f"http://127.0.0.1:{port}/v1"
    async with UpstreamClient(base_url=base, api_key=Secret("")) as upstream:
        runner = TurnRunner(upstream=upstream, adapter=adapter_for("vllm"))
        metrics = WorkerMetrics(ServiceMetrics("worker"), runner)
        body = orjson.dumps(
            {"model": "micro", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        )
        request = worker_pb2.GenerateRequest(body_json=body, request_id="micro")
        loop = asyncio.get_running_loop()
        # One Turns stream for every turn: ops in through a queue, events out through `send`.
        ops: asyncio.Queue[worker_pb2.TurnOps] = asyncio.Queue()
        ends: dict[int, asyncio.Future[int]] = {}
        counted: dict[int, int] = {}
        next_id = 0

        async def one() -> int:
            chunks = 0
            if stage in ("raw", "events"):
                sent = runner._request(client_of(request), stream=True)
                deadline = loop.time() + 60
                async with upstream.post_chat(sent.body, deadline=deadline) as response:
                    if stage == "raw":
                        while data := await response.content.readany():
                            chunks += data.count(b"data: ")
                    else:
                        async for payloads in upstream.read_events(response, deadline=deadline):
                            chunks += len(payloads)
                return chunks - 2  # the usage chunk and [DONE]
            if stage == "stream":
                async for event in runner.stream(client_of(request), budget_s=60):
                    if isinstance(event, StreamBatch):
                        chunks += len(event.chunks)
                return chunks
            # The turn on the worker's Turns stream, as a gateway runs it (framed: events
            # handed to `send`), the flow-control window the gateway gives.
            nonlocal next_id
            next_id += 1
            ended = loop.create_future()
            ends[next_id] = ended
            start = worker_pb2.TurnStart(request=request, stream=True, window_bytes=256 * 1024)
            ops.put_nowait(worker_pb2.TurnOps(ops=[worker_pb2.TurnOp(id=next_id, start=start)]))
            return int(await ended)

        async def requests() -> AsyncIterator[worker_pb2.TurnOps]:
            while True:
                yield await ops.get()

        def send(message: Any) -> None:
            # What the framed stream would write (a Batch of TurnEvents), as its bytes.
            events = worker_pb2.TurnEvents.FromString(message.SerializeToString()).events
            for event in events:
                if event.HasField("generated"):
                    counted[event.id] = counted.get(event.id, 0) + len(
                        event.generated.chunks.chunks
                    )
                    if not event.generated.HasField("record"):
                        continue
                elif not event.error_json:
                    continue
                ended = ends.pop(event.id)
                if event.error_json:
                    ended.set_exception(RuntimeError(event.error_json.decode()))
                else:
                    ended.set_result(counted.pop(event.id, 0))

        turn_streams = TurnStreams(runner, upstream_timeout_s=60, metrics=metrics)
        serving = asyncio.ensure_future(_drain(turn_streams.serve(requests(), send=send)))

        for _ in range(3):  # warm-up
            await one()
        before = resource.getrusage(resource.RUSAGE_SELF)
        chunks = 0
        for _ in range(max(1, streams // clients)):
            chunks += sum(await asyncio.gather(*(one() for _ in range(clients))))
        after = resource.getrusage(resource.RUSAGE_SELF)
        serving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await serving
        user = (after.ru_utime - before.ru_utime) / chunks * 1e6
        system = (after.ru_stime - before.ru_stime) / chunks * 1e6
        return f"{user + system:.1f} µs CPU per chunk (user {user:.1f}, system {system:.1f})"


async def framed(*, messages: int, request_kb: int, ids: int, window: int) -> str:
    """CPU µs per message of a framed stream, both ends in this process over loopback: the
    gateway's side sends ledger records the size of an OpenClaw turn's (`request_kb` of
    request, `ids` prompt token ids), the dataproxy's side parses each and answers it."""
    from protos import common_pb2, dataproxy_pb2
    from services.runtime.framed import LEDGER_PREAMBLE, Batch, FramedCall, FramedServer

    async def serve(requests: Any, *, send: Any) -> AsyncIterator[Any]:
        ended = asyncio.get_running_loop().create_future()

        def on_message(message: Any) -> None:
            send(Batch([dataproxy_pb2.LedgerResponse(id=op.id) for op in message.ops]))

        def on_end() -> None:
            if not ended.done():
                ended.set_result(None)

        requests.listen(on_message, on_end)
        await ended
        return
        yield  # an async generator, as the services' serve functions are

    server: Any = FramedServer(
        serve,
        preamble=LEDGER_PREAMBLE,
        parse=dataproxy_pb2.LedgerRequests.FromString,
        name="micro",
        sends=True,
    )
    await server.start("127.0.0.1", 0)
    call: Any = await FramedCall.connect(
        "127.0.0.1",
        server.port,
        preamble=LEDGER_PREAMBLE,
        parse=dataproxy_pb2.LedgerResponses.FromString,
        peer="micro",
    )
    loop = asyncio.get_running_loop()
    waiting: dict[int, asyncio.Future[None]] = {}

    def answered(message: Any) -> None:
        for answer in message.answers:
            waiting.pop(answer.id).set_result(None)

    call.listen(answered, lambda: None)
    body = bytes(range(256)) * (request_kb * 4)
    record = common_pb2.TurnRecord(prompt_token_ids=bytes(4 * ids), interaction_id="micro")
    next_id = iter(range(1, 1 << 62))

    async def one() -> None:
        op = dataproxy_pb2.LedgerRequest(id=next(next_id), timeout_s=5)
        op.record.request_json = body
        op.record.record.CopyFrom(record)
        waiting[op.id] = future = loop.create_future()
        call.send_now(Batch([op]))
        await future

    async def run(count: int) -> None:
        sem = asyncio.Semaphore(window)

        async def limited() -> None:
            async with sem:
                await one()

        await asyncio.gather(*(limited() for _ in range(count)))

    await run(200)  # warm-up
    before = resource.getrusage(resource.RUSAGE_SELF)
    await run(messages)
    after = resource.getrusage(resource.RUSAGE_SELF)
    await call.done_writing()
    await server.close()
    user = (after.ru_utime - before.ru_utime) / messages * 1e6
    system = (after.ru_stime - before.ru_stime) / messages * 1e6
    return f"{user + system:.1f} µs CPU per message (user {user:.1f}, system {system:.1f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", help="run this checkout's services instead of this one's")
    parser.add_argument(
        "--log-level",
        default="info",
        help="the services' log level (the bench runs them at warning)",
    )
    sub = parser.add_subparsers(dest="what", required=True)
    led = sub.add_parser("ledger", help="a dataproxy's ledger: CPU per turn")
    led.add_argument("--turns", type=int, default=3000)
    led.add_argument("--batch", type=int, default=16)
    wk = sub.add_parser("worker", help="a worker's streamed turns: CPU per chunk")
    wk.add_argument("--streams", type=int, default=64)
    wk.add_argument("--clients", type=int, default=8)
    wk.add_argument("--tokens", type=int, default=256)
    wk.add_argument("--interval-ms", type=float, default=4.0)
    wk.add_argument("--stage", choices=["raw", "events", "stream", "turn"], default="turn")
    fr = sub.add_parser("framed", help="a framed stream's OpenClaw-sized records: CPU per message")
    fr.add_argument("--messages", type=int, default=4000)
    fr.add_argument("--request-kb", type=int, default=60)
    fr.add_argument("--ids", type=int, default=12000)
    fr.add_argument("--window", type=int, default=4)
    args = parser.parse_args(argv)
    root = Path(args.root).resolve() if args.root else Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root))
    os.chdir(root)  # the mock starts from the same checkout
    from services.runtime.logs import configure_logging

    # The services' own logging, rendered as there (the ledger's per-turn line costs what it
    # costs there), written nowhere.
    terminal, sys.stderr = sys.stderr, open(os.devnull, "w")  # noqa: SIM115
    try:
        configure_logging(service="micro", json_logs=True, level=args.log_level)
    finally:
        sys.stderr = terminal
    if args.what == "ledger":
        with _redis_url() as url:
            spent = uvloop.run(ledger(url, turns=args.turns, batch=args.batch))
        print(f"ledger ({root}): {spent:.1f} µs CPU per turn (a begin and a record)")
    elif args.what == "framed":
        result = uvloop.run(
            framed(
                messages=args.messages,
                request_kb=args.request_kb,
                ids=args.ids,
                window=args.window,
            )
        )
        print(f"framed ({root}): {result}")
    else:
        with _mock(args.tokens, args.interval_ms) as port:
            result = uvloop.run(
                worker(port=port, streams=args.streams, clients=args.clients, stage=args.stage)
            )
        print(f"worker {args.stage} ({root}): {result}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
