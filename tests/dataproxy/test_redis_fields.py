"""Hash field names are spelled once: Python reads and writes the dataproxy's hashes through the
constants in services/dataproxy/redis_keys.py, and every field a .lua script names literally
is one of those constants (the scripts cannot import them)."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

from services.dataproxy import redis_keys

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ROOT / "services"

# The hash commands and which of their arguments (after the key) are field names.
FIELD_ARGS = {
    "HGET": "first",
    "HEXISTS": "first",
    "HINCRBY": "first",
    "HINCRBYFLOAT": "first",
    "HSETNX": "first",
    "HSET": "pairs",
    "HMSET": "pairs",
    "HMGET": "all",
    "HDEL": "all",
}
CALL = re.compile(r"redis\.p?call\(\s*'(\w+)'\s*,")


def _declared() -> set[str]:
    names: set[str] = set()
    for name, value in vars(redis_keys).items():
        if name.endswith("Fields") and isinstance(value, type):
            names |= {v for k, v in vars(value).items() if k.isupper() and isinstance(v, str)}
    return names


def _arguments(source: str, start: int) -> list[str]:
    """The top-level arguments of the call whose first argument starts at `start`."""
    depth, args, current = 1, [], ""
    for char in source[start:]:
        if char in "({[":
            depth += 1
        elif char in ")}]":
            depth -= 1
        if depth == 0 or (char == "," and depth == 1):
            args.append(current.strip())
            current = ""
            if depth == 0:
                break
        else:
            current += char
    return args


def lua_fields(source: str) -> Iterator[tuple[str, str]]:
    """(command, field) for every field named by a string literal in a hash command."""
    for match in CALL.finditer(source):
        command = match.group(1).upper()
        if command not in FIELD_ARGS:
            continue
        rest = _arguments(source, match.end())[1:]  # after the key
        how = FIELD_ARGS[command]
        picked = rest[:1] if how == "first" else rest[0::2] if how == "pairs" else rest
        for arg in picked:
            literal = re.fullmatch(r"'([^']*)'", arg)
            if literal:
                yield command, literal.group(1)


def test_the_field_parser_reads_fields_not_values() -> None:
    source = (
        "redis.call('HSET', KEYS[1], 'state', 'active', 'epoch', tonumber(ARGV[1]))\n"
        "redis.call('HMGET', KEYS[2], 'a', 'b')\nredis.call('HGET', KEYS[3], ARGV[1])\n"
        "redis.call('ZADD', KEYS[4], 1, 'not_a_field')\n"
    )
    assert sorted(lua_fields(source)) == [
        ("HMGET", "a"),
        ("HMGET", "b"),
        ("HSET", "epoch"),
        ("HSET", "state"),
    ]


def test_every_field_a_script_names_is_a_declared_constant() -> None:
    declared = _declared()
    assert {"key_id", "state", "episode", "epoch", "last_interaction", "count"} <= declared
    seen: set[str] = set()
    for path in sorted(SERVICES.glob("*/lua/*.lua")):
        for command, name in lua_fields(path.read_text()):
            seen.add(name)
            assert name in declared, (
                f"{path.relative_to(ROOT)}: {command} of field {name!r}, which "
                "services/dataproxy/redis_keys.py does not declare"
            )
    assert len(seen) >= 40  # the parser found the scripts' fields


HASH_METHODS = {"hget", "hmget", "hset", "hincrby", "hincrbyfloat", "hdel", "hexists", "hsetnx"}


def _literal_fields(tree: ast.AST) -> Iterator[tuple[int, str]]:
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in HASH_METHODS
        ):
            continue
        for arg in node.args[1:]:
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                yield node.lineno, arg.value
        for keyword in node.keywords:
            if keyword.arg == "mapping" and isinstance(keyword.value, ast.Dict):
                for key in keyword.value.keys:
                    if isinstance(key, ast.Constant) and isinstance(key.value, str):
                        yield node.lineno, key.value


def test_python_names_hash_fields_by_their_constants() -> None:
    declared = _declared()
    for path in sorted((SERVICES / "dataproxy").glob("*.py")):
        for line, name in _literal_fields(ast.parse(path.read_text())):
            # A value (a hash value, e.g. a worker record) is not a field; only names are.
            assert name not in declared, (
                f"{path.relative_to(ROOT)}:{line}: field {name!r} spelled out; use its "
                "constant in services/dataproxy/redis_keys.py"
            )
