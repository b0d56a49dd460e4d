"""TurnRecord messages for tests, with their arrays given as lists (packed as the worker does)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from protos import common_pb2
from schema.packing import pack_float32, pack_int32
from services.dataproxy.turns import PriorTurn, TurnEncoder, encode_turn


def turn_record(
    *,
    prompt_token_ids: Sequence[int] = (),
    output_token_ids: Sequence[int] = (),
    output_logprobs: Sequence[float] = (),
    **fields: Any,
) -> common_pb2.TurnRecord:
    """A TurnRecord whose id and logprob arrays are packed from lists."""
    return common_pb2.TurnRecord(
        prompt_token_ids=pack_int32(prompt_token_ids),
        output_token_ids=pack_int32(output_token_ids),
        output_logprobs=pack_float32(output_logprobs),
        **fields,
    )


def turn_sample(
    *, output_token_ids: Sequence[int] = (), output_logprobs: Sequence[float] = (), **fields: Any
) -> common_pb2.TurnSample:
    """A TurnSample whose arrays are packed from lists."""
    return common_pb2.TurnSample(
        output_token_ids=pack_int32(output_token_ids),
        output_logprobs=pack_float32(output_logprobs),
        **fields,
    )


@dataclass(frozen=True, slots=True)
class WithRequest:
    """A worker's record and the request the gateway recorded with it."""

    record: common_pb2.TurnRecord
    request_json: bytes

    def encode(self, **fields: Any) -> bytes:
        """The stored turn record, whole (`encode_turn`)."""
        return encode_turn(self.record, request_json=self.request_json, **fields)

    def encoder(self, prior: PriorTurn | None = None) -> TurnEncoder:
        """A TurnEncoder for it, sharing with `prior`."""
        return TurnEncoder(self.record, request_json=self.request_json, prior=prior)
