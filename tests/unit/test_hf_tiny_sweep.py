"""The sweep's tiny configs (benchmarks/hf_families.py) and what the adapter does with the classes they opened up:
per-layer lists cut to a layer of each kind, sizes a class leaves None filled, transformers' heterogeneous
per_layer_config shrunk; a multimodal class's encoders that a text forward never reaches frozen; an embedding that
normalizes its output is no norm; a class whose layers take inputs computed from the token ids refused by rule."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn

from plait.errors import ConfigError
from plait.models.adapter import is_norm_module

BENCHMARK = Path(__file__).parents[2] / "benchmarks" / "hf_families.py"


@pytest.fixture(scope="module")
def sweep():
    spec = importlib.util.spec_from_file_location("hf_families_tiny", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_per_layer_lists_keep_a_layer_of_each_kind(sweep):
    from transformers import AutoConfig

    config = AutoConfig.for_model("bailing_hybrid")  # 42 layers: full attention first at layer 5, dense MLPs at 0-1
    out = sweep.tiny_overrides(config)
    assert out["num_hidden_layers"] == len(out["layer_types"]) == len(out["mlp_layer_types"]) == 4
    assert set(out["layer_types"]) == {"linear_attention", "full_attention"}
    assert set(out["mlp_layer_types"]) == {"dense", "sparse"}


def test_sizes_a_class_leaves_none_are_filled(sweep):
    from transformers import AutoConfig

    config = AutoConfig.for_model("deepseek_v2")
    assert config.num_experts_per_tok is None  # its topk would get k=None
    out = sweep.tiny_overrides(config)
    assert out["num_experts_per_tok"] == 2 and out["num_key_value_heads"] == out["num_attention_heads"]


def test_heterogeneous_config_shrunk_and_run_by_transformers(sweep, tmp_path):
    from transformers import AutoConfig

    assert sweep.write_tiny("gemma4_text", tmp_path) is None
    config = AutoConfig.from_pretrained(str(tmp_path))
    per_layer = config.to_dict()["per_layer_config"]
    assert config.layer_types[-1] == "full_attention" and len(config.layer_types) == 4
    assert all(v <= 64 for overrides in per_layer.values() for v in overrides.values() if isinstance(v, int))


def test_inputs_from_tokens_are_refused_by_rule(sweep, tmp_path):
    from plait.spec.load import load_model

    assert sweep.write_tiny("gemma4_text", tmp_path) is None
    with pytest.raises(ConfigError, match=r"hf-layer-inputs-from-tokens"):
        load_model(str(tmp_path))


def test_encoders_a_text_forward_never_reaches_are_frozen(sweep, tmp_path):
    from plait.models import adapter_for
    from plait.spec.load import load_model

    assert sweep.write_tiny("phi4_multimodal", tmp_path) is None
    adapter = adapter_for(load_model(str(tmp_path)))
    model = adapter.build("meta")
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all(".embed_tokens_extend." in n for n in frozen)
    assert all(p.requires_grad for n, p in model.named_parameters() if n.startswith(adapter.blocks_path + "."))
    assert model.get_parameter("model.embed_tokens.weight").requires_grad


def test_an_embedding_that_normalizes_is_no_norm():
    from transformers.models.inkling.modeling_inkling import InklingNormedEmbedding, InklingRMSNorm

    with torch.device("meta"):
        assert not is_norm_module(InklingNormedEmbedding(10, 8, padding_idx=0, norm_eps=1e-6))
        assert is_norm_module(InklingRMSNorm(8))
        assert not is_norm_module(nn.Linear(2, 2))
