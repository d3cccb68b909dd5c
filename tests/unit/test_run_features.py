"""The run's features a config turns on, refused in one line where they cannot work: validation, metrics sinks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from plait.errors import ConfigError
from plait.train.config import load_config
from plait.train.data import split_held_out
from plait.train.resolve import check_outputs


def config_of(tmp_path: Path, *overrides: str):
    return load_config(None, [f'log.dir="{tmp_path / "log"}"', *overrides])


@pytest.mark.parametrize(("overrides", "named"), [
    (["eval.every=5"], "set fraction"),
    (["eval.fraction=1.5"], "fraction=1.5"),
    (["eval.every=5", "eval.fraction=0.1", "eval.path=val.txt"], "both set"),
    (["eval.batches=0"], "batches=0"),
])
def test_eval_sections_that_cannot_work_are_refused(tmp_path: Path, overrides: list[str], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        config_of(tmp_path, *overrides)


def test_keep_best_needs_a_checkpoint_dir(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="checkpoint.dir"):
        check_outputs(config_of(tmp_path, "eval.every=2", "eval.fraction=0.1", "eval.keep_best=true"))


def test_the_held_out_tail_is_the_fraction_and_disjoint() -> None:
    tokens = np.arange(1000)
    train, held = split_held_out(tokens, 0.05)
    assert len(held) == 50 and len(train) == 950
    assert train[-1] + 1 == held[0]
    assert len(split_held_out(tokens, 0.0)[1]) == 0


def test_an_unknown_wandb_mode_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="log.wandb"):
        config_of(tmp_path, 'log.wandb="cloud"')


# ---- fine-tune guards: a Hugging Face model's tokenizer and position limit --------------------------------------
class Launched(Exception):
    """The command got past its checks to the point of starting ranks."""


@pytest.fixture
def no_launch(monkeypatch):
    import plait.launch

    def stub(*args, **kwargs):
        raise Launched()

    monkeypatch.setattr(plait.launch, "run_local", stub)


def train_cli(tmp_path: Path, model_dir: Path, capsys, *, seq_len: int = 16, tokenizer: str | None = None):
    from plait.cli import main
    from plait.train.config import config_from_dict, dump_toml

    data = {"source": "shipped"} | ({"tokenizer": tokenizer} if tokenizer else {})
    config = config_from_dict({"model": {"file": str(model_dir)}, "data": data, "log": {"dir": str(tmp_path / "log")},
                               "train": {"steps": 2, "global_batch": 4, "seq_len": seq_len},
                               "plan": {"devices": 2, "pins": {"tp": 1, "pp": 1}}})
    path = tmp_path / "run.toml"
    path.write_text(dump_toml(config))
    code = main(["train", str(path)])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "warning:" not in line]
    return code, lines


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma", "gpt2"])
def test_seq_len_past_the_position_limit_is_refused_for_every_family(tmp_path: Path, family: str, capsys) -> None:
    from plait.models.hf_tiny import write_tiny_config

    model_dir = write_tiny_config(family, tmp_path / family)  # 64 positions
    code, lines = train_cli(tmp_path, model_dir, capsys, seq_len=128, tokenizer="byte")
    assert code == 2 and len(lines) == 1 and "seq_len=128" in lines[0] and "64" in lines[0], lines


def test_a_model_folder_without_a_tokenizer_is_refused_naming_byte(tmp_path: Path, capsys, no_launch) -> None:
    from plait.models.hf_tiny import write_tiny_config

    model_dir = write_tiny_config("llama", tmp_path / "llama", vocab_size=256)
    code, lines = train_cli(tmp_path, model_dir, capsys)
    assert code == 2 and len(lines) == 1 and "no tokenizer.json" in lines[0] and 'tokenizer = "byte"' in lines[0]
    with pytest.raises(Launched):  # asked for on purpose, bytes train
        train_cli(tmp_path, model_dir, capsys, tokenizer="byte")
