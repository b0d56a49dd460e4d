"""The rollgate YAML file (or an AReaL-style `config.yaml`): loaded, validated, and turned into
the `ROLLGATE_*` environment each service reads.

One file describes the whole stack. `${VAR}` (or `${VAR:-default}`) is expanded from the
environment; key fields (`admin_key`, `trainer_key`, `upstreams[].api_key`) must be a `${VAR}`
reference and keep the variable's *name*, so a key never lives in a file. Dotted overrides
(`worker.upstreams.0.base_url=http://…`) are applied before validation.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from stackconfig.kinds import DEFAULT_KIND, SGLANG_PATHS, UPSTREAM_KINDS, kinds_help

# The model name clients may send for "whatever this stack serves by default" (AReaL's scripts).
DEFAULT_MODEL_ALIAS = "default"
SERVICES = ("gateway", "router", "dataproxy", "worker")
_VAR_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
_WHOLE_VAR_REF = re.compile(r"^\$\{([A-Za-z_][A-Za-z0-9_]*)\}$")
_MODEL_LIST_HOSTS = ("platform.", "console.", "dashboard.", "www.")


class ConfigError(ValueError):
    """The configuration is wrong; the message says what and how to fix it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class UpstreamConfig:
    """One upstream LLM endpoint and the workers bound to it."""

    name: str
    kind: str = DEFAULT_KIND
    # Always ends in /v1.
    base_url: str
    # The *name* of the environment variable holding the key ("" when the upstream needs none).
    api_key_var: str = ""
    # Served model ids (empty: ask the upstream's /models at start-up).
    models: tuple[str, ...] = ()
    # (alias, served id): the name an agent is configured with → the id the upstream serves.
    aliases: tuple[tuple[str, str], ...] = ()
    # A local tokenizer.json: token ids for `openai`, input_ids for sglang's `generate` path.
    tokenizer: str = ""
    # sglang only: `chat` (OpenAI endpoint) or `generate` (native /generate, exact ids).
    sglang_path: str = "chat"
    workers: int = 2
    timeout_s: float = 600.0


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingConfig:
    """Defaults applied when a client leaves them out, and group sampling."""

    max_new_tokens: int | None = None
    temperature: float | None = None
    # G > 1: the worker asks the upstream for G samples per call; the agent gets sample 0.
    n_samples: int = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class GatewayConfig:
    """The HTTP gateway."""

    port: int = 8080
    max_body_bytes: int | None = None
    request_timeout_s: float | None = None
    # The HTTP edge's limits (docs/deploy.md).
    header_timeout_s: float | None = None
    body_timeout_s: float | None = None
    keepalive_timeout_s: float | None = None
    max_header_bytes: int | None = None
    max_headers: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RouterConfig:
    """The router."""

    address: str = "127.0.0.1:50051"
    worker_lease_s: float | None = None
    heartbeat_interval_s: float | None = None
    worker_forget_after_s: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class DataProxyConfig:
    """The dataproxy (and the Trainer service it serves)."""

    address: str = "127.0.0.1:50052"
    turn_timeout_s: float | None = None
    # Lifecycle (docs/lifecycle.md); None keeps the dataproxy's default.
    refresh_timeout_s: float | None = None
    session_idle_timeout_s: float | None = None
    pause_wait_s: float | None = None
    late_reward_timeout_s: float | None = None
    trainer_key_var: str = ""
    # Resolved from `trainer_key_var` at load time; never in repr.
    trainer_key: str = field(default="", repr=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class RolloutConfig:
    """Capacity settings of online RL (AReaL's names)."""

    batch_size: int | None = None
    max_head_offpolicyness: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RollgateConfig:
    """The whole stack's configuration, validated."""

    admin_key_var: str = ""
    # The admin key's value, resolved from `admin_key_var` at load time; never in repr.
    admin_key: str = field(default="", repr=False)
    redis_url: str = ""
    redis_prefix: str = ""
    log_level: str = ""
    gateway: GatewayConfig = GatewayConfig()
    router: RouterConfig = RouterConfig()
    dataproxy: DataProxyConfig = DataProxyConfig()
    upstreams: tuple[UpstreamConfig, ...] = ()
    # What `"model": "default"` means: a served id or alias; "" = the first upstream's first model.
    default_model: str = ""
    sampling: SamplingConfig = SamplingConfig()
    rollout: RolloutConfig = RolloutConfig()
    # "rollgate" or "areal": the file's flavour.
    style: str = "rollgate"
    # Dotted names of fields the file has but rollgate does not use (reported once).
    ignored: tuple[str, ...] = ()

    def upstream(self, name: str) -> UpstreamConfig:
        """The upstream called `name` (or with that index)."""
        for i, upstream in enumerate(self.upstreams):
            if name in (upstream.name, str(i)):
                return upstream
        names = ", ".join(u.name for u in self.upstreams) or "none"
        raise ConfigError(f"no upstream {name!r} in the configuration (upstreams: {names})")


# ----------------------------------------------------------------------------- base URLs


def normalize_base_url(raw: str, *, where: str = "base_url") -> str:
    """The API base URL (a bare host gets `/v1`), or ConfigError explaining what is wrong."""
    url = raw.strip().rstrip("/")
    parts = urlsplit(url)
    example = "e.g. http://127.0.0.1:8000/v1 or https://api.example.com/v1"
    if parts.username or parts.password:
        raise ConfigError(
            f"{where} has credentials in the URL: put the key in an environment variable "
            "and name it in `api_key: ${VAR}` instead"
        )
    if parts.scheme not in {"http", "https"} or not parts.netloc:
        raise ConfigError(f"{where}={raw!r} is not an http(s) URL ({example})")
    if parts.query or parts.fragment:
        raise ConfigError(
            f"{where}={raw!r} has a query string or fragment: this looks like a link copied "
            "from a web page (a marketing or sign-up link), not an API address. Use the "
            f"provider's API base URL from its documentation ({example})"
        )
    if parts.netloc.startswith(_MODEL_LIST_HOSTS) or url.endswith((".html", ".htm")):
        raise ConfigError(
            f"{where}={raw!r} looks like a website address, not an API address. Use the "
            f"OpenAI-compatible API base URL from the provider's documentation ({example})"
        )
    if url.endswith("/v1/v1"):
        raise ConfigError(f"{where}={raw!r} ends in /v1/v1: drop one /v1")
    if url.endswith(("/chat/completions", "/completions", "/generate")):
        raise ConfigError(
            f"{where}={raw!r} names an endpoint: give the base URL instead (drop the "
            f"endpoint path; {example})"
        )
    # A bare host gets the usual /v1; a base with its own path (…/v1, …/api/paas/v4,
    # …/v1beta/openai) is the provider's and is kept as given.
    return url + "/v1" if parts.path in {"", "/"} else url


# ----------------------------------------------------------------------------- raw YAML


def expand_vars(value: Any, environ: Mapping[str, str], *, path: str = "") -> Any:
    """`${VAR}` / `${VAR:-default}` expanded in every string of `value` (recursively)."""
    if isinstance(value, dict):
        return {k: expand_vars(v, environ, path=_join(path, str(k))) for k, v in value.items()}
    if isinstance(value, list):
        return [expand_vars(v, environ, path=_join(path, str(i))) for i, v in enumerate(value)]
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


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


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


def _key_var(value: Any, where: str) -> str:
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


# ----------------------------------------------------------------------------- typed reading


class _Reader:
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
        return _join(self.path, name)

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

    def section(self, name: str) -> _Reader:
        return _Reader(self.get(name), self.where(name))

    def unknown(self) -> list[str]:
        return [self.where(k) for k in self.raw if k not in self.used]


def _strings(value: Any, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return tuple(v.strip() for v in value.split(",") if v.strip())
    if isinstance(value, list) and all(isinstance(v, str | int | float) for v in value):
        return tuple(str(v) for v in value)
    raise ConfigError(f"{where} must be a list of model ids")


def _upstream(reader: _Reader, index: int) -> UpstreamConfig:
    where = reader.where
    kind = reader.string("kind", DEFAULT_KIND).lower()
    if kind not in UPSTREAM_KINDS:
        raise ConfigError(
            f"{where('kind')}={kind!r} is not one of {', '.join(UPSTREAM_KINDS)} ({kinds_help()})"
        )
    raw_base = reader.string("base_url")
    if not raw_base:
        raise ConfigError(f"{where('base_url')} is required (e.g. http://127.0.0.1:8000/v1)")
    aliases_raw = reader.get("aliases") or {}
    if not isinstance(aliases_raw, dict):
        raise ConfigError(f"{where('aliases')} must map alias → served model id")
    models = _strings(reader.get("models"), where("models"))
    aliases = tuple((str(a), str(m)) for a, m in aliases_raw.items())
    for alias, served in aliases:
        if models and served not in models:
            raise ConfigError(
                f"{where('aliases')}.{alias} points at {served!r}, which is not in "
                f"{where('models')} ({', '.join(models)}): add it there or fix the alias"
            )
    sglang_path = reader.string("sglang_path", "chat").lower()
    if sglang_path not in SGLANG_PATHS:
        raise ConfigError(f"{where('sglang_path')}={sglang_path!r} is not `chat` or `generate`")
    tokenizer = reader.string("tokenizer")
    if kind == "sglang" and sglang_path == "generate" and not tokenizer:
        raise ConfigError(
            f"{where('sglang_path')}=generate needs {where('tokenizer')}: the path of the "
            "model's tokenizer.json (the worker renders the chat template and sends input_ids)"
        )
    if tokenizer and not Path(tokenizer).is_file():
        raise ConfigError(
            f"{where('tokenizer')}={tokenizer!r} is not a file: give the path of a local "
            "tokenizer.json (rollgate never downloads one at run time)"
        )
    upstream = UpstreamConfig(
        name=reader.string("name", f"upstream-{index}"),
        kind=kind,
        base_url=normalize_base_url(raw_base, where=where("base_url")),
        api_key_var=_key_var(reader.get("api_key"), where("api_key")),
        models=models,
        aliases=aliases,
        tokenizer=tokenizer,
        sglang_path=sglang_path,
        workers=reader.integer("workers") or 2,
        timeout_s=reader.number("timeout_s") or 600.0,
    )
    unknown = reader.unknown()
    if unknown:
        raise ConfigError(
            f"unknown field(s) {', '.join(unknown)}: an upstream has name, kind, base_url, "
            "api_key, models, aliases, tokenizer, sglang_path, workers, timeout_s"
        )
    return upstream


def _sampling(reader: _Reader) -> SamplingConfig:
    return SamplingConfig(
        max_new_tokens=reader.integer("max_new_tokens"),
        temperature=_temperature(reader),
        n_samples=reader.integer("n_samples") or 1,
    )


def _temperature(reader: _Reader) -> float | None:
    value = reader.get("temperature")
    if value is None or value == "":
        return None
    try:
        temperature = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{reader.where('temperature')}={value!r} is not a number") from None
    if temperature < 0:
        raise ConfigError(f"{reader.where('temperature')}={value!r} must be ≥ 0")
    return temperature


def _from_rollgate(raw: dict[str, Any], environ: Mapping[str, str]) -> RollgateConfig:
    top = _Reader(raw, "")
    admin_key_var = _key_var(top.get("admin_key"), "admin_key")
    redis = top.section("redis")
    gateway = top.section("gateway")
    router = top.section("router")
    dataproxy = top.section("dataproxy")
    worker = top.section("worker")
    rollout = top.section("rollout")
    trainer_key_var = _key_var(dataproxy.get("trainer_key"), "dataproxy.trainer_key")
    upstreams_raw = worker.get("upstreams") or []
    if not isinstance(upstreams_raw, list):
        raise ConfigError("worker.upstreams must be a list (one `- name: …` entry per upstream)")
    upstreams = tuple(
        _upstream(_Reader(u, f"worker.upstreams.{i}"), i) for i, u in enumerate(upstreams_raw)
    )
    _check_unique(upstreams)
    default_model = worker.string("default_model")
    _check_default_model(upstreams, default_model)
    config = RollgateConfig(
        admin_key_var=admin_key_var,
        admin_key=_resolve(admin_key_var, environ, "admin_key"),
        redis_url=redis.string("url"),
        redis_prefix=redis.string("prefix"),
        log_level=top.string("log_level"),
        gateway=GatewayConfig(
            port=gateway.integer("port", minimum=0) or 8080,
            max_body_bytes=gateway.integer("max_body_bytes"),
            request_timeout_s=gateway.number("request_timeout_s"),
            header_timeout_s=gateway.number("header_timeout_s"),
            body_timeout_s=gateway.number("body_timeout_s"),
            keepalive_timeout_s=gateway.number("keepalive_timeout_s"),
            max_header_bytes=gateway.integer("max_header_bytes"),
            max_headers=gateway.integer("max_headers"),
        ),
        router=RouterConfig(
            address=router.string("address", "127.0.0.1:50051"),
            worker_lease_s=router.number("worker_lease_s"),
            heartbeat_interval_s=router.number("heartbeat_interval_s"),
            worker_forget_after_s=router.number("worker_forget_after_s"),
        ),
        dataproxy=DataProxyConfig(
            address=dataproxy.string("address", "127.0.0.1:50052"),
            turn_timeout_s=dataproxy.number("turn_timeout_s"),
            refresh_timeout_s=dataproxy.number("refresh_timeout_s"),
            session_idle_timeout_s=dataproxy.number("session_idle_timeout_s"),
            pause_wait_s=dataproxy.number("pause_wait_s"),
            late_reward_timeout_s=dataproxy.number("late_reward_timeout_s"),
            trainer_key_var=trainer_key_var,
            trainer_key=_resolve(trainer_key_var, environ, "dataproxy.trainer_key"),
        ),
        upstreams=upstreams,
        default_model=default_model,
        sampling=_sampling(worker.section("sampling")),
        rollout=RolloutConfig(
            batch_size=rollout.integer("batch_size"),
            max_head_offpolicyness=rollout.integer("max_head_offpolicyness", minimum=0),
        ),
        style="rollgate",
    )
    readers = (top, redis, gateway, router, dataproxy, worker, rollout)
    unknown = [name for reader in readers for name in reader.unknown()]
    if unknown:
        raise ConfigError(
            f"unknown field(s) {', '.join(unknown)}: check the spelling against "
            "rollgate.example.yaml"
        )
    return config


def _check_unique(upstreams: Sequence[UpstreamConfig]) -> None:
    seen: dict[str, str] = {}
    for upstream in upstreams:
        names = [*upstream.models, *(alias for alias, _ in upstream.aliases)]
        for name in names:
            if name in seen and seen[name] != upstream.name:
                raise ConfigError(
                    f"model {name!r} is listed by upstreams {seen[name]!r} and "
                    f"{upstream.name!r}: a model name picks one upstream, so list it once "
                    "(or give one of them an alias)"
                )
            seen[name] = upstream.name
    names = [u.name for u in upstreams]
    if len(set(names)) != len(names):
        raise ConfigError(f"upstream names must be unique (got {', '.join(names)})")


def _serves(upstream: UpstreamConfig, name: str) -> bool:
    return name in upstream.models or any(alias == name for alias, _ in upstream.aliases)


def _check_default_model(upstreams: Sequence[UpstreamConfig], default_model: str) -> None:
    """`worker.default_model` names a model some upstream can serve, and no other upstream
    already claims the name `default`."""
    explicit = [u.name for u in upstreams if _serves(u, DEFAULT_MODEL_ALIAS)]
    if default_model and explicit:
        raise ConfigError(
            f"worker.default_model={default_model!r}, but upstream {explicit[0]!r} already "
            f"serves a model named {DEFAULT_MODEL_ALIAS!r}: remove one of the two"
        )
    if not default_model or any(_serves(u, default_model) for u in upstreams):
        return
    if upstreams and all(u.models for u in upstreams):
        served = ", ".join(n for u in upstreams for n in (*u.models, *(a for a, _ in u.aliases)))
        raise ConfigError(
            f"worker.default_model={default_model!r} is not served by any upstream (served: "
            f"{served}): name one of those, or add it to an upstream's models"
        )


def _default_for(config: RollgateConfig, upstream: UpstreamConfig) -> tuple[bool, str]:
    """Whether this upstream's workers serve `default`, and as which model ("" = their first).

    An explicit model or alias named `default` wins; else `worker.default_model` goes to the
    upstream listing it (or to each upstream that asks its /models, which registers it only if
    it serves it); without one, the first upstream's first model.
    """
    if any(_serves(u, DEFAULT_MODEL_ALIAS) for u in config.upstreams):
        return False, ""
    wanted = config.default_model
    if wanted:
        if _serves(upstream, wanted) or not upstream.models:
            return True, wanted
        return False, ""
    first = config.upstreams[0] if config.upstreams else upstream
    return first.name == upstream.name, ""


def _resolve(var: str, environ: Mapping[str, str], where: str) -> str:
    if not var:
        return ""
    value = environ.get(var, "")
    if not value:
        raise ConfigError(f"{where} is ${{{var}}} but {var} is not set: export {var}=…")
    return value


# AReaL's fields that rollgate uses, by dotted name.
_AREAL_USED = frozenset(
    {
        "actor.path",
        "rollout.base_url",
        "rollout.api_key",
        "rollout.kind",
        "rollout.admin_api_key",
        "rollout.agent.admin_api_key",
        "rollout.max_head_offpolicyness",
        "rollout.request_timeout",
        "gconfig.max_new_tokens",
        "gconfig.temperature",
        "gconfig.n_samples",
        "train_dataset.batch_size",
    }
)


def _flatten(raw: Any, path: str = "") -> dict[str, Any]:
    if isinstance(raw, dict) and raw:
        out: dict[str, Any] = {}
        for key, value in raw.items():
            out.update(_flatten(value, _join(path, str(key))))
        return out
    return {path: raw}


# Sections only a rollgate file has: one of them makes the file a rollgate file, even when it
# also has AReaL's `rollout:` (rollgate reads `rollout.batch_size` and friends too).
_ROLLGATE_SECTIONS = frozenset(
    {"admin_key", "redis", "gateway", "router", "dataproxy", "worker", "log_level"}
)


def is_areal(raw: Mapping[str, Any]) -> bool:
    """True for an AReaL-style file: `actor`, `rollout`, `gconfig` or `train_dataset`, and
    none of rollgate's own sections."""
    areal = {"actor", "rollout", "gconfig", "train_dataset"}
    return bool(areal & raw.keys()) and not (_ROLLGATE_SECTIONS & raw.keys())


def _from_areal(raw: dict[str, Any], environ: Mapping[str, str]) -> RollgateConfig:
    flat = _flatten(raw)
    rollout = raw.get("rollout") or {}
    agent = rollout.get("agent") or {} if isinstance(rollout, dict) else {}
    gconfig = _Reader(raw.get("gconfig"), "gconfig")
    admin_raw = agent.get("admin_api_key") if isinstance(agent, dict) else None
    admin_where = "rollout.agent.admin_api_key"
    if admin_raw is None and isinstance(rollout, dict):
        admin_raw, admin_where = rollout.get("admin_api_key"), "rollout.admin_api_key"
    admin_key_var = _key_var(admin_raw, admin_where)
    rollout_reader = _Reader(rollout, "rollout")
    upstreams: tuple[UpstreamConfig, ...] = ()
    base_url = rollout_reader.string("base_url")
    if base_url:
        model = _Reader(raw.get("actor"), "actor").string("path")
        kind = rollout_reader.string("kind", "sglang" if "sglang" in raw else DEFAULT_KIND).lower()
        if kind not in UPSTREAM_KINDS:
            raise ConfigError(f"rollout.kind={kind!r} is not one of {', '.join(UPSTREAM_KINDS)}")
        upstreams = (
            UpstreamConfig(
                name="rollout",
                kind=kind,
                base_url=normalize_base_url(base_url, where="rollout.base_url"),
                api_key_var=_key_var(rollout_reader.get("api_key"), "rollout.api_key"),
                models=(model,) if model else (),
                timeout_s=rollout_reader.number("request_timeout") or 600.0,
            ),
        )
    return RollgateConfig(
        admin_key_var=admin_key_var,
        admin_key=_resolve(admin_key_var, environ, admin_where),
        upstreams=upstreams,
        sampling=_sampling(gconfig),
        rollout=RolloutConfig(
            batch_size=_Reader(raw.get("train_dataset"), "train_dataset").integer("batch_size"),
            max_head_offpolicyness=rollout_reader.integer("max_head_offpolicyness", minimum=0),
        ),
        style="areal",
        ignored=tuple(sorted(name for name in flat if name not in _AREAL_USED)),
    )


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
        raise ConfigError(f"{source} is not valid YAML: {err}") from None
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
        _from_areal(expanded, environ) if is_areal(expanded) else _from_rollgate(expanded, environ)
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


# ----------------------------------------------------------------------------- per service


def _put(env: dict[str, str], name: str, value: object) -> None:
    if value is None or value == "" or value == ():
        return
    env[name] = str(value)


def settings_env(
    config: RollgateConfig, service: str, *, upstream: str | None = None
) -> dict[str, str]:
    """The `ROLLGATE_*` variables `service` reads, from the configuration.

    Each service's `__main__` merges these *under* the real environment before
    `Settings.from_env`. A worker serves one upstream: `upstream` names it (or its index);
    it may be left out when the configuration has exactly one.
    """
    if service not in SERVICES:
        raise ConfigError(f"unknown service {service!r} (one of {', '.join(SERVICES)})")
    env: dict[str, str] = {}
    _put(env, "ROLLGATE_REDIS_URL", config.redis_url)
    _put(env, "ROLLGATE_REDIS_PREFIX", config.redis_prefix)
    _put(env, "ROLLGATE_LOG_LEVEL", config.log_level)
    if service in ("gateway", "dataproxy"):
        _put(env, "ROLLGATE_ADMIN_KEY", config.admin_key)
    if service == "gateway":
        _put(env, "ROLLGATE_ROUTER_ADDR", config.router.address)
        _put(env, "ROLLGATE_DATAPROXY_ADDR", config.dataproxy.address)
        _put(env, "ROLLGATE_MAX_BODY_BYTES", config.gateway.max_body_bytes)
        _put(env, "ROLLGATE_REQUEST_TIMEOUT_S", config.gateway.request_timeout_s)
        _put(env, "ROLLGATE_HEADER_TIMEOUT_S", config.gateway.header_timeout_s)
        _put(env, "ROLLGATE_BODY_TIMEOUT_S", config.gateway.body_timeout_s)
        _put(env, "ROLLGATE_KEEPALIVE_TIMEOUT_S", config.gateway.keepalive_timeout_s)
        _put(env, "ROLLGATE_MAX_HEADER_BYTES", config.gateway.max_header_bytes)
        _put(env, "ROLLGATE_MAX_HEADERS", config.gateway.max_headers)
        # start_session waits as long as the dataproxy's refresh does (plus a margin).
        _put(env, "ROLLGATE_REFRESH_TIMEOUT_S", config.dataproxy.refresh_timeout_s)
    elif service == "router":
        _put(env, "ROLLGATE_WORKER_LEASE_S", config.router.worker_lease_s)
        _put(env, "ROLLGATE_HEARTBEAT_INTERVAL_S", config.router.heartbeat_interval_s)
        _put(env, "ROLLGATE_WORKER_FORGET_AFTER_S", config.router.worker_forget_after_s)
    elif service == "dataproxy":
        _put(env, "ROLLGATE_TURN_TIMEOUT_S", config.dataproxy.turn_timeout_s)
        _put(env, "ROLLGATE_REFRESH_TIMEOUT_S", config.dataproxy.refresh_timeout_s)
        _put(env, "ROLLGATE_SESSION_IDLE_TIMEOUT_S", config.dataproxy.session_idle_timeout_s)
        _put(env, "ROLLGATE_PAUSE_WAIT_S", config.dataproxy.pause_wait_s)
        _put(env, "ROLLGATE_LATE_REWARD_TIMEOUT_S", config.dataproxy.late_reward_timeout_s)
        _put(env, "ROLLGATE_TRAINER_KEY", config.dataproxy.trainer_key)
        _put(env, "ROLLGATE_BATCH_SIZE", config.rollout.batch_size)
        _put(env, "ROLLGATE_MAX_HEAD_OFFPOLICYNESS", config.rollout.max_head_offpolicyness)
    else:
        env.update(worker_env(config, _pick_upstream(config, upstream)))
    return env


def _pick_upstream(config: RollgateConfig, name: str | None) -> UpstreamConfig:
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


def worker_env(config: RollgateConfig, upstream: UpstreamConfig) -> dict[str, str]:
    """The worker's `ROLLGATE_*` variables for one upstream (never the key itself)."""
    env: dict[str, str] = {}
    _put(env, "ROLLGATE_ROUTER_ADDR", config.router.address)
    _put(env, "ROLLGATE_UPSTREAM_NAME", upstream.name)
    _put(env, "ROLLGATE_UPSTREAM_BASE_URL", upstream.base_url)
    _put(env, "ROLLGATE_UPSTREAM_KIND", upstream.kind)
    _put(env, "ROLLGATE_UPSTREAM_API_KEY_VAR", upstream.api_key_var)
    _put(env, "ROLLGATE_UPSTREAM_MODELS", ",".join(upstream.models))
    _put(env, "ROLLGATE_UPSTREAM_ALIASES", ",".join(f"{a}={m}" for a, m in upstream.aliases))
    serve_default, default_model = _default_for(config, upstream)
    env["ROLLGATE_SERVE_DEFAULT_MODEL"] = "1" if serve_default else "0"
    _put(env, "ROLLGATE_DEFAULT_MODEL", default_model)
    _put(env, "ROLLGATE_UPSTREAM_TOKENIZER", upstream.tokenizer)
    if upstream.kind == "sglang":
        _put(env, "ROLLGATE_SGLANG_PATH", upstream.sglang_path)
    _put(env, "ROLLGATE_UPSTREAM_TIMEOUT_S", upstream.timeout_s)
    _put(env, "ROLLGATE_DEFAULT_MAX_TOKENS", config.sampling.max_new_tokens)
    _put(env, "ROLLGATE_DEFAULT_TEMPERATURE", config.sampling.temperature)
    if config.sampling.n_samples > 1:
        _put(env, "ROLLGATE_N_SAMPLES", config.sampling.n_samples)
    return env


def merged_environ(
    environ: Mapping[str, str], config_path: str | None, overrides: Sequence[str], service: str,
    *, upstream: str | None = None,
) -> dict[str, str]:  # fmt: skip
    """`environ` over the configuration's variables for `service` (no file: `environ` as is)."""
    if not config_path:
        if overrides:
            raise ConfigError("dotted overrides need --config FILE")
        return dict(environ)
    config = load_config(config_path, environ=environ, overrides=overrides, upstream_keys=False)
    if service == "worker":
        # Only the worker needs (and only it gets) its own upstream's key.
        check_upstream_key(config, _pick_upstream(config, upstream), environ)
    return {**settings_env(config, service, upstream=upstream), **environ}
