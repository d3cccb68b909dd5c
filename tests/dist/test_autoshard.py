"""Per-operator sharding end to end: a plan of a module that is not a decoder, `plait check` on its ranks (dp2 x
tp2: tensor-parallel placements from the solver, fully_shard over dp), EQUAL to one process."""

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


def test_check_proves_a_pinned_per_operator_plan_equal(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    # Pins make the tiny MLP split (alone, the solver keeps it replicated: its tensors are too small for tp2 to
    # pay on local-cpu's links); the rest of the placements and redistributions are the solver's.
    plan = auto_plan("mlp:build", "mlp:batch", CLUSTER_PRESETS["local-cpu"], global_batch=4, dp=2, tp=2,
                     pins={"ups.0.weight": "S0", "downs.0.weight": "S1", "ups.1": "S2"})
    assert plan.operators.params["ups.0.weight"] == "S0" and plan.operators.outputs["ups.1"] == "S2"
    check_equal(plan, tmp_path)
    assert "dp2 tp2" in plan.describe()


def test_check_proves_the_split_embedding_table_equal(tmp_path, monkeypatch):
    """DLRM under a budget its whole table does not fit: the solver splits the table (and runs the operator
    DTensor has no rule for replicated, through register_sharding); two ranks equal one process."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    plan = auto_plan("dlrm:build", "dlrm:batch", CLUSTER_PRESETS["local-cpu"], global_batch=8, tp=2,
                     memory_limit=10 * 2**20)
    assert plan.operators.params["table.weight"] != "R" and plan.operators.replicated_ops
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
