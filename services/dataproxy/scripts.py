"""The dataproxy's Lua scripts (`lua/*.lua`), loaded once by the shared loader
(services/runtime/redis_scripts.py)."""

from __future__ import annotations

from dataclasses import dataclass

from services.runtime.redis_scripts import LuaScript

PACKAGE = "services.dataproxy"


def load(name: str) -> LuaScript:
    """The dataproxy's script `lua/<name>.lua`."""
    return LuaScript.load(PACKAGE, name)


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
            bind_episode=load("bind_episode"),
            append_turn=load("append_turn"),
            set_reward=load("set_reward"),
            publish=load("publish"),
            release_marker=load("release_marker"),
            extend_marker=load("extend_marker"),
            begin_turn=load("begin_turn"),
            claim_due=load("claim_due"),
            release_turn=load("release_turn"),
        )
