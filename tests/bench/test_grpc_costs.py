"""bench/grpc_costs.py: its plain-socket shape exchanges the same messages as the gRPC one."""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from services.runtime.grpc_client import open_channel

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _costs() -> ModuleType:
    spec = importlib.util.spec_from_file_location("grpc_costs", BENCH / "grpc_costs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_every_shape_answers_every_turn_on_a_real_server_process() -> None:
    costs = _costs()
    server = await asyncio.create_subprocess_exec(
        sys.executable, str(BENCH / "grpc_costs.py"), "--serve", "0", stdout=subprocess.PIPE
    )
    try:
        assert server.stdout is not None
        line = await asyncio.wait_for(server.stdout.readline(), timeout=30)
        port, socket_port = (int(p) for p in line.split())
        channel = open_channel(f"127.0.0.1:{port}")
        try:
            for shape in ("bidi-2", "socket-1", "socket-2"):
                result = await asyncio.wait_for(
                    costs.measure(channel, shape, turns=50, concurrency=4, socket_port=socket_port),
                    timeout=60,
                )
                # Every turn was answered (measure waits for each turn's K answers) and both
                # sides spent CPU on it.
                assert result["turns_per_s"] > 0, shape
                assert result["client_us"] > 0 and result["server_us"] > 0, shape
        finally:
            await channel.close()
    finally:
        server.terminate()
        await asyncio.wait_for(server.wait(), timeout=10)


def test_a_socket_turn_gets_its_k_answers_and_no_more() -> None:
    costs = _costs()
    client = costs._SocketClient(2)
    sent: list[bytes] = []

    class Transport:
        def write(self, data: bytes) -> None:
            sent.append(data)

    client.connection_made(Transport())

    async def run() -> bool:
        turn = asyncio.ensure_future(client.turn())
        await asyncio.sleep(0)
        chunks, final = (m.SerializeToString() for m in costs._answers(2))
        # The first answer arrives split across two reads: the turn is not done yet.
        first = costs._frame([(1, chunks)])
        framed = costs._SIZE.pack(len(first)) + first
        client.data_received(framed[:7])
        client.data_received(framed[7:])
        await asyncio.sleep(0)
        assert not turn.done()
        last = costs._frame([(1, final)])
        client.data_received(costs._SIZE.pack(len(last)) + last)
        await asyncio.wait_for(turn, timeout=5)
        return turn.done()

    assert asyncio.run(run())
    # One request frame, naming the turn and K.
    (size,) = costs._SIZE.unpack_from(sent[0])
    [(turn_id, body)] = costs._unframe(sent[0][4 : 4 + size])
    assert turn_id == 1
    assert costs.worker_pb2.GenerateRequest.FromString(body).weight_version == 2
