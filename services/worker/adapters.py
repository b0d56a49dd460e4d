"""Which adapter turns a given upstream kind's JSON into chunks and a turn record."""

from __future__ import annotations

from typing import Any, Protocol

from services.worker.openai_compat import OpenAICompatAdapter
from services.worker.turn import TurnAccumulator
from services.worker.vllm import VllmAdapter


class UpstreamAdapter(Protocol):
    """What the worker needs from one upstream kind."""

    @property
    def kind(self) -> str:
        """The `upstream_kind` written on turn records."""
        ...

    def prepare(self, body: dict[str, Any]) -> None:
        """Adds this kind's fields to the upstream body."""

    def read_chunk(self, chunk: dict[str, Any], acc: TurnAccumulator) -> None:
        """Absorbs one streamed chunk."""

    def read_completion(self, body: dict[str, Any], acc: TurnAccumulator) -> None:
        """Absorbs one non-streaming completion."""


# sglang (issue 4) plugs in here: its own module with the same three methods.
_ADAPTERS: dict[str, type[UpstreamAdapter]] = {
    OpenAICompatAdapter.kind: OpenAICompatAdapter,
    VllmAdapter.kind: VllmAdapter,
}


def adapter_for(kind: str) -> UpstreamAdapter:
    """The adapter for `kind` (`openai` or `vllm`)."""
    try:
        return _ADAPTERS[kind]()
    except KeyError:
        raise ValueError(f"unknown upstream kind {kind!r}") from None
