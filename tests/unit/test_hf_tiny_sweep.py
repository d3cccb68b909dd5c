"""The sweep's tiny configs (benchmarks/hf_families.py) and what the adapter does with the classes they opened up:
per-layer lists cut to a layer of each kind, sizes a class leaves None filled, transformers' heterogeneous
per_layer_config shrunk; a multimodal class's encoders that a text forward never reaches frozen; an embedding that
normalizes its output is no norm; a class whose layers take more than hidden states refused by rule."""

from __future__ import annotations

import dataclasses
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


def test_layers_taking_more_than_hidden_states_are_refused_by_rule(sweep, tmp_path):
    from plait.spec.load import load_model

    assert sweep.write_tiny("gemma4_text", tmp_path) is None
    with pytest.raises(ConfigError, match=r"hf-layers-pass-hidden-states"):
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


class _Toy(nn.Module):
    """up (column-wise) -> scale (parameters, on up's output) -> down (row-wise); `side` (parameters) reads the
    whole input and feeds `gate` (column-wise); `leak` (parameters) reads the whole input and adds into the split
    width, where a rank would keep a partial gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Module()
        self.mlp.up, self.mlp.gate, self.mlp.down = nn.Linear(4, 8), nn.Linear(4, 8), nn.Linear(8, 4)
        self.mlp.side, self.mlp.leak = nn.Linear(4, 4), nn.Linear(4, 8)
        self.mlp.scale = _Scale()

    def forward(self, x):
        m = self.mlp
        return m.down(m.scale(m.up(x)) * m.gate(m.side(x)) + m.leak(x))


class _Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return x * self.alpha


class _Mixer(nn.Module):
    """Parameters of its own and a child; mixes the sequence (a running sum), as a linear attention does."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.decay = nn.Linear(4, 4), nn.Parameter(torch.ones(4))

    def forward(self, x):
        return self.proj(x).cumsum(1) * self.decay


class _Hybrid(nn.Module):
    """A block: `norm` -> `mixer` (the plan places nothing in it) added to the residual -> `mlp` (gathered: up
    column-wise, down row-wise); `flat` returns [b * s, h] (no sequence dim to cut)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.mixer = nn.LayerNorm(4), _Mixer()
        self.flat = nn.Linear(4, 4)
        self.mlp = nn.Module()
        self.mlp.up, self.mlp.down = nn.Linear(4, 8), nn.Linear(8, 4)

    def forward(self, x):
        h = x + self.mixer(self.norm(x))
        h = h + self.flat(h.flatten(0, 1)).view_as(h)
        return h + self.mlp.down(self.mlp.up(h))


def test_a_module_outside_any_gathered_parent_runs_whole_where_exact():
    from plait.hf.flow import unplaced_styles

    styles = {"mlp.up": "colwise", "mlp.down": "rowwise"}
    found = unplaced_styles(_Hybrid(), styles, lambda b: b(torch.zeros(1, 4, 4, requires_grad=True)), "unplaced")
    assert found == {"mixer": "replicate_module", "flat": "unplaced"}
    leaky = _Hybrid()  # the mixer's output now also feeds the MLP's split width directly: a partial gradient
    leaky.forward = lambda x: x + leaky.mlp.down(leaky.mlp.up(x) + leaky.mixer(x).repeat(1, 1, 2))
    found = unplaced_styles(leaky, styles, lambda b: b(torch.zeros(1, 4, 4, requires_grad=True)), "unplaced")
    assert found["mixer"] == "unplaced"


def test_unplaced_modules_replicated_only_where_exact():
    from plait.hf.flow import unplaced_styles

    styles = {"mlp.up": "colwise", "mlp.gate": "colwise", "mlp.down": "rowwise"}
    found = unplaced_styles(_Toy(), styles, lambda block: block(torch.zeros(2, 4, requires_grad=True)), "unplaced")
    assert found == {"mlp.side": "replicate", "mlp.scale": "sharded_input", "mlp.leak": "unplaced"}
    experts = {**styles, "mlp.experts": "moe_tp_experts"}  # a style the walk does not know proves nothing
    found = unplaced_styles(_Toy(), experts, lambda block: block(torch.zeros(2, 4, requires_grad=True)), "unplaced")
    assert set(found.values()) == {"unplaced"}


@pytest.mark.parametrize("family,path,style", [("minicpm3", "layers.*.self_attn.q_a_proj", "plait:replicate"),
                                               ("apertus", "layers.*.mlp.act_fn", "plait:sharded_input")])
def test_classes_unplaced_modules_admitted_under_tp(sweep, tmp_path, family, path, style):
    from plait.legality import tensor_problems
    from plait.spec.load import load_model

    assert sweep.write_tiny(family, tmp_path) is None
    spec = load_model(str(tmp_path))
    assert spec.tp_plan[path] == style and "unplaced" not in spec.tp_plan.values()
    assert not tensor_problems(spec, 2)


def test_an_attention_its_plan_leaves_whole_runs_replicated_and_is_priced_so(sweep, tmp_path):
    from plait.cost.compute import layer_cost
    from plait.cost.memory import layer_params
    from plait.legality import tensor_problems
    from plait.models import adapter_for
    from plait.spec.cluster import HostOverheads
    from plait.spec.clusters import CLUSTER_PRESETS
    from plait.spec.load import load_model

    assert sweep.write_tiny("youtu", tmp_path) is None  # its plan places no attention module (MLA)
    spec = load_model(str(tmp_path))
    assert spec.tp_plan["layers.*.self_attn"] == "plait:replicate_module" and not tensor_problems(spec, 2)
    block = adapter_for(spec).tp_plan().block
    assert block["self_attn"] == "replicate_module" and not any(p.startswith("self_attn.") for p in block)
    attention = adapter_for(spec).meta_model.model.layers[0].self_attn
    whole = sum(p.numel() for p in attention.parameters())
    assert all(b.replicated_params == whole and 0 < b.replicated_flops_per_token < b.flops_per_token
               and b.replicated_attention_flops_per_token == b.attention_flops_per_token > 0 for b in spec.blocks)
    # every tensor rank holds the attention whole: its share of a layer is not divided by tp
    plain = spec.replace(blocks=tuple(dataclasses.replace(b, replicated_params=0, replicated_flops_per_token=0.0,
                                                          replicated_attention_flops_per_token=0.0)
                                      for b in spec.blocks))
    assert layer_params(spec, 2) == pytest.approx(layer_params(plain, 2) + whole / 2)
    # kernels alone: on a GPU preset this tiny layer is host-bound (max(kernels, host)), which would hide it
    cluster = dataclasses.replace(CLUSTER_PRESETS["a100-80g"], host=HostOverheads())
    assert layer_cost(spec, cluster, 64, 1, 2, True).fwd > layer_cost(plain, cluster, 64, 1, 2, True).fwd
    assert layer_cost(spec, cluster, 64, 1, 1, False).fwd == layer_cost(plain, cluster, 64, 1, 1, False).fwd


def test_a_linear_attention_partly_placed_runs_whole_without_its_placements(sweep, tmp_path):
    from plait.legality import tensor_problems
    from plait.models import adapter_for
    from plait.spec.load import load_model

    assert sweep.write_tiny("qwen3_5_text", tmp_path) is None  # its plan gathers linear_attn's projections only
    spec = load_model(str(tmp_path))
    assert spec.tp_plan["layers.*.linear_attn.out_proj"] == "colwise_gather_output"
    assert spec.tp_plan["layers.*.linear_attn"] == "plait:replicate_module" and not tensor_problems(spec, 2)
    block = adapter_for(spec).tp_plan().block
    assert block["linear_attn"] == "replicate_module" and not any(p.startswith("linear_attn.") for p in block)
    assert block["self_attn"] == "gather_input" and block["self_attn.o_proj"] == "rowwise"  # the full-attention layer


def test_a_hybrid_replicates_its_linear_attention_and_splits_its_full_one(sweep, tmp_path):
    from plait.execute.tensor import layer_style
    from plait.legality import tensor_problems
    from plait.models import adapter_for
    from plait.spec.load import load_model

    assert sweep.write_tiny("minimax", tmp_path) is None  # "self_attn": lightning (linear) or full attention by layer
    spec = load_model(str(tmp_path))
    mark = "replicate_module:MiniMaxLightningAttention"
    assert spec.tp_plan["layers.*.self_attn"] == "plait:" + mark and not tensor_problems(spec, 2)
    adapter = adapter_for(spec)
    plan = adapter.tp_plan().block
    assert plan["self_attn"] == mark and plan["self_attn.q_proj"] == "colwise"  # the full attention keeps its plan
    kinds = {}
    for index, layer in enumerate(adapter.meta_model.model.layers):
        kinds[type(layer.self_attn).__name__] = (layer_style("self_attn", plan["self_attn"], layer, plan, []),
                                                 spec.blocks[index])
    full, linear = kinds["MiniMaxAttention"], kinds["MiniMaxLightningAttention"]
    assert full[0] == "gather_input" and linear[0] == mark
    lightning = adapter.meta_model.model.layers[1].self_attn
    assert linear[1].replicated_params - full[1].replicated_params == sum(p.numel() for p in lightning.parameters())


def test_an_all_reduce_module_and_a_normalizing_embedding_run_whole(sweep, tmp_path):
    from plait.legality import tensor_problems
    from plait.models import adapter_for
    from plait.spec.load import load_model

    assert sweep.write_tiny("inkling_text", tmp_path) is None
    spec = load_model(str(tmp_path))
    assert spec.tp_plan["layers.*.mlp.shared_experts"] == "all_reduce" and not tensor_problems(spec, 2)
    plan = adapter_for(spec).tp_plan()
    # the shared experts' bare weights the class splits (and sums with all_reduce) are held whole instead
    assert plan.block["mlp.shared_experts"] == "replicate_module"
    assert not any(p.startswith("mlp.shared_experts.") for p in plan.block)
    # its token embedding normalizes each row: a vocabulary-parallel lookup would normalize partial sums
    assert plan.root["model.embed_tokens"] == "position_embedding" and plan.root["lm_head"] == "output"


def test_local_params_split_the_sinks_and_keep_the_gathered_attention(sweep, tmp_path):
    from plait.legality import tensor_problems
    from plait.models import adapter_for
    from plait.spec.load import load_model

    assert sweep.write_tiny("granite_swa", tmp_path) is None  # "self_attn": local_params, "self_attn.sinks": colwise
    spec = load_model(str(tmp_path))
    assert not tensor_problems(spec, 2)
    block = adapter_for(spec).tp_plan().block
    assert block["self_attn.sinks"] == "local_param" and block["self_attn"] == "gather_input"


def test_a_class_whose_layers_read_the_mask_gets_a_causal_one(sweep, tmp_path):
    from plait.models import adapter_for
    from plait.spec.load import load_model

    assert sweep.write_tiny("deepseek_v32", tmp_path / "dsa") is None  # its indexer slices the mask it is given
    assert sweep.write_tiny("qwen3", tmp_path / "qwen3") is None
    dsa = adapter_for(load_model(str(tmp_path / "dsa")))
    assert dsa.needs_causal_mask
    frozen = dsa.untrained_parameters  # its indexer's top-k passes no gradient back: frozen, not waited for
    assert frozen and all(".self_attn.indexer." in name for name in frozen)
    assert not adapter_for(load_model(str(tmp_path / "qwen3"))).needs_causal_mask  # SDPA's causal path, no mask
