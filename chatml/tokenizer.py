"""A local tokenizer file (`tokenizer.json`, the `tokenizers` library): never downloaded."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer


class LocalTokenizer:
    """Encodes text to ids with a tokenizer.json read once at start-up."""

    def __init__(self, path: str) -> None:
        if not Path(path).is_file():
            raise ValueError(
                f"tokenizer {path!r} is not a file: give the path of the model's tokenizer.json "
                "(rollgate never downloads one at run time)"
            )
        try:
            self._tokenizer = Tokenizer.from_file(path)
        except Exception as err:  # the library raises its own exception type for bad files
            raise ValueError(f"tokenizer {path!r} could not be read: {err}") from None
        self.path = path

    def encode(self, text: str) -> list[int]:
        """The ids of `text`, without added special tokens (templates write their own)."""
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)
