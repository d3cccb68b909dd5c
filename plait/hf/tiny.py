"""Tiny Hugging Face model directories built locally (nothing is downloaded): for tests, examples and the demo.

    write_tiny_config("qwen2", "runs/tiny-qwen2")      # config.json only: plait initializes from a seed
    write_tiny_checkpoint("llama", "runs/base", seed=0) # config.json and model.safetensors (random weights)
    train_tokenizer(texts, 320, "runs/base")            # tokenizer.json, tokenizer_config.json (byte-level BPE)
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
WINDOWED_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    # sliding windows of 6 tokens, shorter than the tests' sequences: every layer (Starcoder2, Mistral), the last
    # layers only (Qwen2's max_window_layers), every other layer under the class's own eager attention (Gemma 2)
    "starcoder2-window": ("Starcoder2Config", {"sliding_window": 6}),
    "mistral-window": ("MistralConfig", {"sliding_window": 6}),
    "qwen2-window": ("Qwen2Config", {"sliding_window": 6, "use_sliding_window": True, "max_window_layers": 2}),
    "gemma2-window": ("Gemma2Config", {"sliding_window": 6, "head_dim": 16}),
}
COMMON = dict(vocab_size=67, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=1)


def tiny_config(family: str, **overrides: Any):
    """A transformers config of `family` (llama, mistral, qwen2, qwen3, gemma, gpt2, or a windowed one of
    WINDOWED_CONFIGS) a few thousand parameters big."""
    import transformers

    if family == "gpt2":
        fields = dict(vocab_size=67, n_embd=32, n_layer=4, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=1)
        return transformers.GPT2Config(**{**fields, **overrides})
    configs = {**FAMILY_CONFIGS, **WINDOWED_CONFIGS}
    if family not in configs:
        raise ValueError(f"family {family!r} is not one of {', '.join([*configs, 'gpt2'])}")
    class_name, extra = configs[family]
    return getattr(transformers, class_name)(**{**COMMON, **extra, **overrides})


def write_tiny_config(family: str, directory: str | Path, **overrides: Any) -> Path:
    """Save a tiny config of `family` to `directory` (config.json); returns the directory."""
    directory = Path(directory)
    tiny_config(family, **overrides).save_pretrained(str(directory))
    return directory


FAMILIES = (*FAMILY_CONFIGS, "gpt2")


def write_tiny_checkpoint(family: str, directory: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """A tiny model of `family` with random weights drawn from `seed`, saved as Hugging Face saves one
    (config.json, model.safetensors): a checkpoint to fine-tune in tests and examples. Returns the directory."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()  # a bar for one small file is noise
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides))
    model.save_pretrained(str(directory))
    return Path(directory)


def train_tokenizer(texts: list[str], vocab_size: int, directory: str | Path) -> Path:
    """A byte-level BPE tokenizer trained here on `texts` (lossless on any text; ids 0 and 1 are <s> and </s>,
    <s> starts every encoded text), saved as tokenizer.json and tokenizer_config.json. Returns the directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(directory))
    return Path(directory)
