"""Packed arrays: int32 / float32 little-endian whatever the host, and the errors that say
why a value cannot be packed (the worker turns them into an upstream error)."""

from __future__ import annotations

import pytest

from schema.packing import count, pack_float32, pack_int32, unpack_float32, unpack_int32


def test_int32_is_little_endian_and_round_trips() -> None:
    ids = [0, 1, -3, 151_643, 2**31 - 1, -(2**31)]
    packed = pack_int32(ids)
    assert packed[:8] == b"\x00\x00\x00\x00\x01\x00\x00\x00"
    assert packed[8:12] == b"\xfd\xff\xff\xff"
    assert unpack_int32(packed) == ids
    assert count(packed) == len(ids)


def test_any_iterable_packs_like_its_list() -> None:
    ids = [5, 6, 7]
    assert pack_int32(iter(ids)) == pack_int32(tuple(ids)) == pack_int32(ids)
    assert pack_int32([]) == b""


@pytest.mark.parametrize(
    ("value", "error"),
    [(2**31, OverflowError), (-(2**31) - 1, OverflowError), (1.5, TypeError), ("7", TypeError)],
)
def test_a_value_that_is_no_int32_is_refused_with_the_reason(
    value: object, error: type[Exception]
) -> None:
    with pytest.raises(error):
        pack_int32([1, value])  # type: ignore[list-item]


def test_float32_round_trips_at_float32_precision() -> None:
    logprobs = [-0.5, -1.25, 0.0, float("-inf")]
    assert unpack_float32(pack_float32(logprobs)) == logprobs
    assert pack_float32([1.0]) == b"\x00\x00\x80\x3f"


def test_unaligned_data_is_refused() -> None:
    with pytest.raises(ValueError, match="not 4-byte aligned"):
        unpack_int32(b"\x00\x00\x00")
