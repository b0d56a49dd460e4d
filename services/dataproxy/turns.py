"""Turn records: the worker's TurnRecord as the msgpack map stored per completed interaction."""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack  # type: ignore[import-untyped]
import orjson

from protos import common_pb2
from schema.packing import pack_int32
from schema.trajectory import (
    TURN_RECORD_FIELDS,
    TURN_SAMPLE_FIELDS,
    VERSIONS_AT_ADMISSION,
    VERSIONS_FROM_CHUNKS,
)
from services.runtime.prefix import common_prefix

# A stored `request_json` of 4 KB or more is zlib-compressed (level 1) with `request_codec:
# "zlib"`. Since turns store only what they add to the episode's previous turn (TurnEncoder),
# that is mostly an episode's first turn: a 48 KB system prompt costs a third of its size once.
# Measured (2-core dev VM, other jobs running; 48 KB of English technical prose from
# tests/dataproxy/large_prompt.py): request of the prompt + one user message, 50.8 KB ->
# 17.8 KB, compress 0.19 ms (best of 7) / 0.31 ms (median) per turn; with OpenClaw's 12 tools
# as well, 54.6 KB -> 18.1 KB, 0.41 ms. Decompressing at publication (off the hot path)
# costs ~0.1 ms. Records written before the field existed have no `request_codec`: plain JSON.
REQUEST_CODEC_ZLIB = "zlib"
_REQUEST_ZLIB_LEVEL = 1


def compress_request(request_json: bytes) -> bytes:
    """`request_json` as a turn record stores it (zlib level 1)."""
    return zlib.compress(request_json, _REQUEST_ZLIB_LEVEL)


# Below this size a request is stored as is: compressing it saves little and costs hot-path CPU.
_COMPRESS_FROM_BYTES = 4096


def _request_fields(request_json: bytes) -> dict[str, Any]:
    """The turn record's `request_json` (compressed when large) and its `request_codec`."""
    if len(request_json) < _COMPRESS_FROM_BYTES:
        return {"request_json": request_json}
    return {"request_json": compress_request(request_json), "request_codec": REQUEST_CODEC_ZLIB}


def request_json_of(turn: Mapping[str, Any]) -> bytes:
    """A decoded turn record's request JSON, decompressed as its `request_codec` says."""
    raw = bytes(turn.get("request_json") or b"")
    codec = turn.get("request_codec")
    if not codec or not raw:
        return raw
    if codec != REQUEST_CODEC_ZLIB:
        raise ValueError(f"turn record request_codec {codec!r} is not known")
    return zlib.decompress(raw)


def output_length(record: common_pb2.TurnRecord) -> int:
    """Output tokens as the trajectory counts them: the ids, else the logprobs (both packed,
    four bytes each)."""
    return (len(record.output_token_ids) or len(record.output_logprobs)) // 4


def per_token_versions(spans: Sequence[tuple[int, int]], n_output: int) -> list[int] | None:
    """One version per output token from ordered (tokens, version) spans; None unless the
    spans cover exactly `n_output` tokens (nothing is padded or cut to make them fit)."""
    if sum(tokens for tokens, _ in spans) != n_output:
        return None
    versions: list[int] = []
    for tokens, version in spans:
        versions.extend([version] * tokens)
    return versions


# A turn's request and prompt ids are stored as a prefix of an earlier turn of the same open
# episode plus their own suffix when they share at least this much: agents resend the whole
# conversation (a 48 KB system prompt, its tools, every earlier message) every turn.
MIN_SHARED_REQUEST_BYTES = 256
MIN_SHARED_IDS = 64


@dataclass(frozen=True, slots=True)
class PriorTurn:
    """An episode's latest turn recorded by this process: what the next turn may share."""

    index: int
    request_json: bytes
    # Its prompt ids followed by its output ids (int32 LE): the next prompt usually extends it.
    token_ids: bytes

    @property
    def size(self) -> int:
        """Bytes held."""
        return len(self.request_json) + len(self.token_ids)


class PriorTurns:
    """The latest recorded turn of recently active episodes, bounded in count and bytes.

    A miss (another replica recorded the previous turn, a restart, an eviction) only means
    the turn is stored whole; correctness never depends on this memory.
    """

    def __init__(self, *, max_episodes: int = 1024, max_bytes: int = 128 << 20) -> None:
        self._entries: OrderedDict[Hashable, PriorTurn] = OrderedDict()
        self._max_episodes = max_episodes
        self._max_bytes = max_bytes
        self._bytes = 0

    def get(self, episode: Hashable) -> PriorTurn | None:
        """The episode's latest turn, if this process remembers it."""
        prior = self._entries.get(episode)
        if prior is not None:
            self._entries.move_to_end(episode)
        return prior

    def put(self, episode: Hashable, prior: PriorTurn) -> None:
        """Remembers `prior` as the episode's latest turn (a later index wins)."""
        old = self._entries.pop(episode, None)
        if old is not None:
            self._bytes -= old.size
            if old.index > prior.index:
                prior = old
        self._entries[episode] = prior
        self._bytes += prior.size
        while self._entries and (
            len(self._entries) > self._max_episodes or self._bytes > self._max_bytes
        ):
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted.size


class TurnEncoder:
    """One turn's record (docs/internals.md, *Turn records*), packed once and encoded per
    attempt: the append re-encodes it when the weight version moved meanwhile."""

    def __init__(
        self,
        record: common_pb2.TurnRecord,
        *,
        request_json: bytes,
        prior: PriorTurn | None = None,
    ) -> None:
        self.record = record
        self.request_json = request_json
        self.prior = prior
        # The worker sends the arrays packed as they are stored: no conversion here.
        self.prompt_ids = record.prompt_token_ids
        self.output_ids = record.output_token_ids
        self._shared: dict[str, Any] = {}
        request, prompt = request_json, self.prompt_ids
        if prior is not None:
            shared = common_prefix(request, prior.request_json)
            if shared >= MIN_SHARED_REQUEST_BYTES:
                self._shared["request_prefix"] = [prior.index, shared]
                request = request[shared:]
            ids = common_prefix(prompt, prior.token_ids) // 4
            if ids >= MIN_SHARED_IDS:
                self._shared["prompt_prefix_ids"] = [prior.index, ids]
                prompt = prompt[ids * 4 :]
        self._request = _request_fields(request)
        self._prompt = prompt

    def encode(
        self,
        *,
        weight_version: int,
        now: float,
        weight_version_end: int | None = None,
        turn_type: str = "main",
        output_versions: Sequence[int] | None = None,
        output_versions_source: str = VERSIONS_AT_ADMISSION,
    ) -> bytes:
        """The msgpack turn record; JSON fields stay bytes.

        `weight_version` is the version when the turn was admitted; `weight_version_end` the
        version when it finished (differs only when the trainer changed weights without
        pausing submission first). `output_versions`, one per output token, is the version
        each token was sampled under (streamed turns); without it every token carries
        `weight_version`.
        """
        record = self.record
        data: bytes = msgpack.packb(
            {
                # The fields schema.trajectory publishes as the worker sent them.
                **{name: getattr(record, name) for name in TURN_RECORD_FIELDS},
                "created_at": record.started_at_unix_s or now,
                **self._request,
                **self._shared,
                "assistant_message_json": record.assistant_message_json,
                "usage_json": record.usage_json or b"{}",
                "prompt_token_ids": self._prompt,
                "weight_version": weight_version,
                "weight_version_end": weight_version
                if weight_version_end is None
                else weight_version_end,
                # "main", or "side" (X-Turn-Type: heartbeats, memory flushes; not trained on).
                "turn_type": turn_type,
                **(
                    {"output_versions": pack_int32(output_versions)}
                    if output_versions is not None
                    else {}
                ),
                "output_versions_source": output_versions_source
                if output_versions is None
                else VERSIONS_FROM_CHUNKS,
                # Group sampling (G > 1): samples 1..G-1 of the same call; absent when G = 1.
                **(
                    {"extra_samples": _samples(record.extra_samples)}
                    if record.extra_samples
                    else {}
                ),
            },
            use_bin_type=True,
        )
        return data

    def recorded_at(self, index: int) -> PriorTurn:
        """This turn as the next one of its episode may share it, once appended at `index`."""
        return PriorTurn(
            index=index,
            request_json=self.request_json,
            token_ids=self.prompt_ids + self.output_ids,
        )


def encode_turn(
    record: common_pb2.TurnRecord,
    *,
    request_json: bytes,
    weight_version: int,
    now: float,
    weight_version_end: int | None = None,
    turn_type: str = "main",
    output_versions: Sequence[int] | None = None,
    output_versions_source: str = VERSIONS_AT_ADMISSION,
) -> bytes:
    """The msgpack turn record of a turn stored whole (nothing shared with an earlier one)."""
    return TurnEncoder(record, request_json=request_json).encode(
        weight_version=weight_version,
        now=now,
        weight_version_end=weight_version_end,
        turn_type=turn_type,
        output_versions=output_versions,
        output_versions_source=output_versions_source,
    )


def _samples(samples: Sequence[common_pb2.TurnSample]) -> list[dict[str, Any]]:
    """The extra samples of a group-sampled call as msgpack maps (packed arrays as bytes)."""
    return [
        {
            **{name: getattr(sample, name) for name in TURN_SAMPLE_FIELDS},
            "assistant_message_json": sample.assistant_message_json,
        }
        for sample in samples
    ]


def decode_turn(data: bytes) -> dict[str, Any]:
    """A stored turn record as a dict (JSON and packed fields still bytes; `request_json`
    decompressed, `request_codec` removed). A record that shares a prefix with an earlier
    turn needs that turn: read the episode's records with `decode_turns`."""
    turn: dict[str, Any] = msgpack.unpackb(data, raw=False)
    if "request_prefix" in turn or "prompt_prefix_ids" in turn:
        raise ValueError("this turn record shares a prefix with an earlier one: use decode_turns")
    turn["request_json"] = request_json_of(turn)
    turn.pop("request_codec", None)
    return turn


def decode_turns(records: Sequence[bytes]) -> list[dict[str, Any]]:
    """An episode's stored turn records, in order, each whole: prefixes shared with earlier
    turns (`request_prefix`, `prompt_prefix_ids`: [index, length]) resolved to exact bytes."""
    turns: list[dict[str, Any]] = []
    for index, data in enumerate(records):
        turn: dict[str, Any] = msgpack.unpackb(data, raw=False)
        request = request_json_of(turn)
        turn.pop("request_codec", None)
        shared = turn.pop("request_prefix", None)
        if shared is not None:
            source, length = _prefix_source(shared, index)
            request = turns[source]["request_json"][:length] + request
        turn["request_json"] = request
        shared = turn.pop("prompt_prefix_ids", None)
        if shared is not None:
            source, length = _prefix_source(shared, index)
            earlier = turns[source]
            ids = earlier["prompt_token_ids"] + earlier["output_token_ids"]
            turn["prompt_token_ids"] = ids[: length * 4] + bytes(turn["prompt_token_ids"])
        turns.append(turn)
    return turns


def _prefix_source(shared: Any, index: int) -> tuple[int, int]:
    source, length = int(shared[0]), int(shared[1])
    if not 0 <= source < index:
        raise ValueError(f"turn {index} shares a prefix with turn {source}, not an earlier one")
    return source, length


def history_entry(turn: dict[str, Any], reward: float | None) -> bytes:
    """One interaction as JSON for GetHistory: request, output message, finish reason, reward."""
    return orjson.dumps(
        {
            "interaction_id": turn["interaction_id"],
            "created_at": turn["created_at"],
            "request": orjson.loads(turn["request_json"]) if turn["request_json"] else None,
            "output_message": orjson.loads(turn["assistant_message_json"])
            if turn["assistant_message_json"]
            else None,
            "finish_reason": turn["finish_reason"],
            "usage": orjson.loads(turn["usage_json"]) if turn["usage_json"] else {},
            "reward": reward,
        }
    )
