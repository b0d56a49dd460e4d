"""The dataproxy's Lua scripts (`lua/*.lua`), loaded once by the shared loader
(services/runtime/redis_scripts.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.runtime.redis_scripts import LuaScript, ScriptStatus, text_of

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


# What each script returns, typed: its status strings as an enum, its reply as a dataclass.
# The callers compare members, never the bytes Redis answers with.


class BeginTurn(ScriptStatus):
    """begin_turn.lua's status."""

    OK = "ok"
    UNKNOWN = "unknown"
    NOT_ACTIVE = "not_active"
    NEEDS_SESSION = "needs_session"
    NEW = "new"
    PAUSED = "paused"


@dataclass(frozen=True, slots=True, kw_only=True)
class BeganTurn:
    """begin_turn.lua's reply; `epoch` is the session's episode count when NEW."""

    status: BeginTurn
    key_id: str
    episode: str
    epoch: int
    weight_version: int
    mode: str

    @classmethod
    def parse(cls, reply: list[Any]) -> BeganTurn:
        """From `{status, key_id, episode, epoch, weight_version, mode}`."""
        status, key_id, episode, epoch, version, mode = reply
        return cls(
            status=BeginTurn.parse(status),
            key_id=text_of(key_id),
            episode=text_of(episode),
            epoch=int(epoch),
            weight_version=int(version),
            mode=text_of(mode),
        )


class AppendTurn(ScriptStatus):
    """append_turn.lua's status."""

    OK = "ok"
    DUPLICATE = "duplicate"
    ENDED = "ended"
    VERSION = "version"


@dataclass(frozen=True, slots=True, kw_only=True)
class AppendedTurn:
    """append_turn.lua's reply: the turn's index (the current weight version on VERSION)."""

    status: AppendTurn
    value: int

    @classmethod
    def parse(cls, reply: list[Any]) -> AppendedTurn:
        """From `{status, index_or_version}`."""
        status, value = reply
        return cls(status=AppendTurn.parse(status), value=int(value))


class SetReward(ScriptStatus):
    """set_reward.lua's status."""

    OK = "ok"
    NOT_ACTIVE = "not_active"
    NO_INTERACTION = "no_interaction"
    NOT_FOUND = "not_found"


@dataclass(frozen=True, slots=True, kw_only=True)
class RewardSet:
    """set_reward.lua's reply: the interaction rewarded and whether it is the episode's last."""

    status: SetReward
    interaction_id: str
    is_last: bool

    @classmethod
    def parse(cls, reply: list[Any]) -> RewardSet:
        """From `{status, interaction_id, is_last}`."""
        status, found, is_last = reply
        return cls(
            status=SetReward.parse(status),
            interaction_id=text_of(found),
            is_last=bool(int(is_last)),
        )


class RevokeKey(ScriptStatus):
    """revoke_key.lua's and revoke_access_key.lua's status."""

    REVOKED = "revoked"
    ALREADY = "already"
    UNKNOWN = "unknown"
    RETRY = "retry"


@dataclass(frozen=True, slots=True, kw_only=True)
class KeyRevoked:
    """revoke_key.lua's reply (`discarded` and `missing` are empty for revoke_access_key.lua);
    on RETRY `missing` names an episode the script was not given."""

    status: RevokeKey
    key_id: str
    kind: str
    discarded: int = 0
    missing: str = ""

    @classmethod
    def parse(cls, reply: list[Any]) -> KeyRevoked:
        """From `{status, key_id, kind[, discarded, missing]}`."""
        status, key_id, kind, *rest = reply
        return cls(
            status=RevokeKey.parse(status),
            key_id=text_of(key_id),
            kind=text_of(kind),
            discarded=int(rest[0]) if rest else 0,
            missing=text_of(rest[1]) if len(rest) > 1 else "",
        )
