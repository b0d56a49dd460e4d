"""`rollgate trajectories export` as a real process: JSON Lines, cursor, ranges, no consuming."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from rollgate.trajectories_cli import parse_export_args
from services.dataproxy.redis_keys import RedisKeys
from tests.rollgate.test_trajectories_cli import publish

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def keys(key_prefix: str) -> RedisKeys:
    return RedisKeys(key_prefix)


async def run_export(redis_url: str, prefix: str, *args: str) -> tuple[int, str, str]:
    code = (
        "import sys; from rollgate.trajectories_cli import export_main; "
        "sys.exit(export_main(sys.argv[1:]))"
    )
    process = await asyncio.create_subprocess_exec(
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
    )
    async with asyncio.timeout(30):
        out, err = await process.communicate()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


def files_in(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_export_writes_every_trajectory_as_json_lines_without_consuming(
    redis_client: aioredis.Redis, redis_url: str, key_prefix: str, keys: RedisKeys, tmp_path: Path
) -> None:
    ids = [await publish(redis_client, keys, f"t{n}") for n in range(3)]
    await redis_client.xgroup_create(keys.trajectories, "ppo", id="0")
    out = tmp_path / "all.jsonl"

    code, _, err = await run_export(redis_url, key_prefix, "--out", str(out), "--all")

    assert code == 0, err
    rows = lines(out)
    assert [r["stream_id"] for r in rows] == ids
    assert [r["trajectory_id"] for r in rows] == ["t0", "t1", "t2"]
    assert rows[0]["interactions"][0]["output_token_ids"] == [4, 5]
    assert rows[0]["interactions"][0]["reward"] == 0.75
    groups: Any = await redis_client.xinfo_groups(keys.trajectories)
    assert [(g["name"], g["pending"], g["last-delivered-id"]) for g in groups] == [
        (b"ppo", 0, b"0-0")
    ]
    assert "exported 3 trajectories" in err


async def test_default_export_writes_only_what_was_not_exported_yet(
    redis_client: aioredis.Redis, redis_url: str, key_prefix: str, keys: RedisKeys, tmp_path: Path
) -> None:
    first_ids = [await publish(redis_client, keys, f"a{n}") for n in range(2)]
    code, _, err = await run_export(redis_url, key_prefix, "--out", str(tmp_path / "1.jsonl"))
    assert code == 0, err
    later_id = await publish(redis_client, keys, "b0")

    code, _, err = await run_export(redis_url, key_prefix, "--out", str(tmp_path / "2.jsonl"))
    again, _, _ = await run_export(redis_url, key_prefix, "--out", str(tmp_path / "3.jsonl"))

    assert code == again == 0, err
    assert [r["stream_id"] for r in lines(tmp_path / "1.jsonl")] == first_ids
    assert [r["stream_id"] for r in lines(tmp_path / "2.jsonl")] == [later_id]
    assert lines(tmp_path / "3.jsonl") == []
    cursor = await redis_client.hget(f"{key_prefix}export_cursors", "default")
    assert cursor == later_id.encode()


async def test_named_cursors_are_independent(
    redis_client: aioredis.Redis, redis_url: str, key_prefix: str, keys: RedisKeys, tmp_path: Path
) -> None:
    stream_id = await publish(redis_client, keys, "t0")
    await run_export(redis_url, key_prefix, "--out", str(tmp_path / "a.jsonl"))

    code, _, _ = await run_export(
        redis_url, key_prefix, "--out", str(tmp_path / "b.jsonl"), "--name", "analysis"
    )

    assert code == 0
    assert [r["stream_id"] for r in lines(tmp_path / "b.jsonl")] == [stream_id]


async def test_a_range_is_inclusive_and_leaves_the_cursor_alone(
    redis_client: aioredis.Redis, redis_url: str, key_prefix: str, keys: RedisKeys, tmp_path: Path
) -> None:
    ids = [await publish(redis_client, keys, f"t{n}") for n in range(4)]
    out = tmp_path / "range.jsonl"

    code, _, err = await run_export(
        redis_url, key_prefix, "--out", str(out), "--from-id", ids[1], "--to-id", ids[2]
    )

    assert code == 0, err
    assert [r["stream_id"] for r in lines(out)] == ids[1:3]
    assert await redis_client.hget(f"{key_prefix}export_cursors", "default") is None


async def test_append_adds_to_an_existing_file(
    redis_client: aioredis.Redis, redis_url: str, key_prefix: str, keys: RedisKeys, tmp_path: Path
) -> None:
    out = tmp_path / "log.jsonl"
    await publish(redis_client, keys, "t0")
    await run_export(redis_url, key_prefix, "--out", str(out))
    await publish(redis_client, keys, "t1")

    code, _, _ = await run_export(redis_url, key_prefix, "--out", str(out), "--append")

    assert code == 0
    assert [r["trajectory_id"] for r in lines(out)] == ["t0", "t1"]


async def test_export_warns_when_unexported_trajectories_were_trimmed(
    redis_client: aioredis.Redis, redis_url: str, key_prefix: str, keys: RedisKeys, tmp_path: Path
) -> None:
    exported = await publish(redis_client, keys, "t0")
    first = tmp_path / "first.jsonl"
    code, _, err = await run_export(redis_url, key_prefix, "--out", str(first))
    assert code == 0 and "trimmed" not in err
    gone = await publish(redis_client, keys, "t1")
    kept = await publish(redis_client, keys, "t2")
    # A trim up to `gone`, as the trimmer does (XTRIM MINID) once every group acked it.
    await redis_client.xdel(keys.trajectories, exported, gone)
    out = tmp_path / "x.jsonl"

    code, _, err = await run_export(redis_url, key_prefix, "--out", str(out))

    assert code == 0
    assert [r["stream_id"] for r in lines(out)] == [kept]
    assert "were trimmed from the stream" in err


async def test_an_unreachable_redis_exits_1_and_writes_nothing(
    key_prefix: str, tmp_path: Path
) -> None:
    out = tmp_path / "none.jsonl"

    code, _, err = await run_export("redis://127.0.0.1:1/0", key_prefix, "--out", str(out))

    assert code == 1
    assert "redis://127.0.0.1:1/0" in err
    assert files_in(tmp_path) == []  # not even a temporary file is left


def test_all_and_a_range_exclude_each_other(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        parse_export_args(["--out", "f", "--all", "--from-id", "1-0"], {}, tmp_path / "none")


def test_export_options_default_from_the_stack_file(tmp_path: Path) -> None:
    stack = tmp_path / "stack.json"
    stack.write_text(json.dumps({"redis_url": "redis://h:1/0", "redis_prefix": "x:"}))

    options = parse_export_args(["--out", "f"], {}, stack)

    assert (options.redis_url, options.prefix, options.name) == ("redis://h:1/0", "x:", "default")
    assert options.uses_cursor
