"""The generic Hugging Face adapter in one process: what it reads from a class, and two pipeline stages built on meta,
materialized with `to_empty` (buffers then hold garbage until the adapter restores them) and loaded with the
model's weights, computing exactly the class's own logits."""

from __future__ import annotations

import pytest
import torch

from plait.errors import ConfigError
from plait.models import adapter_for
from plait.hf.structure import discover
from plait.hf.tiny import write_tiny_config
from plait.models.stage import build_stage
from plait.spec.load import load_model


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {family: write_tiny_config(family, root / family) for family in ("gemma", "gpt2", "qwen3")}


@pytest.mark.parametrize("family", ["gemma", "gpt2", "qwen3"])
def test_two_stages_from_meta_compute_the_class_logits(tiny_dirs, family):
    adapter = adapter_for(load_model(str(tiny_dirs[family])))
    model = adapter.build("cpu")
    adapter.initialize(model, seed=0)
    tokens = torch.randint(0, 60, (2, 8))
    expected = adapter.forward(model, tokens)
    weights = model.state_dict()
    meta, half = adapter.build("meta"), adapter.num_layers // 2
    stages = [build_stage(adapter, meta, range(half), first=True, last=False, seq_len=8),
              build_stage(adapter, meta, range(half, adapter.num_layers), first=False, last=True, seq_len=8)]
    for stage in stages:
        stage.to_empty(device="cpu")
        stage.retie()
        adapter.reset_buffers(stage)
        stage.load_state_dict({k: v for k, v in weights.items() if k in stage.state_dict()}, strict=False)
        stage.retie()
    assert torch.equal(stages[1](stages[0](tokens)), expected)


def test_layout_read_from_the_class(tiny_dirs):
    gpt2 = adapter_for(load_model(str(tiny_dirs["gpt2"])))
    assert (gpt2.blocks_path, gpt2.pre, gpt2.post) == ("transformer.h", ("transformer.wte", "transformer.wpe"),
                                                       ("transformer.ln_f", "lm_head"))
    assert gpt2.tied == {"lm_head.weight": "transformer.wte.weight"}
    gemma = adapter_for(load_model(str(tiny_dirs["gemma"])))
    norm = "model.layers.0.input_layernorm.weight"
    assert torch.equal(gemma.initial_tensor(norm, (32,), 0), torch.zeros(32))  # the class's (1 + w) norm init
    assert gemma.tp_plan().block["self_attn.k_proj"] == "colwise_kv:2"  # 2 kv heads: replicated where tp > 2


def test_a_class_without_one_layer_list_is_refused():
    class Base(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.ModuleList([torch.nn.Linear(2, 2)]), torch.nn.ModuleList([torch.nn.Linear(2, 2)])

    class Model(torch.nn.Module):
        base_model_prefix = "model"

        def __init__(self):
            super().__init__()
            self.model = Base()

        @property
        def base_model(self):
            return self.model

    with pytest.raises(ConfigError, match=r"decoder layers are ambiguous .*: a, b\); plait needs exactly one \[rule hf-one-layer-list\]"):
        discover(Model(), type("Config", (), {"model_type": "two-lists"})())
