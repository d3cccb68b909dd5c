"""Tiny Hugging Face model directories built locally (nothing is downloaded): for tests, examples and the demo.

    write_tiny_config("qwen2", "runs/tiny-qwen2")      # config.json only: plait initializes from a seed
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

FAMILY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    # an odd vocabulary (67: tensor parallelism shards it unevenly), grouped-query attention
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),  # head_dim decoupled from hidden / heads
    "gemma": ("GemmaConfig", {"head_dim": 16}),  # tied, GeGLU, (1 + w) norms, scaled embedding
}
COMMON = dict(vocab_size=67, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=1)


def tiny_config(family: str, **overrides: Any):
    """A transformers config of `family` (llama, mistral, qwen2, qwen3, gemma, gpt2) a few thousand parameters big."""
    import transformers

    if family == "gpt2":
        fields = dict(vocab_size=67, n_embd=32, n_layer=4, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=1)
        return transformers.GPT2Config(**{**fields, **overrides})
    if family not in FAMILY_CONFIGS:
        raise ValueError(f"family {family!r} is not one of {', '.join([*FAMILY_CONFIGS, 'gpt2'])}")
    class_name, extra = FAMILY_CONFIGS[family]
    return getattr(transformers, class_name)(**{**COMMON, **extra, **overrides})


def write_tiny_config(family: str, directory: str | Path, **overrides: Any) -> Path:
    """Save a tiny config of `family` to `directory` (config.json); returns the directory."""
    directory = Path(directory)
    tiny_config(family, **overrides).save_pretrained(str(directory))
    return directory


FAMILIES = (*FAMILY_CONFIGS, "gpt2")
