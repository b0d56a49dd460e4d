"""At-least-once consumption through the real Trainer server: a SIGKILLed consumer's entries
are reclaimed by another consumer (XAUTOCLAIM), and the client drops duplicates by id."""

from __future__ import annotations

import asyncio
import os
import signal
import struct
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
import redis.asyncio as aioredis

from rollgate.trainer_client import PulledTrajectory, TrainerClient
from schema.trajectory import CODEC
from services.dataproxy.redis_keys import RedisKeys
from services.dataproxy.settings import DataProxySettings
from services.dataproxy.trainer_servicer import TrainerServicer
from services.dataproxy.trajectory import EpisodeInfo, build_trajectory, encode_trajectory
from services.runtime.secret import Secret
from tests.harness.inprocess import serving_trainer
from tests.harness.poll import eventually

REPO = Path(__file__).resolve().parents[2]
ADMIN_KEY = "admin-consumers-" + "c" * 24
RECLAIM_IDLE_S = 0.5

# A consumer process: pulls N trajectories, prints their ids, then hangs until killed.
CONSUMER = """
import asyncio, sys
from rollgate.trainer_client import TrainerClient

async def main(address, key, group, consumer, count):
    async with TrainerClient(address, key) as tc:
        async for item in tc.pull(
            group, consumer, max_count=int(count), idle_timeout_s=10, include_history=True
        ):
            print(item.trajectory.trajectory_id, flush=True)
        print("PULLED", flush=True)
        await asyncio.Event().wait()  # never acks: dies holding its entries

asyncio.run(main(*sys.argv[1:]))
"""


class Trainer:
    """A real Trainer gRPC server on port 0 over the test's Redis prefix."""

    def __init__(self, address: str, keys: RedisKeys, redis: aioredis.Redis) -> None:
        self.address = address
        self.keys = keys
        self.redis = redis

    def client(self) -> TrainerClient:
        return TrainerClient(self.address, ADMIN_KEY, timeout_s=5.0)

    async def publish(self, trajectory_id: str) -> str:
        record = msgpack.packb(
            {
                "interaction_id": "c1",
                "request_json": b'{"messages": [{"role": "user", "content": "hi"}]}',
                "assistant_message_json": b'{"role": "assistant", "content": "yo"}',
                "prompt_token_ids": struct.pack("<2i", 1, 2),
                "output_token_ids": struct.pack("<1i", 3),
                "output_logprobs": struct.pack("<1f", -0.5),
                "exact_tokens": True,
            },
            use_bin_type=True,
        )
        info = EpisodeInfo(
            trajectory_id=trajectory_id,
            session_id="s",
            task_id="t",
            key_id="k",
            episode="s",
            started_at=1.0,
            ended_at=2.0,
            end_reason="end_session",
        )
        data = encode_trajectory(build_trajectory(info, [record], {"c1": 1.0}))
        fields = {"trajectory_id": trajectory_id, "codec": CODEC, "data": data}
        stream_id: Any = await self.redis.xadd(self.keys.trajectories, fields)  # type: ignore[arg-type]
        return str(stream_id.decode())

    async def pending_by_consumer(self, group: str) -> dict[str, int]:
        consumers: Any = await self.redis.xinfo_consumers(self.keys.trajectories, group)
        return {c["name"].decode(): int(c["pending"]) for c in consumers}


@pytest.fixture
async def trainer(redis_client: aioredis.Redis, key_prefix: str) -> AsyncIterator[Trainer]:
    keys = RedisKeys(prefix=key_prefix)
    servicer = TrainerServicer(
        redis=redis_client,
        keys=keys,
        settings=DataProxySettings(admin_key=Secret(ADMIN_KEY)),
        reclaim_idle_s=RECLAIM_IDLE_S,
    )
    async with serving_trainer(servicer) as address:
        yield Trainer(address, keys, redis_client)


async def run_doomed_consumer(trainer: Trainer, group: str, count: int) -> list[str]:
    """Starts a consumer process, waits until it pulled `count` entries, SIGKILLs it."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        CONSUMER,
        trainer.address,
        ADMIN_KEY,
        group,
        "doomed",
        str(count),
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=asyncio.subprocess.PIPE,
    )
    assert process.stdout is not None
    pulled: list[str] = []
    try:
        async with asyncio.timeout(30):
            while (line := (await process.stdout.readline()).decode().strip()) != "PULLED":
                assert line, "the consumer exited before pulling"
                pulled.append(line)
    finally:
        process.send_signal(signal.SIGKILL)
        async with asyncio.timeout(10):
            await process.wait()
    assert process.returncode == -signal.SIGKILL
    return pulled


async def pull_until(
    tc: TrainerClient, group: str, consumer: str, want: int
) -> list[PulledTrajectory]:
    """Pulls (idle-bounded rounds) until `want` trajectories came, for at most 20 s."""
    got: list[PulledTrajectory] = []

    async def arrived() -> bool:
        async with asyncio.timeout(30):
            got.extend(
                [
                    item
                    async for item in tc.pull(
                        group, consumer, idle_timeout_s=0.3, include_history=True
                    )
                ]
            )
        return len(got) >= want

    await eventually(arrived, timeout_s=20, interval_s=0, what=f"{want} trajectories pulled")
    return got


async def test_a_killed_consumers_entries_are_reclaimed_by_another_consumer(
    trainer: Trainer,
) -> None:
    ids = ["t0", "t1", "t2"]
    for trajectory_id in ids:
        await trainer.publish(trajectory_id)

    held = await run_doomed_consumer(trainer, "ppo", count=2)
    assert held == ["t0", "t1"]
    assert await trainer.pending_by_consumer("ppo") == {"doomed": 2}

    async with trainer.client() as tc:
        got = await pull_until(tc, "ppo", "survivor", want=3)
        delivered: Any = await trainer.redis.xpending_range(
            trainer.keys.trajectories, "ppo", min="-", max="+", count=10
        )
        acked = await tc.ack("ppo", [item.stream_id for item in got])
        stats = await tc.stats()

    assert sorted(item.trajectory.trajectory_id for item in got) == ids
    owners = {d["message_id"].decode(): d["consumer"].decode() for d in delivered}
    deliveries = {d["message_id"].decode(): d["times_delivered"] for d in delivered}
    by_id = {item.trajectory.trajectory_id: item.stream_id for item in got}
    assert set(owners.values()) == {"survivor"}
    assert deliveries[by_id["t0"]] >= 2 and deliveries[by_id["t1"]] >= 2  # came back
    assert acked == 3
    assert (stats.pending, stats.consumed) == (0, 3)
    assert await trainer.pending_by_consumer("ppo") == {"doomed": 0, "survivor": 0}


async def test_a_reclaimed_copy_of_a_trajectory_already_trained_on_is_dropped_and_acked(
    trainer: Trainer,
) -> None:
    await trainer.publish("t0")
    async with trainer.client() as tc:
        first = await pull_until(tc, "ppo", "survivor", want=1)
        await tc.ack("ppo", [first[0].stream_id])

        await trainer.publish("t0")  # the same episode a second time (a double publication)
        await trainer.publish("t1")
        held = await run_doomed_consumer(trainer, "ppo", count=1)
        assert held == ["t0"]

        later = await pull_until(tc, "ppo", "survivor", want=1)

        async def pending() -> dict[str, int]:
            found: dict[str, int] = await trainer.pending_by_consumer("ppo")
            if found != {"doomed": 0, "survivor": 1}:
                later.extend(
                    [
                        item
                        async for item in tc.pull(
                            "ppo", "survivor", idle_timeout_s=0.3, include_history=True
                        )
                    ]
                )
            return found

        await eventually(pending, want={"doomed": 0, "survivor": 1}, timeout_s=20, interval_s=0)

    assert [item.trajectory.trajectory_id for item in later] == ["t1"]


async def test_a_second_pull_before_acking_brings_max_count_new_trajectories(
    trainer: Trainer,
) -> None:
    for n in range(5):
        await trainer.publish(f"t{n}")

    async with trainer.client() as tc, asyncio.timeout(30):
        first = [
            item
            async for item in tc.pull(
                "ppo", "c0", max_count=2, idle_timeout_s=5, include_history=True
            )
        ]
        second = [
            item
            async for item in tc.pull(
                "ppo", "c0", max_count=2, idle_timeout_s=5, include_history=True
            )
        ]
        await tc.ack("ppo", [item.stream_id for item in first + second])
        third = [
            item
            async for item in tc.pull(
                "ppo", "c0", max_count=2, idle_timeout_s=0.5, include_history=True
            )
        ]

    assert [item.trajectory.trajectory_id for item in first] == ["t0", "t1"]
    assert [item.trajectory.trajectory_id for item in second] == ["t2", "t3"]
    assert [item.trajectory.trajectory_id for item in third] == ["t4"]


async def test_an_adapters_memory_of_handed_out_ids_is_bounded_and_still_drops_recent_copies(
    trainer: Trainer,
) -> None:
    from rollgate.episodes import LiveOptions, LiveSource

    async with trainer.client() as tc:
        options = LiveOptions(group="bounded", consumer="c0", handed_limit=3)
        source = await LiveSource(tc, options).start()
        try:
            for n in range(8):
                await trainer.publish(f"t{n}")
                async with asyncio.timeout(10):
                    unit = await source.take()
                assert unit is not None
                source.taken(unit)
                assert source.remembered <= 3  # never grows past the limit
            # The same episode published again (a retried publication): still recent, dropped.
            await trainer.publish("t7")
            await trainer.publish("t8")
            async with asyncio.timeout(10):
                unit = await source.take()
            # (The client drops that copy first, by its own bounded memory; the source would.)
            assert unit is not None and unit[0].trajectory.trajectory_id == "t8"
            assert source.remembered == 3
            assert "t7" in source._handed and "t4" not in source._handed
        finally:
            await source.aclose()


async def test_a_replayed_files_memory_of_ids_is_bounded_too(tmp_path: Path) -> None:
    import json

    from rollgate.episodes import FileSource

    def line(trajectory_id: str) -> str:
        return json.dumps({"stream_id": "1-0", "schema_version": 2, "trajectory_id": trajectory_id})

    # A file joined from two overlapping exports: t3 twice, close together.
    ids = ["t0", "t1", "t2", "t3", "t3", "t4", "t5"]
    path = tmp_path / "joined.jsonl"
    path.write_text("".join(line(t) + "\n" for t in ids))
    source = FileSource(path, handed_limit=2)
    got = []
    while True:
        try:
            unit = await source.take()
        except EOFError:
            break
        got.append(unit[0].trajectory.trajectory_id)
        assert source.remembered <= 2
    assert got == ["t0", "t1", "t2", "t3", "t4", "t5"]
    assert source.duplicates_dropped == 1
