"""A per-operator plan trains through the one launcher and loop (plait.train.loop): what a decoder's run does, a
module of any shape does. Small modules (examples/operators/run_*.py, tests/tied_stages.py), six launches: sinks,
validation, bf16, restarts and the full state dict in one; resume and reshard across plans and world sizes (two);
`plait check` of an in-batch softmax compared like with like (uneven rows, from a folder that does not hold the
module), of a weight tied across pipeline stages, and of a fused table under a pipeline of micro-batches."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.dist
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "operators"
ROOT = EXAMPLES.parents[1]


def _train(config: Path, *args: str, env: dict | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "plait", "train", str(config), *args], capture_output=True, text=True,
                          env={**os.environ, "PLAIT_OMP_THREADS": "1", **(env or {})}, cwd=cwd, timeout=400)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _one_process_loss(model: str, batch: str, rows: int, calls: int, bf16: bool) -> float:
    """Step 1's loss on one process: the mean of the module's loss over the step's calls (dp x micro-batches)."""
    from plait.execute.operators import build_module, make_batch
    from plait.operators import batch as batches

    sys.path.insert(0, str(EXAMPLES))
    try:
        module = build_module(model, seed=0, dtype=torch.float32)
        data = make_batch(batch, rows, 0, 0, torch.float32)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            return (sum(batches.call(module, batches.split(data, calls, i)) for i in range(calls)) / calls).item()
    finally:
        sys.path.remove(str(EXAMPLES))


def test_a_module_trains_with_sinks_validation_bf16_restarts_and_a_full_state_dict(tmp_path):
    """The two-tower model (a dict batch, a 0-d logit scale under fully_shard, both tables trained by the fused
    row-wise SGD, an in-batch softmax) on dp2: TensorBoard, validation every 2 steps on held-out batches, bf16 under
    CPU autocast (step 1's loss is one process's in bf16, not fp32's), rank 1 killed after step 3 and the job
    restarted from step 2's checkpoint (--max-restarts), the end table, measured.json, the loss plot and model.pt."""
    config = tmp_path / "run.toml"
    config.write_text(f'''[model]
module = "run_two_tower:build_small"
path = "{EXAMPLES}"
[data]
batch = "run_two_tower:batch"
[train]
steps = 4
global_batch = 8
precision = "bf16"
[plan]
devices = 2
pins = {{ tp = 1, table_optimizer = "sgd" }}
[eval]
every = 2
batch = "run_two_tower:batch"
batches = 2
[checkpoint]
dir = "{tmp_path / "ckpt"}"
every = 2
[log]
dir = "{tmp_path / "log"}"
tensorboard = true
save_model = true
progress = false
''')
    done = _train(config, "--max-restarts", "1", env={"PLAIT_FAULT": "kill:rank=1:step=3"})
    log = tmp_path / "log"
    output = done.stdout + done.stderr
    assert "resumed from" in output and "predicted vs measured" in output
    rows = _rows(log / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and {r["precision"] for r in rows} == {"bf16"}
    bf16 = _one_process_loss("run_two_tower:build_small", "run_two_tower:batch", 8, 2, bf16=True)
    fp32 = _one_process_loss("run_two_tower:build_small", "run_two_tower:batch", 8, 2, bf16=False)
    assert abs(rows[0]["loss"] - bf16) <= 1e-5 * bf16 and abs(rows[0]["loss"] - fp32) > 1e-4 * fp32
    assert [r["step"] for r in _rows(log / "eval.jsonl")] == [2, 4]
    assert all(math.isfinite(r["val_loss"]) for r in _rows(log / "eval.jsonl"))
    assert list((log / "tensorboard").glob("events.out.tfevents.*"))
    assert (log / "measured.json").is_file() and (log / "loss.png").is_file()
    plan = json.loads((log / "plan.json").read_text())
    assert plan["degrees"]["dp"] == 2 and set(plan["operators"]["fused_tables"]) == {"user_table.weight",
                                                                                       "item_table.weight"}
    state = torch.load(log / "model.pt")
    assert state["logit_scale"].dim() == 0 and abs(state["logit_scale"].item() - math.log(1 / 0.07)) > 1e-4


def test_a_checkpoint_resumes_under_another_plan_and_world_size(tmp_path):
    """The graph network (module-level tensors) trains 4 steps on tp2 (2 ranks); its step-2 checkpoint then resumes
    on 4 ranks under pp2 x tp2 (stages cut between its layers, 2 micro-batches): steps 3 and 4 are the first run's
    to fp32 rounding, the weights and AdamW states resharded by DCP from one layout to the other."""
    config = tmp_path / "run.toml"
    config.write_text(f'''[model]
module = "run_graph:build"
path = "{EXAMPLES}"
[data]
batch = "run_graph:batch"
[train]
steps = 4
global_batch = 8
[optimizer]
warmup = 1
[plan]
pins = {{ tp = 2 }}
[checkpoint]
dir = "{tmp_path / "ckpt"}"
every = 2
[log]
dir = "{tmp_path / "log"}"
progress = false
''')
    _train(config, "--nproc", "2")
    first = _rows(tmp_path / "log" / "metrics.jsonl")
    assert [r["step"] for r in first] == [1, 2, 3, 4]
    shutil.rmtree(tmp_path / "ckpt" / "step_000004")
    done = _train(config, "--nproc", "4", "--resume", "--set", "plan.pins={pp = 2, tp = 2, num_micro_batches = 2}")
    assert "resumed from" in done.stdout + done.stderr
    plan = json.loads((tmp_path / "log" / "plan.json").read_text())
    assert (plan["degrees"]["pp"], plan["degrees"]["tp"], plan["num_micro_batches"]) == (2, 2, 2)
    again = _rows(tmp_path / "log" / "metrics.jsonl")
    assert [r["step"] for r in again] == [1, 2, 3, 4]
    for before, after in zip(first[2:], again[2:]):
        assert abs(before["loss"] - after["loss"]) <= 1e-5 * before["loss"], (before, after)


def test_check_compares_an_in_batch_softmax_like_with_like_from_any_folder(tmp_path):
    """The two-tower model on dp2 x tp2: each data-parallel rank's in-batch softmax sees its half of the batch as
    negatives, and so does the one process `plait check` compares with (the mean over the step's calls); the
    2,003-row user table split by rows over tp (1,002 and 1,001: DTensor's uneven shards) and both tables trained
    by the fused row-wise SGD. EQUAL, run from a folder that does not hold the module and without it on PYTHONPATH
    (the plan's import_paths)."""
    import dataclasses

    from plait.operators.planner import auto_plan
    from plait.spec.clusters import CLUSTER_PRESETS

    sys.path.insert(0, str(EXAMPLES))
    try:
        plan = auto_plan("run_two_tower:build_small", "run_two_tower:batch", CLUSTER_PRESETS["local-cpu"],
                         global_batch=8, dp=2, tp=2, table_optimizer="sgd")
    finally:
        sys.path.remove(str(EXAMPLES))
    rows = dict(plan.operators.params, **{"user_table.weight": "S0"})  # a row count tp2 does not divide
    plan = plan.replace(operators=dataclasses.replace(plan.operators, params=rows))
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)  # plait itself, not the examples
    done = subprocess.run([sys.executable, "-m", "plait", "check", "--plan", str(path), "--steps", "2"],
                          capture_output=True, text=True, env={**env, "PLAIT_OMP_THREADS": "1"}, cwd=tmp_path,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "EQUAL" in done.stdout and "not a mean over its samples" in done.stderr


def test_check_proves_a_weight_tied_across_pipeline_stages_summed(tmp_path):
    """An output layer tied to the embedding (tests/tied_stages.py) on pp2 x tp2: the first stage holds the embedding
    split by rows, the last stage its copy as the output layer, replicated; each step sums the copies' gradients
    across the stages (before: refused), and clipping counts the weight once. EQUAL with --clip."""
    from plait.operators.planner import auto_plan
    from plait.spec.clusters import CLUSTER_PRESETS

    sys.path.insert(0, str(ROOT / "tests"))
    try:
        plan = auto_plan("tied_stages:build", "tied_stages:batch", CLUSTER_PRESETS["local-cpu"], global_batch=8,
                         tp=2, pp=2, pins={"embed.weight": "S0"})
    finally:
        sys.path.remove(str(ROOT / "tests"))
    assert [stage.params.get("embed.weight", stage.params.get("head.weight")) for stage in plan.operators.stages] \
        == ["S0", "R"]
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    done = subprocess.run([sys.executable, "-m", "plait", "check", "--plan", str(path), "--steps", "2", "--clip",
                           "0.5"], capture_output=True, text=True, env={**os.environ, "PLAIT_OMP_THREADS": "1"},
                          cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "EQUAL" in done.stdout


def test_check_proves_a_fused_table_under_a_pipeline_of_micro_batches(tmp_path):
    """plait's Llama on pp2, 1F1B over 4 micro-batches, its token embedding trained by the fused row-wise SGD: the
    first stage's later forwards run after earlier backwards, so the rows are updated once, at the step's end, from
    every micro-batch's gradient scaled as the schedule scales the others (1 / micro-batches); before, each backward
    moved the rows at once and m times too far (DIFFERENT, 1e-4 AdamW steps)."""
    from plait.operators.planner import auto_plan
    from plait.spec.clusters import CLUSTER_PRESETS

    sys.path.insert(0, str(EXAMPLES))
    try:
        plan = auto_plan("decoders:llama", "decoders:tokens", CLUSTER_PRESETS["local-cpu"], global_batch=8, pp=2,
                         num_micro_batches=4, table_optimizer="sgd")
    finally:
        sys.path.remove(str(EXAMPLES))
    assert plan.operators.fused_tables == {"model.tok_embeddings.weight": "sgd"} and plan.num_micro_batches == 4
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    done = subprocess.run([sys.executable, "-m", "plait", "check", "--plan", str(path), "--steps", "2"],
                          capture_output=True, text=True, env={**os.environ, "PLAIT_OMP_THREADS": "1"},
                          cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "EQUAL" in done.stdout
