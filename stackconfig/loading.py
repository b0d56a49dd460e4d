"""Loading the file: read, dotted overrides applied, `${VAR}` expanded (key fields keep the
variable's *name*), then read as rollgate's own format or AReaL's.

One file describes the whole stack. `${VAR}` (or `${VAR:-default}`) is expanded from the
environment; key fields (`admin_key`, `trainer_key`, `upstreams[].api_key`) must be a `${VAR}`
reference and keep the variable's *name*, so a key never lives in a file. Dotted overrides
(`worker.upstreams.0.base_url=http://…`) are applied before validation.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from stackconfig.areal import from_areal, is_areal
from stackconfig.model import ConfigError, RollgateConfig, UpstreamConfig
from stackconfig.reader import join
from stackconfig.rollgate_file import from_rollgate

_VAR_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def expand_vars(value: Any, environ: Mapping[str, str], *, path: str = "") -> Any:
    """`${VAR}` / `${VAR:-default}` expanded in every string of `value` (recursively)."""
    if isinstance(value, dict):
        return {k: expand_vars(v, environ, path=join(path, str(k))) for k, v in value.items()}
    if isinstance(value, list):
        return [expand_vars(v, environ, path=join(path, str(i))) for i, v in enumerate(value)]
    if not isinstance(value, str):
        return value

    def replace(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        if name in environ:
            return environ[name]
        if default is not None:
            return default
        raise ConfigError(
            f"{path} uses ${{{name}}} but {name} is not set in the environment: "
            f"export {name}=… or write ${{{name}:-default}}"
        )

    return _VAR_REF.sub(replace, value)


def apply_override(raw: dict[str, Any], override: str) -> None:
    """Applies one `a.b.0.c=value` override (value parsed as YAML) to the raw tree in place."""
    dotted, sep, text = override.partition("=")
    if not sep or not dotted.strip():
        raise ConfigError(
            f"override {override!r} is not `dotted.name=value` "
            "(e.g. worker.upstreams.0.base_url=http://127.0.0.1:8000/v1)"
        )
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text
    names = dotted.strip().split(".")
    node: Any = raw
    for i, name in enumerate(names):
        last = i == len(names) - 1
        if isinstance(node, list):
            if not name.isdigit() or int(name) > len(node):
                raise ConfigError(
                    f"override {dotted}: {'.'.join(names[:i])} has {len(node)} entries; "
                    f"{name!r} is not an index from 0 to {len(node)}"
                )
            index = int(name)
            if index == len(node):
                node.append({} if not last else value)
            if last:
                node[index] = value
            node = node[index]
        elif isinstance(node, dict):
            if last:
                node[name] = value
            else:
                node = node.setdefault(name, [] if names[i + 1].isdigit() else {})
        else:
            raise ConfigError(f"override {dotted}: {'.'.join(names[:i])} is not a section")


def load_config(
    path: str | Path | None = None,
    *,
    environ: Mapping[str, str],
    overrides: Sequence[str] = (),
    text: str | None = None,
    upstream_keys: bool = True,
) -> RollgateConfig:
    """The validated configuration of a YAML file (or `text`), overrides applied.

    With `upstream_keys` (the default: `rollgate up`, `check-upstream`) every upstream's
    `api_key: ${VAR}` must name a variable that is set in `environ`; a service that never
    sees the upstream keys (gateway, router, dataproxy) loads with `upstream_keys=False`.
    """
    source = str(path) if path is not None else "<text>"
    if text is None:
        if path is None:
            raise ConfigError("no configuration file given")
        try:
            text = Path(path).read_text()
        except OSError as err:
            raise ConfigError(f"cannot read the configuration {source}: {err.strerror}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{source} is not valid YAML: {_yaml_problem(err)}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source} must be a YAML mapping (key: value lines) at the top")
    for override in overrides:
        apply_override(raw, override)
    keys = _key_fields(raw)
    expanded = expand_vars(_without(raw, keys), environ)
    _restore(expanded, keys)
    config = (
        from_areal(expanded, environ) if is_areal(expanded) else from_rollgate(expanded, environ)
    )
    # What it was read from, so a launcher can hand the same file to each service.
    config = replace(
        config, path=str(path) if path is not None else "", text=text, overrides=tuple(overrides)
    )
    if upstream_keys:
        for upstream in config.upstreams:
            check_upstream_key(config, upstream, environ)
    return config


def check_upstream_key(
    config: RollgateConfig, upstream: UpstreamConfig, environ: Mapping[str, str]
) -> None:
    """ConfigError naming the variable when the upstream's `api_key: ${VAR}` is not set."""
    var = upstream.api_key_var
    if not var or environ.get(var, ""):
        return
    index = config.upstreams.index(upstream)
    where = "rollout.api_key" if config.style == "areal" else f"worker.upstreams.{index}.api_key"
    raise ConfigError(
        f"{where} is ${{{var}}} (the key of upstream {upstream.name!r}) but {var} is not set "
        f"in the environment: `export {var}=<the key>` in the shell that runs rollgate (or "
        f"the worker), or remove api_key if {upstream.base_url} needs no key"
    )


# Key fields keep their `${VAR}` text through expansion: the loader needs the variable's name.
_KEY_FIELD_NAMES = frozenset({"admin_key", "trainer_key", "api_key", "admin_api_key"})


def _key_fields(raw: Any, path: tuple[Any, ...] = ()) -> dict[tuple[Any, ...], Any]:
    found: dict[tuple[Any, ...], Any] = {}
    if isinstance(raw, dict):
        for key, value in raw.items():
            if key in _KEY_FIELD_NAMES and not isinstance(value, dict | list):
                found[(*path, key)] = value
            else:
                found.update(_key_fields(value, (*path, key)))
    elif isinstance(raw, list):
        for i, value in enumerate(raw):
            found.update(_key_fields(value, (*path, i)))
    return found


def _without(raw: Any, keys: Mapping[tuple[Any, ...], Any]) -> Any:
    if not keys:
        return raw
    copy = yaml.safe_load(yaml.safe_dump(raw))
    for path in keys:
        node = copy
        for name in path[:-1]:
            node = node[name]
        node[path[-1]] = None
    return copy


def _restore(expanded: Any, keys: Mapping[tuple[Any, ...], Any]) -> None:
    for path, value in keys.items():
        node = expanded
        for name in path[:-1]:
            node = node[name]
        node[path[-1]] = value


def _yaml_problem(err: yaml.YAMLError) -> str:
    """One line: what the YAML parser found and where (line and column, 1-based)."""
    problem = getattr(err, "problem", None) or str(err)
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return " ".join(f"{problem}{where}".split())
