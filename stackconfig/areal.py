"""An AReaL-style `config.yaml` translated into a `RollgateConfig`: the fields rollgate uses,
each mapped onto the name it has in rollgate's own file; every other field is reported once
as ignored."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stackconfig.kinds import DEFAULT_KIND, UPSTREAM_KINDS
from stackconfig.model import ConfigError, RollgateConfig, RolloutConfig, UpstreamConfig
from stackconfig.reader import FieldReader, join, key_var, resolve_key
from stackconfig.rollgate_file import sampling
from stackconfig.urls import normalize_base_url

# AReaL's fields that rollgate uses, by dotted name → the name the same setting has in
# rollgate's own file (`upstream.*`: the one upstream an AReaL file describes). A dotted
# override of one of these wins over the environment as the rollgate name's would.
AREAL_NAMES: Mapping[str, str] = {
    "actor.path": "upstream.models",
    "rollout.base_url": "upstream.base_url",
    "rollout.api_key": "upstream.api_key",
    "rollout.kind": "upstream.kind",
    "rollout.admin_api_key": "admin_key",
    "rollout.agent.admin_api_key": "admin_key",
    "rollout.max_head_offpolicyness": "rollout.max_head_offpolicyness",
    "rollout.request_timeout": "upstream.timeout_s",
    "gconfig.max_new_tokens": "worker.sampling.max_new_tokens",
    "gconfig.temperature": "worker.sampling.temperature",
    "gconfig.n_samples": "worker.sampling.n_samples",
    "train_dataset.batch_size": "rollout.batch_size",
}


def _flatten(raw: Any, path: str = "") -> dict[str, Any]:
    if isinstance(raw, dict) and raw:
        out: dict[str, Any] = {}
        for key, value in raw.items():
            out.update(_flatten(value, join(path, str(key))))
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


def from_areal(raw: dict[str, Any], environ: Mapping[str, str]) -> RollgateConfig:
    flat = _flatten(raw)
    rollout = raw.get("rollout") or {}
    agent = rollout.get("agent") or {} if isinstance(rollout, dict) else {}
    gconfig = FieldReader(raw.get("gconfig"), "gconfig")
    admin_raw = agent.get("admin_api_key") if isinstance(agent, dict) else None
    admin_where = "rollout.agent.admin_api_key"
    if admin_raw is None and isinstance(rollout, dict):
        admin_raw, admin_where = rollout.get("admin_api_key"), "rollout.admin_api_key"
    admin_key_var = key_var(admin_raw, admin_where)
    rollout_reader = FieldReader(rollout, "rollout")
    upstreams: tuple[UpstreamConfig, ...] = ()
    base_url = rollout_reader.string("base_url")
    if base_url:
        model = FieldReader(raw.get("actor"), "actor").string("path")
        kind = rollout_reader.string("kind", "sglang" if "sglang" in raw else DEFAULT_KIND).lower()
        if kind not in UPSTREAM_KINDS:
            raise ConfigError(f"rollout.kind={kind!r} is not one of {', '.join(UPSTREAM_KINDS)}")
        upstreams = (
            UpstreamConfig(
                name="rollout",
                kind=kind,
                base_url=normalize_base_url(base_url, where="rollout.base_url"),
                api_key_var=key_var(rollout_reader.get("api_key"), "rollout.api_key"),
                models=(model,) if model else (),
                timeout_s=rollout_reader.number("request_timeout") or 600.0,
            ),
        )
    return RollgateConfig(
        admin_key_var=admin_key_var,
        admin_key=resolve_key(admin_key_var, environ, admin_where),
        upstreams=upstreams,
        sampling=sampling(gconfig),
        rollout=RolloutConfig(
            batch_size=FieldReader(raw.get("train_dataset"), "train_dataset").integer("batch_size"),
            max_head_offpolicyness=rollout_reader.integer("max_head_offpolicyness", minimum=0),
        ),
        style="areal",
        ignored=tuple(sorted(name for name in flat if name not in AREAL_NAMES)),
    )
