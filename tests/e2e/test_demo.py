"""`plait demo` in a shortened mode: plans, trains on 2 ranks, samples text, exits 0."""

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.dist
def test_demo_plans_trains_and_samples(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PLAIT_OMP_THREADS": "1"}
    log_dir = tmp_path / "demo"
    result = subprocess.run([sys.executable, "-m", "plait", "demo", "--steps", "6", "--seconds", "0",
                             "--sample-tokens", "20", "--log-dir", str(log_dir)],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "top plans" in out and "chosen:" in out
    assert "ROMEO:" in out and f"loss plot: {log_dir / 'loss.png'}" in out
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 6 and records[-1]["loss"] < records[0]["loss"]
    assert (log_dir / "model.pt").is_file() and (log_dir / "loss.png").is_file()
    assert (log_dir / "demo.toml").is_file() and (log_dir / "plan.json").is_file()
