"""Crash and restart through the real `plait train` command on 2 gloo ranks.

* A rank SIGKILLed mid-training (PLAIT_FAULT) under `--max-restarts 1`: the elastic agent
  restarts both ranks, they resume from the last checkpoint, and every step's loss and the
  final weights equal those of a run that was never interrupted.
* The same kill without restarts: the job fails with an error naming the dead rank, within a
  bound (the subprocess timeout), instead of hanging.
* A hung rank: the others' next collective times out (PLAIT_DIST_TIMEOUT_S), the job fails, and the
  rank that hung is the one named.
* A dead peer: one line per rank, no traceback.
* Ctrl-C half-way through a save: exit 130, one line, the previous checkpoint intact, and a resume
  from it reproduces the uninterrupted run.
"""

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

MODEL = {"name": "restart-tiny-gpt", "arch": "gpt", "num_layers": 2, "hidden_size": 32, "num_heads": 4,
         "vocab_size": 128, "max_seq_len": 32}
STEPS = 8


@pytest.fixture()
def workdir() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="plait-restart-"))  # outside pytest's pruned basetemp
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def clean() -> Iterator[Path]:
    """One run that was never interrupted, for every test to compare its losses and weights with."""
    root = Path(tempfile.mkdtemp(prefix="plait-restart-clean-"))
    done = plait_train(write_config(root, "clean"))
    assert done.returncode == 0, done.stderr[-3000:]
    yield root
    shutil.rmtree(root, ignore_errors=True)


def write_config(root: Path, name: str) -> Path:
    return write_run_config(root, name, MODEL, {"train": {"steps": STEPS, "global_batch": 4, "seq_len": 16, "seed": 5},
                                                "optimizer": {"warmup": 2},
                                                "checkpoint": {"dir": str(root / name / "ckpt"), "every": 2, "keep": 2},
                                                "log": {"save_model": True}},
                            plan=local_plan(MODEL, 4, 16, dp=2, tp=1, pp=1, micro_batch=2))


def plait_train(config: Path, *args: str, fault: str | None = None, timeout: float = 240,
                dist_timeout: float | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PLAIT_OMP_THREADS": "1"}
    env.pop("PLAIT_FAULT", None)
    if fault:
        env["PLAIT_FAULT"] = fault
    if dist_timeout:
        env["PLAIT_DIST_TIMEOUT_S"] = str(dist_timeout)
    return subprocess.run([sys.executable, "-m", "plait", "train", str(config), "--nproc", "2", *args],
                          env=env, capture_output=True, text=True, timeout=timeout)


def losses(root: Path, name: str) -> dict[int, float]:
    rows = map(json.loads, (root / name / "log" / "metrics.jsonl").read_text().splitlines())
    return {row["step"]: row["loss"] for row in rows}  # a resumed step's last line wins


def test_killed_rank_restarts_from_the_checkpoint(workdir: Path, clean: Path) -> None:
    import torch

    crashed = plait_train(write_config(workdir, "crashed"), "--max-restarts", "1", fault="kill:rank=1:step=5")
    assert crashed.returncode == 0, crashed.stderr[-3000:]
    assert "injecting 'kill' on rank 1 after step 5" in crashed.stderr
    assert "resumed from" in crashed.stderr and "step_000004" in crashed.stderr
    assert losses(workdir, "crashed") == losses(clean, "clean")
    lines = (workdir / "crashed" / "log" / "metrics.jsonl").read_text().splitlines()
    # step 5 was logged, lost with the kill (after the checkpoint of step 4) and redone: logged once
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4, 5, 6, 7, 8]
    a = torch.load(clean / "clean" / "log" / "model.pt")
    b = torch.load(workdir / "crashed" / "log" / "model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_dead_rank_without_restarts_is_named(workdir: Path) -> None:
    result = plait_train(write_config(workdir, "dead"), fault="kill:rank=1:step=2", timeout=300)
    assert result.returncode != 0
    assert "rank 1 failed (signal SIGKILL)" in result.stderr
    # the checkpoint of step 2 was complete before the kill, and stays usable
    from plait.train.checkpoint import latest_complete

    assert latest_complete(workdir / "dead" / "ckpt").step == 2


def test_hung_rank_times_out(workdir: Path) -> None:
    result = plait_train(write_config(workdir, "hung"), fault="hang:rank=1:step=1", timeout=300, dist_timeout=10)
    assert result.returncode != 0
    assert "injecting 'hang' on rank 1 after step 1" in result.stderr
    assert "plait: rank 1 hung (last began step 1)" in result.stderr  # the rank that hung, not the one that waited
    assert "rank 0 failed" not in result.stderr and "rank 0 timed out waiting" in result.stderr
    assert "Traceback" not in result.stderr


def test_dead_peer_without_checkpoints_is_one_line_per_rank(workdir: Path) -> None:
    """PLAIT_FAULT fires without a checkpoint dir too; the peer that lost the dead rank says so in one line."""
    result = plait_train(write_config(workdir, "bare"), "--set", "checkpoint.dir=none", fault="kill:rank=1:step=2")
    assert result.returncode == 1
    assert "injecting 'kill' on rank 1 after step 2" in result.stderr
    assert "plait: rank 1 failed (signal SIGKILL)" in result.stderr
    assert "Traceback" not in result.stderr and "closing signal" not in result.stderr
    # The surviving rank ends without the interpreter's teardown, where gloo's threads, cut off mid-read by the
    # dead peer, aborted it ("terminate called without an active exception" after its line).
    assert "terminate called" not in result.stderr
    assert len(result.stderr.splitlines()) <= 8, result.stderr


def test_ctrl_c_during_a_save_loses_nothing(workdir: Path, clean: Path) -> None:
    """Ctrl-C half-way through the save of step 4 (shards written, no manifest): one line, exit 130, the
    checkpoint of step 2 byte for byte as it was, and a resume continues from it to the same losses."""
    from plait.train.checkpoint import latest_complete

    config = write_config(workdir, "cut")
    result = plait_train(config, fault="interrupt:rank=0:step=4")
    assert result.returncode == 130, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("plait train: interrupted; the last complete "
                                                            "checkpoint is ")
    ckpt = workdir / "cut" / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_000002", "step_000004.tmp"]
    found = latest_complete(ckpt)  # every file of step 2 matches the SHA-256 its manifest recorded at the save
    assert found.step == 2 and not found.refused

    resumed = plait_train(config, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "step 2)" in resumed.stderr
    assert losses(workdir, "cut") == losses(clean, "clean")
    steps = [json.loads(line)["step"] for line in (workdir / "cut" / "log" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1))
