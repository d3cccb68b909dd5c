"""The checkpoint store without torch: atomic publish, manifests, verification, fallback, pruning."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plait.errors import ConfigError
from plait.train.checkpoint import (
    MANIFEST, check_fresh_dir, complete_dirs, latest_complete, prune, publish, remove_stale_tmp, step_dir, tmp_dir,
    verify, write_manifest,
)
from plait.runtime.faults import Fault, maybe_inject, parse_fault


def fake_checkpoint(root: Path, step: int, *, publish_it: bool = True) -> Path:
    """A directory shaped like a real checkpoint (DCP .metadata and shards, meta.json, rng files)."""
    tmp = tmp_dir(root, step)
    (tmp / "rng").mkdir(parents=True)
    (tmp / ".metadata").write_bytes(b"metadata" * 10)
    for rank in range(2):
        (tmp / f"__{rank}_0.distcp").write_bytes(bytes([step, rank]) * 500)
        (tmp / "rng" / f"rank_{rank:05d}.pt").write_bytes(b"rng" * 7)
    (tmp / "meta.json").write_text(json.dumps({"step": step}))
    if not publish_it:
        return tmp
    write_manifest(tmp, step)
    publish(tmp, step_dir(root, step))
    return step_dir(root, step)


def test_a_published_checkpoint_verifies(tmp_path: Path) -> None:
    path = fake_checkpoint(tmp_path, 4)
    assert verify(path) is None
    assert latest_complete(tmp_path).path == path
    assert not tmp_dir(tmp_path, 4).exists()


def test_an_unfinished_save_is_invisible(tmp_path: Path) -> None:
    done = fake_checkpoint(tmp_path, 2)
    fake_checkpoint(tmp_path, 4, publish_it=False)  # crashed before the manifest and rename
    assert [s for s, _ in complete_dirs(tmp_path)] == [2]
    found = latest_complete(tmp_path)
    assert found.path == done and not found.refused
    remove_stale_tmp(tmp_path)
    assert not tmp_dir(tmp_path, 4).exists() and done.exists()


CORRUPTIONS = {
    "truncated shard": lambda d: (d / "__1_0.distcp").write_bytes((d / "__1_0.distcp").read_bytes()[:100]),
    "flipped byte": lambda d: (d / "__0_0.distcp").write_bytes(b"\xff" + (d / "__0_0.distcp").read_bytes()[1:]),
    "missing shard": lambda d: (d / "__0_0.distcp").unlink(),
    "missing rng file": lambda d: (d / "rng" / "rank_00001.pt").unlink(),
    "missing manifest": lambda d: (d / MANIFEST).unlink(),
    "garbage manifest": lambda d: (d / MANIFEST).write_text("{not json"),
    "manifest without files": lambda d: (d / MANIFEST).write_text(json.dumps({"step": 6, "files": {}})),
    "missing metadata": lambda d: (d / ".metadata").unlink(),
}


@pytest.mark.parametrize("how", list(CORRUPTIONS))
def test_a_corrupt_checkpoint_is_named_and_skipped(tmp_path: Path, how: str) -> None:
    older = fake_checkpoint(tmp_path, 3)
    newer = fake_checkpoint(tmp_path, 6)
    CORRUPTIONS[how](newer)
    problem = verify(newer)
    assert problem, f"{how} was not detected"
    found = latest_complete(tmp_path)
    assert found.path == older and found.step == 3
    assert found.refused[0][0] == newer
    (message,) = found.warnings()
    assert "step_000006" in message and "falling back to step_000003" in message


def test_no_usable_checkpoint(tmp_path: Path) -> None:
    only = fake_checkpoint(tmp_path, 1)
    (only / MANIFEST).unlink()
    found = latest_complete(tmp_path)
    assert found.path is None and "no complete checkpoint is left" in found.warnings()[0]
    assert latest_complete(tmp_path / "nowhere").path is None


def test_prune_keeps_the_newest(tmp_path: Path) -> None:
    for step in (1, 2, 3, 10):
        fake_checkpoint(tmp_path, step)
    prune(tmp_path, keep=2)
    assert [s for s, _ in complete_dirs(tmp_path)] == [3, 10]


def test_republishing_a_step_replaces_it(tmp_path: Path) -> None:
    path = fake_checkpoint(tmp_path, 5)
    (path / MANIFEST).unlink()  # broken
    fake_checkpoint(tmp_path, 5)
    assert verify(path) is None
    assert not list(tmp_path.glob("*.old"))


def test_a_fresh_run_refuses_a_used_directory(tmp_path: Path) -> None:
    check_fresh_dir(tmp_path / "new")  # nothing there: fine
    fake_checkpoint(tmp_path, 7)
    with pytest.raises(ConfigError, match="step_000007.*--resume"):
        check_fresh_dir(tmp_path)


def test_fault_specs() -> None:
    assert parse_fault("kill:rank=1:step=4") == Fault(kind="kill", rank=1, step=4)
    assert parse_fault("hang:step=2:rank=0") == Fault(kind="hang", rank=0, step=2)
    for bad in ("explode:rank=1:step=2", "kill:rank=1", "kill:rank=a:step=1", ""):
        with pytest.raises(ConfigError, match="PLAIT_FAULT"):
            parse_fault(bad)
    maybe_inject(0, 4, Fault(kind="kill", rank=1, step=4))  # another rank: nothing happens
    maybe_inject(1, 3, Fault(kind="kill", rank=1, step=4))  # another step: nothing happens
