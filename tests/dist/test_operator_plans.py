"""Per-operator sharding end to end: plans of modules that are not decoders, `plait check` on their ranks (DLRM
dp2 x tp2: tensor-parallel placements from the solver, fully_shard over dp, a fused table; ResNet dp2: BatchNorm
synchronised over dp), EQUAL to one process. (`plait train` of per-operator plans: tests/dist/test_train_modules.py;
the other examples' runs on 2 and 4 ranks are in docs/any-module.md; two
launches here keep the suite's time.)"""

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


def test_check_proves_the_split_fused_table_equal_under_fully_shard(tmp_path, monkeypatch):
    """DLRM on dp2 x tp2 under a budget its whole table does not fit (4 MiB table, 2.3 MiB per rank): the solver
    splits the table on tp, its lookup's backward updates its rows (fused row-wise SGD, the rows exchanged over
    dp), fully_shard shards the rest over dp; four ranks equal one process running the same optimizers. One launch
    covers the executor's whole path."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    plan = auto_plan("dlrm:build", "dlrm:batch", CLUSTER_PRESETS["local-cpu"], global_batch=16, dp=2, tp=2,
                     memory_limit=2.3 * 2**20, table_optimizer="sgd")
    assert plan.operators.params["table.weight"] != "R"
    assert plan.operators.fused_tables == {"table.weight": "sgd"}
    assert plan.operators.peak_memory_bytes <= 2.3 * 2**20 and "dp2 tp2" in plan.describe()
    check_equal(plan, tmp_path)


def test_check_proves_batch_norm_synchronised_over_data_parallel_ranks_equal(tmp_path, monkeypatch):
    """ResNet on dp2: each BatchNorm's statistics summed over both ranks' halves of the batch (forward and
    backward), so two ranks equal one process over the whole batch (unsynchronised: loss 1e-3 apart)."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    plan = auto_plan("resnet:build", "resnet:batch", CLUSTER_PRESETS["local-cpu"], global_batch=16, dp=2, tp=1)
    assert len(plan.operators.synchronised_norms) == 5
    check_equal(plan, tmp_path)
