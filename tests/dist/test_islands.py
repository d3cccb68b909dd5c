"""Training across islands on torchft, proven: a DiLoCo plan at H = 1 (outer SGD of lr 1, no momentum) on 2 islands
of 2 ranks each (fully_shard inside) equals one process, through `plait check` as a user runs it (a lighthouse, one
launch per island). One launch: ~45 s on a 2-core machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from plait.plan import IslandPlan, Plan
from plait.spec import ModelSpec
from plait.spec.load import load_cluster, load_train

ROOT = Path(__file__).resolve().parents[2]


def island_plan(tmp_path: Path) -> Path:
    model = ModelSpec(name="tiny-islands", arch="gpt", num_layers=2, hidden_size=32, num_heads=4, ffn_hidden_size=64,
                      vocab_size=64, max_seq_len=32)
    cluster = load_cluster(ROOT / "examples" / "clusters" / "islands-local.yaml")
    plan = Plan.of(dp=2, zero=3, model=model, cluster=cluster, train=load_train(global_batch=8, seq_len=16,
                                                                                   precision="fp32"),
                   micro_batch=2, islands=IslandPlan(count=2, method="diloco", inner_steps=1))
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    return path


def test_diloco_at_h1_equals_one_process(tmp_path):
    out = tmp_path / "check.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PLAIT_OMP_THREADS": "1", "COLUMNS": "200"}
    result = subprocess.run([sys.executable, "-m", "plait", "check", "--plan", str(island_plan(tmp_path)),
                             "--steps", "3", "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "EQUAL" in result.stdout and "across 2 islands" in result.stdout
    report = json.loads(out.read_text())
    assert report["passed"] and max(report["loss_rel_diffs"]) < 1e-12
    islands = report["runtime"]["islands"]
    assert len(islands) == 2 and all(i["exchanges"] == 3 and i["bytes_sent"] > 0 for i in islands)
