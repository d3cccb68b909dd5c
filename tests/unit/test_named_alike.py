"""A model is priced the same whichever way it is named: the published config.json of every family plait has closed
forms for (its class measured on meta, plait.hf.spec) against its preset, or plait's reference decoder of the
config's shape where there is no preset, pinned alike. Peak memory and step time agree within 5% at 2K to 128K
tokens, under each recompute mode, alone and under tp, cp and pp, in both precisions the executor runs on GPUs
(fully_shard's 16-bit parameters; autocast over DDP's fp32 ones), once the bytes the class keeps beyond the
reference layer are set apart (plait.cost.model.CLASS_ACTIVATIONS); those bytes are what the class's source says it
keeps (`class_extra_per_token`), and none under selective or full recompute but what GPT-2's fused q|k|v GEMM saves."""

from __future__ import annotations

import dataclasses
import json
from functools import lru_cache
from pathlib import Path

import pytest

from plait.cost.model import CLASS_ACTIVATIONS, predict
from plait.legality import plan_problems
from plait.plan import Plan
from plait.spec import TrainSpec
from plait.spec.clusters import CLUSTER_PRESETS
from plait.spec.load import load_model, model_from_hf_config
from plait.spec.models import MODEL_PRESETS

HF = Path(__file__).resolve().parents[2] / "examples" / "hf"
FAMILIES = {"llama-2-7b": "llama2-7b", "llama-2-13b": "llama2-13b", "llama-3-8b": "llama3-8b",
            "llama-3-70b": "llama3-70b", "mistral-7b": None, "qwen2-0.5b": None, "qwen3-8b": None, "gemma-7b": None,
            "gpt2": None, "mixtral-8x7b": "mixtral-8x7b", "qwen3-30b-a3b": None}
"""Published config.json under examples/hf -> its preset (None: plait's reference decoder of its shape)."""
SEQ_LENS = (2048, 8192, 32768, 131072)
LAYOUTS = {"alone": dict(dp=2), "tp": dict(dp=1, tp=2), "cp": dict(dp=1, cp=2), "pp": dict(dp=1, pp=2)}
CARRIERS = {"fully_shard": 3, "ddp": 0}  # ZeRO stage: 16-bit parameters and residual stream / autocast over fp32
A100 = CLUSTER_PRESETS["a100-80g"]
TOLERANCE = 0.05


@lru_cache(maxsize=None)
def named(family: str):
    """(the config.json's ModelSpec, measured; the preset's, or the reference decoder of the config's shape)."""
    directory = HF / family
    preset = FAMILIES[family]
    config = json.loads((directory / "config.json").read_text())
    return load_model(str(directory)), MODEL_PRESETS[preset] if preset else model_from_hf_config(config)


def _plan(model, layout: str, carrier: str, mode: str, seq_len: int) -> Plan:
    """One plan on two A100s: two replicas, or one of tp2, cp2 or pp2 (four micro-batches through the pipeline)."""
    degrees = LAYOUTS[layout]
    stages, micro_batches = degrees.get("pp", 1), 4 if layout == "pp" else 1
    return Plan(degrees=degrees, zero=CARRIERS[carrier], sequence_parallel=layout == "tp",
                recompute=(mode,) * stages, micro_batch=1, num_micro_batches=micro_batches, model=model,
                train=TrainSpec(global_batch=degrees["dp"] * micro_batches, seq_len=seq_len),
                cluster=dataclasses.replace(A100, num_devices=2))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_config_json_is_priced_as_its_preset(family):
    hf, preset = named(family)
    checked = 0
    for seq_len in SEQ_LENS:
        for layout in LAYOUTS:
            for carrier in CARRIERS:
                for mode in ("none", "selective", "full"):
                    mine, theirs = (_plan(m, layout, carrier, mode, seq_len) for m in (hf, preset))
                    rules = [{v.rule for v in plan_problems(p)} for p in (mine, theirs)]
                    # refused alike, or the class runs what plait's reference decoder cannot (a window of any length)
                    assert rules[0] <= rules[1], (family, seq_len, layout)
                    a, b = predict(mine), predict(theirs)
                    where = (family, seq_len, layout, carrier, mode)
                    own = a.memory_parts.get(CLASS_ACTIVATIONS, 0.0)
                    checked += 1
                    assert a.step_time_s == pytest.approx(b.step_time_s, rel=TOLERANCE), where
                    if mode == "selective" and hf.num_experts:
                        continue  # two executors: see test_selective_experts_keep_what_each_executor_saves
                    assert a.peak_memory_bytes - own == pytest.approx(b.peak_memory_bytes, rel=TOLERANCE), where
                    if mode != "none":  # what the class keeps beyond is recomputed: one block's at most
                        assert own <= TOLERANCE * a.peak_memory_bytes, where
    assert checked == len(SEQ_LENS) * len(LAYOUTS) * len(CARRIERS) * 3


@pytest.mark.parametrize("family", ["mixtral-8x7b", "qwen3-30b-a3b"])
def test_selective_experts_keep_what_each_executor_saves(family):
    """A mixture-of-experts config.json runs transformers' class, the preset plait's reference MoE: under selective
    recompute each keeps every second GEMM output of its own order. The class runs each routed expert as one fused
    gate|up GEMM and a down GEMM, so it keeps every slot's down projection (k·h per token: 2·4096 for Mixtral,
    8·2048 for Qwen3-MoE) besides the attention's and the router's, measured on meta as the eager loop runs."""
    hf, _ = named(family)
    block = hf.blocks[0]
    kept = block.selective_elements_per_token
    attention = hf.q_size + hf.kv_size + hf.q_size  # q GEMM, v GEMM, the fused kernel's output
    assert kept == attention + hf.num_experts + hf.experts_per_token * hf.hidden_size
    assert block.selective_fp32_elements_per_token == hf.num_heads  # the logsumexp


def test_a_position_table_shorter_than_the_sequence_is_refused_by_its_field(capsys):
    """GPT-2's learned table holds 1024 positions: 2048 tokens are refused before any pricing, in one line naming the
    field and the file (plait.train.resolve.check_position_limit), exit 2, never priced from the 64 and 128 tokens
    its blocks were measured at."""
    from plait.cli import main

    code = main(["plan", "--model", str(HF / "gpt2"), "--cluster", "a100-80g", "--devices", "8", "--global-batch", "8",
                 "--seq-len", "2048", "--tp", "1", "--pp", "1"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1
    assert "max_position_embeddings=1024" in lines[0] and "config.json" in lines[0] and "2048" in lines[0]
