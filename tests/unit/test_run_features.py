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
