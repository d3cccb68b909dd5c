"""The reference models: sizes equal ModelSpec's counts, deterministic init, pipeline-friendly layout."""

from __future__ import annotations

import pytest
import torch

from plait.models import build_model, initial_state_dict
from plait.spec import ModelSpec
from plait.spec.models import MODEL_PRESETS


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
def test_param_count_equals_spec(name):
    spec = MODEL_PRESETS[name]
    model = build_model(spec, device="meta")
    assert sum(p.numel() for p in model.parameters()) == spec.num_params


@pytest.mark.parametrize("arch,tied", [("gpt", False), ("gpt", True), ("llama", False), ("llama", True)])
def test_param_count_small_variants(arch, tied):
    spec = ModelSpec(arch=arch, num_layers=3, hidden_size=48, num_heads=6, num_kv_heads=2 if arch == "llama" else 6,
                     ffn_hidden_size=80, vocab_size=100, max_seq_len=40, tied_embeddings=tied)
    model = build_model(spec, device="meta")
    assert sum(p.numel() for p in model.parameters()) == spec.num_params


def tiny(arch: str) -> ModelSpec:
    return ModelSpec(arch=arch, num_layers=3, hidden_size=32, num_heads=4, num_kv_heads=2 if arch == "llama" else None,
                     ffn_hidden_size=64, vocab_size=50, max_seq_len=24)


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_forward_is_causal_and_shaped(arch):
    model = build_model(tiny(arch), device="cpu", seed=0)
    tokens = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))
    logits = model(tokens)
    assert logits.shape == (2, 12, 50)
    changed = tokens.clone()
    changed[:, 8] = (changed[:, 8] + 1) % 50
    # positions before the change cannot see it
    torch.testing.assert_close(model(changed)[:, :8], logits[:, :8])
    assert not torch.allclose(model(changed)[:, 8:], logits[:, 8:])


def test_init_is_deterministic_and_per_tensor():
    spec = tiny("llama")
    a = build_model(spec, device="cpu", seed=3).state_dict()
    b = build_model(spec, device="cpu", seed=3).state_dict()
    c = build_model(spec, device="cpu", seed=4).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.attention.wq.weight"], c["layers.0.attention.wq.weight"])
    # a subset (what one pipeline stage builds) gets exactly the full model's tensors
    subset = initial_state_dict(spec, 3, ["layers.2.feed_forward.w1.weight", "output.weight"])
    assert all(torch.equal(subset[k], a[k]) for k in subset)
    assert not torch.equal(a["layers.0.attention.wq.weight"], a["layers.1.attention.wq.weight"])


def test_stages_keep_global_names_and_pass_hidden_states():
    from plait.models import adapter_for, build_stage

    spec = tiny("gpt")
    adapter = adapter_for(spec)
    full = build_model(spec, device="cpu", seed=0)
    first = build_stage(adapter, build_model(spec, device="cpu", seed=0), [0, 1], first=True, last=False, seq_len=10)
    last = build_stage(adapter, build_model(spec, device="cpu", seed=0), [2], first=False, last=True, seq_len=10)
    assert list(last.layers.keys()) == ["2"]  # global names survive the cut
    assert first.output is None and last.tok_embeddings is None
    assert {n for n, _ in last.named_parameters()} >= {"layers.2.attention.wq.weight", "output.weight"}
    tokens = torch.randint(0, 50, (2, 10))
    hidden = first(tokens)
    assert hidden.shape == (2, 10, 32)
    torch.testing.assert_close(last(hidden), full(tokens))
