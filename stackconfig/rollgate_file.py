"""rollgate's own file format (rollgate.example.yaml) read into a `RollgateConfig`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from stackconfig.kinds import DEFAULT_KIND, SGLANG_PATHS, UPSTREAM_KINDS, kinds_help
from stackconfig.model import (
    DEFAULT_MODEL_ALIAS,
    ConfigError,
    DataProxyConfig,
    GatewayConfig,
    RollgateConfig,
    RolloutConfig,
    RouterConfig,
    SamplingConfig,
    UpstreamConfig,
)
from stackconfig.reader import FieldReader, key_var, read_section, resolve_key, strings
from stackconfig.urls import normalize_base_url


def _upstream(reader: FieldReader, index: int) -> UpstreamConfig:
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
    models = strings(reader.get("models"), where("models"))
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
        api_key_var=key_var(reader.get("api_key"), where("api_key")),
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


def sampling(reader: FieldReader) -> SamplingConfig:
    return SamplingConfig(
        max_new_tokens=reader.integer("max_new_tokens"),
        temperature=_temperature(reader),
        n_samples=reader.integer("n_samples") or 1,
    )


def _temperature(reader: FieldReader) -> float | None:
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


def from_rollgate(raw: dict[str, Any], environ: Mapping[str, str]) -> RollgateConfig:
    top = FieldReader(raw, "")
    admin_key_var = key_var(top.get("admin_key"), "admin_key")
    redis = top.section("redis")
    gateway = top.section("gateway")
    router = top.section("router")
    dataproxy = top.section("dataproxy")
    worker = top.section("worker")
    rollout = top.section("rollout")
    trainer_key_var = key_var(dataproxy.get("trainer_key"), "dataproxy.trainer_key")
    upstreams_raw = worker.get("upstreams") or []
    if not isinstance(upstreams_raw, list):
        raise ConfigError("worker.upstreams must be a list (one `- name: …` entry per upstream)")
    upstreams = tuple(
        _upstream(FieldReader(u, f"worker.upstreams.{i}"), i) for i, u in enumerate(upstreams_raw)
    )
    _check_unique(upstreams)
    default_model = worker.string("default_model")
    _check_default_model(upstreams, default_model)
    config = RollgateConfig(
        admin_key_var=admin_key_var,
        admin_key=resolve_key(admin_key_var, environ, "admin_key"),
        redis_url=redis.string("url"),
        redis_prefix=redis.string("prefix"),
        log_level=top.string("log_level"),
        gateway=read_section(gateway, GatewayConfig),
        router=read_section(router, RouterConfig),
        dataproxy=read_section(
            dataproxy,
            DataProxyConfig,
            trainer_key_var=trainer_key_var,
            trainer_key=resolve_key(trainer_key_var, environ, "dataproxy.trainer_key"),
        ),
        upstreams=upstreams,
        default_model=default_model,
        sampling=sampling(worker.section("sampling")),
        rollout=read_section(rollout, RolloutConfig),
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


def _check_default_model(upstreams: Sequence[UpstreamConfig], default_model: str) -> None:
    """`worker.default_model` names a model some upstream can serve, and no other upstream
    already claims the name `default`."""
    explicit = [u.name for u in upstreams if u.serves(DEFAULT_MODEL_ALIAS)]
    if default_model and explicit:
        raise ConfigError(
            f"worker.default_model={default_model!r}, but upstream {explicit[0]!r} already "
            f"serves a model named {DEFAULT_MODEL_ALIAS!r}: remove one of the two"
        )
    if not default_model or any(u.serves(default_model) for u in upstreams):
        return
    if upstreams and all(u.models for u in upstreams):
        served = ", ".join(n for u in upstreams for n in (*u.models, *(a for a, _ in u.aliases)))
        raise ConfigError(
            f"worker.default_model={default_model!r} is not served by any upstream (served: "
            f"{served}): name one of those, or add it to an upstream's models"
        )
