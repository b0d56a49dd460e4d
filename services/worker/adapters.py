"""Which adapter turns a given upstream kind's JSON into chunks and a turn record."""

from __future__ import annotations

from typing import Any, Protocol

from chatml.tokenizer import LocalTokenizer
from services.worker.openai_compat import OpenAICompatAdapter, Translator
from services.worker.sglang import SglangChatAdapter, SglangGenerateAdapter
from services.worker.turn import TurnAccumulator
from services.worker.vllm import VllmAdapter


class UpstreamAdapter(Protocol):
    """What the worker needs from one upstream kind."""

    @property
    def kind(self) -> str:
        """The `upstream_kind` written on turn records."""
        ...

    @property
    def single_sample(self) -> bool:
        """True when the kind can only ask for one sample per call."""
        ...

    @property
    def reads_token_ids(self) -> bool:
        """True when the kind records the token ids the chunks carry (the prompt's included)."""
        ...

    def endpoint(self, base_url: str) -> str:
        """The URL this kind POSTs to."""
        ...

    def prepare(self, body: dict[str, Any]) -> None:
        """Adds this kind's fields to the upstream body."""

    def encode(self, body: dict[str, Any], request_json: bytes) -> bytes:
        """The upstream's request bytes for the prepared parameters and the recorded part."""
        ...

    def translator(self, upstream_body: bytes, model: str) -> Translator:
        """A per-turn translator of the upstream's JSON into chat JSON."""
        ...

    def read_chunk(self, chunk: dict[str, Any], acc: TurnAccumulator) -> None:
        """Absorbs one streamed chunk."""

    def read_completion(self, body: dict[str, Any], acc: TurnAccumulator) -> None:
        """Absorbs one non-streaming completion."""


_ADAPTERS: dict[str, type[UpstreamAdapter]] = {
    OpenAICompatAdapter.kind: OpenAICompatAdapter,
    VllmAdapter.kind: VllmAdapter,
    SglangChatAdapter.kind: SglangChatAdapter,
}


def adapter_for(
    kind: str, *, sglang_path: str = "chat", tokenizer: LocalTokenizer | None = None
) -> UpstreamAdapter:
    """The adapter for `kind` (`openai`, `vllm` or `sglang`; sglang's `generate` path needs
    a tokenizer)."""
    if kind == "sglang" and sglang_path == "generate":
        if tokenizer is None:
            raise ValueError("the sglang generate path needs a tokenizer (tokenizer.json)")
        return SglangGenerateAdapter(tokenizer)
    try:
        return _ADAPTERS[kind]()
    except KeyError:
        raise ValueError(f"unknown upstream kind {kind!r}") from None
