"""The adapter for any OpenAI-compatible upstream: text and logprobs, no token ids."""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

from services.worker.turn import TurnAccumulator
from services.worker.upstream import chat_body


class Translator(Protocol):
    """Per turn: the upstream's JSON (events or one answer) as chat-completions JSON."""

    def events(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        """The chat chunks of one upstream event."""
        ...

    def completion(self, body: dict[str, Any]) -> dict[str, Any]:
        """The chat.completion of one upstream answer."""
        ...


class PassThrough:
    """The per-turn translator of chat-completions upstreams: their JSON is already chat JSON."""

    def events(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        """The chat chunks of one upstream event (here: the event itself)."""
        return [event]

    def completion(self, body: dict[str, Any]) -> dict[str, Any]:
        """The chat.completion of one upstream answer (here: the answer itself)."""
        return body


class OpenAICompatAdapter:
    """Reads standard chat-completions chunks and bodies; the ids stay unknown (not exact)."""

    kind: ClassVar[str] = "openai"
    # True when the adapter can only ask for one sample per call.
    single_sample: ClassVar[bool] = False
    # True when the kind records the token ids the chunks carry (the prompt's included).
    reads_token_ids: ClassVar[bool] = False

    def endpoint(self, base_url: str) -> str:
        """The URL this kind POSTs to."""
        return base_url + "/chat/completions"

    def prepare(self, body: dict[str, Any]) -> None:
        """Adds this kind's fields to the upstream body (none for plain OpenAI)."""

    def encode(self, body: dict[str, Any], request_json: bytes) -> bytes:
        """The upstream's request bytes: the recorded part with the parameters spliced in."""
        return chat_body(body, request_json)

    def translator(self, upstream_body: bytes, model: str) -> Translator:
        """A per-turn translator of the upstream's JSON into chat JSON."""
        return PassThrough()

    def read_chunk(self, chunk: dict[str, Any], acc: TurnAccumulator) -> None:
        """Absorbs one streamed chunk, and the ids it carries when the kind reads them (vLLM's
        prompt ids come on the first chunk). Not overridden by a kind: the worker then reads
        the common chunk in one pass with the client's view (`TurnAccumulator.take_common`)."""
        acc.add_chunk(chunk, token_ids=self.reads_token_ids)

    def read_completion(self, body: dict[str, Any], acc: TurnAccumulator) -> None:
        """Absorbs one non-streaming completion."""
        acc.add_completion(body)
