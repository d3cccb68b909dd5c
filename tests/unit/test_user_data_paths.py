"""Data, validation, exports, resumes and generation as users hold them (the end-to-end run of all of it:
tests/e2e/test_chat_finetune.py).

* eval.split picks a DatasetDict's validation split; a split or eval.path that does not exist is one line naming
  the eval key, exit 2 before any rank starts; validating on the training documents is said;
* the token cache is keyed on every tokenizer file (a changed chat_template.jinja tokenizes again) and the masking
  rule; an export copies the tokenizer's files, chat template included, never mixing two tokenizers;
* a resume with other train.steps keeps the schedule it started with or re-stretches it, saying which; it may
  write into the export folder its own run wrote;
* generation stops at the template's end of turn and at stop strings, and prints no special token.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from plait.errors import ConfigError

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TRAIN_DOCS = ["To be, or not to be, that is the question.", "Whether 'tis nobler in the mind to suffer"] * 20
VALIDATION_DOCS = ["The slings and arrows of outrageous fortune."] * 20


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer with ChatML's special turn markers, saved by transformers (chat_template.jinja)."""
    from transformers import AutoTokenizer

    from plait.hf.tiny import train_tokenizer

    folder = train_tokenizer([" ".join(TRAIN_DOCS + VALIDATION_DOCS)], 300, tmp_path_factory.mktemp("chatml"))
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    tokenizer.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def dataset_dict(tmp_path_factory) -> Path:
    import datasets

    folder = tmp_path_factory.mktemp("dict") / "ds"
    splits = {"train": TRAIN_DOCS, "validation": VALIDATION_DOCS}
    datasets.DatasetDict({name: datasets.Dataset.from_dict({"text": docs}) for name, docs in splits.items()}
                         ).save_to_disk(str(folder))
    return folder


def byte_config(tmp_path: Path, dataset: Path, *overrides: str):
    from plait.train.config import load_config

    return load_config(None, ['data.source="hf"', f'data.path="{dataset}"', 'data.tokenizer="byte"',
                              f'log.dir="{tmp_path / "log"}"', *overrides])


def test_eval_split_validates_on_the_named_split(tmp_path: Path, dataset_dict: Path) -> None:
    from plait.spec.models import MODEL_PRESETS
    from plait.train.data import eval_tokens, same_documents, training_tokens

    model = MODEL_PRESETS["tiny-gpt"]
    config = byte_config(tmp_path, dataset_dict, "eval.every=2", 'eval.split="validation"')
    held_out = bytes(np.asarray(eval_tokens(config, model), dtype=np.uint8))
    assert held_out == b"\0".join(d.encode() for d in VALIDATION_DOCS)
    assert bytes(np.asarray(training_tokens(config, model), dtype=np.uint8)).startswith(TRAIN_DOCS[0].encode())
    assert same_documents(config) is None
    same = byte_config(tmp_path, dataset_dict, "eval.every=2", 'eval.split="train"')
    assert same_documents(same) == f"{dataset_dict}, split 'train'"
    also_same = byte_config(tmp_path, dataset_dict, "eval.every=2", f'eval.path="{dataset_dict}"')
    assert same_documents(also_same) == f"{dataset_dict}, split 'train'"  # the folder again, read at data.split
    with pytest.raises(ConfigError, match=r"has no split 'valid' \(it has train, validation\); set eval.split"):
        eval_tokens(byte_config(tmp_path, dataset_dict, "eval.every=2", 'eval.split="valid"'), model)
    with pytest.raises(ConfigError, match=r"eval.path '.*missing' does not exist; set eval.path to an existing"):
        eval_tokens(byte_config(tmp_path, dataset_dict, "eval.every=2", f'eval.path="{tmp_path / "missing"}"'),
                    model)
    with pytest.raises(ValueError, match="fraction=0.1 and split='validation' are both set"):
        byte_config(tmp_path, dataset_dict, "eval.fraction=0.1", 'eval.split="validation"')


def test_a_bad_eval_split_stops_plait_train_in_one_line_and_a_shared_one_warns(
        tmp_path: Path, dataset_dict: Path, capsys, no_launch) -> None:
    from plait.cli import main
    from plait.train.config import dump_toml

    common = ["train.steps=2", "train.global_batch=4", "train.seq_len=16", "plan.devices=1", "plan.profile=false",
              "eval.every=1", "eval.batches=1"]
    config = tmp_path / "run.toml"
    config.write_text(dump_toml(byte_config(tmp_path, dataset_dict, *common, 'eval.split="test"')))
    assert main(["train", str(config)]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("plait train: error: ") and "set eval.split" in lines[0], lines
    config.write_text(dump_toml(byte_config(tmp_path, dataset_dict, *common, 'eval.split="train"')))
    with pytest.raises(no_launch):
        main(["train", str(config)])
    assert "warning: validation reads the training documents" in capsys.readouterr().err


def test_the_cache_key_holds_the_chat_template_and_the_masking_rule(tmp_path: Path, chatml_dir: Path,
                                                                      monkeypatch) -> None:
    import shutil

    import plait.train.chat
    from plait.train.data import cache_key, cached_tokens, load_tokenizer

    folder = tmp_path / "tok"
    shutil.copytree(chatml_dir, folder)
    chat = [{"role": "user", "content": "To be?"}, {"role": "assistant", "content": "Or not to be."}]
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": chat}) + "\n")
    before = load_tokenizer(str(folder))
    first = np.asarray(cached_tokens(data, "jsonl", before, tmp_path / "cache", text_key="messages", chat=True))
    (folder / "chat_template.jinja").write_text(CHATML.replace("<|im_end|>\n", "<|im_end|>\n\n"))
    after = load_tokenizer(str(folder))
    assert after.identity != before.identity
    second = np.asarray(cached_tokens(data, "jsonl", after, tmp_path / "cache", text_key="messages", chat=True))
    assert not np.array_equal(first, second), "a new template is rendered again, not read from the cache"
    assert len(list((tmp_path / "cache").glob("*.npy"))) == 2
    key = cache_key("content", after, "jsonl", "messages", chat=True)
    monkeypatch.setattr(plait.train.chat, "MASK_RULE", "another-rule")
    assert cache_key("content", after, "jsonl", "messages", chat=True) != key


def test_an_export_copies_every_file_of_the_tokenizer_trained_with(tmp_path: Path, chatml_dir: Path) -> None:
    import shutil

    from plait.hf.checkpoint import _copy_tokenizer
    from plait.hf.tokenizer_files import tokenizer_files

    tokenizer = shutil.copytree(chatml_dir, tmp_path / "tokenizer")
    (tokenizer / "additional_chat_templates").mkdir()
    (tokenizer / "additional_chat_templates" / "tool_use.jinja").write_text("{{ messages }}")
    names = {p.as_posix() for p in tokenizer_files(tokenizer)}
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
            "additional_chat_templates/tool_use.jinja"} <= names
    model = tmp_path / "model"
    model.mkdir()
    for name in ("tokenizer.json", "special_tokens_map.json", "generation_config.json"):  # another tokenizer's
        (model / name).write_text("{}")
    out = tmp_path / "out"
    out.mkdir()
    _copy_tokenizer(model, out, tokenizer)
    copied = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert copied == names | {"generation_config.json"}  # no special_tokens_map.json of the other tokenizer
    assert (out / "tokenizer.json").read_bytes() == (tokenizer / "tokenizer.json").read_bytes()


def test_a_resume_with_other_steps_keeps_its_schedule_or_restretches_it_and_says_which() -> None:
    from plait.train.checkpoint import schedule_note, schedule_span
    from plait.train.config import load_config, lr_at

    meta = {"step": 20, "config": {"train": {"steps": 20}}}  # a checkpoint that does not record its span
    extended = load_config(None, ["train.steps=40", "optimizer.lr=1e-3", "optimizer.warmup=2"])
    assert schedule_span(extended, meta) == 20
    note = schedule_note(extended, meta)
    assert note.startswith("train.steps=40 resumes a run whose learning-rate schedule spans 20 steps: it keeps")
    assert "optimizer.schedule_steps=40" in note and f"lr {lr_at(20, extended.optimizer, 40):.3g} at step 21" in note
    stretched = load_config(None, ["train.steps=40", "optimizer.schedule_steps=40"])
    assert schedule_span(stretched, {**meta, "schedule_steps": 20}) == 40
    assert schedule_note(stretched, {**meta, "schedule_steps": 20}).startswith(
        "optimizer.schedule_steps=40 re-stretches the cosine schedule this run started over 20 steps")
    assert schedule_note(load_config(None, ["train.steps=20"]), meta) is None  # a restart: nothing changed
    assert schedule_note(load_config(None, ["train.steps=40", 'optimizer.schedule="constant"']), meta) is None


def test_a_resume_may_replace_the_export_its_own_run_wrote(tmp_path: Path) -> None:
    from plait.train.checkpoint import META, exports_here
    from plait.train.config import load_config

    step = tmp_path / "ckpt" / "step_000002"
    step.mkdir(parents=True)
    (step / META).write_text(json.dumps({"step": 2, "config": {"checkpoint": {"export_hf": str(tmp_path / "hf")}}}))
    mine = [f'checkpoint.dir="{tmp_path / "ckpt"}"', f'checkpoint.export_hf="{tmp_path / "hf"}"']
    assert exports_here(load_config(None, [*mine, "checkpoint.resume=true"]))
    assert not exports_here(load_config(None, mine)), "a new run into a filled folder still needs consent"
    other = load_config(None, [*mine[:1], f'checkpoint.export_hf="{tmp_path / "other"}"', "checkpoint.resume=true"])
    assert not exports_here(other)


def scripted(ids: list[int], vocab: int):
    """logits_of for a model that says `ids`, one after the other, after any prompt."""
    state = {"start": None}

    def logits_of(tokens: torch.Tensor) -> torch.Tensor:
        if state["start"] is None:
            state["start"] = tokens.shape[1]
        logits = torch.zeros(1, tokens.shape[1], vocab)
        logits[0, -1, ids[min(tokens.shape[1] - state["start"], len(ids) - 1)]] = 1.0
        return logits
    return logits_of


def test_generation_stops_at_the_end_of_turn_and_at_stop_strings(chatml_dir: Path) -> None:
    from plait.commands.generate import Generator, chat_prompt_ids, chat_template_tokenizer, end_ids, printed_text
    from plait.train.data import load_tokenizer
    from plait.train.sample import sample

    tokenizer = load_tokenizer(str(chatml_dir))
    chat = chat_template_tokenizer(tokenizer)
    end_of_turn = chat.convert_tokens_to_ids("<|im_end|>")
    prompt = chat_prompt_ids(chat, "Who?")
    assert chat.decode(prompt.tolist()) == "<|im_start|>user\nWho?<|im_end|>\n<|im_start|>assistant\n"
    answer = chat.encode("To be, or not to be.", add_special_tokens=False)
    next_turn = chat.encode("\n", add_special_tokens=False) + [chat.convert_tokens_to_ids("<|im_start|>")]
    logits_of = scripted(answer + [end_of_turn] + next_turn * 5, tokenizer.vocab_size)
    generator = Generator(logits_of=logits_of, tokenizer=tokenizer, max_seq_len=64)
    ends = end_ids(generator)
    assert end_of_turn in ends and tokenizer.eos_id in ends
    out = sample(logits_of, prompt, num_tokens=30, max_seq_len=64, stop_ids=ends)
    assert out[len(prompt):].tolist() == answer + [end_of_turn], "stopped at the end of the turn"
    assert printed_text(tokenizer.decode, prompt, out, ends, [], reply_only=True) == "To be, or not to be."
    whole = printed_text(tokenizer.decode, prompt, out, ends, [], reply_only=False)
    assert whole == "user\nWho?\nassistant\nTo be, or not to be.", "no special token printed"
    logits_of = scripted(answer + [end_of_turn], tokenizer.vocab_size)
    stop = lambda added: "or" in tokenizer.decode(added.numpy())  # noqa: E731
    out = sample(logits_of, prompt, num_tokens=30, max_seq_len=64, stop=stop)
    assert len(out) - len(prompt) < len(answer)
    assert printed_text(tokenizer.decode, prompt, out, ends, ["or"], reply_only=True) == "To be, "


def test_plait_plan_refuses_a_seq_len_past_the_position_limit_as_train_does(tmp_path: Path, capsys) -> None:
    from plait.cli import main
    from plait.hf.tiny import write_tiny_config

    model_dir = write_tiny_config("llama", tmp_path / "llama")  # max_position_embeddings = 64
    args = ["plan", "--model", str(model_dir), "--cluster", "local-cpu", "--devices", "2", "--global-batch", "4"]
    assert main([*args, "--seq-len", "128"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "--seq-len 128 is past" in lines[0] and "max_position_embeddings=64" in lines[0], lines
    assert main([*args, "--seq-len", "64"]) == 0
