"""The key a client tool sends when a key variable holds a list.

`ROLLGATE_ADMIN_KEY` / `ROLLGATE_TRAINER_KEY` may list several keys, comma-separated, while a
rotation is under way (docs/deploy.md, "Rotating the configured keys"): the services accept
every one, and the first is the current one — the one a client sends.
"""

from __future__ import annotations


def current_key(value: str) -> str:
    """The first key of a comma-separated list (`value` itself when it is one key)."""
    return value.split(",", 1)[0].strip()
