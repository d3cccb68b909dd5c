"""transformers' own experts, read from the class (plait.hf.experts), refused or admitted by legality, and their
checkpoint tensors fused as transformers fuses them. Pure: models built on meta, no process group."""

from __future__ import annotations

import pytest

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
             max_position_embeddings=64)


def meta_model(model_type: str, **overrides):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **{**SMALL, **overrides})
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def test_the_experts_and_their_moe_block_are_read_from_the_module_tree():
    from plait.hf.experts import MOE_BLOCK, MOE_REPLICATE, class_experts, moe_tensor_styles

    block = meta_model("qwen2_moe", shared_expert_intermediate_size=16).model.layers[0]
    assert [path for path, _ in class_experts(block)] == ["mlp.experts"]
    placed = ["mlp.experts", "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj",
              "self_attn.q_proj"]
    # the router and the shared expert's gate are placed nowhere by the class's plan: kept whole
    assert moe_tensor_styles([block], placed) == {"mlp": MOE_BLOCK, "mlp.gate": MOE_REPLICATE,
                                                  "mlp.shared_expert_gate": MOE_REPLICATE}
    dense = meta_model("qwen2").model.layers[0]
    assert class_experts(dense) == [] and moe_tensor_styles([dense], []) == {}


@pytest.mark.parametrize("model_type,shapes,inner,hidden,packed", [
    # [E, 2I, h] and [E, h, I]: gate|up concatenated, split over tp each on its own
    ("qwen3_moe", {"gate_up_proj": (4, 32, 32), "down_proj": (4, 32, 16)}, {"gate_up_proj": 1, "down_proj": 2},
     {"gate_up_proj": 2, "down_proj": 1}, {"gate_up_proj": 2, "down_proj": 1}),
    # transposed [E, h, 2I] / [E, I, h], gate and up interleaved, with biases ([E, 2I], [E, h]: the latter unsplit)
    ("gpt_oss", {"gate_up_proj": (4, 32, 32), "gate_up_proj_bias": (4, 32), "down_proj": (4, 16, 32),
                 "down_proj_bias": (4, 32)},
     {"gate_up_proj": 2, "gate_up_proj_bias": 1, "down_proj": 1, "down_proj_bias": None},
     {"gate_up_proj": 1, "gate_up_proj_bias": 1, "down_proj": 2, "down_proj_bias": 1},
     {"gate_up_proj": 1, "gate_up_proj_bias": 1, "down_proj": 1, "down_proj_bias": 1}),
])
def test_which_dimension_each_parallelism_splits(model_type, shapes, inner, hidden, packed):
    from plait.hf.experts import class_experts, hidden_dim, inner_dim, packed_parts

    overrides = {"intermediate_size": 16} if model_type == "gpt_oss" else {}
    (_, experts), *_ = class_experts(meta_model(model_type, **overrides).model.layers[0])
    assert {n: tuple(p.shape) for n, p in experts.named_parameters()} == shapes
    for name in shapes:
        assert inner_dim(experts, name) == inner[name], name
        assert hidden_dim(experts, name) == hidden[name], name
        assert packed_parts(experts, name) == packed[name], name


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    """A tiny Qwen3-MoE saved as transformers saves it (its experts one by one on disk), and its ModelSpec."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from plait.spec.load import load_model

    directory = tmp_path_factory.mktemp("qwen3_moe")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**SMALL))
    model.save_pretrained(str(directory))
    return directory, model, load_model(str(directory))


def test_a_class_with_an_expert_plan_runs_under_ep_and_tp(qwen3_moe):
    from plait.legality import expert_problems, tensor_problems

    _, _, spec = qwen3_moe
    assert spec.source.startswith("hf:"), "the class itself runs, not plait's MoE decoder"
    assert (spec.num_experts, spec.experts_per_token, spec.moe_ffn_hidden_size) == (4, 2, 16)
    assert spec.ep_plan["layers.*.mlp.experts"] == "ep_dispatch_experts"
    assert spec.tp_plan["layers.*.mlp.gate"] == "plait:replicate", "the router, placed nowhere, kept whole"
    assert expert_problems(spec, 2) == [] and expert_problems(spec, 4) == []
    assert tensor_problems(spec, 2) == []
    (problem,) = expert_problems(spec, 3)
    assert problem.rule == "ep-divides-experts"


@pytest.mark.parametrize("ep_plan,rule,named", [
    ({}, "ep-needs-class-plan", "base_model_ep_plan"),
    ({"layers.*.mlp.experts": "a_future_dispatch"}, "ep-style-runs", "a_future_dispatch"),
])
def test_what_plait_cannot_split_is_refused_naming_the_rule(qwen3_moe, ep_plan, rule, named):
    from plait.legality import expert_problems, tensor_problems

    _, _, spec = qwen3_moe
    (problem,) = expert_problems(spec.replace(ep_plan=ep_plan), 2)
    assert problem.rule == rule and named in str(problem) and spec.name in str(problem)
    # the class's own names for its experts' tensor split (Aria's packed_rowwise) are plait's to translate
    aria_like = spec.replace(tp_plan={**spec.tp_plan, "layers.*.mlp.experts.gate_up_proj": "packed_rowwise"})
    assert tensor_problems(aria_like, 2) == []


def test_experts_saved_one_by_one_are_fused_as_transformers_fuses_them(qwen3_moe):
    from safetensors import safe_open

    from plait.hf.checkpoint import _stacked_experts, weight_files

    directory, model, _ = qwen3_moe
    files = weight_files(directory)
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in files, "save_pretrained wrote them one by one"

    def read(key):
        with safe_open(str(files[key]), framework="pt") as f:
            return f.get_tensor(key)

    experts = model.model.layers[1].mlp.experts
    for leaf in ("gate_up_proj", "down_proj"):
        fused = _stacked_experts(f"model.layers.1.mlp.experts.{leaf}", files, read)
        assert fused is not None and fused.equal(getattr(experts, leaf).detach()), leaf
    assert _stacked_experts("model.layers.1.mlp.gate.weight", files, read) is None


def test_the_planner_prices_the_class_experts_as_plait_prices_its_own(qwen3_moe):
    """The measured ModelSpec of a transformers MoE class: its experts' share of each block (what ep splits and the
    router's imbalance stretches) equals the closed forms plait prices its own MoE decoder with."""
    from plait.cost.compute import Slicing, expert_flops, sliced_layer_cost
    from plait.cost.memory import expert_params, layer_params
    from plait.spec.clusters import CLUSTER_PRESETS

    _, _, spec = qwen3_moe
    closed = spec.replace(blocks=(), pre_params=None, post_params=None)
    weights = 4 * 3 * 32 * 16  # E experts of gate, up [I, h] and down [h, I]
    assert all(b.expert_params == weights for b in spec.blocks)
    assert expert_flops(spec, 10) == expert_flops(closed, 10) == 10 * 2 * 2 * weights / 4  # top-2 of 4 per token
    for tp, ep in ((1, 2), (2, 2), (1, 4)):
        assert expert_params(spec, tp, ep) == expert_params(closed, tp, ep) == weights / tp / ep
        assert layer_params(spec, 1, 1) - layer_params(spec, 1, ep) == pytest.approx(weights * (1 - 1 / ep))
    cluster = CLUSTER_PRESETS["local-cpu"]

    def forward(model, imbalance):
        return sliced_layer_cost(model.replace(router_imbalance=imbalance), cluster, 16, 1, Slicing(ep=2)).fwd

    # the busiest expert rank's extra slots cost what they cost plait's own MoE of the same shape
    assert forward(spec, 2.0) > forward(spec, 1.0)
    assert (forward(spec, 2.0) - forward(spec, 1.0)) == pytest.approx(forward(closed, 2.0) - forward(closed, 1.0))


def test_layers_of_one_class_with_and_without_experts_are_measured_apart():
    """DeepSeek-V3's first layers hold a dense MLP, the others experts, in one class: each measured as it is."""
    from plait.hf.spec import _layer_kind

    model = meta_model("deepseek_v3", n_routed_experts=4, first_k_dense_replace=1, num_hidden_layers=3, n_group=1,
                       topk_group=1, q_lora_rank=16, kv_lora_rank=8, qk_rope_head_dim=8, qk_nope_head_dim=8,
                       v_head_dim=8)
    kinds = [_layer_kind(model.config, i, layer) for i, layer in enumerate(model.model.layers)]
    assert kinds[0] != kinds[1] == kinds[2]


def test_q_k_norms_a_class_plan_leaves_unmarked_sum_their_gradient_over_tp(tmp_path):
    """Sarvam-MoE's q/k norms over head_dim read tp-sharded heads, which its class's plan does not say (it marks no
    norm): plait gives them Qwen3's "head_norm" (replicated_with_grad_allreduce) rather than a partial gradient."""
    from transformers import AutoConfig

    from plait.models import adapter_for
    from plait.spec.load import load_model

    AutoConfig.for_model("sarvam_moe", **SMALL).save_pretrained(str(tmp_path))
    block = adapter_for(load_model(str(tmp_path))).tp_plan().block
    assert block["self_attn.q_norm"] == block["self_attn.k_norm"] == "head_norm"
    assert "input_layernorm" in block and block["input_layernorm"] == "norm", "the block's own norms stay norms"
