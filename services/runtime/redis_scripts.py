"""The one loader of Redis scripts: every service keeps its scripts as `.lua` files in a `lua/`
folder beside its modules, loads each once by name and runs it with EVALSHA (EVAL on NOSCRIPT).

A script's caller wraps it in one typed function (a dataclass in, an enum or dataclass out), so
positional KEYS/ARGV and the script's status strings are spelled in one place next to the call.
No service runs another's scripts: a script is loaded from the package that owns it.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

ScriptArg = str | bytes | int | float

StatusT = TypeVar("StatusT", bound="ScriptStatus")


class ScriptStatus(enum.Enum):
    """The status strings a script returns first, by name; `parse` turns Redis's bytes into one
    (an unlisted status is a programming error between the script and its wrapper)."""

    @classmethod
    def parse(cls: type[StatusT], raw: bytes | str) -> StatusT:
        """The member whose value is `raw` (bytes from Redis or str)."""
        return cls(raw.decode() if isinstance(raw, bytes) else raw)


def text_of(value: object) -> str:
    """A value from a Redis reply as text: bytes decoded, "" when absent (None)."""
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass(frozen=True, slots=True, kw_only=True)
class LuaScript:
    """One script's source and its SHA-1 (the name Redis caches it under)."""

    name: str
    source: str
    sha: str

    @classmethod
    def load(cls, package: str, name: str) -> LuaScript:
        """Reads `lua/<name>.lua` from the package (e.g. "services.dataproxy") that owns it."""
        source = resources.files(package).joinpath(f"lua/{name}.lua").read_text()
        return cls(name=name, source=source, sha=hashlib.sha1(source.encode()).hexdigest())

    async def run(
        self, redis: aioredis.Redis, keys: Sequence[str], args: Sequence[ScriptArg] = ()
    ) -> Any:
        """EVALSHA; on NOSCRIPT (a restarted or failed-over Redis) EVAL, which caches it again."""
        try:
            return await redis.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await redis.eval(self.source, len(keys), *keys, *args)
