"""Fault hooks: what the last user message can force, for tests.

`/fail-<status>` answers that HTTP status (429 with `Retry-After: 2`), `/hang` waits until the
client goes away, `/fail-midstream` cuts the connection after the first streamed chunks, and
`/utf8-fragment` (vllm flavour) samples a lone UTF-8 fragment token as vLLM reports one.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollgate.mock_llm.plan import Token

_FAIL = re.compile(r"/fail-(\d{3})\b")
# The first byte of a three-byte UTF-8 character: a lone fragment when nothing completes it.
FRAGMENT_ID = 228


@dataclass(frozen=True, slots=True, kw_only=True)
class Faults:
    """The faults one request asks for."""

    fail_status: int | None = None
    hang: bool = False
    fail_midstream: bool = False
    utf8_fragment: bool = False

    @classmethod
    def of(cls, user_text: str) -> Faults:
        """The faults the last user message names."""
        forced = _FAIL.search(user_text)
        return cls(
            fail_status=int(forced.group(1)) if forced else None,
            hang="/hang" in user_text,
            fail_midstream="/fail-midstream" in user_text,
            utf8_fragment="/utf8-fragment" in user_text,
        )

    def failure(self) -> tuple[int, str, dict[str, str]] | None:
        """(status, message, headers) of the forced failure, if one was asked for."""
        if self.fail_status is None:
            return None
        headers = {"Retry-After": "2"} if self.fail_status == 429 else {}
        return self.fail_status, f"mock failure {self.fail_status} forced by the request", headers


def with_fragment(tokens: list[Token], make: Callable[..., Token]) -> list[Token]:
    """A lone UTF-8 fragment sampled after the first token, as vLLM reports one."""
    lone = make("\u00e4", "content", "")
    lone = dataclasses.replace(lone, fixed_id=FRAGMENT_ID, entry_token="", entry_bytes=())
    after = tokens[1]
    # The detokenizer gives up on the fragment when the next token arrives: U+FFFD.
    after = dataclasses.replace(after, text="\ufffd" + after.text)
    return [tokens[0], lone, after, *tokens[2:]]
