"""How ZeroClaw reads its config.toml, as far as rollgate's example files need it.

The facts are those of ../shared/reference/clients_2026.md (zeroclaw-labs/zeroclaw @ 15d2866,
`crates/zeroclaw-config/src/schema.rs`, `compatible.rs::chat_completions_url`): schema v3 keeps
providers under `[providers.models.<slot>.<alias>]` and an agent names one as `<slot>.<alias>`;
a legacy (v1) file is migrated on load, where `default_provider = "custom:<url>"` becomes a
`custom` provider and a named `[model_providers.<name>]` profile lands in the slot `<name>`,
which v3 drops unless it is a slot it knows.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The slots a v3 file can use: `custom` (any OpenAI-compatible endpoint), the hosted families,
# and the local servers that have a default URI.
KNOWN_SLOTS = frozenset(
    {"custom", "openai", "sglang", "vllm", "llamacpp", "lmstudio", "osaurus", "litellm"}
)
# ModelProviderConfig's fields.
PROVIDER_FIELDS = frozenset(
    {
        "uri",
        "api_key",
        "model",
        "wire_api",
        "kind",
        "temperature",
        "timeout_secs",
        "extra_headers",
        "max_tokens",
        "fallback",
        "fallback_models",
        "merge_system_into_user",
        "provider_extra",
        "requires_openai_auth",
    }
)
WIRE_APIS = ("chat_completions", "responses")


@dataclass(frozen=True, slots=True, kw_only=True)
class Provider:
    """What the agent's requests are built from."""

    slot: str
    uri: str
    api_key: str
    model: str
    wire_api: str = "chat_completions"
    extra_headers: dict[str, str] = field(default_factory=dict)

    def chat_completions_url(self) -> str:
        """`uri` + /chat/completions, unless `uri` already ends with it."""
        uri = self.uri.rstrip("/")
        return uri if uri.endswith("/chat/completions") else uri + "/chat/completions"


def load(path: Path) -> dict[str, Any]:
    """The file as TOML."""
    with path.open("rb") as f:
        return tomllib.load(f)


def migrate_legacy(legacy: dict[str, Any]) -> dict[str, Any]:
    """The v3 document a v1 file becomes (only the provider part)."""
    if legacy.get("schema_version", 1) >= 3:
        return legacy
    default_provider = str(legacy.get("default_provider", ""))
    models: dict[str, dict[str, Any]] = {}
    if default_provider.startswith("custom:"):
        slot, entry = "custom", {"uri": default_provider.removeprefix("custom:")}
    else:
        profile = legacy.get("model_providers", {}).get(default_provider, {})
        slot = default_provider
        entry = {"uri": profile.get("base_url", "")}
        if "wire_api" in profile:
            entry["wire_api"] = profile["wire_api"]
    entry |= {"api_key": legacy.get("api_key", ""), "model": legacy.get("default_model", "")}
    models[slot] = {"default": entry}
    return {
        "schema_version": 3,
        "providers": {"models": models},
        "agents": {"main": {"model_provider": f"{slot}.default"}},
    }


def providers(config: dict[str, Any]) -> dict[str, Provider]:
    """Every provider v3 keeps, by `<slot>.<alias>`; unknown slots are dropped (silently)."""
    out: dict[str, Provider] = {}
    for slot, aliases in config.get("providers", {}).get("models", {}).items():
        if slot not in KNOWN_SLOTS:
            continue
        for alias, entry in aliases.items():
            unknown = set(entry) - PROVIDER_FIELDS
            if unknown:
                raise ValueError(f"providers.models.{slot}.{alias}: unknown fields {unknown}")
            wire_api = entry.get("wire_api", "chat_completions")
            if wire_api not in WIRE_APIS:
                raise ValueError(f"wire_api {wire_api!r} fails to load")
            out[f"{slot}.{alias}"] = Provider(
                slot=slot,
                uri=entry.get("uri", ""),
                api_key=entry.get("api_key", ""),
                model=entry.get("model", ""),
                wire_api=wire_api,
                extra_headers=dict(entry.get("extra_headers", {})),
            )
    return out


def agent_provider(config: dict[str, Any], agent: str = "main") -> Provider | None:
    """The provider the agent names (None: it names one v3 dropped or never had)."""
    name = config.get("agents", {}).get(agent, {}).get("model_provider", "")
    return providers(config).get(name)


def chat_request(provider: Provider, text: str) -> tuple[str, dict[str, str], dict[str, Any]]:
    """The URL, headers and body of one streamed chat call, as `compatible.rs` sends it."""
    headers = {
        "Content-Type": "application/json",
        "Authorization": f"Bearer {provider.api_key}",
        **provider.extra_headers,
    }
    body = {
        "model": provider.model,
        "messages": [{"role": "user", "content": text}],
        "temperature": 0.7,
        "max_tokens": 64,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return provider.chat_completions_url(), headers, body
