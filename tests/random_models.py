"""Random small decoder specs (plait's features, tied or not, grouped-query attention, odd vocabularies) for the
property tests and the sample of planner-emitted plans that tests/dist checks for real."""

from __future__ import annotations

import random

from plait.spec import ModelSpec


def random_spec(seed: int) -> ModelSpec:
    rng = random.Random(seed)
    heads = rng.choice([2, 4, 8])
    kv_heads = rng.choice([d for d in (1, 2, 4, 8) if heads % d == 0])
    head_dim = rng.choice([8, 16])
    hidden = heads * head_dim if rng.random() < 0.8 else rng.choice([32, 48, 64])  # sometimes decoupled
    arch = rng.choice(["gpt", "llama"])
    features = {}
    if rng.random() < 0.3:
        features = {"mlp": rng.choice(["gelu", "swiglu", "geglu"]), "bias": rng.choice(["all", "qkv", "none"]),
                    "norm": rng.choice(["layernorm", "rmsnorm"])}
    return ModelSpec(name=f"random-{seed}", arch=arch, num_layers=rng.randint(2, 6), hidden_size=hidden,
                     num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, ffn_hidden_size=8 * rng.randint(2, 12),
                     vocab_size=rng.randint(33, 301), max_seq_len=64, tied_embeddings=rng.random() < 0.5,
                     qk_norm=rng.random() < 0.2, **features)
