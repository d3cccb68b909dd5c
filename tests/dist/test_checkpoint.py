"""Checkpoints on 2 and 4 gloo ranks: exact resume (DP, ZeRO-1, FSDP, TP, PP) and resharding
to another plan (DPxTP 2x2 -> FSDP 4, -> DP 2; PP 2x2 -> no pipeline), through the real loop.

Every run trains the same tiny GPT on the shipped text for 6 steps with a checkpoint every 3.
"Stopping at step 3" is a copy of a run's step-3 checkpoint into a fresh directory, from which
a second run resumes to step 6: its steps 4..6 must match the uninterrupted run's -- exactly
(losses and final weights bit for bit) under the same plan, to floating point under another.

Two launches (world 4, then world 2) run all cases; this file is also their worker:
    python tests/dist/test_checkpoint.py SCRIPT.json
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

STEPS, EVERY, GLOBAL_BATCH, SEQ_LEN = 6, 3, 4, 16
MODEL = {"name": "ckpt-tiny-gpt", "arch": "gpt", "num_layers": 4, "hidden_size": 32, "num_heads": 4,
         "vocab_size": 128, "max_seq_len": 32}

# name -> plan degrees; each trains 6 steps from scratch ("A" runs)
PLANS: dict[str, dict] = {
    "dp2": dict(dp=2, micro_batch=2),
    "zero1": dict(dp=2, zero=1, micro_batch=1, num_micro_batches=2),
    "fsdp2": dict(dp=2, zero=3, micro_batch=2),
    "tp2": dict(tp=2, sequence_parallel=True, micro_batch=2, num_micro_batches=2),
    "pp2": dict(pp=2, schedule="1f1b", micro_batch=1, num_micro_batches=4, layers_per_stage=[3, 1]),
    "dp2tp2": dict(dp=2, tp=2, micro_batch=1, num_micro_batches=2),
    # zero=3: DDP under a pipeline fails in this executor (DDP's bucket rebuild sees each
    # parameter once per micro-batch forward)
    "pp2dp2": dict(pp=2, dp=2, zero=3, schedule="gpipe", micro_batch=1, num_micro_batches=2),
    "fsdp4": dict(dp=4, zero=3, micro_batch=1),
}
WORLD = {name: math.prod(p.get(k, 1) for k in ("dp", "tp", "pp")) for name, p in PLANS.items()}
EXACT = ["dp2", "zero1", "fsdp2", "tp2", "pp2"]
# resumed run -> (plan that saved the step-3 checkpoint, plan that resumes from it)
RESHARD = {"dp2tp2-to-fsdp4": ("dp2tp2", "fsdp4"), "dp2tp2-to-dp2": ("dp2tp2", "dp2"),
           "pp2dp2-to-dp2": ("pp2dp2", "dp2"), "pp2-to-tp2": ("pp2", "tp2"),
           "zero1-to-fsdp2": ("zero1", "fsdp2")}


# ---- building runs (pytest side) ----------------------------------------------------------
def write_plan(root: Path, name: str) -> Path:
    from plait.plan import Plan
    from plait.spec import ModelSpec, TrainSpec
    from plait.spec.clusters import CLUSTER_PRESETS

    kwargs = {"dp": 1, "tp": 1, "pp": 1, "num_micro_batches": 1, **PLANS[name]}
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in kwargs.items()}
    plan = Plan.of(model=ModelSpec(**MODEL), train=TrainSpec(global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN, precision="fp32"),
                cluster=CLUSTER_PRESETS["local-cpu"], **kwargs)
    path = root / "plans" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(plan.to_json())
    return path


def run_item(root: Path, run: str, plan: str, *, resume_from: Path | None = None) -> dict:
    """One training run in the worker's script: its config, and a checkpoint to copy in first."""
    model_file = root / "model.json"
    model_file.write_text(json.dumps(MODEL))
    config = {
        "model": {"file": str(model_file)},
        "train": {"steps": STEPS, "global_batch": GLOBAL_BATCH, "seq_len": SEQ_LEN, "seed": 3},
        "optimizer": {"warmup": 2},
        "plan": {"file": str(write_plan(root, plan))},
        "checkpoint": {"dir": str(root / run / "ckpt"), "every": EVERY, "keep": 5, "resume": resume_from is not None},
        "log": {"dir": str(root / run / "log"), "progress": False, "save_model": True},
    }
    copy = [str(resume_from), str(root / run / "ckpt" / resume_from.name)] if resume_from else None
    return {"world": WORLD[plan], "config": config, "copy": copy}


def launch(root: Path, world: int, items: list[dict]) -> None:
    from plait.runtime.launch import run_local

    script = root / f"script-{world}.json"
    script.write_text(json.dumps([i for i in items if i["world"] == world]))
    code = run_local(world, [__file__, str(script)], module=None, timeout_s=600)
    assert code == 0, f"the {world}-rank launch failed (exit {code}); see the output above"


def losses(root: Path, run: str) -> dict[int, float]:
    """Step -> loss from metrics.jsonl (a resumed run appends; the last line of a step wins)."""
    lines = (root / run / "log" / "metrics.jsonl").read_text().splitlines()
    return {row["step"]: row["loss"] for row in map(json.loads, lines)}


def weights(root: Path, run: str) -> dict:
    import torch

    return torch.load(root / run / "log" / "model.pt")


@pytest.fixture(scope="module")
def runs() -> Iterator[Path]:
    # Not under pytest's basetemp: other pytest sessions on this machine prune old basetemps
    # while these launches run.
    root = Path(tempfile.mkdtemp(prefix="plait-ckpt-"))
    items = [run_item(root, f"A-{name}", name) for name in PLANS]
    # resumed runs copy a step-3 checkpoint that an "A" run wrote earlier in the same launch or
    # in the world-4 launch, which goes first
    items += [run_item(root, f"C-{name}", name, resume_from=root / f"A-{name}" / "ckpt" / "step_000003")
              for name in EXACT]
    items += [run_item(root, f"C-{run}", dst, resume_from=root / f"A-{src}" / "ckpt" / "step_000003")
              for run, (src, dst) in RESHARD.items()]
    ordered = sorted(items, key=lambda i: i["copy"] is not None)  # "A" runs first within a launch
    launch(root, 4, ordered)
    launch(root, 2, ordered)
    yield root
    shutil.rmtree(root, ignore_errors=True)


# ---- tests --------------------------------------------------------------------------------
pytestmark = pytest.mark.dist


@pytest.mark.parametrize("name", EXACT)
def test_exact_resume(runs: Path, name: str) -> None:
    import torch

    full, resumed = losses(runs, f"A-{name}"), losses(runs, f"C-{name}")
    assert sorted(resumed) == [4, 5, 6], "the resumed run must start at step 4"
    assert [resumed[s] for s in (4, 5, 6)] == [full[s] for s in (4, 5, 6)]
    a, c = weights(runs, f"A-{name}"), weights(runs, f"C-{name}")
    assert a.keys() == c.keys()
    for key in a:
        assert torch.equal(a[key], c[key]), f"{name}: {key} differs after resuming"


@pytest.mark.parametrize("run", list(RESHARD))
def test_reshard_on_resume(runs: Path, run: str) -> None:
    import torch

    src, dst = RESHARD[run]
    full, resumed = losses(runs, f"A-{src}"), losses(runs, f"C-{run}")
    assert sorted(resumed) == [4, 5, 6]
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(full[step], rel=1e-5, abs=2e-6), f"step {step}"
    a, c = weights(runs, f"A-{src}"), weights(runs, f"C-{run}")
    for key in a:
        torch.testing.assert_close(c[key], a[key], rtol=1e-4, atol=1e-5, msg=f"{run}: {key}")


def test_checkpoints_are_complete_and_pruned(runs: Path) -> None:
    from plait.train.checkpoint import complete_dirs, verify

    ckpt = runs / "A-dp2" / "ckpt"
    assert [step for step, _ in complete_dirs(ckpt)] == [3, 6]
    assert all(verify(path) is None for _, path in complete_dirs(ckpt))
    assert not list(ckpt.glob("*.tmp")), "no temporary directory is left after a clean run"
    meta = json.loads((ckpt / "step_000006" / "meta.json").read_text())
    assert meta["step"] == 6 and meta["world_size"] == 2 and meta["plan"]["model"]["num_layers"] == 4
    assert meta["loader"]["step_in_epoch"] == 6


# ---- worker (each rank) -------------------------------------------------------------------
def worker(script: Path) -> None:
    import torch.distributed as dist

    from plait.runtime.launch import init_distributed
    from plait.train import loop
    from plait.train.config import config_from_dict
    from plait.train.resolve import resolve_plan

    init_distributed("gloo", 120)
    for item in json.loads(script.read_text()):
        if item["copy"] and dist.get_rank() == 0:
            src, dst = map(Path, item["copy"])
            shutil.copytree(src, dst)
        dist.barrier()
        config = config_from_dict(item["config"])
        # loop.run's body, without its destroy_process_group: one process group serves every run
        loop._train(config, resolve_plan(config))
    from plait.runtime.launch import shutdown_distributed

    shutdown_distributed()  # at a barrier: a rank closing its connections while another reads aborts it


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
