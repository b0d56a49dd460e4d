"""A small byte-level BPE tokenizer.json built in the test (no downloads), lossless."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

_CORPUS = [
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n",
    "<|im_start|>user\nhello there, what is the weather like today?<|im_end|>\n",
    "<|im_start|>assistant\nMock reply 42: you said hello there<|im_end|>\n",
    "<think>\nLet me think about what the user asked before I answer.\n</think>\n\n",
    '<tool_call>\n{"name": "search", "arguments": {"query": "weather"}}\n</tool_call>',
]


def build_tokenizer(directory: Path) -> Path:
    """Trains a tiny byte-level BPE on a fixed corpus and saves it as tokenizer.json."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer=trainer)
    path = directory / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def decode_fn(path: Path) -> Callable[[list[int]], str]:
    """Ids back to text with the same file: how the mock LLM reads /generate's input_ids."""
    tokenizer = Tokenizer.from_file(str(path))
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=False)
