"""A chat fine-tune as a user runs it, end to end, in one process: a tiny Hugging Face Llama with a ChatML
tokenizer (special <|im_start|> / <|im_end|> tokens, the template in chat_template.jinja as transformers 5 writes
it) trains on chat JSON lines, checkpoints, exports, and is resumed as if interrupted after its last checkpoint
with more --steps.

* the export chats: `AutoTokenizer.from_pretrained(export).apply_chat_template(...)` renders as the base does;
* the resume is allowed into the export folder the run wrote itself, keeps the learning-rate schedule it started
  with (and says so in one line), and TensorBoard and metrics.jsonl hold every step once;
* `plait generate --chat` answers from the export without printing a special token.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PLAIT_OMP_THREADS": "1"}
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
QUESTIONS = [("Who wrote Hamlet?", "Shakespeare."), ("When?", "Around 1600."), ("Where?", "In London."),
             ("Is it long?", "Yes, very long.")]
LR = 1e-3
pytestmark = pytest.mark.dist


def chatml_tokenizer(folder: Path, texts: list[str]) -> Path:
    """A byte-level BPE tokenizer with ChatML's turn markers as special tokens and its template, saved by
    transformers (chat_template.jinja)."""
    from transformers import AutoTokenizer

    from plait.hf.tiny import train_tokenizer

    train_tokenizer(texts, 300, folder)
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    tokenizer.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(str(folder))
    return folder


def plait(*argv: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "plait", *argv], capture_output=True, text=True, env=ENV,
                          timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    from plait.hf.tiny import write_tiny_checkpoint
    from plait.train.config import toml_text

    root = tmp_path_factory.mktemp("chat")
    base = write_tiny_checkpoint("llama", root / "base", seed=1, vocab_size=320)
    chatml_tokenizer(base, [" ".join(q + " " + a for q, a in QUESTIONS) * 30])
    conversations = [[{"role": "user", "content": q}, {"role": "assistant", "content": a}] for q, a in QUESTIONS]
    (root / "chat.jsonl").write_text("".join(json.dumps({"messages": conversations[i % 4]}) + "\n"
                                             for i in range(40)))
    config = root / "chat.toml"
    config.write_text(toml_text({
        "model": {"file": str(base), "weights": "pretrained"},
        "data": {"source": "jsonl", "path": str(root / "chat.jsonl"), "text_key": "messages", "chat": True},
        "optimizer": {"lr": LR, "warmup": 1}, "train": {"steps": 4, "global_batch": 4, "seq_len": 32},
        "plan": {"devices": 1, "profile": False},
        "checkpoint": {"dir": str(root / "ckpt"), "every": 2, "export_hf": str(root / "hf")},
        "log": {"dir": str(root / "log"), "progress": False, "tensorboard": True}}))
    plait("train", str(config))
    # interrupted after step 4 was logged, before its checkpoint: the resume starts from step 2, with 2 more steps
    shutil.rmtree(root / "ckpt" / "step_000004")
    resumed = plait("train", str(config), "--resume", "--steps", "6")
    return {"root": root, "base": base, "export": root / "hf", "resumed": resumed.stderr}


def test_the_export_of_a_chat_fine_tune_renders_chats_as_the_base(run: dict) -> None:
    from transformers import AutoTokenizer

    assert (run["export"] / "chat_template.jinja").read_text() == CHATML
    exported = AutoTokenizer.from_pretrained(str(run["export"]), local_files_only=True)
    base = AutoTokenizer.from_pretrained(str(run["base"]), local_files_only=True)
    messages = [{"role": "user", "content": "Who wrote Hamlet?"}]
    rendered = exported.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == "<|im_start|>user\nWho wrote Hamlet?<|im_end|>\n<|im_start|>assistant\n"
    assert exported.apply_chat_template(messages, add_generation_prompt=True) == base.apply_chat_template(
        messages, add_generation_prompt=True)


def test_a_resume_keeps_its_schedule_its_export_folder_and_each_step_once(run: dict) -> None:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    from plait.train.config import OptimizerConfig, lr_at

    notes = [line for line in run["resumed"].splitlines() if "learning-rate schedule spans 4 steps" in line]
    assert len(notes) == 1 and "optimizer.schedule_steps=6" in notes[0], run["resumed"][-2000:]
    rows = [json.loads(line) for line in (run["root"] / "log" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, 6]
    schedule = OptimizerConfig(lr=LR, warmup=1)
    assert [row["lr"] for row in rows] == pytest.approx([lr_at(s, schedule, 4) for s in range(6)])
    assert rows[-1]["lr"] == pytest.approx(LR * schedule.min_lr_ratio)  # held at the floor, no jump back up
    steps = [event.step for file in sorted((run["root"] / "log" / "tensorboard").glob("events.out.tfevents.*"))
             for event in EventFileLoader(str(file)).Load() for value in event.summary.value
             if value.tag == "train/loss"]
    assert sorted(steps) == [1, 2, 3, 4, 5, 6], steps
    assert "exported the weights of step 6" in run["resumed"]


def test_generate_chat_answers_without_special_tokens(run: dict) -> None:
    from plait.cli import main

    def reply(weights: Path) -> str:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["generate", str(weights), "--chat", "--prompt", "Who wrote Hamlet?", "--tokens", "12"]) == 0
        return out.getvalue()

    from_export = reply(run["export"])
    assert "<|im_" not in from_export and "Who wrote Hamlet?" not in from_export, from_export
    assert reply(run["root"] / "ckpt") == from_export  # the checkpoint renders the prompt with the same template
