"""A tensor-parallel plan for Hugging Face classes that declare none, derived from their layers
(plait.hf.tensor_plan): StableLM's plain projections split column-wise in and row-wise out (its tp2 run is
EQUAL to one process: tests/dist/test_hf_families.py); a fused q|k|v projection (Bloom), a module per head
(StableLM's qk_layernorm) and projections in the layer itself (BioGPT) are refused naming the family and why, and
a pinned tp says so in one sentence."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from plait.errors import ConfigError

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64)


def derived(folder: Path):
    from plait.hf.adapter import HFAdapter
    from plait.hf.tensor_plan import Heads, derived_tensor_plan
    from plait.spec import ModelSpec

    probe = HFAdapter(ModelSpec(name=folder.name, source=f"hf:{folder}", num_layers=1, hidden_size=1, num_heads=1,
                                vocab_size=1))
    return derived_tensor_plan(probe, Heads(heads=4, kv=2, head_dim=16))


def test_plain_projections_split_column_wise_in_and_row_wise_out(tmp_path: Path) -> None:
    import transformers

    transformers.StableLmConfig(**TINY, num_key_value_heads=2).save_pretrained(str(tmp_path / "stablelm"))
    plan, why = derived(tmp_path / "stablelm")
    assert why is None
    assert plan == {f"layers.*.{path}": f"plait:{style}" for path, style in [
        ("self_attn.q_proj", "colwise"), ("self_attn.k_proj", "colwise"), ("self_attn.v_proj", "colwise"),
        ("self_attn.o_proj", "rowwise"), ("mlp.gate_proj", "colwise"), ("mlp.up_proj", "colwise"),
        ("mlp.down_proj", "rowwise")]}


@pytest.mark.parametrize("family,config,why", [
    ("stablelm", dict(num_key_value_heads=2, qk_layernorm=True),
     "self_attn.q_layernorm.norms holds one module per head"),
    ("bloom", dict(n_layer=2, n_head=4), "self_attention's projections (query_key_value 64->192, dense 64->64) are not "
                                         "plain"),
    ("biogpt", dict(num_hidden_layers=2), "its projections fc1, fc2 sit in the decoder layer itself"),
])
def test_layers_plait_cannot_split_are_refused_saying_why(tmp_path: Path, family: str, config: dict, why: str) -> None:
    import transformers

    sizes = {k: v for k, v in TINY.items() if family != "bloom" or k in ("vocab_size", "hidden_size")}
    transformers.AutoConfig.for_model(family, **{**sizes, **config}).save_pretrained(str(tmp_path / family))
    plan, reason = derived(tmp_path / family)
    assert plan == {} and reason.startswith(why), reason


def test_a_pinned_tp_names_the_family_and_what_works_in_one_sentence() -> None:
    from plait.legality import NO_TENSOR_PLAN, tensor_problems
    from plait.search import plan
    from plait.spec import TrainSpec
    from plait.spec.models import MODEL_PRESETS

    model = dataclasses.replace(MODEL_PRESETS["tiny-llama"], name="persimmon", source="hf:/models/persimmon",
                                tp_plan={NO_TENSOR_PLAN: "attn's projections are not plain"})
    (problem,) = tensor_problems(model, 2)
    assert problem.rule == "tp-needs-class-plan"
    assert str(problem.message) == ("tp=2: persimmon declares no tensor-parallel plan (base_model_tp_plan), and plait "
                                    "cannot split its layers itself: attn's projections are not plain; use tp=1 (data "
                                    "parallelism, FSDP and pipelines need no plan)")
    with pytest.raises(ConfigError) as refused:
        plan(model, "local-cpu", TrainSpec(global_batch=4, seq_len=16), num_devices=2, tp=2)
    assert str(refused.value).startswith(problem.message + "; valid tp for persimmon on 2 devices: 1"), refused.value
    assert "does not divide" not in str(refused.value)
