"""Issued admin and trainer keys: their shapes, and that free text never shows them."""

from __future__ import annotations

from services.runtime.keys import access_key_kind, looks_like_key_id, new_access_key
from services.runtime.secret import scrub


def test_issued_keys_have_their_kinds_shape_and_are_masked_in_free_text() -> None:
    admin, trainer = new_access_key("admin"), new_access_key("trainer")
    assert (access_key_kind(admin), access_key_kind(trainer)) == ("admin", "trainer")
    assert access_key_kind("sk-admin-short") == "" and access_key_kind("rg-admin-x" * 5) == ""
    text = f"failed for key={admin} and {trainer!r}"
    scrubbed = scrub(text)
    assert admin not in scrubbed and trainer not in scrubbed
    assert "sk-admin-***" in scrubbed and "sk-trainer-***" in scrubbed
    assert looks_like_key_id("0123456789abcdef01234567")
    assert not looks_like_key_id("0123456789ABCDEF01234567")
