"""A prompt's token ids read once per shared prefix, not once per turn.

With `return_token_ids` vLLM sends the whole prompt's ids on an answer's first chunk: for an
agent that resends a 48 KB system prompt, its tools and every earlier message each turn, that
is ≈ 12 000 ids and 75 KB of JSON per turn, and reading them into the record's int32 array
(`orjson.loads`, then `struct.pack`) cost ≈ 0.26 ms of the worker's CPU per turn — more than
the rest of the turn's chunks together — growing with the conversation, although nearly all of
those ids are the previous turn's.

So the array's text is cut out of the chunk before the chunk is parsed (`cut_prompt_ids`), and
`PromptIdsCache.pack` turns it into the packed array reading only what differs from a prompt
it packed before: the latest prompt that began with the same bytes (an agent's system prompt:
the same episode's previous turn, or another episode of the same agent) shares a prefix of
text, and the ids before the last comma inside that prefix are the same ids, so their packed
bytes are taken as they are and only the rest is parsed. The result is the bytes a whole parse
gives (a test compares them on every shape of overlap); a text that is not a JSON list of
int32 is refused as the whole parse refuses it. A miss only means a whole parse.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import orjson

from schema.packing import int32_array, pack_int32
from services.runtime.errors import UpstreamError
from services.runtime.prefix import common_prefix

# The key of the array in a chunk (vLLM writes no space after the colon; JSON may).
_KEY = b'"prompt_token_ids":'
# JSON's whitespace (the empty slice past the end stops the skipping too).
_SPACE = (b" ", b"\t", b"\n", b"\r")
# What the array is replaced by in the chunk that is then parsed.
_CUT = b'"prompt_token_ids":null'


def cut_prompt_ids(payload: bytes) -> tuple[bytes, bytes] | None:
    """(`payload` with the prompt ids array replaced by null, the array's text between its
    brackets), or None when the payload has no such array. The key cannot occur inside a JSON
    string (a quote in a string is escaped), so the first one found is a key: the caller checks
    that the parsed chunk has it where prompt ids go, and parses `payload` whole otherwise."""
    start = payload.find(_KEY)
    if start < 0:
        return None
    opened = start + len(_KEY)
    while payload[opened : opened + 1] in _SPACE:
        opened += 1
    if payload[opened : opened + 1] != b"[":
        return None  # null, or not an array: the chunk is parsed whole
    opened += 1
    end = payload.find(b"]", opened)
    if end < 0:
        return None
    return payload[:start] + _CUT + payload[end + 1 :], payload[opened:end]


def _pack_all(text: bytes) -> bytes:
    try:
        ids = orjson.loads(b"[" + text + b"]")
    except orjson.JSONDecodeError:
        raise UpstreamError("the upstream sent prompt token ids that are not a JSON list") from None
    try:
        return pack_int32(ids)
    except (TypeError, OverflowError):
        raise UpstreamError("the upstream sent token ids that are not 32-bit integers") from None


class PromptIdsCache:
    """The latest prompt packed per leading `key_bytes` of its text, bounded in count and bytes.

    One per worker process; a turn's record never depends on what it holds (a miss parses the
    whole text)."""

    def __init__(
        self, *, key_bytes: int = 1024, max_entries: int = 256, max_bytes: int = 64 << 20
    ) -> None:
        self._key_bytes = key_bytes
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._entries: OrderedDict[bytes, tuple[bytes, bytes]] = OrderedDict()
        self._bytes = 0
        # Ids taken from an earlier prompt and ids parsed (what the tests read).
        self.reused = 0
        self.parsed = 0

    def pack(self, text: bytes) -> bytes:
        """The ids of `text` (a JSON list's inside) as int32 little-endian; UpstreamError when
        they are not a list of 32-bit integers."""
        key = text[: self._key_bytes]
        entry = self._entries.get(key)
        packed = self._extend(entry, text) if entry is not None else None
        if packed is None:
            packed = _pack_all(text)
            self.parsed += len(packed) // 4
        self._put(key, text, packed)
        return packed

    def _extend(self, entry: tuple[bytes, bytes], text: bytes) -> bytes | None:
        old_text, old_packed = entry
        shared = common_prefix(text, old_text)
        if shared == len(text) == len(old_text):
            self.reused += len(old_packed) // 4
            return old_packed
        # Every id before a comma both texts have inside their shared bytes is the same id.
        comma = text.rfind(b",", 0, shared)
        rest = text[comma + 1 :]
        if comma <= 0 or not rest.strip():
            return None
        ids = text.count(b",", 0, comma) + 1
        packed = _pack_all(rest)
        self.reused += ids
        self.parsed += len(packed) // 4
        return old_packed[: ids * 4] + packed

    def _put(self, key: bytes, text: bytes, packed: bytes) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= len(old[0]) + len(old[1])
        self._entries[key] = (text, packed)
        self._bytes += len(text) + len(packed)
        while self._entries and (
            len(self._entries) > self._max_entries or self._bytes > self._max_bytes
        ):
            _, (old_text, old_packed) = self._entries.popitem(last=False)
            self._bytes -= len(old_text) + len(old_packed)


def read_with_prompt_ids(
    payload: bytes, cache: PromptIdsCache
) -> tuple[dict[str, Any], Sequence[int]] | None:
    """`payload` (a chunk or a completion) parsed with its prompt ids cut out first and read
    through `cache`, and those ids; None when they cannot be cut from it (the caller parses it
    whole); UpstreamError when they are not int32 ids."""
    cut = cut_prompt_ids(payload)
    if cut is None:
        return None
    rest, ids = cut
    try:
        parsed = orjson.loads(rest)
    except orjson.JSONDecodeError:
        return None
    if type(parsed) is not dict or not _took_prompt_ids(parsed):
        return None
    return parsed, int32_array(cache.pack(ids))


def _took_prompt_ids(chunk: dict[str, Any]) -> bool:
    """Whether the prompt ids `cut_prompt_ids` replaced by null were where prompt ids go (top
    level, else choice 0, as `TurnAccumulator` reads them); the null is removed."""
    if "prompt_token_ids" in chunk:
        if chunk["prompt_token_ids"] is not None:
            return False
        del chunk["prompt_token_ids"]
        return True
    choices = chunk.get("choices")
    if type(choices) is not list or len(choices) != 1 or type(choices[0]) is not dict:
        return False
    choice = choices[0]
    if choice.get("index", 0) != 0 or choice.get("prompt_token_ids", False) is not None:
        return False
    del choice["prompt_token_ids"]
    return True
