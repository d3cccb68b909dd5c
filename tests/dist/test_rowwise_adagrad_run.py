"""Fused row-wise Adagrad on ranks (plait.execute.embedding_tables): DLRM on dp2 x tp2 with its table split by columns, each
row's sum of squares all-reduced over the tensor-parallel ranks and the touched rows exchanged over dp, EQUAL to
one process running the same optimizer on the whole table (one launch of 4 ranks)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from plait.operators.planner import auto_plan
from plait.spec.clusters import CLUSTER_PRESETS

sys.path.insert(0, str(Path(__file__).parent))
from operator_check import check_equal  # noqa: E402

pytestmark = pytest.mark.dist
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "operators"


def test_check_proves_rowwise_adagrad_on_a_column_split_table_equal(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    plan = auto_plan("dlrm:build", "dlrm:batch", CLUSTER_PRESETS["local-cpu"], global_batch=16, dp=2, tp=2,
                     table_optimizer="rowwise_adagrad", pins={"table.weight": "S1"})
    assert plan.operators.fused_tables == {"table.weight": "rowwise_adagrad"}
    assert plan.operators.params["table.weight"] == "S1"
    check_equal(plan, tmp_path, steps=3)
