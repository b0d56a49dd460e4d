"""The adapter for any OpenAI-compatible upstream: text and logprobs, no token ids."""

from __future__ import annotations

from typing import Any, ClassVar

from services.worker.turn import TurnAccumulator


class OpenAICompatAdapter:
    """Reads standard chat-completions chunks and bodies; the ids stay unknown (not exact)."""

    kind: ClassVar[str] = "openai"

    def prepare(self, body: dict[str, Any]) -> None:
        """Adds this kind's fields to the upstream body (none for plain OpenAI)."""

    def read_chunk(self, chunk: dict[str, Any], acc: TurnAccumulator) -> None:
        """Absorbs one streamed chunk."""
        acc.add_chunk(chunk)

    def read_completion(self, body: dict[str, Any], acc: TurnAccumulator) -> None:
        """Absorbs one non-streaming completion."""
        acc.add_completion(body)
