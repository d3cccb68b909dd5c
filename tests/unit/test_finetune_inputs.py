"""What a user fine-tuning a Hugging Face checkpoint can get wrong, refused before any rank starts (exit 2, one line
naming the value): pretrained weights without a checkpoint, an export of a model that is not Hugging Face's or
into a folder holding files, a bad JSON line, a tokenizer larger than the model; and `plait export`'s inputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plait.cli import main as cli_main
from plait.errors import ConfigError


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A tiny Llama checkpoint (config.json, model.safetensors), built here."""
    from plait.hf.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint("llama", tmp_path_factory.mktemp("hf") / "llama", seed=0)


def run(argv: list[str], capsys) -> tuple[int, str]:
    code = cli_main(argv)
    return code, capsys.readouterr().err


def one_error(err: str, command: str) -> str:
    lines = [line for line in err.splitlines() if line.strip() and "warning:" not in line]
    assert len(lines) == 1 and lines[0].startswith(f"plait {command}: error: "), err
    assert "Traceback" not in err
    return lines[0]


def write_config(tmp_path: Path, **sections: dict) -> Path:
    from plait.train.config import config_from_dict, dump_toml

    sections.setdefault("log", {"dir": str(tmp_path / "log")})
    sections.setdefault("train", {"steps": 2, "global_batch": 4, "seq_len": 16})
    sections.setdefault("plan", {"devices": 2})
    path = tmp_path / "run.toml"
    path.write_text(dump_toml(config_from_dict(sections)))
    return path


def test_pretrained_needs_a_hugging_face_folder_with_weights(tmp_path, hf_dir, capsys):
    from plait.train.config import load_config

    with pytest.raises(ConfigError, match="set model.file to its folder"):
        load_config(None, ['model.weights="pretrained"'])
    config = write_config(tmp_path, model={"file": "examples/models/gpt-small.yaml", "weights": "pretrained"})
    code, err = run(["train", str(config)], capsys)
    assert code == 2 and "gpt-small.yaml' is a plait model file" in one_error(err, "train")
    bare = tmp_path / "config-only"
    bare.mkdir()
    (bare / "config.json").write_text((hf_dir / "config.json").read_text())
    config = write_config(tmp_path, model={"file": str(bare), "weights": "pretrained"})
    code, err = run(["train", str(config)], capsys)
    assert code == 2 and "holds no model.safetensors" in one_error(err, "train")


def test_export_needs_a_hugging_face_model_and_an_empty_folder(tmp_path, hf_dir, capsys, no_launch):
    config = write_config(tmp_path, checkpoint={"export_hf": str(tmp_path / "out")})
    code, err = run(["train", str(config)], capsys)
    assert code == 2 and "'tiny-gpt' is not a Hugging Face model" in one_error(err, "train")

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    data = {"source": "text", "path": "plait/data/shakespeare.txt", "tokenizer": "byte"}
    model = {"file": str(hf_dir), "weights": "pretrained"}
    config = write_config(tmp_path, model=model, data=data, checkpoint={"export_hf": str(tmp_path / "out")})
    code, err = run(["train", str(config)], capsys)
    line = one_error(err, "train")
    assert code == 2 and "checkpoint.export_hf" in line and "not empty" in line and "export_overwrite" in line
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"


def test_a_tokenizer_larger_than_the_model_is_refused_before_launch(tmp_path, hf_dir, capsys, no_launch):
    data = {"source": "text", "path": "plait/data/shakespeare.txt", "tokenizer": "byte"}
    config = write_config(tmp_path, model={"file": str(hf_dir), "weights": "pretrained"}, data=data)
    code, err = run(["train", str(config)], capsys)
    line = one_error(err, "train")
    assert code == 2 and "shakespeare.txt" in line and "vocabulary of 67" in line and "data.tokenizer" in line


def test_a_bad_json_line_is_named_before_launch(tmp_path, capsys, no_launch):
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "broken\n')
    config = write_config(tmp_path, data={"source": "jsonl", "path": str(path)})
    code, err = run(["train", str(config)], capsys)
    assert code == 2 and f"{path}' line 2 is not valid JSON" in one_error(err, "train")


def test_export_dir_rule_allows_a_new_or_empty_folder_and_consent(tmp_path):
    from plait.outputs import filled_dir

    assert filled_dir(tmp_path / "new", "x", False, "--force") == (tmp_path / "new").resolve()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "a").write_text("")
    with pytest.raises(ConfigError, match="'.*full' is not empty .1 entries: a.; .*or pass --force"):
        filled_dir(tmp_path / "full", "export folder", False, "pass --force")
    assert filled_dir(tmp_path / "full", "export folder", True, "pass --force").is_dir()


def test_plait_export_refuses_what_is_not_a_checkpoint(tmp_path, hf_dir, capsys):
    code, err = run(["export", str(tmp_path / "absent"), str(tmp_path / "out")], capsys)
    assert code == 2 and "is not a folder" in one_error(err, "export")
    code, err = run(["export", str(hf_dir), str(tmp_path / "out")], capsys)
    assert code == 2 and "holds no complete checkpoint" in one_error(err, "export")
    step = tmp_path / "ckpt" / "step_000004"
    step.mkdir(parents=True)
    (step / "meta.json").write_text(json.dumps({"step": 4}))
    code, err = run(["export", str(step), str(tmp_path / "out")], capsys)
    assert code == 2 and "MANIFEST.json is missing" in one_error(err, "export")
    code, err = run(["export", str(step), str(tmp_path / "out"), "--max-shard-size", "lots"], capsys)
    assert code == 2 and "--max-shard-size" in one_error(err, "export")
    assert not (tmp_path / "out").exists(), "nothing written"
