"""A decoder planned operator by operator, proved on 2 ranks: plait's reference Llama (RoPE, grouped-query
attention through CPU's fused kernel and plait's rule for it), the solver's own plan (priced as Megatron's pattern,
tests/unit/test_operators_decoders.py), `plait check` EQUAL to one process."""

from __future__ import annotations

from pathlib import Path

import pytest

from plait.operators.planner import auto_plan
from plait.spec.clusters import CLUSTER_PRESETS

from test_operator_plans import check_equal  # tests/dist is on sys.path (pytest's default import mode)

pytestmark = pytest.mark.dist
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "operators"


def test_check_proves_the_automatic_llama_plan_equal(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    plan = auto_plan("decoders:llama", "decoders:tokens", CLUSTER_PRESETS["local-cpu"], global_batch=4, tp=2)
    ops = plan.operators
    assert not ops.replicated_ops and ops.step_time_s < ops.data_parallel_step_time_s
    assert sum(p != "R" for p in ops.params.values()) >= 14  # every projection of both blocks split
    check_equal(plan, tmp_path)


def test_check_proves_the_hf_llama_with_float32_norms_equal_in_float64(tmp_path, monkeypatch):
    """transformers' LlamaRMSNorm computes in float32. Its output's gradient, a pending sum over the column-split
    q/k/v (gate/up) readers, is now all-reduced at the value, before the norm's backward casts it: each rank's
    partial gradient went through the float32 norm and was summed later (the row-split projection's backward),
    which one process does not do (9.6e-8 relative gradients, DIFFERENT at global batch 8 in float64)."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    plan = auto_plan("decoders:hf_llama", "decoders:tokens", CLUSTER_PRESETS["local-cpu"], global_batch=8, tp=2)
    assert plan.operators.params["model.model.layers.0.self_attn.q_proj.weight"] == "S0"
    check_equal(plan, tmp_path)
