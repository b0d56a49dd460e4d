"""What grpc.aio costs per turn, on each side: a call per turn vs messages on one open stream.

A server process and this client process (both on uvloop, grpcio's aio API, rollgate's channel
and server options) exchange a turn's messages in each shape, `--turns` times with
`--concurrency` turns in flight, and each side's CPU (user + system, all threads) is divided
by the turns:

- `unary`: one unary call per turn (`Worker.Complete`'s shape: request, one answer).
- `stream-K`: one server-streaming call per turn, K answers (`Worker.Generate`'s shape: the
  chunks, then the record with the last chunks).
- `bidi-K`: one long-lived bidirectional stream shared by every turn; a turn is one request
  message and K answer messages, each tagged with the turn's id (one message per write).
- `bidi-K-batched`: the same stream, but each side writes everything that is queued when its
  writer is free as one message (the turn ledger's way).
- `socket-K`: what `bidi-K` does (the same messages, the same framing, a task per turn on the
  server, one message per write) on a plain TCP connection with asyncio protocols instead of
  gRPC: what one message end costs without grpc.aio's machinery (docs/internals.md, *What a
  turn costs*).

The messages are the worker's real ones (GenerateRequest, GenerateResponse, CompleteResponse
of a 16-token answer). Usage: `.venv/bin/python bench/grpc_costs.py [--turns 4000]
[--concurrency 1 16] [--shapes unary stream-2 bidi-2 ...]`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import struct
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import orjson
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from protos import common_pb2, worker_pb2
from services.runtime.grpc_client import CHANNEL_OPTIONS
from services.runtime.grpc_server import SERVER_OPTIONS

SERVICE = "/bench.Costs/"
_ID = struct.Struct("<Q")
SHAPES = (
    "unary", "stream-1", "stream-2", "bidi-1", "bidi-2", "bidi-1-batched", "bidi-2-batched",
    "socket-1", "socket-2",
)  # fmt: skip
_SIZE = struct.Struct("<I")


def _chunk(i: int) -> bytes:
    return orjson.dumps(
        {
            "id": "chatcmpl-0123456789abcdef",
            "object": "chat.completion.chunk",
            "created": 1764700000,
            "model": "rollgate-mock",
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": f"tok{i} "},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
        }
    )


def _record() -> common_pb2.TurnRecord:
    return common_pb2.TurnRecord(
        interaction_id="chatcmpl-0123456789abcdef",
        upstream_model="rollgate-mock",
        finish_reason="stop",
        prompt_token_ids=struct.pack("<20i", *range(20)),
        output_token_ids=struct.pack("<16i", *range(16)),
        output_logprobs=struct.pack("<16f", *([-0.5] * 16)),
        exact_tokens=True,
        assistant_message_json=orjson.dumps(
            {"role": "assistant", "content": " ".join(f"tok{i}" for i in range(16))}
        ),
        usage_json=b'{"prompt_tokens":20,"completion_tokens":16,"total_tokens":36}',
        latency_s=0.021,
        ttft_s=0.020,
        upstream_kind="vllm",
        started_at_unix_s=1764700000.5,
    )


REQUEST = worker_pb2.GenerateRequest(
    weight_version=3,
    request_id="0123456789abcdef0123456789abcdef",
    request_json=b'{"messages":[{"role":"user","content":"benchmark request, please answer briefly"}]}',
    params_json=b'{"model":"rollgate-mock","stream":true}',
)
CHUNKS = worker_pb2.GenerateResponse(
    chunks=worker_pb2.ChunkBatch(chunks=[_chunk(i) for i in range(16)], output_tokens=16)
)
FINAL = worker_pb2.GenerateResponse(record=_record())
COMPLETE = worker_pb2.CompleteResponse(body_json=b"x" * 700, record=_record())


def _answers(k: int) -> list[worker_pb2.GenerateResponse]:
    """The K answer messages of one streamed turn: chunk batches, then the record."""
    return [CHUNKS] * (k - 1) + [FINAL]


def _frame(items: list[tuple[int, bytes]]) -> bytes:
    """Several (id, message) as one stream message: id, length, bytes, ..."""
    return b"".join(_ID.pack(i) + struct.pack("<I", len(m)) + m for i, m in items)


def _unframe(data: bytes) -> list[tuple[int, bytes]]:
    out, at = [], 0
    while at < len(data):
        (turn,) = _ID.unpack_from(data, at)
        (size,) = struct.unpack_from("<I", data, at + 8)
        out.append((turn, data[at + 12 : at + 12 + size]))
        at += 12 + size
    return out


# -- server -------------------------------------------------------------------------------


class _Writer:
    """One writer per bidi stream: each queued message on its own, or all queued as one."""

    def __init__(self, context: Any, *, batched: bool) -> None:
        self._context = context
        self._batched = batched
        self._queue: list[tuple[int, bytes]] = []
        self._ready = asyncio.Event()

    def put(self, turn: int, message: bytes) -> None:
        self._queue.append((turn, message))
        self._ready.set()

    async def run(self) -> None:
        while True:
            if not self._queue:
                self._ready.clear()
                await self._ready.wait()
                continue
            if self._batched:
                items, self._queue = self._queue, []
                await self._context.write(_frame(items))
            else:
                await self._context.write(_frame([self._queue.pop(0)]))


async def _unary(request: bytes, context: Any) -> bytes:
    worker_pb2.GenerateRequest.FromString(request)
    return COMPLETE.SerializeToString()


def _streaming(k: int) -> Any:
    async def handler(request: bytes, context: Any) -> AsyncIterator[bytes]:
        worker_pb2.GenerateRequest.FromString(request)
        for index, answer in enumerate(_answers(k)):
            if index:
                await asyncio.sleep(0)  # the upstream's next read
            yield answer.SerializeToString()

    return handler


def _bidi(k: int, *, batched: bool) -> Any:
    async def handler(requests: AsyncIterator[bytes], context: Any) -> None:
        writer = _Writer(context, batched=batched)
        task = asyncio.create_task(writer.run())

        async def turn(turn_id: int, body: bytes) -> None:
            worker_pb2.GenerateRequest.FromString(body)
            for index, answer in enumerate(_answers(k)):
                if index:
                    await asyncio.sleep(0)  # the upstream's next read
                writer.put(turn_id, answer.SerializeToString())

        turns = set()
        try:
            async for message in requests:
                for turn_id, body in _unframe(message):
                    t = asyncio.create_task(turn(turn_id, body))
                    turns.add(t)
                    t.add_done_callback(turns.discard)
        finally:
            task.cancel()

    return handler


async def _cpu(request: bytes, context: Any) -> bytes:
    return struct.pack("<d", time.process_time())


def _handlers() -> grpc.GenericRpcHandler:
    methods: dict[str, grpc.RpcMethodHandler] = {
        "Unary": grpc.unary_unary_rpc_method_handler(_unary),
        "Cpu": grpc.unary_unary_rpc_method_handler(_cpu),
    }
    for k in (1, 2, 3):
        methods[f"Stream{k}"] = grpc.unary_stream_rpc_method_handler(_streaming(k))
        methods[f"Bidi{k}"] = grpc.stream_stream_rpc_method_handler(_bidi(k, batched=False))
        methods[f"Bidi{k}Batched"] = grpc.stream_stream_rpc_method_handler(_bidi(k, batched=True))
    return grpc.method_handlers_generic_handler("bench.Costs", methods)


class _Frames(asyncio.Protocol):
    """Length-prefixed frames on a TCP connection, each one `_frame` of (turn id, message)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no asyncio.Transport

    def send(self, turn: int, message: bytes) -> None:
        framed = _frame([(turn, message)])
        assert self.transport is not None
        self.transport.write(_SIZE.pack(len(framed)) + framed)

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while len(self._buffer) >= 4:
            (size,) = _SIZE.unpack_from(self._buffer)
            if len(self._buffer) < 4 + size:
                return
            frame = bytes(self._buffer[4 : 4 + size])
            del self._buffer[: 4 + size]
            for turn_id, body in _unframe(frame):
                self.received(turn_id, body)

    def received(self, turn_id: int, body: bytes) -> None:
        raise NotImplementedError


class _SocketServer(_Frames):
    """The server side of `socket-K`: what `_bidi(k)` does, on a plain connection."""

    def __init__(self) -> None:
        super().__init__()
        self._turns: set[asyncio.Task[None]] = set()

    def received(self, turn_id: int, body: bytes) -> None:
        request = worker_pb2.GenerateRequest.FromString(body)
        k = request.weight_version  # the client names K here
        task = asyncio.get_running_loop().create_task(self._turn(turn_id, k))
        self._turns.add(task)
        task.add_done_callback(self._turns.discard)

    async def _turn(self, turn_id: int, k: int) -> None:
        for index, answer in enumerate(_answers(k)):
            if index:
                await asyncio.sleep(0)  # the upstream's next read
            self.send(turn_id, answer.SerializeToString())


async def serve(port: int) -> None:
    server = grpc.aio.server(options=SERVER_OPTIONS)
    server.add_generic_rpc_handlers((_handlers(),))
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    sockets = await asyncio.get_running_loop().create_server(_SocketServer, "127.0.0.1", 0)
    print(bound, sockets.sockets[0].getsockname()[1], flush=True)
    await server.wait_for_termination()


# -- client -------------------------------------------------------------------------------


_Waiting = dict[int, tuple[asyncio.Future[None], list[Any]]]


def _answered(waiting: _Waiting, turn_id: int, body: bytes, k: int) -> None:
    """One answer of a turn; the turn is done at its K-th."""
    done, got = waiting[turn_id]
    got.append(worker_pb2.GenerateResponse.FromString(body))
    if len(got) == k:
        del waiting[turn_id]
        done.set_result(None)


class _BidiClient:
    """Turns on one open stream: a writer task, a reader task, answers by turn id."""

    def __init__(self, channel: grpc.aio.Channel, k: int, *, batched: bool) -> None:
        name = f"Bidi{k}Batched" if batched else f"Bidi{k}"
        self._call = channel.stream_stream(SERVICE + name)()
        self._k = k
        self._batched = batched
        self._queue: list[tuple[int, bytes]] = []
        self._ready = asyncio.Event()
        self._waiting: _Waiting = {}
        self._next = 0
        self._tasks = [asyncio.create_task(self._write()), asyncio.create_task(self._read())]

    async def turn(self) -> None:
        self._next += 1
        done = asyncio.get_running_loop().create_future()
        self._waiting[self._next] = (done, [])
        self._queue.append((self._next, REQUEST.SerializeToString()))
        self._ready.set()
        await done

    async def _write(self) -> None:
        while True:
            if not self._queue:
                self._ready.clear()
                await self._ready.wait()
                continue
            if self._batched:
                items, self._queue = self._queue, []
            else:
                items = [self._queue.pop(0)]
            await self._call.write(_frame(items))

    async def _read(self) -> None:
        while True:
            message = await self._call.read()
            if message is grpc.aio.EOF:
                return
            for turn_id, body in _unframe(message):
                _answered(self._waiting, turn_id, body, self._k)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._call.cancel()


class _SocketClient(_Frames):
    """The client side of `socket-K`: turns by id on one connection, one frame per write."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self._k = k
        self._request = worker_pb2.GenerateRequest(
            weight_version=k,
            request_id=REQUEST.request_id,
            request_json=REQUEST.request_json,
            params_json=REQUEST.params_json,
        ).SerializeToString()
        self._waiting: _Waiting = {}
        self._next = 0

    async def turn(self) -> None:
        self._next += 1
        done = asyncio.get_running_loop().create_future()
        self._waiting[self._next] = (done, [])
        self.send(self._next, self._request)
        await done

    def received(self, turn_id: int, body: bytes) -> None:
        _answered(self._waiting, turn_id, body, self._k)


async def _server_cpu(channel: grpc.aio.Channel) -> float:
    raw = await channel.unary_unary(SERVICE + "Cpu")(b"")
    return float(struct.unpack("<d", raw)[0])


async def measure(
    channel: grpc.aio.Channel, shape: str, *, turns: int, concurrency: int, socket_port: int
) -> dict[str, float]:
    """Client and server CPU µs per turn and the turns per second of one shape."""
    bidi: _BidiClient | None = None
    connection: _SocketClient | None = None
    if shape.startswith("socket-"):
        k = int(shape.split("-")[1])
        _, connection = await asyncio.get_running_loop().create_connection(
            lambda: _SocketClient(k), "127.0.0.1", socket_port
        )
        one = connection.turn
    elif shape == "unary":
        call = channel.unary_unary(SERVICE + "Unary")

        async def one() -> None:
            body = await call(REQUEST.SerializeToString())
            worker_pb2.CompleteResponse.FromString(body)

    elif shape.startswith("stream-"):
        stream = channel.unary_stream(SERVICE + f"Stream{shape.split('-')[1]}")

        async def one() -> None:
            async for body in stream(REQUEST.SerializeToString()):
                worker_pb2.GenerateResponse.FromString(body)

    else:
        parts = shape.split("-")
        bidi = _BidiClient(channel, int(parts[1]), batched=parts[-1] == "batched")
        one = bidi.turn

    left = turns

    async def loop() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await one()

    left = max(200, turns // 10)  # warm-up
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    left = turns
    server_before, client_before = await _server_cpu(channel), time.process_time()
    started = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    client_s = time.process_time() - client_before
    server_s = await _server_cpu(channel) - server_before
    if bidi is not None:
        await bidi.close()
    if connection is not None and connection.transport is not None:
        connection.transport.close()
    return {
        "client_us": 1e6 * client_s / turns,
        "server_us": 1e6 * server_s / turns,
        "turns_per_s": turns / elapsed,
    }


async def client(port: int, socket_port: int, args: argparse.Namespace) -> None:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
    await channel.channel_ready()
    print("| shape | in flight | client CPU µs/turn | server CPU µs/turn | both | turns/s |")
    print("|---|---|---|---|---|---|")
    for concurrency in args.concurrency:
        for shape in args.shapes:
            results = [
                await measure(
                    channel,
                    shape,
                    turns=args.turns,
                    concurrency=concurrency,
                    socket_port=socket_port,
                )
                for _ in range(args.repeat)
            ]
            best = min(results, key=lambda r: r["client_us"] + r["server_us"])
            print(
                f"| {shape} | {concurrency} | {best['client_us']:.0f} | {best['server_us']:.0f} | "
                f"{best['client_us'] + best['server_us']:.0f} | {best['turns_per_s']:.0f} |",
                flush=True,
            )
    await channel.close()


def main() -> int:
    """Starts the server process, measures every shape, prints a table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--turns", type=int, default=4000)
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1, 16])
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=SHAPES)
    parser.add_argument(
        "--repeat", type=int, default=3, help="runs per shape; the cheapest is printed"
    )
    args = parser.parse_args()
    if args.serve is not None:
        uvloop.run(serve(args.serve))
        return 0
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", "0"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        port, socket_port = (int(p) for p in server.stdout.readline().split())
        uvloop.run(client(port, socket_port, args))
    finally:
        server.terminate()
        server.wait(timeout=10)
    print(f"\n(grpcio {grpc.__version__}, python {sys.version.split()[0]}, pid {os.getpid()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
