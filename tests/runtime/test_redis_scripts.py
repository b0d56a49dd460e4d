"""The Redis script contract: one loader, every script a `.lua` file beside the service that runs
it, one typed call per script whose KEYS and ARGV are the ones its `.lua` file reads, no service
running another's scripts, and a script still runs after Redis forgets it."""

from __future__ import annotations

import importlib
import pkgutil
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import redis.asyncio as aioredis

import services
from services.runtime.metrics import ClaimLeaseCall
from services.runtime.redis_scripts import EACH, KEY, Script, ScriptCall, ScriptStatus, as_bool

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ROOT / "services"


def _sources() -> dict[Path, str]:
    return {p: p.read_text() for p in SERVICES.rglob("*.py") if "_pb2" not in p.name}


def _script_calls() -> list[type[ScriptCall]]:
    """Every call type a service declares (its modules imported), one per `.lua` file."""
    for module in pkgutil.walk_packages(services.__path__, "services."):
        if not module.name.endswith("__main__"):
            importlib.import_module(module.name)
    found: list[type[ScriptCall]] = []
    todo = list(ScriptCall.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        # (slots=True makes a new class: the one left behind is not its module's)
        module = sys.modules[cls.__module__]
        ours = getattr(module, cls.__name__, None) is cls
        if cls.SCRIPT and module.__name__.startswith("services.") and ours:
            found.append(cls)
    return found


def _highest(source: str, name: str) -> int:
    """The highest KEYS[n] (or ARGV[n]) the script reads; 0 when none."""
    return max((int(n) for n in re.findall(rf"\b{name}\[(\d+)\]", source)), default=0)


def test_no_script_is_registered_ad_hoc_or_written_inline() -> None:
    for path, text in _sources().items():
        rel = path.relative_to(ROOT)
        assert "register_script" not in text, f"{rel}: use services.runtime.redis_scripts"
        assert "redis.call(" not in text, f"{rel}: Lua belongs in a .lua file beside the service"
        if rel.as_posix() != "services/runtime/redis_scripts.py":
            assert ".evalsha(" not in text, f"{rel}: run a Script"
            assert "LuaScript.load(" not in text, f"{rel}: Script.load(<its call type>, …)"


def test_each_script_has_one_typed_call_in_its_own_service_that_sends_what_it_reads() -> None:
    calls = _script_calls()
    on_disk = {
        p.relative_to(SERVICES).as_posix(): p.read_text() for p in SERVICES.glob("*/lua/*.lua")
    }
    declared: dict[str, type[ScriptCall]] = {}
    for call in calls:
        # Script.load reads the file from the package of the module declaring the call.
        path = f"{call.__module__.split('.')[1]}/lua/{call.SCRIPT}.lua"
        assert path not in declared, f"{path}: {declared[path].__name__} and {call.__name__}"
        declared[path] = call
    assert set(declared) == set(on_disk), "a .lua file without a call type, or the reverse"
    assert len(on_disk) >= 29
    for path, call in declared.items():
        source = on_disk[path]
        keys, args, more = call.arity()
        if more:
            # Repeated groups follow the fixed ones: the script reads at least those.
            assert _highest(source, "KEYS") >= keys and _highest(source, "ARGV") >= args, path
        else:
            assert (_highest(source, "KEYS"), _highest(source, "ARGV")) == (keys, args), (
                f"{path}: {call.__name__} sends {keys} KEYS and {args} ARGV"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class _Part(ScriptCall):
    hash: str = field(metadata=KEY)
    name: str


@dataclass(frozen=True, slots=True, kw_only=True)
class _Call(ScriptCall):
    SCRIPT = ""  # a test double: no file
    first: str = field(metadata=KEY)
    count: int
    second: str = field(metadata=KEY)
    flag: bool
    ratio: float
    parts: Sequence[_Part] = field(metadata=EACH)
    tail: Sequence[bytes] = field(metadata=EACH)


def test_a_call_sends_its_keys_then_its_arguments_in_field_order_then_each_group() -> None:
    call = _Call(
        first="k1",
        count=3,
        second="k2",
        flag=True,
        ratio=0.5,
        parts=[_Part(hash="h1", name="a"), _Part(hash="h2", name="b")],
        tail=[b"x", b"y"],
    )
    keys, args = call.keys_and_args()
    assert keys == ["k1", "k2", "h1", "h2"]
    assert args == [3, "1", 0.5, "a", "b", b"x", b"y"]
    assert _Call.arity() == (2, 3, True)


class _Echo(ScriptStatus):
    OK = "ok"
    GONE = "gone"


def test_a_status_parses_from_bytes_and_refuses_an_unlisted_one() -> None:
    assert _Echo.parse(b"ok") is _Echo.OK
    assert _Echo.parse("gone") is _Echo.GONE
    try:
        _Echo.parse(b"other")
    except ValueError:
        pass
    else:
        raise AssertionError("an unlisted status must not parse")


async def test_a_script_runs_again_after_redis_forgets_it(
    redis_client: aioredis.Redis, key_prefix: str
) -> None:
    script = Script.load(ClaimLeaseCall, as_bool)
    lease = f"{key_prefix}lease"
    assert await script.run(redis_client, ClaimLeaseCall(lease=lease, holder="me", ttl_ms=60_000))
    await redis_client.script_flush()
    # NOSCRIPT on EVALSHA: the loader sends the source again and Redis caches it anew.
    other = ClaimLeaseCall(lease=lease, holder="other", ttl_ms=60_000)
    assert not await script.run(redis_client, other)
    assert (await redis_client.script_exists(script.lua.sha)) == [True]


def test_script_replies_are_parsed_once_not_compared_as_strings() -> None:
    # Every module that runs a script gets a typed reply (mypy refuses to index one): a status
    # is an enum member (a hash field's value, e.g. an episode's state, is no reply).
    compared = re.compile(r"\b(status|reply|result)\s*(==|!=|\bin\b)\s*[b{\"']")
    callers = [
        (path, text)
        for path, text in _sources().items()
        if "Script.load(" in text or "self._scripts." in text
    ]
    assert len(callers) >= 14
    for path, text in callers:
        rel = path.relative_to(ROOT)
        assert not compared.search(text), f"{rel}: compare the parsed reply's enum status"
        assert "text_of(result" not in text and "_status(reply" not in text, rel
