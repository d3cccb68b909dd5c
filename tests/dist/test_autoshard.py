"""Per-operator sharding end to end: plans of modules that are not decoders, `plait check` on their ranks (DLRM
dp2 x tp2: tensor-parallel placements from the solver, fully_shard over dp, a fused table; ResNet dp2: BatchNorm
synchronised over dp), EQUAL to one process. (The other examples' runs on 2 and 4 ranks are in docs/any-module.md; two
launches here keep the suite's time.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from plait.operators.planner import auto_plan
from plait.spec.clusters import CLUSTER_PRESETS

pytestmark = pytest.mark.dist
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "auto"


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


def check_equal(plan, tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    env = {**os.environ, "PLAIT_OMP_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(EXAMPLES), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "plait", "check", "--plan", str(path), "--steps", "2"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "EQUAL" in done.stdout


def test_plait_train_runs_a_per_operator_plan_with_its_own_batches_loss_and_checkpoints(tmp_path):
    """examples/auto/train-dlrm.toml on 2 ranks: planned per operator at launch, the module's own batches and
    the loss it returns, logged per step, checkpointed; step 1's loss is one process's on the same batch."""
    import json

    import torch

    from plait.execute.autoshard import build_module, make_batch

    root = EXAMPLES.parents[1]
    env = {**os.environ, "PLAIT_OMP_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "plait", "train", str(EXAMPLES / "train-dlrm.toml"),
                           "--set", "train.steps=4", "--set", "checkpoint.every=2",
                           "--set", f'log.dir="{tmp_path}"', "--set", f'checkpoint.dir="{tmp_path / "ckpt"}"'],
                          capture_output=True, text=True, env=env, cwd=root, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(r["loss"] > 0 for r in rows)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_000002", "step_000004"]
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["operators"]["fused_tables"] == {"table.weight": "sgd"} and plan["degrees"]["tp"] == 2
    sys.path.insert(0, str(EXAMPLES))
    try:
        model = build_module("dlrm:build", seed=0, dtype=torch.float32)
        first = model(*make_batch("dlrm:batch", 16, 0, 0, torch.float32)).item()
    finally:
        sys.path.remove(str(EXAMPLES))
    assert abs(rows[0]["loss"] - first) < 1e-5 * abs(first)
