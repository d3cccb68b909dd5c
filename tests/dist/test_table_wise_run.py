"""Table-wise embedding tables on ranks (plait.execute.embedding_tables): each table whole on one tensor-parallel
rank, its lookup's rows broadcast and its rows updated on the owner alone by row-wise Adagrad, beside a replicated
table, EQUAL to one process (one launch of 2 ranks)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from plait.operators.planner import auto_plan
from plait.spec.clusters import CLUSTER_PRESETS

pytestmark = pytest.mark.dist
TESTS = Path(__file__).resolve().parents[1]


def test_check_proves_table_wise_tables_equal(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))
    plan = auto_plan("equal_tables:build", "equal_tables:batch", CLUSTER_PRESETS["local-cpu"], global_batch=8, tp=2,
                     table_optimizer="rowwise_adagrad",
                     pins={"tables.0.weight": "T", "tables.1.weight": "T1", "tables.2.weight": "T1",
                           "tables.3.weight": "R"})
    placed = [plan.operators.params[f"tables.{t}.weight"] for t in range(4)]
    assert placed == ["T0", "T1", "T1", "R"]  # the unpinned owner packed onto the rank the pinned ones leave empty
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    env = {**os.environ, "PLAIT_OMP_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "plait", "check", "--plan", str(path), "--steps", "3"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0 and "EQUAL" in done.stdout, done.stdout[-2000:] + done.stderr[-3000:]
