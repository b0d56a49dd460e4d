"""Typed reading of a raw YAML section, naming the dotted field on every error; key fields."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import MISSING, fields
from typing import Any, TypeVar

from stackconfig.model import ConfigError

T = TypeVar("T")

_WHOLE_VAR_REF = re.compile(r"^\$\{([A-Za-z_][A-Za-z0-9_]*)\}$")


def join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def key_var(value: Any, where: str) -> str:
    """The variable name of a key field, which must be exactly `${VAR}`."""
    if value is None or value == "":
        return ""
    if isinstance(value, str):
        match = _WHOLE_VAR_REF.match(value.strip())
        if match:
            return match.group(1)
    raise ConfigError(
        f"{where} holds a literal key. Keys never live in configuration files (they end up in "
        f"git, in logs and in bug reports): put the key in an environment variable and write "
        f"{where}: ${{MY_API_KEY}} (e.g. `export MY_API_KEY=…`)"
    )


class FieldReader:
    """Reads typed values out of a raw section, naming the dotted field on every error."""

    def __init__(self, raw: Any, path: str) -> None:
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path or 'the file'} must be a mapping (key: value lines)")
        self.raw: dict[str, Any] = raw
        self.path = path
        self.used: set[str] = set()

    def where(self, name: str) -> str:
        return join(self.path, name)

    def get(self, name: str) -> Any:
        self.used.add(name)
        return self.raw.get(name)

    def string(self, name: str, default: str = "") -> str:
        value = self.get(name)
        if value is None:
            return default
        if isinstance(value, bool | dict | list):
            raise ConfigError(f"{self.where(name)} must be a string, not {value!r}")
        return str(value)

    def number(self, name: str) -> float | None:
        value = self.get(name)
        if value is None or value == "":
            return None
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{self.where(name)}={value!r} is not a number") from None
        if number <= 0:
            raise ConfigError(f"{self.where(name)}={value!r} must be positive")
        return number

    def integer(self, name: str, *, minimum: int = 1) -> int | None:
        value = self.get(name)
        if value is None or value == "":
            return None
        try:
            number = int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{self.where(name)}={value!r} is not an integer") from None
        if number < minimum or (isinstance(value, float) and value != number):
            raise ConfigError(f"{self.where(name)}={value!r} must be an integer ≥ {minimum}")
        return number

    def section(self, name: str) -> FieldReader:
        return FieldReader(self.get(name), self.where(name))

    def unknown(self) -> list[str]:
        return [self.where(k) for k in self.raw if k not in self.used]


def strings(value: Any, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return tuple(v.strip() for v in value.split(",") if v.strip())
    if isinstance(value, list) and all(isinstance(v, str | int | float) for v in value):
        return tuple(str(v) for v in value)
    raise ConfigError(f"{where} must be a list of model ids")


def resolve_key(var: str, environ: Mapping[str, str], where: str) -> str:
    if not var:
        return ""
    value = environ.get(var, "")
    if not value:
        raise ConfigError(f"{where} is ${{{var}}} but {var} is not set: export {var}=…")
    return value


def read_section(reader: FieldReader, cls: type[T], **given: Any) -> T:
    """The section dataclass `cls` from its raw mapping: each field read by its type (a
    number or an integer that may be left out, a string with the field's default; an
    integer field's `minimum` from its metadata); `given` fields come from the caller."""
    values = dict(given)
    for spec in fields(cls):  # type: ignore[arg-type]
        if spec.name in values:
            continue
        minimum = spec.metadata.get("minimum", 1)
        default = None if spec.default is MISSING else spec.default
        if spec.type == "float | None":
            values[spec.name] = reader.number(spec.name)
        elif spec.type == "int | None":
            values[spec.name] = reader.integer(spec.name, minimum=minimum)
        elif spec.type == "int":
            values[spec.name] = reader.integer(spec.name, minimum=minimum) or default
        elif spec.type == "str":
            values[spec.name] = reader.string(spec.name, default or "")
        else:
            raise TypeError(f"{cls.__name__}.{spec.name}: no reader for {spec.type}")
    return cls(**values)
