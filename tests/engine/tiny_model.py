"""A tiny Qwen2 model for a real vLLM, built here, byte for byte the same every time.

A byte-level BPE trained on `corpus.txt`, a 2-layer Qwen2 config (head size 32, what vLLM's CPU
attention needs at least) and random weights from a fixed seed, written as safetensors: under
1 MB, never downloaded. The weights are random, so the text is gibberish, but every id and
logprob is the engine's own.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = Path(__file__).with_name("corpus.txt")
SEED = 20261201
VOCAB_TARGET = 1024
HIDDEN = 64
HEADS = 2
KV_HEADS = 1
HEAD_DIM = HIDDEN // HEADS
INTERMEDIATE = 128
LAYERS = 2
MAX_LEN = 2048
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Not special (they show in the decoded text), but single tokens: vLLM's hermes tool parser
# looks them up in the vocabulary.
TOOL_MARKUP = ("<tool_call>", "</tool_call>")

# ChatML as Qwen2.5 writes it: tools in the system message, calls as <tool_call> blocks,
# results as <tool_response> in a user turn.
CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}"
    "{%- else %}You are a helpful assistant.{%- endif %}\n\n# Tools\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, '
    '"arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{%- elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{%- elif message.role == 'assistant' %}<|im_start|>assistant\n"
    "{%- if message.content %}{{ message.content }}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}\n<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": '
    "{%- if call.function.arguments is string %}{{ call.function.arguments }}"
    "{%- else %}{{ call.function.arguments | tojson }}{%- endif %}}\n</tool_call>"
    "{%- endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


def train_tokenizer() -> Tokenizer:
    """The byte-level BPE trained on corpus.txt, with ChatML's special tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_TARGET,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = CORPUS.read_text(encoding="utf-8")
    tokenizer.train_from_iterator([text] * 8, trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_MARKUP])
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    return tokenizer


def _weights(vocab: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(SEED)

    def normal(*shape: int, std: float) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype("<f4")

    kv = KV_HEADS * HEAD_DIM
    # Embeddings with unit scale and a tied head give peaked next-token distributions, so
    # greedy choices are not near-ties that float noise could flip.
    tensors = {"model.embed_tokens.weight": normal(vocab, HIDDEN, std=1.0)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": np.ones(HIDDEN, dtype="<f4"),
            p + "post_attention_layernorm.weight": np.ones(HIDDEN, dtype="<f4"),
            p + "self_attn.q_proj.weight": normal(HIDDEN, HIDDEN, std=0.2),
            p + "self_attn.q_proj.bias": normal(HIDDEN, std=0.1),
            p + "self_attn.k_proj.weight": normal(kv, HIDDEN, std=0.2),
            p + "self_attn.k_proj.bias": normal(kv, std=0.1),
            p + "self_attn.v_proj.weight": normal(kv, HIDDEN, std=0.2),
            p + "self_attn.v_proj.bias": normal(kv, std=0.1),
            p + "self_attn.o_proj.weight": normal(HIDDEN, HIDDEN, std=0.2),
            p + "mlp.gate_proj.weight": normal(INTERMEDIATE, HIDDEN, std=0.2),
            p + "mlp.up_proj.weight": normal(INTERMEDIATE, HIDDEN, std=0.2),
            p + "mlp.down_proj.weight": normal(HIDDEN, INTERMEDIATE, std=0.2),
        }
    tensors["model.norm.weight"] = np.ones(HIDDEN, dtype="<f4")
    return tensors


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """The safetensors format: a little-endian u64 header size, a JSON header, raw data."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, array in tensors.items():
        size = array.nbytes
        header[name] = {
            "dtype": "F32",
            "shape": list(array.shape),
            "data_offsets": [offset, size + offset],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for array in tensors.values():
            f.write(array.tobytes())


def build(directory: Path) -> Path:
    """Writes the model (config, tokenizer, weights) into `directory` and returns it."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    vocab = tokenizer.get_vocab_size()
    tokenizer.save(str(directory / "tokenizer.json"))
    ids = {t: tokenizer.token_to_id(t) for t in (*SPECIAL, *TOOL_MARKUP)}
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": vocab,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_LEN,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "torch_dtype": "float32",
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": MAX_LEN,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    generation = {"eos_token_id": ids["<|im_end|>"], "do_sample": False}
    for name, value in (
        ("config.json", config),
        ("tokenizer_config.json", tokenizer_config),
        ("generation_config.json", generation),
    ):
        (directory / name).write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")
    write_safetensors(directory / "model.safetensors", _weights(vocab))
    return directory


if __name__ == "__main__":
    import sys

    print(build(Path(sys.argv[1])))
