"""The learning-rate schedule of [optimizer] and the model FLOPs behind tokens/s and MFU (pure functions)."""

import math

import pytest

from plait.spec.models import MODEL_PRESETS
from plait.train.config import OptimizerConfig
from plait.train.loop import lr_at
from plait.train.metrics import Throughput, model_flops_per_token


def test_warmup_then_cosine_to_the_floor():
    opt = OptimizerConfig(lr=1.0, warmup=4, schedule="cosine", min_lr_ratio=0.1)
    rates = [lr_at(step, opt, total_steps=14) for step in range(14)]
    assert rates[:4] == [0.25, 0.5, 0.75, 1.0]
    assert rates[4] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(rates[4:], rates[5:]))  # decays monotonically
    assert lr_at(14, opt, 14) == pytest.approx(0.1) and lr_at(99, opt, 14) == pytest.approx(0.1)
    assert lr_at(9, opt, 14) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))


def test_constant_schedule_and_no_warmup():
    opt = OptimizerConfig(lr=2e-3, warmup=0, schedule="constant")
    assert {lr_at(step, opt, 10) for step in range(10)} == {2e-3}


def test_model_flops_match_the_papers_formula_for_gpt():
    # Korthikanti et al. (2022): 72·B·L·s·h²·(1 + s/(6h) + V/(12·h·L)) per step, here per token.
    spec = MODEL_PRESETS["gpt3-175b"]
    L, h, V, s = spec.num_layers, spec.hidden_size, spec.vocab_size, 2048
    paper = 72 * L * h * h * (1 + s / (6 * h) + V / (12 * h * L))
    assert model_flops_per_token(spec, s) == pytest.approx(paper, rel=1e-12)


def test_gated_mlp_and_grouped_query_attention_are_counted():
    spec = MODEL_PRESETS["tiny-llama"]  # h=128, kv heads 2 of 4, ffn 256, SwiGLU
    h, kv, f, s = 128, 64, 256, 64
    per_layer = 2 * (2 * h * h + 2 * h * kv + 3 * h * f) + 4 * s * h
    assert model_flops_per_token(spec, s) == 3 * (4 * per_layer + 2 * h * 256)


def test_throughput_is_tokens_and_flops_over_time():
    t = Throughput(tokens_per_step=1000, flops_per_step=4e9, peak_flops_total=2e10)
    assert t.tokens_per_s(0.5) == 2000 and t.mfu(0.5) == pytest.approx(0.4)
