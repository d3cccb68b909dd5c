"""`plait check` end to end: launches its ranks, prints the comparison, exit code says the verdict."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from equivalence_cases import make_plan  # noqa: E402

from plait.spec.models import MODEL_PRESETS  # noqa: E402

pytestmark = pytest.mark.dist


def plait(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PLAIT_OMP_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "plait", *argv], capture_output=True, text=True, env=env,
                          timeout=300)


@pytest.fixture
def pipeline_plan(tmp_path) -> Path:
    path = tmp_path / "plan.json"
    plan = make_plan({"name": "cli", "model": "llama", "pp": 2, "schedule": "gpipe", "layers_per_stage": [1, 3]})
    path.write_text(plan.to_json())
    return path


def test_check_passes_a_correct_plan(pipeline_plan):
    done = plait("check", "--plan", str(pipeline_plan), "--steps", "2", "--clip", "0.5", "--chat")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "EQUAL" in done.stdout and "loss (1 process)" in done.stdout and "float64" in done.stdout
    assert "chat-masked targets" in done.stdout  # a micro-batch per pipeline step, each training its own count
    assert "worst gradient after step 1" in done.stdout


def test_dry_run_builds_without_ranks(pipeline_plan, tmp_path):
    done = plait("check", "--plan", str(pipeline_plan), "--dry-run", "--json", str(tmp_path / "dry.json"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "BUILDS" in done.stdout
    report = json.loads((tmp_path / "dry.json").read_text())
    assert [r["blocks"] for r in report["ranks"]] == [[0], [1, 2, 3]]
    assert report["ranks"][0]["collectives"]["pp send/recv"] == 2  # one micro-batch pair each way, 2 micro-batches


def test_check_refuses_before_launching(pipeline_plan, tmp_path):
    done = plait("check", "--plan", str(pipeline_plan), "--nproc", "3")
    assert done.returncode == 2 and "--nproc 3 does not match" in done.stderr
    big = make_plan({"name": "big", "model": "gpt", "dp": 2}).replace(model=MODEL_PRESETS["gpt-1.7b"], layers_per_stage=())
    (tmp_path / "big.json").write_text(big.to_json())
    done = plait("check", "--plan", str(tmp_path / "big.json"))
    assert done.returncode == 2 and "too big to check" in done.stderr
    done = plait("check", "--plan", str(tmp_path / "missing.json"))
    assert done.returncode == 2 and "does not exist" in done.stderr
