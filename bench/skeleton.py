"""The lower bound of the design card's data path: three processes that only pass messages.

A turn of rollgate crosses a gateway (HTTP in, HTTP out), a dataproxy (admission and record,
one Redis script each) and a worker (the upstream call), each its own process. This skeleton
does exactly those hops and nothing else — no JSON parsed, no record built, no metrics, logs,
limits or errors — with the cheapest transport Python has (uvloop protocols, length-prefixed
frames, writes of one loop turn coalesced, hiredis for Redis), so what it costs is what any
Python implementation of this shape costs at least:

- gateway (aiohttp web server, like the floor and rollgate): body in → `begin` to the
  dataproxy → `start` to the worker → the worker's answer (streamed: its chunks as they come)
  → `record` to the dataproxy → the answer out;
- dataproxy: each op is one EVALSHA of a two-command script on its pipelined Redis connection;
- worker: each start is one aiohttp client call to the upstream (like the floor and rollgate),
  relaying the answer's bytes as they arrive.

With `--record` (`bench/run.py --skeleton recording`) it also does the work no recording
gateway can skip, each piece once and in the cheapest way: the gateway parses the client's body
and serializes its recorded part (`tools`, `messages`) and the other fields; the worker splices
them into the upstream's body with `logprobs` and `return_token_ids` asked for, reads every
answer chunk's JSON (each sampled token's id and logprob, the text, the usage), writes the
client's chunk without them, and packs the record (ids as int32, logprobs as float32, the
assistant message as JSON), which the gateway hands to the dataproxy with the recorded part
before the answer ends. The prompt's ids (vLLM sends the whole prompt's on the first chunk) are
cut out before that chunk is parsed and only what an earlier prompt with the same first KB did
not have is parsed (`PromptCache`: an agent resends the same prompt plus a little each turn). Still left out: errors, limits, flow control, abort,
per-token weight versions, tool calls, metrics, logs, tracing, the ledger's bookkeeping and the
dataproxy's storage of the turn (it stores 64 bytes of it: rollgate stores only what a turn
adds, a few KB).

`bench/run.py --skeleton [recording]` runs it beside direct, floor and rollgate in the same
rounds (the `skeleton` row). Roles: `python bench/skeleton.py {gateway,dataproxy,worker} …`
(the bench starts them; see `_skeleton` in bench/run.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import struct
import sys
from collections.abc import Callable
from typing import Any

import aiohttp
import hiredis
import orjson
import uvloop
from aiohttp import web

_SIZE = struct.Struct(">I")
# A frame: op (1 byte), id (4 bytes), payload.
_HEAD = struct.Struct(">BI")
BEGIN, START, START_STREAM, RECORD, ANSWER, CHUNK, END = range(7)
SCRIPT = "redis.call('SET', KEYS[1], ARGV[1]) return redis.call('INCR', KEYS[2])"


class Framed(asyncio.Protocol):
    """Frames in (to `on_frame`) and out (coalesced per turn of the loop)."""

    def __init__(self, on_frame: Callable[[Framed, int, int, bytes], None]) -> None:
        self._on_frame = on_frame
        self._buffer = bytearray()
        self._out: list[bytes] = []
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        at = 0
        while len(buffer) - at >= 4:
            (size,) = _SIZE.unpack_from(buffer, at)
            if len(buffer) - at - 4 < size:
                break
            op, ident = _HEAD.unpack_from(buffer, at + 4)
            self._on_frame(self, op, ident, bytes(buffer[at + 9 : at + 4 + size]))
            at += 4 + size
        del buffer[:at]

    def send(self, op: int, ident: int, payload: bytes = b"") -> None:
        if not self._out:
            asyncio.get_running_loop().call_soon(self._flush)
        self._out.append(_SIZE.pack(5 + len(payload)) + _HEAD.pack(op, ident) + payload)

    def _flush(self) -> None:
        out, self._out = self._out, []
        if self.transport is not None and not self.transport.is_closing():
            self.transport.writelines(out)


class RedisPipe(asyncio.Protocol):
    """EVALSHA on one pipelined connection: commands of one loop turn in one write."""

    def __init__(self) -> None:
        self._reader = hiredis.Reader()
        self._waiting: list[Callable[[Any], None]] = []
        self._out: list[bytes] = []
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        while (reply := self._reader.gets()) is not False:
            self._waiting.pop(0)(reply)

    def call(self, command: tuple[Any, ...], done: Callable[[Any], None]) -> None:
        if not self._out:
            asyncio.get_running_loop().call_soon(self._flush)
        self._out.append(hiredis.pack_command(command))
        self._waiting.append(done)

    def _flush(self) -> None:
        out, self._out = self._out, []
        assert self.transport is not None
        self.transport.writelines(out)


async def dataproxy(port: int, redis_host: str, redis_port: int) -> None:
    loop = asyncio.get_running_loop()
    _, redis = await loop.create_connection(RedisPipe, redis_host, redis_port)
    sha: list[str] = []
    redis.call(("SCRIPT", "LOAD", SCRIPT), lambda reply: sha.append(reply.decode()))

    def on_frame(conn: Framed, op: int, ident: int, payload: bytes) -> None:
        key = b"skeleton:%d" % ident
        redis.call(
            ("EVALSHA", sha[0], 2, key, b"skeleton:count", payload[:64] or b"x"),
            lambda reply: conn.send(ANSWER, ident, b"%d" % reply),
        )

    server = await loop.create_server(lambda: Framed(on_frame), "127.0.0.1", port)
    async with server:
        await server.serve_forever()


_DONE = b"[DONE]"


_PROMPT_KEY = b'"prompt_token_ids":['


class PromptCache:
    """The latest prompt ids text packed per first KB of it: a prompt that repeats an earlier
    one's text reuses its packed ids and parses only the rest (an agent resends its system
    prompt, tools and history every turn)."""

    def __init__(self) -> None:
        self._latest: dict[bytes, tuple[bytes, bytes]] = {}

    def pack(self, text: bytes) -> bytes:
        old = self._latest.get(text[:1024])
        packed = None
        if old is not None:
            if old[0] == text:
                packed = old[1]
            else:
                low, high = 0, min(len(text), len(old[0])) + 1
                while high - low > 1:
                    middle = (low + high) // 2
                    if text[low:middle] == old[0][low:middle]:
                        low = middle
                    else:
                        high = middle
                comma = text.rfind(b",", 0, low)
                if comma > 0:
                    ids = orjson.loads(b"[" + text[comma + 1 :] + b"]")
                    shared = (text.count(b",", 0, comma) + 1) * 4
                    packed = old[1][:shared] + struct.pack(f"<{len(ids)}i", *ids)
        if packed is None:
            ids = orjson.loads(b"[" + text + b"]")
            packed = struct.pack(f"<{len(ids)}i", *ids)
        self._latest[text[:1024]] = (text, packed)
        return packed

    def parse(self, payload: bytes, recording: Recording) -> Any:
        """`payload` parsed, its prompt ids (when it has them) cut out first and packed here."""
        start = payload.find(_PROMPT_KEY)
        if start < 0:
            return orjson.loads(payload)
        end = payload.find(b"]", start)
        recording.prompt = self.pack(payload[start + len(_PROMPT_KEY) : end])
        return orjson.loads(payload[:start] + b'"prompt_token_ids":null' + payload[end + 1 :])


class Recording:
    """What a recording worker reads from one answer: the record's parts, the client's view."""

    def __init__(self) -> None:
        self.prompt = b""  # packed
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.text: list[str] = []
        self.usage: Any = None
        self.finish_reason = ""

    def read(self, body: dict[str, Any], *, key: str) -> None:
        """Takes the ids, logprobs and text of one chunk (`key` "delta") or one answer
        ("message") and strips the ids and logprobs from it (the client did not ask)."""
        body.pop("prompt_token_ids", None)
        usage = body.get("usage")
        if usage:
            self.usage = usage
        for choice in body.get("choices") or ():
            ids = choice.pop("token_ids", None)
            if ids:
                self.output_ids.extend(ids)
            choice.pop("prompt_token_ids", None)
            logprobs = choice.get("logprobs")
            if logprobs:
                self.logprobs.extend(entry["logprob"] for entry in logprobs["content"])
                choice["logprobs"] = None
            part = choice.get(key)
            if part:
                content = part.get("content")
                if content:
                    self.text.append(content)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]

    def record(self) -> bytes:
        """The packed record: three arrays, then the message and the usage as JSON."""
        out, logprobs = self.output_ids, self.logprobs
        message = orjson.dumps({"role": "assistant", "content": "".join(self.text)})
        return b"".join(
            (
                _SIZE.pack(len(self.prompt) // 4),
                self.prompt,
                _SIZE.pack(len(out)),
                struct.pack(f"<{len(out)}i", *out),
                struct.pack(f"<{len(logprobs)}f", *logprobs),
                _SIZE.pack(len(message)),
                message,
                orjson.dumps(self.usage),
            )
        )


def _upstream_body(payload: bytes, *, stream: bool) -> bytes:
    """The parameters (parsed: the only part the worker reads) with what the record needs,
    spliced in front of the recorded part's bytes."""
    (size,) = _SIZE.unpack_from(payload)
    params = orjson.loads(payload[4 : 4 + size])
    params["logprobs"] = True
    params["return_token_ids"] = True
    if stream:
        params["stream_options"] = {"include_usage": True}
    return orjson.dumps(params)[:-1] + b"," + payload[5 + size :]


async def worker(port: int, upstream: str, *, record: bool) -> None:
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    loop = asyncio.get_running_loop()
    prompts = PromptCache()

    async def run(conn: Framed, op: int, ident: int, body: bytes) -> None:
        async with session.post(upstream, data=body) as response:
            if op == START:
                conn.send(ANSWER, ident, await response.read())
                return
            async for data in response.content.iter_any():
                conn.send(CHUNK, ident, data)
            conn.send(END, ident)

    async def run_recording(conn: Framed, op: int, ident: int, payload: bytes) -> None:
        stream = op == START_STREAM
        body = _upstream_body(payload, stream=stream)
        recording = Recording()
        async with session.post(upstream, data=body) as response:
            if not stream:
                answer = prompts.parse(await response.read(), recording)
                recording.read(answer, key="message")
                client = orjson.dumps(answer)
                conn.send(ANSWER, ident, _SIZE.pack(len(client)) + client + recording.record())
                return
            pending = b""
            first = True
            async for data in response.content.iter_any():
                events = (pending + data).split(b"\n\n")
                pending = events.pop()
                out = []
                for event in events:
                    if not event.startswith(b"data: ") or event[6:] == _DONE:
                        continue
                    if first:  # vLLM's prompt ids come on the first chunk
                        chunk, first = prompts.parse(event[6:], recording), False
                    else:
                        chunk = orjson.loads(event[6:])
                    recording.read(chunk, key="delta")
                    out.append(orjson.dumps(chunk))
                if out:
                    conn.send(CHUNK, ident, b"data: " + b"\n\ndata: ".join(out) + b"\n\n")
            conn.send(END, ident, recording.record())

    tasks: set[asyncio.Task[None]] = set()
    turn = run_recording if record else run

    def on_frame(conn: Framed, op: int, ident: int, payload: bytes) -> None:
        task = loop.create_task(turn(conn, op, ident, payload))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    server = await loop.create_server(lambda: Framed(on_frame), "127.0.0.1", port)
    async with server:
        await server.serve_forever()


class Peer:
    """The gateway's connection to one peer: each call's frames go to its own queue."""

    def __init__(self) -> None:
        self.waiting: dict[int, asyncio.Queue[tuple[int, bytes]]] = {}
        self.conn = Framed(self._on_frame)

    def protocol(self) -> Framed:
        return self.conn

    def _on_frame(self, conn: Framed, op: int, ident: int, payload: bytes) -> None:
        queue = self.waiting.get(ident)
        if queue is not None:
            queue.put_nowait((op, payload))

    def open(self, op: int, ident: int, payload: bytes) -> asyncio.Queue[tuple[int, bytes]]:
        """Sends `op`; the queue its answer's frames come to (`waiting` until removed)."""
        queue: asyncio.Queue[tuple[int, bytes]] = asyncio.Queue()
        self.waiting[ident] = queue
        self.conn.send(op, ident, payload)
        return queue

    async def ask(self, op: int, ident: int, payload: bytes) -> bytes:
        queue: asyncio.Queue[tuple[int, bytes]] = asyncio.Queue()
        self.waiting[ident] = queue
        self.conn.send(op, ident, payload)
        try:
            return (await queue.get())[1]
        finally:
            del self.waiting[ident]


async def _sse(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    return response


def _split(body: bytes) -> tuple[bool, bytes]:
    """A recording gateway's reading of the body: whether it streams, and the start's payload
    (the other fields, then the recorded part, each serialized once)."""
    parsed = orjson.loads(body)
    recorded = {"tools": parsed.pop("tools")} if "tools" in parsed else {}
    recorded["messages"] = parsed.pop("messages")
    params = orjson.dumps(parsed)
    return parsed.get("stream") is True, _SIZE.pack(len(params)) + params + orjson.dumps(recorded)


def gateway(port: int, dataproxy_port: int, worker_port: int, *, record: bool) -> None:
    ids = iter(range(1, 1 << 31))
    peers: dict[str, Peer] = {}

    async def connect(app: web.Application) -> Any:
        loop = asyncio.get_running_loop()
        for name, peer_port in (("dataproxy", dataproxy_port), ("worker", worker_port)):
            peer = peers[name] = Peer()
            await loop.create_connection(peer.protocol, "127.0.0.1", peer_port)
        yield

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        stream = b'"stream":true' in body
        ident = next(ids)
        await peers["dataproxy"].ask(BEGIN, ident, body[:32])
        worker_peer = peers["worker"]
        if not stream:
            answer = await worker_peer.ask(START, ident, body)
            await peers["dataproxy"].ask(RECORD, ident, answer[:64])
            return web.Response(body=answer, content_type="application/json")
        queue = worker_peer.open(START_STREAM, ident, body)
        response = await _sse(request)
        try:
            while True:
                op, data = await queue.get()
                if op == END:
                    break
                # The end of the answer goes out only once it is recorded.
                if b"[DONE]" in data:
                    await peers["dataproxy"].ask(RECORD, ident, data[:64])
                await response.write(data)
        finally:
            del worker_peer.waiting[ident]
        await response.write_eof()
        return response

    async def chat_recording(request: web.Request) -> web.StreamResponse:
        stream, start = _split(await request.read())
        recorded = start[4 + _SIZE.unpack_from(start)[0] :]
        ident = next(ids)
        digest = hashlib.sha256(request.headers["Authorization"].encode()).hexdigest()
        await peers["dataproxy"].ask(BEGIN, ident, digest.encode())
        worker_peer = peers["worker"]
        if not stream:
            answer = await worker_peer.ask(START, ident, start)
            (size,) = _SIZE.unpack_from(answer)
            await peers["dataproxy"].ask(RECORD, ident, answer[4 + size :] + recorded)
            return web.Response(body=answer[4 : 4 + size], content_type="application/json")
        queue = worker_peer.open(START_STREAM, ident, start)
        response = await _sse(request)
        try:
            while True:
                op, data = await queue.get()
                if op == END:  # the record: the answer ends only once it is stored
                    await peers["dataproxy"].ask(RECORD, ident, data + recorded)
                    break
                await response.write(data)
        finally:
            del worker_peer.waiting[ident]
        await response.write_eof(b"data: [DONE]\n\n")
        return response

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "skeleton"}]})

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.cleanup_ctx.append(connect)
    app.router.add_post("/v1/chat/completions", chat_recording if record else chat)
    app.router.add_get("/v1/models", models)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


def main(argv: list[str] | None = None) -> int:
    """Runs one role until interrupted."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("role", choices=("gateway", "dataproxy", "worker"))
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--dataproxy-port", type=int, default=0)
    parser.add_argument("--worker-port", type=int, default=0)
    parser.add_argument("--redis-port", type=int, default=6379)
    parser.add_argument("--upstream", default="", help="the upstream's chat completions URL")
    parser.add_argument(
        "--record", action="store_true", help="also do the work no recording gateway can skip"
    )
    args = parser.parse_args(argv)
    uvloop.install()
    with contextlib.suppress(KeyboardInterrupt):
        if args.role == "gateway":
            gateway(args.port, args.dataproxy_port, args.worker_port, record=args.record)
        elif args.role == "dataproxy":
            asyncio.run(dataproxy(args.port, "127.0.0.1", args.redis_port))
        else:
            asyncio.run(worker(args.port, args.upstream, record=args.record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
