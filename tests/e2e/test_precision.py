"""Precision is what the plan says: bf16 on CPU computes under autocast (losses differ from fp32, metrics say bf16),
and fp16, which would need a loss scaler plait has not got, is refused in one line before any rank starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
from run_configs import local_plan, write_run_config  # noqa: E402

MODEL = {"name": "precision-gpt", "arch": "gpt", "num_layers": 2, "hidden_size": 32, "num_heads": 4,
         "vocab_size": 256, "max_seq_len": 32}
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PLAIT_OMP_THREADS": "1"}


def train(root: Path, precision: str) -> subprocess.CompletedProcess:
    plan = local_plan(MODEL, 4, 16, dp=1, tp=1, pp=1, micro_batch=4)
    config = write_run_config(root, precision, MODEL, {"train": {"steps": 3, "global_batch": 4, "seq_len": 16,
                                                                  "precision": precision}}, plan=plan)
    return subprocess.run([sys.executable, "-m", "plait", "train", str(config)], capture_output=True, text=True,
                          env=ENV, timeout=300)


def metrics(root: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (root / name / "log" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.dist
def test_bf16_on_cpu_computes_in_bf16(tmp_path: Path) -> None:
    for precision in ("fp32", "bf16"):
        done = train(tmp_path, precision)
        assert done.returncode == 0, done.stderr[-3000:]
    fp32, bf16 = metrics(tmp_path, "fp32"), metrics(tmp_path, "bf16")
    assert {m["precision"] for m in fp32} == {"fp32"} and {m["precision"] for m in bf16} == {"bf16"}
    assert json.loads((tmp_path / "bf16" / "log" / "plan.json").read_text())["train"]["precision"] == "bf16"
    differences = [abs(b["loss"] - f["loss"]) / f["loss"] for b, f in zip(bf16, fp32)]
    assert max(differences) > 1e-5  # it did not run in fp32 ...
    assert max(differences) < 0.05  # ... and it is still the same training


def test_fp16_is_refused_in_one_line(tmp_path: Path) -> None:
    done = train(tmp_path, "fp16")
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1 and "loss scaler" in lines[0] and "bf16" in lines[0], done.stderr
