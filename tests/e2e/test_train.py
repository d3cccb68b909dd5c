"""`plait train` end to end: two local ranks write metrics and a plot; bad input exits 2 before launching."""

import json
import os
import subprocess
import sys

import pytest

from plait.plan import Plan
from plait.spec import TrainSpec
from plait.spec.clusters import CLUSTER_PRESETS
from plait.spec.models import MODEL_PRESETS

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PLAIT_OMP_THREADS": "1"}


def plait(*argv: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "plait", *argv], capture_output=True, text=True, env=ENV,
                          timeout=timeout)


def write_plan(path, model="tiny-gpt", global_batch=8, seq_len=32, **degrees) -> str:
    degrees = degrees or dict(dp=2, tp=1, pp=1, num_micro_batches=2, micro_batch=2)
    plan = Plan.of(model=MODEL_PRESETS[model], train=TrainSpec(global_batch=global_batch, seq_len=seq_len,
                                                             precision="fp32"),
                cluster=CLUSTER_PRESETS["local-cpu"].with_devices(2), **degrees)
    path.write_text(plan.to_json())
    return str(path)


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(f"""
[train]
steps = 3
global_batch = 8
seq_len = 32
[optimizer]
warmup = 1
[log]
dir = "{tmp_path / 'logs'}"
every = 1
""")
    return path


@pytest.mark.dist
def test_two_ranks_write_metrics_plan_and_plot(tmp_path, config):
    plan = write_plan(tmp_path / "plan.json")
    result = plait("train", str(config), "--plan", plan, "--set", "optimizer.lr=1e-2",
                   "--max-seconds", "1000")  # the time-limit vote runs every step, never stops
    assert result.returncode == 0, result.stderr[-3000:]
    logs = tmp_path / "logs"
    records = [json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for key in ("loss", "lr", "tokens_per_s", "mfu", "step_time_s", "grad_norm"):
        assert all(r[key] > 0 for r in records), key
    assert records[0]["lr"] == pytest.approx(1e-2)  # warm-up of one step, then cosine
    assert records[-1]["loss"] < records[0]["loss"]
    assert (logs / "loss.png").stat().st_size > 1000
    assert Plan.from_json(logs / "plan.json").dp == 2
    assert "step     3/3" in result.stdout
    reference = single_process_losses(tmp_path / "logs" / "plan.json", config, ["optimizer.lr=1e-2"])
    assert [r["loss"] for r in records] == pytest.approx(reference, rel=1e-5)


def single_process_losses(plan_file, config_file, overrides) -> list[float]:
    """The loop's maths written out by hand on one process: same data order, AdamW, schedule and clip."""
    import torch
    import torch.nn.functional as F

    from plait.models import build_model
    from plait.train.config import load_config
    from plait.train.data import BatchLoader, load_tokens
    from plait.train.loop import lr_at

    cfg = load_config(config_file, overrides)
    spec = Plan.from_json(plan_file).model
    model = build_model(spec, device="cpu", seed=cfg.train.seed)
    opt = cfg.optimizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt.lr, weight_decay=opt.weight_decay, betas=opt.betas,
                                  eps=opt.eps)
    loader = BatchLoader(load_tokens("shipped"), global_batch=cfg.train.global_batch, seq_len=cfg.train.seq_len,
                         seed=cfg.train.seed)
    losses = []
    for step in range(cfg.train.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, opt, cfg.train.steps)
        tokens, targets = loader.next_batch()
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), opt.clip)
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_bad_config_exits_2_naming_the_key(config):
    config.write_text(config.read_text() + "\n[optimizer2]\nlr = 1\n")
    result = plait("train", str(config), "--nproc", "2")
    assert result.returncode == 2
    assert "unknown key 'optimizer2'" in result.stderr and "Traceback" not in result.stderr


def test_unknown_override_exits_2(config):
    result = plait("train", str(config), "--set", "train.stepz=3")
    assert result.returncode == 2 and "train.stepz" in result.stderr


def test_missing_config_exits_2(tmp_path):
    result = plait("train", str(tmp_path / "absent.toml"))
    assert result.returncode == 2 and "does not exist" in result.stderr


def test_missing_data_file_exits_2(tmp_path, config):
    plan = write_plan(tmp_path / "plan.json")
    result = plait("train", str(config), "--plan", plan, "--set", "data.source=text",
                   "--set", f"data.path={tmp_path / 'absent.txt'}")
    assert result.returncode == 2 and "absent.txt" in result.stderr and "does not exist" in result.stderr


def test_data_too_short_exits_2_with_the_count(tmp_path, config):
    plan = write_plan(tmp_path / "plan.json")
    (tmp_path / "short.txt").write_text("hello")
    result = plait("train", str(config), "--plan", plan, "--set", "data.source=text",
                   "--set", f"data.path={tmp_path / 'short.txt'}")
    assert result.returncode == 2 and "needs at least 257 tokens" in result.stderr


def test_plan_for_another_model_exits_2(tmp_path, config):
    plan = write_plan(tmp_path / "plan.json", model="tiny-llama")
    result = plait("train", str(config), "--plan", plan)
    assert result.returncode == 2 and "plan is for model 'tiny-llama'" in result.stderr


def test_plan_for_another_batch_or_world_exits_2(tmp_path, config):
    plan = write_plan(tmp_path / "plan.json", global_batch=4, num_micro_batches=1, micro_batch=2, dp=2, tp=1, pp=1)
    result = plait("train", str(config), "--plan", plan)
    assert result.returncode == 2 and "global_batch=4" in result.stderr
    plan = write_plan(tmp_path / "plan.json")
    result = plait("train", str(config), "--plan", plan, "--nproc", "4")
    assert result.returncode == 2 and "--nproc 2" in result.stderr


def test_unknown_pin_exits_2(config):
    result = plait("train", str(config), "--set", "plan.pins.tq=2")
    assert result.returncode == 2 and "unknown pin 'tq'" in result.stderr and "tp" in result.stderr


def test_resume_without_checkpoint_dir_exits_2(config):
    result = plait("train", str(config), "--set", "checkpoint.resume=true")
    assert result.returncode == 2 and "checkpoint.dir" in result.stderr


@pytest.mark.dist
def test_a_moe_run_measures_its_routers_balance(tmp_path, config):
    """Every rank counts its routers' top-k slots; the run reports the busiest expert-parallel rank's share against
    what the plan was priced with, and measured.json keeps it per rank and step."""
    result = subprocess.run([sys.executable, "-m", "plait", "train", str(config), "--nproc", "2", "--steps", "6",
                             "--set", "model.preset=tiny-moe", "--set", "plan.pins.ep=2"],
                            capture_output=True, text=True, env={**ENV, "COLUMNS": "250"}, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "router: the busiest expert-parallel rank's slots over the mean" in result.stdout
    assert "priced with 1.25" in result.stdout
    from plait.train.measure import read_measured

    [segment] = read_measured(tmp_path / "logs")
    assert sorted(r.rank for r in segment.ranks) == [0, 1]
    for record in segment.ranks:  # tiny-moe: 4 experts, so ep 2 and 4; one reading per step
        assert sorted(record.router_load) == ["2", "4"]
        assert all(len(values) == 6 for values in record.router_load.values())
        assert len(record.cpu_s) == 6 and all(c > 0 for c in record.cpu_s)  # the process's CPU seconds per step
        for ep, values in record.router_load.items():
            assert all(1.0 <= v <= int(ep) for v in values)
    imbalance = segment.router_imbalance()
    assert set(imbalance) == {2, 4} and 1.0 <= imbalance[2] <= imbalance[4]
