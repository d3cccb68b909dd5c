"""Table-wise embedding tables on ranks (plait.execute.embedding_tables): each table whole on one tensor-parallel
rank, its lookup's rows broadcast and its rows updated on the owner alone by row-wise Adagrad, beside a replicated
table, EQUAL to one process (one launch of 2 ranks)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from plait.operators.planner import auto_plan
from plait.spec.clusters import CLUSTER_PRESETS

sys.path.insert(0, str(Path(__file__).parent))
from operator_check import check_equal  # noqa: E402

pytestmark = pytest.mark.dist
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "operators"


def test_check_proves_table_wise_tables_equal(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    plan = auto_plan("equal_tables:build", "equal_tables:batch", CLUSTER_PRESETS["local-cpu"], global_batch=8, tp=2,
                     table_optimizer="rowwise_adagrad",
                     pins={"tables.0.weight": "T", "tables.1.weight": "T1", "tables.2.weight": "T1",
                           "tables.3.weight": "R"})
    placed = [plan.operators.params[f"tables.{t}.weight"] for t in range(4)]
    assert placed == ["T0", "T1", "T1", "R"]  # the unpinned owner packed onto the rank the pinned ones leave empty
    check_equal(plan, tmp_path, steps=3)


def _train(config: Path, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "plait", "train", str(config), *args], capture_output=True, text=True,
                          env={**os.environ, "PLAIT_OMP_THREADS": "1"}, timeout=400)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout + done.stderr


def _losses(log: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (log / "metrics.jsonl").read_text().splitlines()]


def test_rowwise_adagrad_state_and_table_wise_tables_resume_under_another_placement(tmp_path):
    """4 steps on 2 ranks with three tables table-wise and one split by rows (its rows made whole at the lookup: a
    row split's pending sum does not survive the pooling's sum in torch 2.13's DTensor), row-wise Adagrad; step 2's checkpoint
    resumed with the placements moved (the table-wise ones split by rows or replicated, the row-split one
    table-wise): steps 3 and 4 and the final weights are the first run's, the accumulators read back as the
    tables' rows are (a resume that restarted them moved each touched row by a step sized as a first one's)."""
    def config(place: str) -> Path:
        path = tmp_path / f"run-{len(list(tmp_path.glob('run-*')))}.toml"
        path.write_text(f'''[model]
module = "equal_tables:build"
path = "{EXAMPLES}"
[data]
batch = "equal_tables:batch"
[train]
steps = 4
global_batch = 8
[optimizer]
lr = 0.05
warmup = 1
[plan]
devices = 2
pins = {{ tp = 2, table_optimizer = "rowwise_adagrad", place = {{ {place} }} }}
[checkpoint]
dir = "{tmp_path / "ckpt"}"
every = 2
[log]
dir = "{tmp_path / "log"}"
progress = false
save_model = true
''')
        return path

    first = config('"tables.0.weight" = "T", "tables.1.weight" = "T1", "tables.2.weight" = "T1", '
                   '"tables.3.weight" = "S0", "tables.3" = "R"')
    _train(first)
    unbroken = _losses(tmp_path / "log")
    assert len(unbroken) == 4
    weights = torch.load(tmp_path / "log" / "model.pt")
    plan = json.loads((tmp_path / "log" / "plan.json").read_text())["operators"]["params"]
    assert [plan[f"tables.{t}.weight"] for t in range(4)] == ["T0", "T1", "T1", "S0"]
    shutil.rmtree(tmp_path / "ckpt" / "step_000004")
    moved = config('"tables.0.weight" = "S0", "tables.0" = "R", "tables.1.weight" = "R", "tables.2.weight" = "R", '
                   '"tables.3.weight" = "T"')
    assert "resumed from" in _train(moved, "--resume")
    plan = json.loads((tmp_path / "log" / "plan.json").read_text())["operators"]["params"]
    assert [plan[f"tables.{t}.weight"] for t in range(4)] == ["S0", "R", "R", "T0"]
    resumed = _losses(tmp_path / "log")
    for before, after in zip(unbroken[2:], resumed[2:]):
        assert abs(before - after) <= 2e-6, (unbroken, resumed)  # metrics.jsonl keeps 6 decimals
    again = torch.load(tmp_path / "log" / "model.pt")  # the tables whole, from their owners (full_state_dict)
    assert set(again) == set(weights)
    for name, tensor in weights.items():
        torch.testing.assert_close(again[name], tensor, rtol=1e-5, atol=1e-7, msg=name)


def test_check_proves_the_distinct_row_exchange_equal(tmp_path, monkeypatch):
    """dp2: each rank's distinct touched rows, their gradients summed, exchanged (padded to the most a rank touched,
    found by one all-reduce for every table), the plan naming every table for it; EQUAL (one launch of 2 ranks)."""
    import dataclasses

    monkeypatch.syspath_prepend(str(EXAMPLES))
    plan = auto_plan("equal_tables:build", "equal_tables:batch", CLUSTER_PRESETS["local-cpu"], global_batch=8, dp=2,
                     table_optimizer="rowwise_adagrad")
    every = tuple(sorted(plan.operators.fused_tables))
    plan = plan.replace(operators=dataclasses.replace(plan.operators, distinct_exchange=every))
    check_equal(plan, tmp_path, steps=3)
