"""The upstream kinds, listed once: the configuration file, the worker's settings,
`rollgate check-upstream` and the mock LLM's flavours all derive theirs from `KINDS`.

Adding a kind: one entry here, its adapter in `services/worker/<kind>.py`, and one line in
`services/worker/adapters.py` (a test fails until the adapter is registered).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class UpstreamKind:
    """One kind of upstream server and what rollgate asks of it."""

    name: str
    # Why one picks this kind; named in the error for an unknown kind.
    summary: str
    # Fields a chat request adds so the answer carries the sampled token ids (empty: this
    # kind's chat answers carry none); `rollgate check-upstream` sends them.
    ids_request: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    # The ways the worker may call it (`upstreams[].sglang_path` picks one of SGLang's).
    paths: tuple[str, ...] = ("chat",)


KINDS: tuple[UpstreamKind, ...] = (
    UpstreamKind(
        name="vllm",
        summary="exact ids via return_token_ids",
        ids_request=MappingProxyType({"return_token_ids": True}),
    ),
    UpstreamKind(name="sglang", summary="SGLang", paths=("chat", "generate")),
    UpstreamKind(name="openai", summary="any OpenAI-compatible API"),
)
UPSTREAM_KINDS: tuple[str, ...] = tuple(k.name for k in KINDS)
# What an upstream is when its kind is left out.
DEFAULT_KIND = "openai"
SGLANG_PATHS: tuple[str, ...] = next(k.paths for k in KINDS if k.name == "sglang")


def upstream_kind(name: str) -> UpstreamKind:
    """The kind called `name`; ValueError listing the kinds otherwise."""
    for kind in KINDS:
        if kind.name == name:
            return kind
    raise ValueError(f"{name!r} is not one of {', '.join(UPSTREAM_KINDS)}")


def kinds_help() -> str:
    """`vllm: …; sglang: …; openai: …`, for error messages."""
    return "; ".join(f"{k.name}: {k.summary}" for k in KINDS)
