"""A decoder planned operator by operator, proved on 2 ranks: plait's reference Llama (RoPE, grouped-query
attention through CPU's fused kernel and plait's rule for it), the solver's own plan (priced as Megatron's pattern,
tests/unit/test_operators_decoders.py), `plait check` EQUAL to one process."""

from __future__ import annotations

from pathlib import Path

import pytest

from plait.operators.planner import auto_plan
from plait.spec.clusters import CLUSTER_PRESETS

from test_autoshard import check_equal  # tests/dist is on sys.path (pytest's default import mode)

pytestmark = pytest.mark.dist
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "auto"


def test_check_proves_the_automatic_llama_plan_equal(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    plan = auto_plan("decoders:llama", "decoders:tokens", CLUSTER_PRESETS["local-cpu"], global_batch=4, tp=2)
    ops = plan.operators
    assert not ops.replicated_ops and ops.step_time_s < ops.data_parallel_step_time_s
    assert sum(p != "R" for p in ops.params.values()) >= 14  # every projection of both blocks split
    check_equal(plan, tmp_path)
