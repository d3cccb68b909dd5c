"""The ModelSpec of a Hugging Face class, measured on meta (plait.hf.spec), against the closed forms the cost
model prices plait's own families with: real-size Llama-2-7B, Qwen2-0.5B, GPT-2 and a Gemma-2B-shaped config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plait.cost.compute import layer_flops
from plait.spec.load import load_model, model_from_hf_config

EXAMPLES = Path(__file__).parents[2] / "examples" / "hf"
GEMMA_2B = {"model_type": "gemma", "architectures": ["GemmaForCausalLM"], "hidden_size": 2048,
            "intermediate_size": 16384, "num_hidden_layers": 18, "num_attention_heads": 8, "num_key_value_heads": 1,
            "head_dim": 256, "vocab_size": 256000, "max_position_embeddings": 8192, "hidden_act": "gelu_pytorch_tanh"}


def _config_dir(name: str, tmp_path: Path) -> Path:
    if name == "gemma-2b":
        (tmp_path / "config.json").write_text(json.dumps(GEMMA_2B))
        return tmp_path
    return EXAMPLES / name


@pytest.mark.parametrize("name", ["llama-2-7b", "qwen2-0.5b", "gpt2", "gemma-2b"])
def test_measured_spec_agrees_with_the_closed_forms(name, tmp_path):
    directory = _config_dir(name, tmp_path)
    measured = load_model(str(directory))
    closed = model_from_hf_config(json.loads((directory / "config.json").read_text()))
    assert measured.blocks and not closed.blocks  # one priced from the class on meta, one from the formulas
    assert measured.num_params == pytest.approx(closed.num_params, rel=0.01)
    for seq_len in (1024, 4096):
        weights, attention = layer_flops(measured, 1, seq_len)
        closed_weights, closed_attention = layer_flops(closed, 1, seq_len)
        assert weights == pytest.approx(closed_weights, rel=0.01)
        assert attention == pytest.approx(closed_attention, rel=0.01)


def test_replicated_key_values_are_priced():
    """Multi-query attention under tp=2: each tensor rank computes the whole k and v projections (their one head is
    replicated), so the layer's forward costs more than half of tp=1's, by exactly those projections."""
    from plait.cost.compute import layer_cost, replicated_kv_flops
    from plait.spec import ModelSpec
    from plait.spec.clusters import CLUSTER_PRESETS

    mqa = ModelSpec(name="mqa", source="hf:/nowhere", arch="llama", num_layers=2, hidden_size=2048, num_heads=8,
                    num_kv_heads=1, head_dim=256, ffn_hidden_size=8192, vocab_size=1000)
    cluster = CLUSTER_PRESETS["a100-80g"]
    tokens = 4 * 1024
    extra = replicated_kv_flops(mqa, tokens, 2)
    assert extra == 2.0 * tokens * 2048 * 2 * 256
    assert replicated_kv_flops(mqa, tokens, 1) == 0.0
    assert replicated_kv_flops(mqa.replace(source="plait"), tokens, 2) == 0.0  # plait's decoders refuse kv < tp
    priced = layer_cost(mqa, cluster, 1024, 4, 2, False).fwd
    split_evenly = layer_cost(mqa.replace(source="plait"), cluster, 1024, 4, 2, False).fwd
    assert priced > split_evenly
