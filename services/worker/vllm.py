"""The adapter for vLLM: asks for the sampled token ids (`return_token_ids`) and records them."""

from __future__ import annotations

from typing import Any, ClassVar

from services.worker.openai_compat import OpenAICompatAdapter
from services.worker.turn import TurnAccumulator


class VllmAdapter(OpenAICompatAdapter):
    """OpenAI chunks plus vLLM's `prompt_token_ids` and per-chunk `choices[0].token_ids`."""

    kind: ClassVar[str] = "vllm"
    reads_token_ids: ClassVar[bool] = True

    def prepare(self, body: dict[str, Any]) -> None:
        """Asks vLLM for the prompt ids and the sampled ids."""
        body["return_token_ids"] = True

    def read_completion(self, body: dict[str, Any], acc: TurnAccumulator) -> None:
        """Absorbs one completion and its ids."""
        acc.add_completion(body)
        acc.add_token_ids(body)
