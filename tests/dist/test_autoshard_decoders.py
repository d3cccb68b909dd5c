"""A decoder planned operator by operator, proved on 2 ranks: plait's reference Llama (RoPE, grouped-query
attention through CPU's fused kernel and plait's rule for it) under Megatron's pattern, pinned on the solver
(semi-automatic mode), `plait check` EQUAL to one process."""

from __future__ import annotations

from pathlib import Path

import pytest

from plait.operators.planner import auto_plan
from plait.spec.clusters import CLUSTER_PRESETS

from test_autoshard import check_equal  # tests/dist is on sys.path (pytest's default import mode)

pytestmark = pytest.mark.dist
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "auto"


def test_check_proves_llama_under_megatrons_pattern_equal(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    from decoders import megatron_pins

    plan = auto_plan("decoders:llama", "decoders:tokens", CLUSTER_PRESETS["local-cpu"], global_batch=4, tp=2,
                     pins=megatron_pins("llama"))
    assert plan.operators.params["model.layers.0.attention.wq.weight"] == "S0" and not plan.operators.replicated_ops
    check_equal(plan, tmp_path)
