"""Turn records: the worker's TurnRecord as the msgpack map stored per completed interaction."""

from __future__ import annotations

import sys
import zlib
from array import array
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack  # type: ignore[import-untyped]
import orjson

from protos import common_pb2


def pack_int32(values: Sequence[int]) -> bytes:
    """Token ids as int32 little-endian bytes."""
    packed = array("i", values)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def pack_float32(values: Sequence[float]) -> bytes:
    """Logprobs as float32 little-endian bytes."""
    packed = array("f", values)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def unpack_int32(data: bytes) -> list[int]:
    """The inverse of `pack_int32`."""
    values = array("i")
    values.frombytes(data)
    if sys.byteorder != "little":
        values.byteswap()
    return values.tolist()


def unpack_float32(data: bytes) -> list[float]:
    """The inverse of `pack_float32`."""
    values = array("f")
    values.frombytes(data)
    if sys.byteorder != "little":
        values.byteswap()
    return values.tolist()


# `request_json` is stored zlib-compressed (level 1) with `request_codec: "zlib"`: a repeated
# 48 KB system prompt costs about a third of its size per turn in Redis, not all of it.
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


# Where a turn record's per-token versions come from (`output_versions_source`).
VERSIONS_FROM_CHUNKS = "chunks"  # streamed: each chunk's tokens carry the version as it passed
VERSIONS_AT_ADMISSION = "admission"  # non-streaming: every token carries the admission version
# Streamed, but the chunks' token counts did not add up to the output (an upstream that
# sends no per-chunk ids or logprobs): every token carries the admission version.
VERSIONS_UNCOUNTED = "admission_uncounted"


def output_length(record: common_pb2.TurnRecord) -> int:
    """Output tokens as the trajectory counts them: the ids, else the logprobs."""
    return len(record.output_token_ids) or len(record.output_logprobs)


def per_token_versions(spans: Sequence[tuple[int, int]], n_output: int) -> list[int] | None:
    """One version per output token from ordered (tokens, version) spans; None unless the
    spans cover exactly `n_output` tokens (nothing is padded or cut to make them fit)."""
    if sum(tokens for tokens, _ in spans) != n_output:
        return None
    versions: list[int] = []
    for tokens, version in spans:
        versions.extend([version] * tokens)
    return versions


def encode_turn(
    record: common_pb2.TurnRecord,
    *,
    weight_version: int,
    now: float,
    weight_version_end: int | None = None,
    turn_type: str = "main",
    output_versions: Sequence[int] | None = None,
    output_versions_source: str = VERSIONS_AT_ADMISSION,
) -> bytes:
    """The msgpack turn record of docs/internals.md; JSON fields stay bytes.

    `weight_version` is the version when the turn was admitted; `weight_version_end` the
    version when it finished (differs only when the trainer changed weights without pausing
    submission first). `output_versions`, one per output token, is the version each token
    was sampled under (streamed turns); without it every token carries `weight_version`.
    """
    data: bytes = msgpack.packb(
        {
            "interaction_id": record.interaction_id,
            "created_at": record.started_at_unix_s or now,
            "latency_s": record.latency_s,
            "ttft_s": record.ttft_s,
            "upstream_model": record.upstream_model,
            "upstream_kind": record.upstream_kind,
            "finish_reason": record.finish_reason,
            **_request_fields(record.request_json),
            "assistant_message_json": record.assistant_message_json,
            "usage_json": record.usage_json or b"{}",
            "prompt_token_ids": pack_int32(record.prompt_token_ids),
            "output_token_ids": pack_int32(record.output_token_ids),
            "output_logprobs": pack_float32(record.output_logprobs),
            "exact_tokens": record.exact_tokens,
            "length_mismatch": record.length_mismatch,
            "weight_version": weight_version,
            "weight_version_end": weight_version
            if weight_version_end is None
            else weight_version_end,
            # "main", or "side" (X-Turn-Type: heartbeats, memory flushes; left out of training).
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
            **({"extra_samples": _samples(record.extra_samples)} if record.extra_samples else {}),
        },
        use_bin_type=True,
    )
    return data


def _samples(samples: Sequence[common_pb2.TurnSample]) -> list[dict[str, Any]]:
    """The extra samples of a group-sampled call as msgpack maps (packed arrays as bytes)."""
    return [
        {
            "finish_reason": sample.finish_reason,
            "output_token_ids": pack_int32(sample.output_token_ids),
            "output_logprobs": pack_float32(sample.output_logprobs),
            "exact_tokens": sample.exact_tokens,
            "length_mismatch": sample.length_mismatch,
            "assistant_message_json": sample.assistant_message_json,
        }
        for sample in samples
    ]


def decode_turn(data: bytes) -> dict[str, Any]:
    """A stored turn record as a dict (JSON and packed fields still bytes; `request_json`
    decompressed, `request_codec` removed)."""
    turn: dict[str, Any] = msgpack.unpackb(data, raw=False)
    turn["request_json"] = request_json_of(turn)
    turn.pop("request_codec", None)
    return turn


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
