"""Per-operator plans with pipeline stages, proved on their ranks: the tiny decoders cut between their blocks
(plait.operators.stages), each stage with its own per-operator placements, run by torch.distributed.pipelining's
1F1B; `plait check` EQUAL to one process (tests/unit/test_operators_pipeline.py covers planning)."""

from __future__ import annotations

from pathlib import Path

import pytest

from plait.operators.planner import auto_plan
from plait.spec.clusters import CLUSTER_PRESETS

from test_operator_plans import check_equal  # tests/dist is on sys.path (pytest's default import mode)

pytestmark = pytest.mark.dist
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "operators"


def test_check_proves_a_transformers_llama_cut_in_two_stages_equal(tmp_path, monkeypatch):
    """pp2 on 2 ranks: transformers' LlamaForCausalLM, its own forward run around the block each stage holds."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    plan = auto_plan("decoders:hf_llama", "decoders:tokens", CLUSTER_PRESETS["local-cpu"], global_batch=8, pp=2)
    assert plan.pp == 2 and plan.layers_per_stage == (1, 1) and len(plan.operators.stages) == 2
    check_equal(plan, tmp_path)


def test_check_proves_pipeline_stages_with_tensor_parallel_placements_equal(tmp_path, monkeypatch):
    """pp2 x tp2 on 4 ranks: plait's reference Llama, Megatron's pattern inside each stage (the block solution the
    whole module's program found, reused on both stages), hidden states sent whole between the stages."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    plan = auto_plan("decoders:llama", "decoders:tokens", CLUSTER_PRESETS["local-cpu"], global_batch=8, tp=2, pp=2)
    assert all(sum(p != "R" for p in stage.params.values()) >= 7 for stage in plan.operators.stages)
    check_equal(plan, tmp_path)


def test_plait_train_runs_a_per_operator_pipeline_and_resumes_it(tmp_path):
    """examples/operators/train-vit-pp.toml on 2 ranks: the ViT cut into two stages at launch, trained with its own
    batches and loss, both stages checkpointed; step 1's loss is one process's on the same batch, and a resumed run
    goes on from the last checkpoint."""
    import json
    import os
    import subprocess
    import sys

    import torch

    from plait.execute.operators import build_module, make_batch

    env = {**os.environ, "PLAIT_OMP_THREADS": "1"}
    args = [sys.executable, "-m", "plait", "train", str(EXAMPLES / "train-vit-pp.toml"), "--set", "train.steps=4",
            "--set", "checkpoint.every=2", "--set", f'log.dir="{tmp_path}"',
            "--set", f'checkpoint.dir="{tmp_path / "ckpt"}"']
    done = subprocess.run(args, capture_output=True, text=True, env=env, cwd=EXAMPLES.parents[1], timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["degrees"]["pp"] == 2 and len(plan["operators"]["stages"]) == 2
    sys.path.insert(0, str(EXAMPLES))
    try:
        first = build_module("vit:build", seed=0, dtype=torch.float32)(*make_batch("vit:batch", 8, 0, 0,
                                                                                 torch.float32)).item()
    finally:
        sys.path.remove(str(EXAMPLES))
    assert abs(rows[0]["loss"] - first) < 1e-5 * abs(first)
    resumed = subprocess.run(args[:6] + ["train.steps=6", "--set", "checkpoint.resume=true"] + args[7:],
                             capture_output=True, text=True, env=env, cwd=EXAMPLES.parents[1], timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout + resumed.stderr
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows][-2:] == [5, 6]


def test_check_proves_pipeline_stages_under_fully_shard_equal(tmp_path, monkeypatch):
    """dp2 x pp2 on 4 ranks: the MLP-Mixer's two stages, each fully_shard over its two data-parallel ranks, GPipe
    over 4 micro-batches; the schedule reduces each stage's gradients over dp once a step."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    plan = auto_plan("mixer:build", "mixer:batch", CLUSTER_PRESETS["local-cpu"], global_batch=16, dp=2, pp=2,
                     num_micro_batches=4, schedule="gpipe")
    assert plan.dp == 2 and plan.zero == 3 and plan.num_micro_batches == 4
    check_equal(plan, tmp_path)


def test_check_clips_a_per_operator_pipeline_as_one_process_clips(tmp_path, monkeypatch):
    """pp2 x tp2 on 4 ranks, float64, with --clip below the real norm: each rank's squared norm over its tensor
    shards, summed over the pipeline (plait.execute.parallelize.clip_grad_norm, the rule the decoders' Runner clips
    by) against torch's clip_grad_norm_ on the whole module in one process, every step; a norm summed over the wrong
    ranks or not at all fails the norms' comparison. The module's blocks read their input straight into
    column-split work (tests/split_readers.py), so the second stage's first call reads the hidden states it received
    into split work: their gradient, Partial, is reduced once where DTensor.from_local made them replicated (its
    backward), before the stage sends it back."""
    import json
    import os
    import subprocess
    import sys

    tests = Path(__file__).resolve().parents[1]
    monkeypatch.syspath_prepend(str(tests))
    from split_readers import MEGATRON

    plan = auto_plan("split_readers:build", "split_readers:batch", CLUSTER_PRESETS["local-cpu"], global_batch=8,
                     tp=2, pp=2, pins=MEGATRON)
    first = plan.operators.stages[1].function_reads["linear(4x8x64,256x64,256)#0"]
    assert first == {"0": "R", "1": "S0", "2": "S0"}  # the received hidden states, read as they are, into split work
    path, out = tmp_path / "plan.json", tmp_path / "check.json"
    path.write_text(plan.to_json())
    env = {**os.environ, "PLAIT_OMP_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(tests), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "plait", "check", "--plan", str(path), "--steps", "2", "--clip",
                           "0.02", "--json", str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["passed"] and len(result["grad_norms"]) == 2
    assert min(result["reference_grad_norms"]) > 0.02  # clipping acted on both steps
    for ours, ref in zip(result["grad_norms"], result["reference_grad_norms"]):
        assert abs(ours - ref) <= 1e-12 * ref
