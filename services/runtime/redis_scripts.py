"""The one loader of Redis scripts: every service keeps its scripts as `.lua` files in a `lua/`
folder beside its modules, loads each once and runs it with EVALSHA (EVAL on NOSCRIPT).

Each script has one typed wrapper, a `Script`: a `ScriptCall` dataclass in (its KEYS and ARGV
as named fields, in the order the `.lua` file reads them), its reply parsed once out (an enum
status and a dataclass), so positional lists and status strings are spelled in one place.
No service runs another's scripts: a script is loaded from the package of its call's module.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import hashlib
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from types import MappingProxyType
from typing import Any, ClassVar, Final, Generic, TypeVar, cast

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

from services.runtime.redis_pipeline import ErrorTypes, PipelinedScripts

ScriptArg = str | bytes | int | float

StatusT = TypeVar("StatusT", bound="ScriptStatus")
CallT = TypeVar("CallT", bound="ScriptCall")
ReplyT = TypeVar("ReplyT")

# `field(metadata=KEY)`: the field is one of the script's KEYS (the others are its ARGV).
KEY: Final[Mapping[str, str]] = MappingProxyType({"script": "key"})
# `field(metadata=EACH)`: a sequence whose items come after the fixed KEYS and ARGV: a
# ScriptCall part adds its own KEYS and ARGV (one group per member), a plain value one ARGV.
EACH: Final[Mapping[str, str]] = MappingProxyType({"script": "each"})


class ScriptStatus(enum.Enum):
    """The status strings a script returns first, by name; `parse` turns Redis's bytes into one
    (an unlisted status is a programming error between the script and its wrapper)."""

    @classmethod
    def parse(cls: type[StatusT], raw: bytes | str) -> StatusT:
        """The member whose value is `raw` (bytes from Redis or str); ValueError when none
        is (read from the value map: calling the enum class costs ten times as much)."""
        text = raw.decode() if isinstance(raw, bytes) else raw
        member = cls._value2member_map_.get(text)
        return cast(StatusT, member) if member is not None else cls(text)


def text_of(value: object) -> str:
    """A value from a Redis reply as text: bytes decoded, "" when absent (None)."""
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else str(value)


def as_bool(reply: Any) -> bool:
    """A script's 0/1 reply."""
    return bool(int(reply))


def as_int(reply: Any) -> int:
    """A script's integer reply."""
    return int(reply)


class ScriptCall:
    """A script's arguments by name; subclasses are slotted dataclasses (frozen, unless built
    every turn) naming their `.lua` file in SCRIPT. Their fields, in order, are its KEYS
    (marked KEY) and its ARGV (the rest; a bool is sent as "1"/"0", a float as its repr),
    then the items of fields marked EACH."""

    __slots__ = ()
    SCRIPT: ClassVar[str] = ""

    def keys_and_args(self) -> tuple[list[str], list[ScriptArg]]:
        """KEYS and ARGV in the order the script reads them."""
        layout = _layout(type(self))
        keys: list[str] = list(layout.get_keys(self))
        args: list[ScriptArg] = list(layout.get_args(self))
        if layout.bools:
            args = [_arg(value) for value in args]
        if layout.each:
            tail_keys: list[str] = []
            for name in layout.each:
                for item in getattr(self, name):
                    if isinstance(item, ScriptCall):
                        more_keys, more_args = item.keys_and_args()
                        tail_keys += more_keys
                        args += more_args
                    else:
                        args.append(_arg(item))
            keys += tail_keys
        return keys, args

    @classmethod
    def arity(cls) -> tuple[int, int, bool]:
        """How many fixed KEYS and ARGV the call sends, and whether more follow (EACH)."""
        layout = _layout(cls)
        return len(layout.keys), len(layout.args), bool(layout.each)


@dataclass(frozen=True, slots=True)
class _Layout:
    """A call type's field names by role, in field order."""

    keys: tuple[str, ...]
    args: tuple[str, ...]
    each: tuple[str, ...]
    bools: bool  # whether an ARGV field is a bool (sent as "1"/"0")
    # The hot path: every turn sends two calls, so the fields are read in C, as tuples.
    get_keys: Callable[[Any], Sequence[Any]]
    get_args: Callable[[Any], Sequence[Any]]


_LAYOUTS: dict[type[ScriptCall], _Layout] = {}


def _layout(cls: type[ScriptCall]) -> _Layout:
    """Read once per call type (the fields of a dataclass do not change)."""
    layout = _LAYOUTS.get(cls)
    if layout is None:
        fields = dataclasses.fields(cls)  # type: ignore[arg-type]
        role = {f.name: f.metadata.get("script", "") for f in fields}
        keys = tuple(name for name, r in role.items() if r == KEY["script"])
        args = tuple(name for name, r in role.items() if not r)
        layout = _Layout(
            keys=keys,
            args=args,
            each=tuple(name for name, r in role.items() if r == EACH["script"]),
            bools=any(f.type in {"bool", bool} for f in fields if f.name in args),
            get_keys=_getter(keys),
            get_args=_getter(args),
        )
        _LAYOUTS[cls] = layout
    return layout


def _getter(names: tuple[str, ...]) -> Callable[[Any], Sequence[Any]]:
    """The named attributes of an object, as a tuple (attrgetter of one name gives the value)."""
    if not names:
        return lambda _: ()
    get = operator.attrgetter(*names)
    if len(names) == 1:
        return lambda obj: (get(obj),)
    return get


def _arg(value: Any) -> ScriptArg:
    if value.__class__ is bool:
        return "1" if value else "0"
    return value  # type: ignore[no-any-return]


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
        self,
        redis: aioredis.Redis | PipelinedScripts,
        keys: Sequence[str],
        args: Sequence[ScriptArg] = (),
    ) -> Any:
        """EVALSHA; on NOSCRIPT (a restarted or failed-over Redis) EVAL, which caches it again.
        Through `PipelinedScripts`, in one round trip with the other scripts asked for at once."""
        try:
            return await redis.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await redis.eval(self.source, len(keys), *keys, *args)


@dataclass(frozen=True, slots=True)
class Script(Generic[CallT, ReplyT]):
    """One script's typed wrapper: its call type in, its reply parsed by `parse` out."""

    lua: LuaScript
    call: type[CallT]
    parse: Callable[[Any], ReplyT]

    @classmethod
    def load(cls, call: type[CallT], parse: Callable[[Any], ReplyT]) -> Script[CallT, ReplyT]:
        """`lua/<call.SCRIPT>.lua` of the service whose module declares `call`."""
        package = ".".join(call.__module__.split(".")[:2])
        return cls(LuaScript.load(package, call.SCRIPT), call, parse)

    async def run(self, redis: aioredis.Redis | PipelinedScripts, call: CallT) -> ReplyT:
        """Runs the script with `call`'s KEYS and ARGV; its reply, parsed."""
        keys, args = call.keys_and_args()
        return self.parse(await self.lua.run(redis, keys, args))

    def send(
        self,
        redis: PipelinedScripts,
        call: CallT,
        *,
        then: Callable[[Any], Any] | None = None,
        or_none: ErrorTypes = (),
    ) -> asyncio.Future[Any]:
        """EVALSHA on a pipelined connection, sent with what else this turn of the loop asks
        for: the future of its raw reply (`parse` it), without a coroutine; with `then`, of
        `then(raw reply)`, or None when the call fails with an `or_none` error
        (`PipelinedScripts.evalsha`). NOSCRIPT is an error: `run` falls back to EVAL."""
        keys, args = call.keys_and_args()
        return redis.evalsha(self.lua.sha, len(keys), *keys, *args, then=then, or_none=or_none)
