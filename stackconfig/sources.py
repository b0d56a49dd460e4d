"""Where a service's settings come from, merged in one place with one precedence.

A setting is named twice at most: its environment variable (`ROLLGATE_…`, what the docs and
the manifests set) and its dotted name in the configuration file (`dataproxy.pause_wait_s`).
`Sources.pick` decides, for every setting of every service:

1. a dotted override on the command line (`python -m services.X --config F name=value`);
2. else the environment variable, when it is set and not empty;
3. else the file's value, when the file sets it;
4. else the setting's default (written once, on the service's settings dataclass).

The file's values keep their types (the file was validated when it was read): nothing is
turned into a string and parsed back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from types import MappingProxyType
from typing import Any, TypeVar

from stackconfig.areal import AREAL_NAMES
from stackconfig.loading import check_upstream_key, load_config
from stackconfig.model import SERVICES, ConfigError, RollgateConfig, UpstreamConfig

T = TypeVar("T")
_EMPTY: Mapping[str, Any] = MappingProxyType({})


def env_str(environ: Mapping[str, str], name: str, default: str) -> str:
    """`environ[name]`, or `default` when unset or empty."""
    value = environ.get(name, "").strip()
    return value or default


def env_float(environ: Mapping[str, str], name: str, default: float) -> float:
    """A float setting, with a message naming the variable when it does not parse."""
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None


def env_int(environ: Mapping[str, str], name: str, default: int) -> int:
    """An integer setting, with a message naming the variable when it does not parse."""
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


def env_bool(environ: Mapping[str, str], name: str, default: bool) -> bool:
    """A yes/no setting (1/0, true/false, yes/no, on/off)."""
    raw = environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in {"1", "true", "yes", "on"}:
        return True
    if raw in {"0", "false", "no", "off"}:
        return False
    raise ValueError(f"{name}={raw!r} is not a yes/no value")


@dataclass(frozen=True, slots=True, kw_only=True)
class Sources:
    """The environment, the file's values by dotted name, and the names overridden on the
    command line: what one service's settings are read from."""

    environ: Mapping[str, str]
    file: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)
    overridden: frozenset[str] = frozenset()

    @classmethod
    def of(cls, source: Mapping[str, str] | Sources) -> Sources:
        """`source` itself, or the environment `source` alone (no file)."""
        return source if isinstance(source, Sources) else cls(environ=source)

    def pick(self, env: str, file: str = "") -> tuple[str, Any]:
        """`("file", value)`, `("env", raw text)` or `("", None)`: the precedence, once."""
        value = self.file.get(file) if file else None
        given = value is not None and value != "" and value != ()
        if given and file in self.overridden:
            return "file", value
        raw = self.environ.get(env, "").strip()
        if raw:
            return "env", raw
        return ("file", value) if given else ("", None)

    def get(self, env: str, default: T, *, parse: Callable[[str], T], file: str = "") -> T:
        """The setting: `parse(raw)` of the variable, the file's (typed) value, or `default`."""
        where, value = self.pick(env, file)
        if where == "env":
            return parse(value)
        return value if where == "file" else default

    def text(self, env: str, default: str = "", *, file: str = "") -> str:
        """A string setting."""
        return self.get(env, default, file=file, parse=str)

    def number(self, env: str, default: float, *, file: str = "") -> float:
        """A float setting; the error names the variable."""
        value = self.get(env, default, file=file, parse=lambda raw: env_float({env: raw}, env, 0))
        return float(value)

    def positive(self, env: str, default: float, *, file: str = "") -> float:
        """A float setting that must be positive; the error names the variable."""
        value = self.number(env, default, file=file)
        if value <= 0:
            raise ValueError(f"{env}={value} must be positive")
        return value

    def integer(self, env: str, default: int, *, file: str = "") -> int:
        """An integer setting; the error names the variable."""
        return self.get(env, default, file=file, parse=lambda raw: env_int({env: raw}, env, 0))

    def flag(self, env: str, default: bool, *, file: str = "") -> bool:
        """A yes/no setting."""
        return self.get(env, default, file=file, parse=lambda raw: env_bool({env: raw}, env, False))

    def is_set(self, env: str, *, file: str = "") -> bool:
        """True when the variable or the file gives the setting a value."""
        return self.pick(env, file)[0] != ""


# ----------------------------------------------------------------------------- the file's values

# Top-level fields of `RollgateConfig` whose dotted name in the file differs.
_TOP_NAMES = {"redis_url": "redis.url", "redis_prefix": "redis.prefix"}
# Sections of `RollgateConfig` and where they sit in the file.
_SECTIONS = {
    "gateway": "gateway",
    "router": "router",
    "dataproxy": "dataproxy",
    "rollout": "rollout",
    "sampling": "worker.sampling",
}
# The file's name → the field's, where they differ (an upstream's key field holds a name).
_FIELD_NAMES = {"upstream.api_key": "upstream.api_key_var"}
# Fields that name an environment variable rather than hold a value (the value is resolved).
_VAR_FIELDS = frozenset({"admin_key_var", "trainer_key_var"})


def file_values(config: RollgateConfig, upstream: UpstreamConfig | None = None) -> dict[str, Any]:
    """The file's settings by their dotted names in rollgate's own file; the upstream a
    worker serves as `upstream.*` (with `upstream.serves_default` / `upstream.default_model`
    worked out from `worker.default_model` and the other upstreams)."""
    values: dict[str, Any] = {
        "admin_key": config.admin_key,
        "log_level": config.log_level,
        "worker.default_model": config.default_model,
    }
    values.update((dotted, getattr(config, name)) for name, dotted in _TOP_NAMES.items())
    for name, prefix in _SECTIONS.items():
        values.update(_flat(getattr(config, name), prefix))
    if upstream is not None:
        values.update(_flat(upstream, "upstream"))
        if upstream.kind != "sglang":
            # Only SGLang has paths; any other kind's worker ignores the field.
            values.pop("upstream.sglang_path")
        serves_default, default_model = config.default_for(upstream)
        values["upstream.serves_default"] = serves_default
        values["upstream.default_model"] = default_model
    return values


def _flat(section: Any, prefix: str) -> dict[str, Any]:
    assert is_dataclass(section)
    return {
        f"{prefix}.{f.name}": getattr(section, f.name)
        for f in fields(section)
        if f.name not in _VAR_FIELDS
    }


def _overridden(config: RollgateConfig, upstream: UpstreamConfig | None) -> frozenset[str]:
    """The dotted names the command line set, as `file_values` names them."""
    names: set[str] = set()
    index = config.upstreams.index(upstream) if upstream is not None else -1
    for override in config.overrides:
        dotted = override.partition("=")[0].strip()
        if config.style == "areal":
            dotted = AREAL_NAMES.get(dotted, dotted)
        head, _, rest = dotted.partition(".upstreams.")
        if head == "worker" and rest:
            number, _, name = rest.partition(".")
            if number != str(index):
                continue
            # `…aliases.qwen=…` sets the field `aliases`.
            dotted = "upstream." + name.partition(".")[0]
        names.add(_FIELD_NAMES.get(dotted, dotted))
    return frozenset(names)


def pick_upstream(config: RollgateConfig, name: str | None) -> UpstreamConfig:
    """The upstream a worker serves: `name` (or index), or the only one."""
    if name is not None:
        return config.upstream(name)
    if len(config.upstreams) == 1:
        return config.upstreams[0]
    if not config.upstreams:
        raise ConfigError(
            "the configuration has no upstream: add one under worker.upstreams "
            "(see rollgate.example.yaml)"
        )
    names = ", ".join(u.name for u in config.upstreams)
    raise ConfigError(
        f"the configuration has several upstreams ({names}): tell the worker which one it "
        "serves with --upstream NAME"
    )


def sources_for(
    service: str,
    *,
    environ: Mapping[str, str],
    config_path: str | None = None,
    overrides: Sequence[str] = (),
    upstream: str | None = None,
    text: str | None = None,
) -> Sources:
    """What `service` reads its settings from: `environ`, and the file (with `overrides`)
    when one is given. A worker serves one upstream: `upstream` names it (or its index); it
    may be left out when the file has exactly one. Only a worker checks an upstream key, and
    only its own upstream's."""
    if service not in SERVICES:
        raise ConfigError(f"unknown service {service!r} (one of {', '.join(SERVICES)})")
    if not config_path and text is None:
        if overrides:
            raise ConfigError("dotted overrides need --config FILE")
        return Sources(environ=environ)
    config = load_config(
        config_path, environ=environ, overrides=overrides, text=text, upstream_keys=False
    )
    served = None
    if service == "worker":
        served = pick_upstream(config, upstream)
        check_upstream_key(config, served, environ)
    return Sources(
        environ=environ,
        file=MappingProxyType(file_values(config, served)),
        overridden=_overridden(config, served),
    )
