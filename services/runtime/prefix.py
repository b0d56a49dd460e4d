"""How many leading bytes two byte strings share: what the dataproxy stores once per episode (a
turn's request and prompt ids shared with the previous turn) and the worker parses once (a
prompt's ids shared with an earlier prompt)."""

from __future__ import annotations


def common_prefix(a: bytes, b: bytes) -> int:
    """How many leading bytes `a` and `b` share (`startswith` on memoryview slices: memcmp,
    no copies)."""
    end = min(len(a), len(b))
    view = memoryview(a)

    def same(start: int, stop: int) -> bool:
        return b.startswith(view[start:stop], start)

    if same(0, end):
        return end
    low, high = 0, end  # a[:low] == b[:low], a[:high] != b[:high]
    # The usual miss: the later request ends where the earlier one closed its list.
    probe = max(0, end - 64)
    if same(0, probe):
        low = probe
    else:
        high = probe
    while high - low > 1:
        middle = (low + high) // 2
        if same(low, middle):
            low = middle
        else:
            high = middle
    return low
