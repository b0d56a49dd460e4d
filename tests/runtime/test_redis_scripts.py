"""The Redis script contract: one loader, every script a `.lua` file beside the service that runs
it, no service running another's scripts, and a script still runs after Redis forgets it."""

from __future__ import annotations

import re
from pathlib import Path

import redis.asyncio as aioredis

from services.runtime.redis_scripts import LuaScript, ScriptStatus

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ROOT / "services"
LOAD = re.compile(r'LuaScript\.load\(\s*"(services\.\w+)",\s*"(\w+)"\s*\)')


def _sources() -> dict[Path, str]:
    return {p: p.read_text() for p in SERVICES.rglob("*.py") if "_pb2" not in p.name}


def test_no_script_is_registered_ad_hoc_or_written_inline() -> None:
    for path, text in _sources().items():
        rel = path.relative_to(ROOT)
        assert "register_script" not in text, f"{rel}: use services.runtime.redis_scripts"
        assert "redis.call(" not in text, f"{rel}: Lua belongs in a .lua file beside the service"
        assert ".evalsha(" not in text or rel.as_posix() == "services/runtime/redis_scripts.py"


def test_each_script_is_loaded_by_its_own_service_and_exists() -> None:
    loaded: set[Path] = set()
    for path, text in _sources().items():
        service = path.relative_to(SERVICES).parts[0]
        for package, name in LOAD.findall(text):
            # The dataproxy names its package once (services/dataproxy/scripts.py).
            assert package == f"services.{service}", f"{path}: runs {package}'s script {name}"
            loaded.add(SERVICES / service / "lua" / f"{name}.lua")
        if service == "dataproxy":
            for name in re.findall(r'\bload\("(\w+)"\)', text):
                loaded.add(SERVICES / "dataproxy" / "lua" / f"{name}.lua")
    on_disk = set(SERVICES.glob("*/lua/*.lua"))
    assert loaded - on_disk == set(), "loaded but missing"
    assert on_disk - loaded == set(), "a .lua file no service loads"
    assert len(on_disk) >= 29


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
    script = LuaScript.load("services.runtime", "claim_exporter_lease")
    key = f"{key_prefix}lease"
    assert int(await script.run(redis_client, [key], ["me", 60_000])) == 1
    await redis_client.script_flush()
    # NOSCRIPT on EVALSHA: the loader sends the source again and Redis caches it anew.
    assert int(await script.run(redis_client, [key], ["other", 60_000])) == 0
    assert (await redis_client.script_exists(script.sha)) == [True]


def test_script_statuses_are_compared_as_members_not_bytes() -> None:
    # The callers of the typed replies in services/dataproxy/scripts.py (a hash field's value,
    # e.g. an episode's state, is not a script status).
    callers = ("turn_store.py", "rewards.py", "revocation.py", "access_keys.py")
    status = re.compile(r'\bstatus\s*[!=]=\s*b"')
    for name in callers:
        text = (SERVICES / "dataproxy" / name).read_text()
        assert not status.search(text), f"services/dataproxy/{name}: parse the reply (scripts.py)"
