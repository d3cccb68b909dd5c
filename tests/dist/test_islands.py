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


def test_an_island_killed_mid_run_rejoins_while_the_other_trains_on(tmp_path):
    """Island 1 (one rank) SIGKILLs itself after step 4; island 0 trains on without a restart; island 1's launcher
    restarts it, it takes the weights, optimizer and data position from island 0 and continues: every step once."""
    steps = 24
    cluster = (ROOT / "examples" / "clusters" / "islands-local.yaml").read_text()
    # 1 rank per island, and a link slow enough (4 MB/s: ~1 s a step) that island 0 is still training when
    # island 1's ranks are back
    (tmp_path / "cluster.yaml").write_text(cluster.replace("num_devices: 4", "num_devices: 2")
                                           .replace("devices_per_node: 2", "devices_per_node: 1")
                                           .replace("bandwidth: 50 MB/s", "bandwidth: 4 MB/s"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PLAIT_OMP_THREADS": "1", "COLUMNS": "200",
           "PLAIT_FAULT": "kill:rank=1:step=4"}
    run = [sys.executable, "-m", "plait"]
    made = subprocess.run(run + ["plan", "--model", "tiny-gpt", "--cluster", str(tmp_path / "cluster.yaml"),
                                 "--global-batch", "8", "--seq-len", "64", "--island-method", "sync",
                                 "--json", str(tmp_path / "plan.json")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    (tmp_path / "run.toml").write_text("[data]\nsource = \"shipped\"\n")
    trained = subprocess.run(run + ["train", str(tmp_path / "run.toml"), "--plan", str(tmp_path / "plan.json"),
                                    "--steps", str(steps), "--log-dir", str(tmp_path / "log"),
                                    "--set", "train.global_batch=8", "--set", "train.seq_len=64"],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert trained.returncode == 0, trained.stderr[-4000:]
    assert "injecting 'kill' on rank 1 after step 4" in trained.stderr
    assert "island 1 rejoined at step" in trained.stderr
    assert "island 1: step 24" in trained.stderr and "failed after step 4, rejoined at step" in trained.stderr
    survivor = [json.loads(line) for line in (tmp_path / "log" / "island0" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in survivor] == list(range(1, steps + 1))  # no restart, no step lost or repeated
    outer = [r["outer_step"] for r in survivor]
    assert outer == list(range(outer[0], outer[0] + steps))  # every step committed once
    lost = [json.loads(line) for line in (tmp_path / "log" / "island1" / "metrics.jsonl").read_text().splitlines()]
    rejoined = next(i for i, r in enumerate(lost) if r.get("event") == "rejoined")
    before, after = lost[:rejoined], lost[rejoined + 1:]
    assert [r["step"] for r in before] == [1, 2, 3, 4]
    back = lost[rejoined]["step"]
    assert back >= 4 and [r["step"] for r in after] == list(range(back + 1, steps + 1))
    assert lost[rejoined]["time"] > before[-1]["time"]  # the recovery time is measured from these
