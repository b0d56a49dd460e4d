"""The one JSON reader for what clients send (HTTP bodies, WebSocket frames)."""

from __future__ import annotations

import threading
from typing import Any

import orjson

from services.runtime.errors import InvalidRequest

# Deeper JSON is refused: the hops re-encode bodies with orjson, whose limit is 254 levels,
# and wrap them a few levels deeper on the way (messages, interactions, trajectories).
MAX_JSON_DEPTH = 128
# orjson.dumps refuses values nested deeper than this; nesting a value inside
# (_ORJSON_DUMPS_DEPTH - MAX_JSON_DEPTH) lists makes it refuse exactly what is too deep.
_ORJSON_DUMPS_DEPTH = 254


# The lists `dump_json` wraps a value in: orjson then refuses exactly what is too deep.
_PAD = _ORJSON_DUMPS_DEPTH - MAX_JSON_DEPTH


def load_json(raw: bytes | str, *, what: str = "the request body", check_depth: bool = True) -> Any:
    """`raw` parsed; InvalidRequest saying what is wrong (never echoing the input).

    `check_depth=False` leaves the depth limit to the caller, which must encode the value (or
    every part of it) with `dump_json` before it goes anywhere: a body the relay re-encodes
    anyway is then checked by that one encoding instead of a second one here."""
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as err:
        if "depth limit" in str(err):
            raise _too_deep(what) from None
        raise InvalidRequest(f"{what} is not valid JSON: {err}", code="invalid_json") from None
    if not check_depth:
        return value
    # Counting brackets is cheap and bounds the depth; only bodies that could be too deep pay
    # for the exact check (one encoding, `dump_json`'s).
    brackets = (
        raw.count(b"[") + raw.count(b"{")
        if isinstance(raw, bytes)
        else raw.count("[") + raw.count("{")
    )
    if brackets > MAX_JSON_DEPTH:
        dump_json(value, what=what)
    return value


class _Pad(threading.local):
    """`_PAD` nested lists, built once per thread; the innermost holds the value being encoded.
    Building them per call was a Python loop of `_PAD` steps: 6 µs of a small body's 6.5."""

    def __init__(self) -> None:
        self.inner: list[Any] = [None]
        outer: list[Any] = self.inner
        for _ in range(_PAD - 1):
            outer = [outer]
        self.outer = outer


_PADS = _Pad()


def dump_json(value: Any, *, what: str = "the request body") -> bytes:
    """`value` as JSON, or InvalidRequest when it is nested more than MAX_JSON_DEPTH levels:
    encoded inside `_PAD` lists, where orjson's own limit falls exactly there, then cut out
    (one copy of the bytes instead of a second encoding). orjson calls no Python code while it
    encodes, so nothing else can use this thread's lists meanwhile."""
    pads = _PADS
    pads.inner[0] = value
    try:
        wrapped = orjson.dumps(pads.outer)
    except orjson.JSONEncodeError as err:
        if "ecursion" in str(err):
            raise _too_deep(what) from None
        raise
    finally:
        pads.inner[0] = None
    return wrapped[_PAD:-_PAD]


def _too_deep(what: str) -> InvalidRequest:
    return InvalidRequest(
        f"{what} is nested more than {MAX_JSON_DEPTH} levels deep", code="json_too_deep"
    )
