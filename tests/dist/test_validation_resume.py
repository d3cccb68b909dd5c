"""Validation of a mixture-of-experts model under an interleaved pipeline (2 gloo ranks, through `plait train`), and
a resumed run that keeps its better best checkpoint.

The first run trains a tiny MoE Llama on pp2 with the interleaved schedule (two model chunks per rank) for 4 steps,
evaluating every 2 and keeping the best checkpoint: its last validation loss must be the loss one process computes
from its final weights on the same held-out batches. The second run resumes it for 4 more steps at a learning rate
that wrecks the model: its validation losses are worse, so the best checkpoint must stay the first run's (before
the best loss was restored on resume, the first evaluation after it overwrote the best with a worse one).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
from run_configs import local_plan, write_run_config  # noqa: E402

MODEL = {"name": "val-moe", "arch": "llama", "num_layers": 4, "hidden_size": 32, "num_heads": 4, "num_kv_heads": 2,
         "ffn_hidden_size": 64, "vocab_size": 256, "max_seq_len": 32, "num_experts": 4, "experts_per_token": 2,
         "moe_ffn_hidden_size": 32}
PLAN = dict(pp=2, schedule="interleaved", interleave=2, micro_batch=1, num_micro_batches=4)
STEPS, EVERY, GLOBAL_BATCH, SEQ_LEN, BATCHES, FRACTION = 4, 2, 4, 16, 2, 0.05
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PLAIT_OMP_THREADS": "1"}
pytestmark = pytest.mark.dist


def train(config: Path, *argv: str) -> None:
    done = subprocess.run([sys.executable, "-m", "plait", "train", str(config), *argv], capture_output=True,
                          text=True, env=ENV, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("moe-validation")
    sections = {"train": {"steps": STEPS, "global_batch": GLOBAL_BATCH, "seq_len": SEQ_LEN, "seed": 1},
                "optimizer": {"lr": 1e-2, "warmup": 1},
                "eval": {"every": EVERY, "fraction": FRACTION, "batches": BATCHES, "keep_best": True},
                "checkpoint": {"dir": str(root / "ckpt"), "every": EVERY},
                "log": {"save_model": True}}
    config = write_run_config(root, "moe", MODEL, sections,
                              plan=local_plan(MODEL, GLOBAL_BATCH, SEQ_LEN, dp=1, tp=1, **PLAN))
    train(config)
    (root / "first").mkdir()
    for name in ("eval.jsonl", "model.pt"):
        (root / "moe" / "log" / name).replace(root / "first" / name)
    train(config, "--resume", "--steps", str(2 * STEPS), "--lr", "3.0")
    return root


def evaluations(path: Path) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in map(json.loads, path.read_text().splitlines())}


def test_an_moe_model_under_an_interleaved_pipeline_evaluates_the_one_process_loss(run: Path) -> None:
    import torch
    import torch.nn.functional as F

    from plait.models import build_model
    from plait.spec import ModelSpec
    from plait.train.data import BatchLoader, load_tokens, split_held_out

    first = evaluations(run / "first" / "eval.jsonl")
    assert list(first) == [EVERY, STEPS]
    model = build_model(ModelSpec(**MODEL), device="cpu")
    model.load_state_dict(torch.load(run / "first" / "model.pt", weights_only=True))
    held_out = split_held_out(load_tokens("shipped"), FRACTION)[1]
    loader = BatchLoader(held_out, global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN, seed=1)
    with torch.no_grad():  # row by row, as the pipeline's micro-batches of 1 route them
        losses = [F.cross_entropy(model(t[i:i + 1]).flatten(0, 1), y[i]).item()
                  for t, y in (loader.next_batch() for _ in range(BATCHES)) for i in range(GLOBAL_BATCH)]
    assert first[STEPS] == pytest.approx(sum(losses) / len(losses), rel=1e-5)


def test_a_resumed_run_keeps_the_better_best_checkpoint(run: Path) -> None:
    first = evaluations(run / "first" / "eval.jsonl")
    resumed = evaluations(run / "moe" / "log" / "eval.jsonl")
    later = {step: loss for step, loss in resumed.items() if step > STEPS}
    assert sorted(later) == [STEPS + EVERY, 2 * STEPS]
    best_step = min(first, key=first.get)
    assert min(later.values()) > first[best_step]  # the wrecked run never did better ...
    kept = sorted(p.name for p in (run / "ckpt" / "best").iterdir())
    assert kept == [f"step_{best_step:06d}"]  # ... so the best checkpoint is still the first run's
    meta = json.loads((run / "ckpt" / "best" / kept[0] / "meta.json").read_text())
    assert meta["best_val_loss"] == pytest.approx(first[best_step])
