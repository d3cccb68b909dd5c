"""Training across islands on torchft, proven: a DiLoCo plan at H = 1 (outer SGD of lr 1, no momentum) on 2 islands
of 2 ranks each (fully_shard inside) equals one process, through `plait check` as a user runs it (a lighthouse, one
launch per island); an island killed mid-run rejoins, and checkpoints resume exactly."""

from __future__ import annotations

import json
import os
import shutil
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


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_an_island_killed_mid_run_rejoins_and_checkpoints_resume_exactly(tmp_path):
    """DiLoCo (H = 2, outer Nesterov momentum) on 2 islands of one rank. Island 1 SIGKILLs itself after step 4;
    island 0 trains on without a restart; island 1's launcher restarts it, it takes the weights, both optimizers'
    states and the data position from island 0 and continues: no step twice. Then both islands resume from their
    newest common checkpoint and log exactly the losses of the first run from there on. Two launches, ~90 s."""
    steps = 30
    cluster = (ROOT / "examples" / "clusters" / "islands-local.yaml").read_text()
    # 1 rank per island, and a link slow enough (2 MB/s: ~2 s an exchange) that island 0 is still training when
    # island 1's ranks are back
    (tmp_path / "cluster.yaml").write_text(cluster.replace("num_devices: 4", "num_devices: 2")
                                           .replace("devices_per_node: 2", "devices_per_node: 1")
                                           .replace("bandwidth: 50 MB/s", "bandwidth: 2 MB/s"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PLAIT_OMP_THREADS": "1", "COLUMNS": "200"}
    run = [sys.executable, "-m", "plait"]
    made = subprocess.run(run + ["plan", "--model", "tiny-gpt", "--cluster", str(tmp_path / "cluster.yaml"),
                                 "--global-batch", "8", "--seq-len", "64", "--island-method", "diloco",
                                 "--inner-steps", "2", "--overlap", "0", "--island-precision", "fp32",
                                 "--json", str(tmp_path / "plan.json")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    (tmp_path / "run.toml").write_text("[data]\nsource = \"shipped\"\n[checkpoint]\nevery = 4\n")

    def train(log: str, *extra: str, fault: str | None = None) -> subprocess.CompletedProcess:
        argv = run + ["train", str(tmp_path / "run.toml"), "--plan", str(tmp_path / "plan.json"),
                      "--steps", str(steps), "--log-dir", str(tmp_path / log), "--set", "train.global_batch=8",
                      "--set", "train.seq_len=64", "--set", f'checkpoint.dir="{tmp_path / log / "ckpt"}"', *extra]
        done = subprocess.run(argv, cwd=ROOT, env={**env, **({"PLAIT_FAULT": fault} if fault else {})},
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-4000:]
        return done

    first = train("log", fault="kill:rank=1:step=4")
    assert "injecting 'kill' on rank 1 after step 4" in first.stderr
    assert "island 1: step 30" in first.stderr and "failed after step 4, rejoined at step" in first.stderr
    survivor = [r for r in _records(tmp_path / "log" / "island0" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in survivor] == list(range(1, steps + 1))  # no restart, no step lost or repeated
    outer = [r["outer_step"] for r in survivor]
    assert all(b - a in (0, 1) for a, b in zip(outer, outer[1:])) and outer[-1] >= steps // 2 - 2  # none twice
    lost = _records(tmp_path / "log" / "island1" / "metrics.jsonl")
    rejoined = next(i for i, r in enumerate(lost) if r.get("event") == "rejoined")
    before = [r["step"] for r in lost[:rejoined] if "loss" in r]
    after = [r["step"] for r in lost[rejoined + 1:] if "loss" in r]
    back = lost[rejoined]["step"]
    assert before == [1, 2, 3, 4] and after == list(range(back + 1, steps + 1))

    # resume both islands from their newest common checkpoint after the rejoin: the same losses as the first run
    held = [{int(p.name.removeprefix("step_")) for p in (tmp_path / "log" / "ckpt" / f"island{i}").glob("step_*")}
            for i in (0, 1)]
    start = min(step for step in held[0] & held[1] if back < step and step >= steps - 8)  # 3-4 outer steps after
    for i in (0, 1):
        shutil.copytree(tmp_path / "log" / "ckpt" / f"island{i}" / f"step_{start:06d}",
                        tmp_path / "again" / "ckpt" / f"island{i}" / f"step_{start:06d}")
    train("again", "--resume")
    for i in (0, 1):
        ran = {r["step"]: r["loss"] for r in _records(tmp_path / "log" / f"island{i}" / "metrics.jsonl") if "loss" in r}
        resumed = {r["step"]: r["loss"] for r in _records(tmp_path / "again" / f"island{i}" / "metrics.jsonl")
                   if "loss" in r}
        assert sorted(resumed) == list(range(start + 1, steps + 1))
        assert all(resumed[k] == ran[k] for k in resumed), (i, resumed, ran)
