"""`plait generate` on a Hugging Face model, from both kinds of weights (plait's own models: tests/dist/
test_validation.py, which generates from one of its runs' checkpoints).

A one-process run fine-tunes a tiny Hugging Face Llama with its own BPE tokenizer and leaves a checkpoint and an
export. Greedy text from the checkpoint must be the export's, and the export's what transformers gives.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PLAIT_OMP_THREADS": "1"}
TRAIN = {"steps": 2, "global_batch": 4, "seq_len": 16}
PROMPT = "To be, or"
pytestmark = pytest.mark.dist


def train(config: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "plait", "train", str(config)], capture_output=True, text=True,
                          env=ENV, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    from plait.hf.tiny import train_tokenizer, write_tiny_checkpoint
    from plait.spec.load import load_model
    from plait.train.config import toml_text
    from plait.train.data import shipped_text_path

    root = tmp_path_factory.mktemp("generate")
    base = write_tiny_checkpoint("llama", root / "llama", seed=3, vocab_size=320)
    train_tokenizer([shipped_text_path().read_text(encoding="utf-8")[:30_000]], 320, base)
    config = root / "hf.toml"
    config.write_text(toml_text({
        "model": {"file": str(base), "weights": "pretrained"}, "train": TRAIN,
        "plan": {"devices": 1}, "checkpoint": {"dir": str(root / "hf-ckpt"), "export_hf": str(root / "hf-export")},
        "log": {"dir": str(root / "hf-log"), "progress": False}}))
    assert load_model(str(base)).vocab_size == 320
    train(config)
    return root


def generate(*argv: str) -> str:
    from plait.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["generate", *argv]) == 0
    return out.getvalue().rstrip("\n")


def test_a_hugging_face_checkpoint_and_its_export_generate_alike(runs: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from_checkpoint = generate(str(runs / "hf-ckpt"), "--prompt", PROMPT, "--tokens", "10")
    from_export = generate(str(runs / "hf-export"), "--prompt", PROMPT, "--tokens", "10")
    assert from_checkpoint == from_export
    tokenizer = AutoTokenizer.from_pretrained(str(runs / "hf-export"), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(runs / "hf-export"), local_files_only=True).eval()
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        for _ in range(10):
            next_id = model(ids).logits[0, -1].argmax().view(1, 1)
            ids = torch.cat([ids, next_id], dim=1)
            if int(next_id) == tokenizer.eos_token_id:
                break
    assert from_export == tokenizer.decode(ids[0], skip_special_tokens=False).removeprefix("<s>")
