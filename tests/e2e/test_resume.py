"""`plait train --resume` end to end: broken newer checkpoints are named, skipped and kept aside, the run
continues exactly from the newest complete one, a set with nothing usable stops the resume unchanged
(unless --start-over), and a different --nproc re-plans and reshards."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
from run_configs import local_plan, write_run_config  # noqa: E402

pytestmark = pytest.mark.dist

MODEL = {"name": "resume-tiny-gpt", "arch": "gpt", "num_layers": 2, "hidden_size": 32, "num_heads": 4,
         "vocab_size": 128, "max_seq_len": 32}


@pytest.fixture(scope="module")
def root() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="plait-resume-"))  # outside pytest's pruned basetemp
    yield path
    shutil.rmtree(path, ignore_errors=True)


def write_config(root: Path, name: str) -> Path:
    return write_run_config(root, name, MODEL, {"train": {"steps": 6, "global_batch": 4, "seq_len": 16},
                                                "checkpoint": {"dir": str(root / name / "ckpt"), "every": 2, "keep": 3}},
                            plan=local_plan(MODEL, 4, 16, dp=2, tp=1, pp=1, micro_batch=2))


def plait(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PLAIT_OMP_THREADS": "1"}
    env.pop("PLAIT_FAULT", None)
    return subprocess.run([sys.executable, "-m", "plait", *args], env=env, capture_output=True, text=True,
                          timeout=400)


def losses(root: Path, name: str) -> dict[int, float]:
    rows = map(json.loads, (root / name / "log" / "metrics.jsonl").read_text().splitlines())
    return {row["step"]: row["loss"] for row in rows}


@pytest.fixture(scope="module")
def first_run(root: Path) -> dict[int, float]:
    result = plait("train", str(write_config(root, "run")), "--nproc", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    shutil.copytree(root / "run" / "ckpt" / "step_000002", root / "step_000002.saved")  # for the reshard test
    return losses(root, "run")


def test_fresh_run_refuses_a_used_checkpoint_dir(root: Path, first_run: dict) -> None:
    before = sorted(p.name for p in (root / "run" / "ckpt").iterdir())
    result = plait("train", str(root / "run.toml"), "--nproc", "2")
    assert result.returncode == 2
    assert "already holds checkpoints" in result.stderr and "--resume" in result.stderr
    assert sorted(p.name for p in (root / "run" / "ckpt").iterdir()) == before


def test_resume_skips_broken_checkpoints(root: Path, first_run: dict) -> None:
    ckpt = root / "run" / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_000002", "step_000004", "step_000006"]
    shard = sorted((ckpt / "step_000006").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # truncated
    (ckpt / "step_000004" / "MANIFEST.json").unlink()  # incomplete
    broken = {name: contents(ckpt / name) for name in ("step_000004", "step_000006")}
    result = plait("train", str(root / "run.toml"), "--resume")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step_000006 is not usable" in result.stderr and "truncated" in result.stderr
    assert "step_000004 is not usable" in result.stderr and "MANIFEST.json is missing" in result.stderr
    assert "resumed from" in result.stderr and "step 2" in result.stderr
    resumed = losses(root, "run")
    assert resumed == first_run  # steps 3..6 again, bit for bit (as rounded in metrics.jsonl)
    # what could not be read was not overwritten by the new saves of steps 4 and 6: kept aside, byte for byte
    for name, files in broken.items():
        assert contents(ckpt / f"{name}.unreadable") == files
    assert "kept the unreadable checkpoint step_000006 as step_000006.unreadable" in result.stderr


def contents(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_resume_with_every_checkpoint_corrupt_stops_and_changes_nothing(root: Path) -> None:
    config = write_config(root, "spoilt")
    done = plait("train", str(config), "--nproc", "2", "--steps", "4")
    assert done.returncode == 0, done.stderr[-3000:]
    ckpt = root / "spoilt" / "ckpt"
    for step in ("step_000002", "step_000004"):
        shard = sorted((ckpt / step).glob("*.distcp"))[0]
        shard.write_bytes(b"x" + shard.read_bytes()[1:])  # one flipped byte: the checksum differs
    before = contents(ckpt)

    refused = plait("train", str(config), "--resume")
    assert refused.returncode == 2
    last = refused.stderr.strip().splitlines()[-1]
    assert last.startswith("plait train: error: cannot resume") and str(ckpt) in last and "--start-over" in last
    assert "Traceback" not in refused.stderr
    assert contents(ckpt) == before  # nothing renamed, nothing overwritten

    over = plait("train", str(config), "--start-over", "--steps", "4")
    assert over.returncode == 0, over.stderr[-3000:]
    assert "starting from step 0" in over.stderr
    after = contents(ckpt)
    for name, data in before.items():  # every byte of the unreadable set is still there, under .unreadable
        step, _, rest = name.partition("/")
        assert after[f"{step}.unreadable/{rest}"] == data
    assert sorted(p.name for p in ckpt.iterdir() if not p.name.endswith(".unreadable")) == [
        "step_000002", "step_000004"]


def test_resume_on_another_world_size_replans(root: Path, first_run: dict) -> None:
    config = write_config(root, "shrunk")
    shutil.copytree(root / "step_000002.saved", root / "shrunk" / "ckpt" / "step_000002")
    result = plait("train", str(config), "--resume", "--nproc", "1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "planning for 1 devices" in result.stderr
    resumed = losses(root, "shrunk")
    assert sorted(resumed) == [3, 4, 5, 6]
    for step in resumed:
        assert resumed[step] == pytest.approx(first_run[step], rel=1e-5, abs=2e-6)
