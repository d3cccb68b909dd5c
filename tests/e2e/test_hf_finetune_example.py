"""examples/hf-finetune.toml as its header tells a newcomer to run it (fewer steps): build the tiny checkpoint and
tokenizer, fine-tune on 4 local processes under pp2 x tp2, export, and load the export with from_pretrained."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PLAIT_OMP_THREADS": "1"}


def run(*argv: str) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300)
    assert result.returncode == 0, f"{argv}: exit {result.returncode}\n{result.stdout[-2000:]}{result.stderr[-3000:]}"
    return result


@pytest.mark.dist
def test_the_example_fine_tunes_exports_and_loads(tmp_path):
    run("examples/hf_finetune_setup.py", "--root", str(tmp_path))
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (tmp_path / "base").iterdir()}
    train = run("-m", "plait", "train", "examples/hf-finetune.toml", "--steps", "2", "--log-dir", str(tmp_path),
                "--set", f"model.file={tmp_path / 'base'}", "--set", f"checkpoint.dir={tmp_path / 'ckpt'}",
                "--set", f"checkpoint.export_hf={tmp_path / 'hf'}")
    assert "tp2 pp2" in train.stderr and "on 4 local processes" in train.stderr
    check = run("examples/hf_finetune_setup.py", "--check", "--root", str(tmp_path))
    assert "differ from the trained weights' by 0.0e+00" in check.stdout, check.stdout
