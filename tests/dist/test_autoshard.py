"""Per-operator sharding end to end: a plan of a module that is not a decoder, `plait check` on its ranks (dp2 x
tp2: tensor-parallel placements from the solver, fully_shard over dp), EQUAL to one process. (The other examples'
runs on 2 and 4 ranks are in the README; one launch here keeps the suite's time.)"""

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


def test_check_proves_the_split_embedding_table_equal_under_fully_shard(tmp_path, monkeypatch):
    """DLRM on dp2 x tp2 under a budget its whole table does not fit: the solver splits the table on tp,
    fully_shard shards it further over dp;
    four ranks equal one process. One launch covers the executor's whole path."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    plan = auto_plan("dlrm:build", "dlrm:batch", CLUSTER_PRESETS["local-cpu"], global_batch=8, dp=2, tp=2,
                     memory_limit=6 * 2**20)
    assert plan.operators.params["table.weight"] != "R"
    assert plan.operators.peak_memory_bytes <= 6 * 2**20 and "dp2 tp2" in plan.describe()
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
