"""`plait generate` on both kinds of model, from both kinds of weights.

Two one-process runs make the weights: plait's tiny GPT on bytes (a checkpoint and model.pt), and a tiny Hugging
Face Llama with its own BPE tokenizer (a checkpoint and an export). Greedy text from a checkpoint must be what the
final weights give when loaded by other means (model.pt into plait's model; the export into transformers), and
sampling (temperature, top-p) is reproducible from its seed.
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

sys.path.insert(0, str(Path(__file__).parents[1]))
from run_configs import local_plan, write_run_config  # noqa: E402

GPT = {"name": "gen-gpt", "arch": "gpt", "num_layers": 2, "hidden_size": 32, "num_heads": 4, "vocab_size": 256,
       "max_seq_len": 32}
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
    from plait.models.hf_tiny import train_tokenizer, write_tiny_checkpoint
    from plait.spec.load import load_model
    from plait.train.data import shipped_text_path

    root = tmp_path_factory.mktemp("generate")
    (root / "gpt").mkdir()
    train(write_run_config(root / "gpt", "run", GPT, {
        "train": TRAIN, "checkpoint": {"dir": str(root / "gpt" / "ckpt")}, "log": {"save_model": True}},
        plan=local_plan(GPT, 4, 16, dp=1, tp=1, pp=1, micro_batch=4)))
    base = write_tiny_checkpoint("llama", root / "llama", seed=3, vocab_size=320)
    train_tokenizer([shipped_text_path().read_text(encoding="utf-8")[:30_000]], 320, base)
    config = root / "hf.toml"
    from plait.train.config import toml_text

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


def test_a_plait_checkpoint_generates_what_its_final_weights_do(runs: Path) -> None:
    from plait.spec import ModelSpec
    from plait.train.sample import sample_text  # model.pt into plait's own model, decoded greedily

    text = generate(str(runs / "gpt" / "ckpt"), "--prompt", PROMPT, "--tokens", "12")
    model_pt = torch.load(runs / "gpt" / "run" / "log" / "model.pt", weights_only=True)
    assert text == sample_text(ModelSpec(**GPT), model_pt, PROMPT, num_tokens=12, top_k=0)
    assert text.startswith(PROMPT) and len(text) > len(PROMPT)


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


def test_sampling_follows_its_seed(runs: Path) -> None:
    args = [str(runs / "gpt" / "ckpt"), "--prompt", PROMPT, "--tokens", "24", "--temperature", "1.5", "--top-p", "0.95"]
    first, again = generate(*args, "--seed", "1"), generate(*args, "--seed", "1")
    assert first == again and first.startswith(PROMPT)
    assert {generate(*args, "--seed", str(seed)) for seed in (2, 3, 4)} != {first}
