"""A mixed-cluster plan runs: `plait plan` on the emulated cluster (examples/clusters/mixed-local.yaml: two fast
ranks, two throttled 2x slower) places the slow group on the first pipeline stage, and `plait check` runs it on
4 processes, throttle included, equal to one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist
ROOT = Path(__file__).resolve().parents[2]


def plait(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PLAIT_OMP_THREADS": "1"}
    env.pop("PLAIT_THROTTLE", None)  # the groups' own slowdown, not a straggler's
    return subprocess.run([sys.executable, "-m", "plait", *argv], capture_output=True, text=True, env=env,
                          timeout=300, cwd=ROOT)


def test_a_mixed_cluster_plan_runs_as_one_process_would(tmp_path):
    plan_file = tmp_path / "plan.json"
    done = plait("plan", "--cluster", "examples/clusters/mixed-local.yaml", "--model", "tiny-gpt",
                 "--global-batch", "8", "--seq-len", "32", "--pp", "2", "--top", "1", "--json", str(plan_file))
    assert done.returncode == 0, done.stderr[-3000:]
    plan = json.loads(plan_file.read_text())["plans"][0]
    groups = plan["stage_groups"]
    assert sorted(groups) == ["fast", "slow"]
    layers = dict(zip(groups, plan["layers_per_stage"]))
    assert layers["slow"] < layers["fast"]  # the throttled group holds fewer layers
    # the groups hold consecutive ranks (fast: 0-1, slow: 2-3): a slow first stage maps torchrun's ranks 2, 3 to
    # pipeline rank 0, so this also runs the rank mapping
    done = plait("check", "--plan", str(plan_file), "--steps", "2")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "EQUAL" in done.stdout and "groups=" in done.stdout

    # and each group's processes run its stage: the slow group's ranks (2, 3) hold pipeline position 0 and the
    # first stage, throttled; torch numbers a process group's members in global-rank order, so this needs the
    # executor's own position (plait.execute.pipeline.PlacedStage), not the group's numbering
    from plait.runtime.launch import run_local

    out = tmp_path / "placement.json"
    os.environ["PLAIT_OMP_THREADS"] = "1"
    os.environ.pop("PLAIT_THROTTLE", None)
    code = run_local(4, [str(ROOT / "tests" / "dist" / "_placement_worker.py"), str(plan_file), str(out)],
                     module=None, timeout_s=300)
    assert code == 0
    placed = {row["rank"]: row for row in json.loads(out.read_text())}
    slow_first = groups[0] == "slow"
    slow_ranks, fast_ranks = (2, 3), (0, 1)
    for rank in slow_ranks:
        assert placed[rank]["position"] == (0 if slow_first else 1)
        assert placed[rank]["throttled"] == [2.0]
    for rank in fast_ranks:
        assert placed[rank]["position"] == (1 if slow_first else 0)
        assert placed[rank]["throttled"] == [1.0]
    first_stage_ranks = {r for r, row in placed.items() if 0 in row["stages"]}
    assert first_stage_ranks == set(slow_ranks if slow_first else fast_ranks)
