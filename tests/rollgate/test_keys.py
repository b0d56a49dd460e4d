"""The key a client tool sends when its variable lists several (a rotation under way)."""

from __future__ import annotations

import pytest

from rollgate.keys import current_key


@pytest.mark.parametrize(
    ("value", "sent"),
    [("k1", "k1"), ("new,old", "new"), (" new , old", "new"), ("", "")],
)
def test_the_first_listed_key_is_sent(value: str, sent: str) -> None:
    assert current_key(value) == sent
