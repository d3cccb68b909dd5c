"""plait's own checkpoint files are read without unpickling: the random states round-trip as plain data, and a
planted pickle in a rank's random-state file is refused (no code runs) -- in the loader and at launch."""

from __future__ import annotations

import os
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from plait.errors import ConfigError
from plait.train.checkpoint import _load_rng, _save_rng, read_rng_file


class Planted:
    """What an attacker would put in a shared checkpoint: unpickling it runs a command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def draws() -> tuple[float, float, float]:
    return torch.rand(1).item(), random.random(), float(np.random.rand())


def test_random_states_round_trip_as_plain_data(tmp_path: Path) -> None:
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    np.random.standard_normal()  # a cached gaussian is part of numpy's state too
    path = tmp_path / "rank_00000.pt"
    _save_rng(path)
    expected = draws()
    torch.manual_seed(99), random.seed(99), np.random.seed(99)
    _load_rng(path)
    assert draws() == expected
    # The file really is plain data: weights_only=True (no allow-list) reads it.
    assert set(torch.load(path, weights_only=True)) >= {"torch", "python", "numpy"}


def test_a_planted_pickle_is_refused_without_running(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "rank_00000.pt"
    torch.save({"torch": torch.get_rng_state(), "python": Planted(marker), "numpy": 0}, path)
    with pytest.raises(ConfigError, match="refuses this one") as refused:
        read_rng_file(path)
    assert str(path) in str(refused.value) and "\n" not in str(refused.value)
    assert not marker.exists()
    with pytest.raises(ConfigError):
        _load_rng(path)
    assert not marker.exists()
    # the same bytes, unpickled the old way, would have run the command: the test plants a real threat
    with path.open("rb") as f:
        torch.load(f, weights_only=False)
    assert marker.exists()


def test_a_raw_pickle_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "rank_00001.pt"
    path.write_bytes(pickle.dumps(Planted(marker)))
    with pytest.raises(ConfigError, match="plait reads its own checkpoint files without unpickling"):
        read_rng_file(path)
    assert not marker.exists()


def test_plait_train_resume_refuses_a_planted_pickle_before_ranks_start(tmp_path: Path) -> None:
    import shutil
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from bad_input_world import CKPT, base_config, run_cli, to_toml, write_manifest_again

    root = tmp_path / "shared-ckpt"
    shutil.copytree(CKPT, root)
    step = next(root.glob("step_*"))
    marker = tmp_path / "pwned"
    rng_file = step / "rng" / "rank_00000.pt"
    torch.save({"torch": torch.get_rng_state(), "python": Planted(marker), "numpy": 0}, rng_file)
    write_manifest_again(step)  # whoever plants the file writes the manifest too
    config = base_config()
    config["checkpoint"]["dir"] = str(root)
    (tmp_path / "run.toml").write_text(to_toml(config))
    code, err = run_cli(["train", str(tmp_path / "run.toml")])
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and str(rng_file) in lines[0], err
    assert not marker.exists()
