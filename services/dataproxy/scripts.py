"""The dataproxy's Lua scripts: loaded once from `lua/*.lua`, run with EVALSHA (EVAL on NOSCRIPT)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

ScriptArg = str | bytes | int | float


@dataclass(frozen=True, slots=True, kw_only=True)
class LuaScript:
    """One script's source and its SHA-1 (the name Redis caches it under)."""

    name: str
    source: str
    sha: str

    @classmethod
    def load(cls, name: str) -> LuaScript:
        """Reads `lua/<name>.lua` from the package."""
        source = resources.files("services.dataproxy").joinpath(f"lua/{name}.lua").read_text()
        return cls(name=name, source=source, sha=hashlib.sha1(source.encode()).hexdigest())

    async def run(self, redis: aioredis.Redis, keys: list[str], args: list[ScriptArg]) -> Any:
        """EVALSHA; on NOSCRIPT (a restarted or failed-over Redis) EVAL, which caches it again."""
        try:
            return await redis.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await redis.eval(self.source, len(keys), *keys, *args)


@dataclass(frozen=True, slots=True, kw_only=True)
class Scripts:
    """Every session transition the dataproxy makes, one script each."""

    bind_episode: LuaScript
    append_turn: LuaScript
    set_reward: LuaScript
    publish: LuaScript
    release_marker: LuaScript
    extend_marker: LuaScript
    begin_turn: LuaScript
    claim_due: LuaScript
    release_turn: LuaScript

    @classmethod
    def load(cls) -> Scripts:
        """Reads all the scripts."""
        return cls(
            bind_episode=LuaScript.load("bind_episode"),
            append_turn=LuaScript.load("append_turn"),
            set_reward=LuaScript.load("set_reward"),
            publish=LuaScript.load("publish"),
            release_marker=LuaScript.load("release_marker"),
            extend_marker=LuaScript.load("extend_marker"),
            begin_turn=LuaScript.load("begin_turn"),
            claim_due=LuaScript.load("claim_due"),
            release_turn=LuaScript.load("release_turn"),
        )
