"""`rollgate trajectories tail` as a real process: prints entries, never joins a group."""

from __future__ import annotations

import asyncio
import json
import signal
import struct
import sys
from pathlib import Path
from typing import Any

import msgpack  # type: ignore[import-untyped]
import orjson
import redis.asyncio as aioredis

from rollgate.trajectories_cli import parse_args
from schema.trajectory import CODEC
from services.dataproxy.redis_keys import RedisKeys
from services.dataproxy.trajectory import EpisodeInfo, build_trajectory, encode_trajectory

REPO = Path(__file__).resolve().parents[2]


async def publish(redis: aioredis.Redis, keys: RedisKeys, trajectory_id: str) -> str:
    record = msgpack.packb(
        {
            "interaction_id": "c1",
            "request_json": orjson.dumps({"messages": [{"role": "user", "content": "hi"}]}),
            "assistant_message_json": orjson.dumps({"role": "assistant", "content": "yo"}),
            "prompt_token_ids": struct.pack("<3i", 1, 2, 3),
            "output_token_ids": struct.pack("<2i", 4, 5),
            "output_logprobs": struct.pack("<2f", -0.5, -0.25),
            "exact_tokens": True,
            "weight_version": 2,
        },
        use_bin_type=True,
    )
    info = EpisodeInfo(
        trajectory_id=trajectory_id,
        session_id=f"s-{trajectory_id}",
        task_id="task",
        key_id="k",
        episode=f"s-{trajectory_id}",
        started_at=1.0,
        ended_at=2.0,
        end_reason="end_session",
    )
    data = encode_trajectory(build_trajectory(info, [record], {"c1": 0.75}))
    stream_id: Any = await redis.xadd(
        keys.trajectories, {"trajectory_id": trajectory_id, "codec": CODEC, "data": data}
    )
    return str(stream_id.decode())


async def start_tail(redis_url: str, prefix: str, *args: str) -> asyncio.subprocess.Process:
    code = "import sys; from rollgate.trajectories_cli import tail_main; sys.exit(tail_main(sys.argv[1:]))"
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        code,
        "--redis-url",
        redis_url,
        "--prefix",
        prefix,
        *args,
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        # A run started in the background (`cmd &` in a script) inherits SIGINT ignored, and
        # Python keeps an ignored SIGINT: give the CLI the disposition a terminal gives it.
        preexec_fn=_default_sigint,
    )


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


async def finish(process: asyncio.subprocess.Process) -> tuple[int, str, str]:
    async with asyncio.timeout(30):
        out, err = await process.communicate()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_tail_prints_published_trajectories_as_json_and_never_joins_a_group(
    redis_client: aioredis.Redis, redis_url: str, key_prefix: str
) -> None:
    keys = RedisKeys(prefix=key_prefix)
    stream_ids = [await publish(redis_client, keys, t) for t in ("t1", "t2")]

    code, out, err = await finish(
        await start_tail(redis_url, key_prefix, "--json", "--from-start", "--count", "2")
    )

    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert [line["trajectory_id"] for line in lines] == ["t1", "t2"]
    assert [line["stream_id"] for line in lines] == stream_ids
    first = lines[0]["interactions"][0]
    # Schema 2 stores messages once per trajectory; the JSON still shows them expanded.
    assert first["messages"] == [{"role": "user", "content": "hi"}] and first["tools"] is None
    assert "messages_ref" not in first and "messages_table" not in lines[0]
    assert lines[0]["schema_version"] == 2
    assert first["prompt_token_ids"] == [1, 2, 3]
    assert first["output_token_ids"] == [4, 5]
    assert first["output_logprobs"] == [-0.5, -0.25]
    assert first["output_versions"] == [2, 2]
    assert lines[0]["final_reward"] == 0.75
    assert await redis_client.xinfo_groups(keys.trajectories) == []


async def test_tail_with_a_count_follows_only_new_trajectories(
    redis_client: aioredis.Redis, redis_url: str, key_prefix: str
) -> None:
    keys = RedisKeys(prefix=key_prefix)
    await publish(redis_client, keys, "old")
    process = await start_tail(redis_url, key_prefix, "--count", "1")
    assert process.stderr is not None
    async with asyncio.timeout(30):
        banner = await process.stderr.readline()
    assert b"following" in banner

    await publish(redis_client, keys, "new")
    code, out, err = await finish(process)

    assert code == 0, err
    assert len(out.splitlines()) == 1
    assert "new  session=s-new  turns=1  reward=0.75  tokens=3+2" in out
    assert await redis_client.xinfo_groups(keys.trajectories) == []


async def test_tail_exits_cleanly_after_the_timeout_without_new_entries(
    redis_url: str, key_prefix: str
) -> None:
    code, out, err = await finish(
        await start_tail(redis_url, key_prefix, "--from-now", "--timeout-s", "0.3")
    )

    assert code == 0, err
    assert out == ""


async def test_tail_reports_an_unreachable_redis_and_exits_1(key_prefix: str) -> None:
    code, _out, err = await finish(
        await start_tail("redis://127.0.0.1:1/0", key_prefix, "--timeout-s", "0.3")
    )

    assert code == 1
    assert "redis://127.0.0.1:1/0" in err


def test_plain_tail_starts_from_the_beginning_and_follows(tmp_path: Path) -> None:
    options = parse_args([], {}, tmp_path / "missing.json")

    assert options.start_id == "0-0"
    assert options.count is None and options.timeout_s is None
    assert options.redis_url == "redis://127.0.0.1:6379/0"
    assert options.prefix == "rg:"


def test_a_count_without_from_start_reads_only_new_entries(tmp_path: Path) -> None:
    assert parse_args(["--count", "3"], {}, tmp_path / "none").start_id == "$"
    assert parse_args(["--count", "3", "--from-start"], {}, tmp_path / "none").start_id == "0-0"


def test_the_redis_url_comes_from_env_then_the_stack_file(tmp_path: Path) -> None:
    stack = tmp_path / "stack.json"
    stack.write_text(json.dumps({"redis_url": "redis://stack:1/0", "redis_prefix": "st:"}))

    from_stack = parse_args([], {}, stack)
    from_redis_url = parse_args([], {"REDIS_URL": "redis://plain:2/0"}, stack)
    from_rollgate = parse_args(
        [], {"REDIS_URL": "redis://plain:2/0", "ROLLGATE_REDIS_URL": "redis://rg:3/0"}, stack
    )
    from_flag = parse_args(["--redis-url", "redis://flag:4/0"], {"REDIS_URL": "x"}, stack)

    assert (from_stack.redis_url, from_stack.prefix) == ("redis://stack:1/0", "st:")
    assert from_redis_url.redis_url == "redis://plain:2/0"
    assert from_rollgate.redis_url == "redis://rg:3/0"
    assert from_flag.redis_url == "redis://flag:4/0"


async def test_ctrl_c_ends_tail_with_status_0(redis_url: str, key_prefix: str) -> None:
    process = await start_tail(redis_url, key_prefix)
    assert process.stderr is not None
    async with asyncio.timeout(30):
        assert b"following" in await process.stderr.readline()

    process.send_signal(signal.SIGINT)
    code, _out, err = await finish(process)

    assert code == 0, err
