"""The `state` values of keys and episodes are named once (redis_keys.py): the Lua scripts
write and compare the same strings."""

from __future__ import annotations

import re
from pathlib import Path

from services.dataproxy.redis_keys import EpisodeFields, EpisodeStatus, KeyFields, KeyStatus

LUA = "\n".join(path.read_text() for path in sorted(Path("services/dataproxy/lua").glob("*.lua")))


def test_every_state_value_is_one_the_scripts_use() -> None:
    for value in [*EpisodeStatus, *KeyStatus]:
        assert f"'{value.value}'" in LUA, value


def test_every_state_the_scripts_write_is_a_named_value() -> None:
    # `'state', '<x>'` is a write (HSET) or two field names in a row (HMGET).
    fields = {v for c in (EpisodeFields, KeyFields) for k, v in vars(c).items() if k.isupper()}
    written = set(re.findall(r"'state', '([a-z_]+)'", LUA)) - fields
    assert written, "no state written: the pattern no longer matches the scripts"
    assert written <= {v.value for v in [*EpisodeStatus, *KeyStatus]}
