"""The CUDA path on one device, measured: bf16 training, the profile's compute figures, and the cost model's
predicted step time and peak memory against measured ones over a grid of single-device plans.

    python benchmarks/gpu_check.py                           # on a GPU machine: ~1B model grid, under 8 minutes
    python benchmarks/gpu_check.py --device cpu --quick      # CI: the same code paths with tiny models

Three parts, each written to --out DIR as JSON (precision.json, profile.json, grid.json, and all of it in
gpu_check.json) and printed as tables:

1. Precision: plait's reference decoder and a Hugging Face Llama built locally from a config (nothing is
   downloaded) train a few AdamW steps on one fixed batch through the executor (plait.execute.parallelize on a
   world of 1: NCCL on CUDA, gloo on CPU), once in fp32 and once in bf16 mixed precision. The loss must fall, and
   bf16 losses must match fp32 within BF16_TOLERANCE (see there why). On CPU plait computes bf16 plans in fp32
   (plait.execute.parallelize._mixed_precision), so there the two runs agree exactly and the table says so.
2. Profile: the compute part of `plait profile --quick` (plait.profile.runner.compute_steps: GEMMs, attention,
   a whole block) and the free memory, on this one device, against the preset's assumptions (h200-141g on an
   H200, h100-80g on other GPUs, local-cpu on CPU): GEMM rate as a fraction of peak against
   peak · matmul · h / (h + matmul_half_dim).
   `plait profile` itself needs two ranks for its link fits, which one GPU cannot host.
3. Grid: single-device plans of a 1.4B Llama (Llama-3.2-1B's widths) over micro-batch 1-8, sequence 1K-8K and each
   recompute mode (tiny model and sequences with --quick or on CPU): plait.cost.predict's step time and peak
   memory against the median of a few timed steps after warm-up (torch.cuda.synchronize) and
   torch.cuda.max_memory_allocated / max_memory_reserved. The prediction's allocated part leaves out the reserve
   it keeps for fragmentation and the runtime; reserved memory is compared with the whole prediction. Points the
   memory model says do not fit are skipped, and the budget (--budget-s) stops new points near its end; both are
   listed. On CPU peak memory is "n/a": the cost model's CPU memory figures have their own benchmark
   (memory_accuracy.py, PyTorch's MemTracker).

Without a GPU, a saved run can be priced again by this tree's cost model (after a constant moved, or against
another preset), and the GPU host times fitted on it:

    python benchmarks/gpu_check.py --reprice benchmarks/results/gpu/h100-2026-11-26-a [--cluster h200-141g] [--fit-host]

benchmarks/results/gpu/ keeps the grids the GPU presets' constants were fitted and checked on (plait/spec/clusters.py).

Targets (issue 15): median step-time error 10%, median peak-memory error 5%.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from plait.cost import predict
from plait.errors import ConfigError
from plait.plan import RECOMPUTE_MODES, Plan
from plait.spec import ModelSpec, TrainSpec
from plait.spec.clusters import CLUSTER_PRESETS
from plait.spec.models import MODEL_PRESETS

TARGETS = {"step_time": 0.10, "memory": 0.05}
BF16_TOLERANCE = 0.02
"""Largest |bf16 - fp32| / fp32 of any step's loss. bf16 keeps 8 significant bits (unit roundoff 2⁻⁸ = 0.39%);
under autocast the matmuls round their inputs to bf16 and accumulate in fp32, the loss is taken in fp32, and the
weights and AdamW states stay fp32. A loss near ln(V) then moves by about one roundoff per rounded operand,
partly cancelling over the tokens; over a few steps AdamW's normalized updates add a similar amount. 2% is five
roundoffs: wide enough for that, an order of magnitude below what a wrong dtype (fp16 overflow, a bf16 master
copy, a loss in bf16) does to these losses."""
DEFAULT_BUDGET_S = {"cuda": 450.0, "cpu": 120.0}
MiB = 2**20


class BadInput(Exception):
    """A command-line value that cannot run here: printed as one line, exit code 2."""


# ---- the device and its world of one ------------------------------------------------------------

def resolve_device(requested: str) -> str:
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise BadInput(f"--device cuda: no CUDA device is available here (torch {torch.__version__}, "
                       f"CUDA build: {torch.version.cuda or 'none'}); use --device cpu or --device auto")
    return requested


def start_world(device: str) -> None:
    """One process as a torchrun world of 1 (what parallelize needs): NCCL on CUDA, gloo on CPU."""
    from plait.runtime.launch import init_distributed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    init_distributed("nccl" if device == "cuda" else "gloo", timeout_s=300.0)


def preset_name(device: str) -> str:
    """The preset this device is compared with: h200-141g on an H200, h100-80g on any other GPU, local-cpu on CPU."""
    if device != "cuda":
        return "local-cpu"
    import torch

    return "h200-141g" if "H200" in torch.cuda.get_device_name() else "h100-80g"


def cluster_for(device: str):
    return CLUSTER_PRESETS[preset_name(device)].with_devices(1)


def synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def release(device: str) -> None:
    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


# ---- 1. precision -------------------------------------------------------------------------------

def precision_models(device: str, quick: bool, folder: Path) -> list[ModelSpec]:
    """plait's reference decoder and a Hugging Face Llama from a local config, small enough to train in seconds."""
    from plait.hf.tiny import write_tiny_config
    from plait.spec.load import load_model

    if quick or device == "cpu":
        reference = MODEL_PRESETS["tiny-llama"]
        hf_dir = write_tiny_config("llama", folder / "hf-llama", max_position_embeddings=256)
    else:
        reference = MODEL_PRESETS["tiny-llama"].replace(name="small-llama", hidden_size=512, num_heads=8,
                                                        num_kv_heads=4, ffn_hidden_size=1408, vocab_size=8192,
                                                        max_seq_len=1024)
        hf_dir = write_tiny_config("llama", folder / "hf-llama", vocab_size=8192, hidden_size=512,
                                   intermediate_size=1408, num_attention_heads=8, num_key_value_heads=4,
                                   max_position_embeddings=1024)
    return [reference, load_model(str(hf_dir / "config.json")).replace(name="hf-llama")]


def train_losses(model: ModelSpec, device: str, precision: str, seq: int, micro_batch: int, steps: int,
                 lr: float) -> tuple[list[float], str]:
    """AdamW steps on one fixed batch through the executor; the losses and the dtype the run computed in."""
    from plait.execute.batches import batch_for_step
    from plait.execute.parallelize import parallelize

    plan = Plan.of(model=model, cluster=cluster_for(device),
                   train=TrainSpec(global_batch=micro_batch, seq_len=seq, precision=precision), micro_batch=micro_batch)
    runner = parallelize(plan, seed=0, device=device, precision=precision)
    optimizer = runner.make_optimizer(lr)
    tokens, targets = batch_for_step(plan, 0, 0)
    losses = []
    for _ in range(steps):
        losses.append(runner.train_step(tokens, targets))
        optimizer.step()
        optimizer.zero_grad()
    computed = str(runner.mixed_precision or "torch.float32").removeprefix("torch.")
    del runner, optimizer
    release(device)
    return losses, computed


def precision_check(device: str, quick: bool, folder: Path) -> list[dict]:
    # The learning rate keeps the fp32 loss falling at every step: at 3e-3 the 8K-vocabulary models of the GPU size
    # jumped from 8.2 to 10.1 at step 3 (first GPU run, 2026-11-26), and two runs of an unstable trajectory part by
    # more than rounding (3.6% and 4.8% there); the tiny CPU size is stable at 3e-3.
    seq, micro_batch, steps, lr = (64, 2, 5, 3e-3) if quick or device == "cpu" else (512, 4, 8, 1e-3)
    rows = []
    for model in precision_models(device, quick, folder):
        fp32, _ = train_losses(model, device, "fp32", seq, micro_batch, steps, lr=lr)
        bf16, computed = train_losses(model, device, "bf16", seq, micro_batch, steps, lr=lr)
        differences = [abs(b - f) / abs(f) for b, f in zip(bf16, fp32)]
        rows.append({"model": model.name, "source": model.source, "params": model.num_params, "seq_len": seq,
                     "micro_batch": micro_batch, "lr": lr, "fp32_losses": fp32, "bf16_losses": bf16,
                     "fp32_falls_every_step": all(b < a for a, b in zip(fp32, fp32[1:])),
                     "bf16_computed_in": computed, "max_rel_difference": max(differences),
                     "tolerance": BF16_TOLERANCE, "within_tolerance": max(differences) <= BF16_TOLERANCE,
                     "loss_falls": fp32[-1] < fp32[0] and bf16[-1] < bf16[0]})
    return rows


def precision_table(rows: list[dict]) -> Table:
    t = Table(title=f"Training on one device: fp32 against bf16 mixed precision (tolerance {BF16_TOLERANCE:.0%})")
    for col in ("model", "params", "bf16 computed in", "fp32 loss first → last", "bf16 loss first → last",
                "max |Δ|/fp32", "loss falls", "fp32 falls every step"):
        t.add_column(col, justify="left" if col in ("model", "bf16 computed in") else "right")
    for r in rows:
        ok = "green" if r["within_tolerance"] else "red"
        t.add_row(r["model"], f"{r['params'] / 1e6:.2f}M", r["bf16_computed_in"],
                  f"{r['fp32_losses'][0]:.4f} → {r['fp32_losses'][-1]:.4f}",
                  f"{r['bf16_losses'][0]:.4f} → {r['bf16_losses'][-1]:.4f}",
                  f"[{ok}]{r['max_rel_difference']:.2e}[/]", "yes" if r["loss_falls"] else "[red]no[/]",
                  "yes" if r["fp32_falls_every_step"] else "[red]no[/] (an unstable run: the comparison is loose)")
    return t


# ---- 2. profile ---------------------------------------------------------------------------------

def profile_check(device: str) -> dict:
    """`plait profile --quick`'s compute steps and free memory on this device, against the preset."""
    from plait.profile import devices
    from plait.profile.runner import ProfileOptions, compute_steps

    local = devices.local_device()
    samples = []
    for step in compute_steps(local, ProfileOptions(quick=True), samples):
        step.run()
    cluster = cluster_for(device)
    eff = cluster.efficiency
    rows = []
    for s in samples:
        h = s.hidden_size
        assumed = eff.matmul * (h / (h + eff.matmul_half_dim) if eff.matmul_half_dim else 1.0)
        rows.append({"name": s.name, "hidden_size": h, "seconds": s.seconds, "flops": s.flops,
                     "flops_per_s": s.flops_per_s, "fraction_of_peak": s.flops_per_s / cluster.peak_flops,
                     "assumed_fraction": assumed, "assumed_seconds": s.flops / (cluster.peak_flops * assumed)})
    return {"preset": cluster.name, "device_name": _device_name(local), "dtype": str(local.dtype).removeprefix("torch."),
            "peak_flops": cluster.peak_flops, "efficiency": {"matmul": eff.matmul,
                                                             "matmul_half_dim": eff.matmul_half_dim,
                                                             "overhead": eff.overhead},
            "memory_bytes_available": devices.available_memory_bytes(local, 1),
            "memory_bytes_assumed": cluster.memory_bytes, "rows": rows}


def _device_name(local) -> str:  # noqa: ANN001
    import platform

    import torch

    return torch.cuda.get_device_name(local.device) if local.is_cuda else platform.processor() or platform.machine()


def profile_table(profile: dict) -> Table:
    t = Table(title=f"Measured on {profile['device_name']} ({profile['dtype']}) against {profile['preset']}: "
                    f"peak {profile['peak_flops'] / 1e12:.3g} TFLOP/s, matmul {profile['efficiency']['matmul']}, "
                    f"half dim {profile['efficiency']['matmul_half_dim']:g}")
    for col in ("op", "h", "measured ms", "assumed ms", "measured TFLOP/s", "fraction of peak", "assumed fraction",
                "measured/assumed"):
        t.add_column(col, justify="left" if col == "op" else "right")
    for r in profile["rows"]:
        t.add_row(r["name"], str(r["hidden_size"]), f"{r['seconds'] * 1e3:.3f}", f"{r['assumed_seconds'] * 1e3:.3f}",
                  f"{r['flops_per_s'] / 1e12:.4g}", f"{r['fraction_of_peak']:.3f}", f"{r['assumed_fraction']:.3f}",
                  f"{r['fraction_of_peak'] / r['assumed_fraction']:.2f}")
    t.caption = (f"memory available {profile['memory_bytes_available'] / 2**30:.1f} GiB, "
                 f"preset assumes {profile['memory_bytes_assumed'] / 2**30:.1f} GiB")
    return t


# ---- 3. grid --------------------------------------------------------------------------------------

def grid_model(device: str, quick: bool) -> ModelSpec:
    if quick or device == "cpu":
        return MODEL_PRESETS["tiny-llama"]
    # Llama-3.2-1B's widths, layers and tied embeddings with the 8B's head_dim of 128 (32 query heads of 128 over
    # h = 2048, where the 1B has 64): 1.40B parameters
    return MODEL_PRESETS["llama3-8b"].replace(name="llama-1b", num_layers=16, hidden_size=2048, num_heads=32,
                                              num_kv_heads=8, ffn_hidden_size=8192, tied_embeddings=True)


def grid_plans(device: str, quick: bool, shapes: list[tuple[int, int]] | None = None) -> list[Plan]:
    """Cheapest first (tokens per micro-batch), each recompute mode in turn: the budget cuts the costly end.
    `shapes`: (micro-batch, sequence) pairs instead of the default grid."""
    model = grid_model(device, quick)
    if shapes:
        shapes = list(shapes)
    elif quick or device == "cpu":
        shapes = [(1, 32), (2, 32)]
    else:
        shapes = [(mb, s) for mb in (1, 2, 4, 8) for s in (1024, 2048, 4096, 8192)]
    shapes.sort(key=lambda shape: (shape[0] * shape[1], shape[1]))
    return [Plan.of(model=model, cluster=cluster_for(device), micro_batch=mb, recompute=(mode,),
                    train=TrainSpec(global_batch=mb, seq_len=s, precision="bf16"))
            for mb, s in shapes for mode in RECOMPUTE_MODES]


def measure_plan(plan: Plan, device: str, warmup: int, steps: int, initial: dict) -> dict:
    """Median step time (forward, backward, AdamW) after warm-up, and the peak memory over every step.
    `initial`: the model's initial weights (CPU tensors), drawn once for the whole grid (for 1B parameters that
    takes longer than the steps)."""
    import torch

    from plait.execute.batches import batch_for_step
    from plait.execute.parallelize import parallelize

    release(device)
    runner = parallelize(plan, seed=0, device=device, initial_state=initial)
    optimizer = runner.make_optimizer(1e-4)
    tokens, targets = batch_for_step(plan, 0, 0)
    times, forward_backward, optimizer_times, losses = [], [], [], []
    static = None
    for index in range(warmup + steps):
        synchronize(device)
        start = time.perf_counter()
        losses.append(runner.train_step(tokens, targets))
        synchronize(device)
        middle = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        if index >= warmup:
            times.append(time.perf_counter() - start)
            forward_backward.append(middle - start)
            optimizer_times.append(time.perf_counter() - middle)
        if index == 0 and device == "cuda":  # weights, optimizer states and what the step keeps between steps
            static = torch.cuda.memory_allocated()
    measured = {"step_times_s": times, "step_time_s": statistics.median(times), "losses": losses,
                "forward_backward_s": statistics.median(forward_backward),
                "optimizer_s": statistics.median(optimizer_times),
                "allocated_bytes": None, "reserved_bytes": None, "static_allocated_bytes": static}
    if device == "cuda":
        measured["allocated_bytes"] = torch.cuda.max_memory_allocated()
        measured["reserved_bytes"] = torch.cuda.max_memory_reserved()
    del runner, optimizer
    release(device)
    return measured


def grid_row(plan: Plan) -> dict:
    prediction = predict(plan)
    reserve = prediction.memory_parts.get("reserve", 0.0)
    return {"plan": plan.describe(), "model": plan.model.name, "micro_batch": plan.micro_batch,
            "seq_len": plan.train.seq_len, "recompute": plan.recompute[0],
            "predicted_step_time_s": prediction.step_time_s, "predicted_peak_bytes": prediction.peak_memory_bytes,
            "predicted_allocated_bytes": prediction.peak_memory_bytes - reserve,
            "predicted_step_time_parts": dict(prediction.step_time_parts),
            "predicted_memory_parts": dict(prediction.memory_parts),
            "fits": prediction.peak_memory_bytes <= plan.cluster.memory_bytes, "status": "pending"}


def run_grid(plans: list[Plan], device: str, budget_s: float, warmup: int, steps: int, console: Console,
             on_row=None) -> list[dict]:  # noqa: ANN001
    """Measure each plan that fits while the budget lasts: a point starts only if the slowest so far, doubled
    (the next is at least as large), still ends inside the budget."""
    from plait.models import initial_state_dict

    rows = [grid_row(plan) for plan in plans]
    start, slowest = time.perf_counter(), 0.0
    initial = initial_state_dict(plans[0].model, seed=0)  # every plan of the grid has the same model
    columns = (TextColumn("[bold]grid[/]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.description}"))
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task("starting", total=len(plans))
        for plan, row in zip(plans, rows):
            bar.update(task, description=row["plan"])
            if not row["fits"]:
                row["status"] = "skipped: does not fit (memory model)"
            elif time.perf_counter() - start + 2 * slowest > budget_s:
                row["status"] = "skipped: budget"
            else:
                began = time.perf_counter()
                try:
                    row.update(measure_plan(plan, device, warmup, steps, initial), status="measured")
                except Exception as error:  # an out-of-memory point is a finding: record it, go on
                    if "out of memory" not in str(error).lower():
                        raise
                    release(device)
                    row["status"] = f"failed: out of memory ({str(error).splitlines()[0][:120]})"
                slowest = max(slowest, time.perf_counter() - began)
                _errors(row)
                if on_row is not None:  # written as it goes: a run cut short keeps what it measured
                    on_row(rows)
            bar.advance(task)
    return rows


def _errors(row: dict) -> None:
    if row["status"] != "measured":
        return
    row["step_time_error"] = row["predicted_step_time_s"] / row["step_time_s"] - 1
    if row["allocated_bytes"]:
        row["allocated_error"] = row["predicted_allocated_bytes"] / row["allocated_bytes"] - 1
        row["reserved_error"] = row["predicted_peak_bytes"] / row["reserved_bytes"] - 1


def grid_summary(rows: list[dict]) -> dict:
    measured = [r for r in rows if r["status"] == "measured"]

    def median_abs(key: str) -> float | None:
        values = [abs(r[key]) for r in measured if r.get(key) is not None]
        return statistics.median(values) if values else None

    summary = {"points": len(rows), "measured": len(measured),
               "skipped_not_fitting": [r["plan"] for r in rows if r["status"].startswith("skipped: does not fit")],
               "skipped_budget": [r["plan"] for r in rows if r["status"] == "skipped: budget"],
               "failed": [r["plan"] for r in rows if r["status"].startswith("failed")],
               "median_step_time_error": median_abs("step_time_error"),
               "median_allocated_error": median_abs("allocated_error"),
               "median_reserved_error": median_abs("reserved_error"), "targets": TARGETS}
    return summary


def _mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / MiB:.0f}"


def _pct(value: float | None, target: float) -> str:
    if value is None:
        return "n/a"
    return f"[{'green' if abs(value) <= target else 'red'}]{value:+.1%}[/]"


def grid_table(rows: list[dict], device: str) -> Table:
    memory_note = "" if device == "cuda" else " (CPU: peak memory n/a, see memory_accuracy.py)"
    t = Table(title=f"Single-device plans: predicted (plait.cost.predict) against measured{memory_note}")
    for col in ("mb", "s", "recompute", "pred step ms", "meas step ms", "step err", "pred alloc MiB",
                "max alloc MiB", "alloc err", "pred peak MiB", "max reserved MiB", "reserved err", "status"):
        t.add_column(col, justify="left" if col in ("recompute", "status") else "right")
    for r in rows:
        measured = r["status"] == "measured"
        t.add_row(str(r["micro_batch"]), str(r["seq_len"]), r["recompute"], f"{r['predicted_step_time_s'] * 1e3:.1f}",
                  f"{r['step_time_s'] * 1e3:.1f}" if measured else "-",
                  _pct(r.get("step_time_error"), TARGETS["step_time"]), _mib(r["predicted_allocated_bytes"]),
                  _mib(r.get("allocated_bytes")), _pct(r.get("allocated_error"), TARGETS["memory"]),
                  _mib(r["predicted_peak_bytes"]), _mib(r.get("reserved_bytes")),
                  _pct(r.get("reserved_error"), TARGETS["memory"]), r["status"])
    return t


def summary_lines(summary: dict) -> list[str]:
    def verdict(value: float | None, target: float) -> str:
        if value is None:
            return "n/a"
        return f"{value:.1%} ({'meets' if value <= target else 'misses'} the {target:.0%} target)"

    lines = [f"grid: {summary['measured']} of {summary['points']} points measured; median |error| step time "
             f"{verdict(summary['median_step_time_error'], TARGETS['step_time'])}, allocated "
             f"{verdict(summary['median_allocated_error'], TARGETS['memory'])}, reserved "
             f"{verdict(summary['median_reserved_error'], TARGETS['memory'])}"]
    if summary["skipped_not_fitting"]:
        lines.append(f"skipped, the memory model says they do not fit: {', '.join(summary['skipped_not_fitting'])}")
    if summary["skipped_budget"]:
        lines.append(f"left for the budget (--budget-s): {', '.join(summary['skipped_budget'])}")
    if summary["failed"]:
        lines.append(f"failed (out of memory): {', '.join(summary['failed'])}")
    return lines


# ---- a saved grid, priced again -------------------------------------------------------------------

def saved_grid(folder: Path) -> tuple[dict, list[dict]]:
    """(header, measured rows) of a run that --out wrote (its gpu_check.json holds both)."""
    try:
        header = json.loads((folder / "gpu_check.json").read_text())
        rows = header["grid"]["rows"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise BadInput(f"--reprice {folder}: not a gpu_check output folder (its gpu_check.json, as --out writes it, "
                       f"with a grid): {error}") from None
    if header.get("device") != "cuda":
        raise BadInput(f"--reprice {folder}: a {header.get('device')} run; only CUDA grids carry GPU timings")
    return header, [r for r in rows if r["status"] == "measured"]


def reprice(rows: list[dict], cluster) -> list[dict]:  # noqa: ANN001
    """The measured rows with this tree's predictions for `cluster` (the grid's model, one device)."""
    model = grid_model("cuda", quick=False)
    priced = []
    for row in rows:
        plan = Plan.of(model=model, cluster=cluster.with_devices(1), micro_batch=row["micro_batch"],
                       recompute=(row["recompute"],),
                       train=TrainSpec(global_batch=row["micro_batch"], seq_len=row["seq_len"], precision="bf16"))
        fresh = {**row, **{k: v for k, v in grid_row(plan).items() if k != "status"}}
        _errors(fresh)
        priced.append(fresh)
    return priced


def fit_host(rows: list[dict], cluster):  # noqa: ANN001, ANN201
    """GPU host times fitted on measured step times (robust least squares on log(predicted / measured), the
    four fields plait.spec.clusters.GPU_HOST holds) with the optimizer's bandwidth taken from the measured
    optimizer step first (memory_balance scales it linearly). Returns (cluster with the fit, its figures)."""
    import numpy as np
    from scipy.optimize import least_squares

    from plait.spec.cluster import HostOverheads

    base = cluster.replace(host=HostOverheads())
    optimizer = [r["optimizer_s"] / r["predicted_step_time_parts"]["optimizer"] for r in reprice(rows, base)]
    balance = round(base.efficiency.memory_balance * statistics.median(optimizer))
    base = base.replace(efficiency=dataclasses.replace(base.efficiency, memory_balance=float(balance)))
    measured = np.array([r["step_time_s"] for r in rows])

    def with_host(ms) -> object:  # noqa: ANN001
        return base.replace(host=HostOverheads(layer_overhead_s=ms[0] * 1e-3, recompute_layer_overhead_s=ms[1] * 1e-3,
                                               selective_layer_overhead_s=ms[2] * 1e-3, step_overhead_s=ms[3] * 1e-3))

    def residuals(ms) -> object:  # noqa: ANN001
        predicted = np.array([r["predicted_step_time_s"] for r in reprice(rows, with_host(ms))])
        return np.log(predicted / measured)

    start = [1.0, 1.0, 2.0, 20.0]
    fit = least_squares(residuals, start, bounds=([0.0] * 4, [100.0] * 4), loss="soft_l1", f_scale=0.05,
                        diff_step=0.01)
    figures = {"memory_balance": balance, "layer_overhead_ms": fit.x[0], "recompute_layer_overhead_ms": fit.x[1],
               "selective_layer_overhead_ms": fit.x[2], "step_overhead_ms": fit.x[3]}
    return with_host(fit.x), figures


def run_reprice(args: argparse.Namespace) -> int:
    folder = Path(args.reprice)
    header, rows = saved_grid(folder)
    name = args.cluster or header["preset"]
    if name not in CLUSTER_PRESETS:
        raise BadInput(f"--cluster {name!r}: not a preset; choose one of {', '.join(CLUSTER_PRESETS)}")
    cluster = CLUSTER_PRESETS[name]
    console = Console(width=200)
    console.print(f"{folder}: {len(rows)} measured rows of {header['device_name']} ({header['date']}, torch "
                  f"{header['torch']}), priced by this tree against {name}")
    priced = reprice(rows, cluster)
    console.print(grid_table(priced, "cuda"))
    for line in summary_lines(grid_summary(priced))[:1]:
        console.print(line)
    if args.fit_host:
        fitted, figures = fit_host(rows, cluster)
        console.print("host times fitted on these rows: " + ", ".join(
            f"{k} {v:.3g}" if k != "memory_balance" else f"{k} {v}" for k, v in figures.items()))
        for line in summary_lines(grid_summary(reprice(rows, fitted)))[:1]:
            console.print(f"with them: {line}")
    return 0


# ---- main -----------------------------------------------------------------------------------------

def write_json(out: Path, name: str, data: object) -> None:
    from plait.outputs import write_text

    write_text(out / name, json.dumps(data, indent=1))


def run(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from plait.outputs import output_dir

    device = resolve_device(args.device)
    budget_s = args.budget_s if args.budget_s is not None else DEFAULT_BUDGET_S[device]
    if budget_s <= 0:
        raise BadInput(f"--budget-s {budget_s:g}: give a positive number of seconds (default "
                       f"{DEFAULT_BUDGET_S[device]:g} on {device})")
    out = output_dir(args.out, "--out")
    console = Console(width=200)
    started = time.perf_counter()
    start_world(device)
    try:
        header = {"device": device, "quick": args.quick, "torch": torch.__version__, "host": socket.gethostname(),
                  "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                  "budget_s": budget_s, "preset": preset_name(device)}
        console.print(f"gpu_check on {header['device_name']} ({device}) against {header['preset']}, "
                      f"torch {torch.__version__}, "
                      f"budget {budget_s:g} s")
        errors: dict[str, str] = {}

        def attempt(part: str, work):  # noqa: ANN001, ANN202
            """One part's failure is a finding, not the end of the run: the traceback is kept, the next part runs."""
            try:
                return work()
            except Exception:  # noqa: BLE001
                errors[part] = traceback.format_exc()
                console.print(f"[red]{part} failed[/]:\n{errors[part]}")
                return None

        def precision_part() -> list[dict]:
            with tempfile.TemporaryDirectory(prefix="plait-gpu-check-") as folder:
                rows = precision_check(device, args.quick, Path(folder))
            console.print(precision_table(rows))
            write_json(out, "precision.json", rows)
            return rows

        def profile_part() -> dict:
            result = profile_check(device)
            console.print(profile_table(result))
            write_json(out, "profile.json", result)
            return result

        def grid_part() -> dict:
            remaining = budget_s - (time.perf_counter() - started)
            rows = run_grid(grid_plans(device, args.quick, args.shapes), device, remaining, args.warmup, args.steps, console,
                            on_row=lambda rows: write_json(out, "grid.json", {"rows": rows}))
            summary = grid_summary(rows)
            console.print(grid_table(rows, device))
            for line in summary_lines(summary):
                console.print(line)
            write_json(out, "grid.json", {"rows": rows, "summary": summary})
            return {"rows": rows, "summary": summary}

        precision = attempt("precision", precision_part)
        profile = attempt("profile", profile_part)
        grid = attempt("grid", grid_part)
        header["seconds"] = time.perf_counter() - started
        write_json(out, "gpu_check.json", {**header, "precision": precision, "profile": profile, "grid": grid,
                                           "errors": errors})
        console.print(f"wrote {out}/gpu_check.json (and precision.json, profile.json, grid.json) "
                      f"in {header['seconds']:.0f} s")
        if errors:
            console.print(f"[red]failed parts: {', '.join(errors)}[/] (tracebacks above and in gpu_check.json)")
            return 1
    finally:
        dist.destroy_process_group()
    return 0


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for item in text.split(","):
        mb, _, seq = item.strip().lower().partition("x")
        if not (mb.isdigit() and seq.isdigit() and int(mb) > 0 and int(seq) > 0):
            raise argparse.ArgumentTypeError(f"{item!r} is not micro-batch x sequence (positive integers, e.g. 2x4096)")
        shapes.append((int(mb), int(seq)))
    return shapes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"),
                        help="where to run (default: cuda if available, else cpu)")
    parser.add_argument("--quick", action="store_true", help="tiny models and sequences: the CPU/CI size")
    parser.add_argument("--out", default="gpu_check_out", help="folder for the JSON files (default: gpu_check_out/)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds for the whole run; no grid point starts that would end past it "
                             f"(default: {DEFAULT_BUDGET_S['cuda']:g} on CUDA, {DEFAULT_BUDGET_S['cpu']:g} on CPU)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per grid point (default: 2; 1 with --quick)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per grid point (default: 5; 2 with --quick)")
    parser.add_argument("--shapes", type=parse_shapes, default=None, metavar="MBxS,...",
                        help="grid shapes as micro-batch x sequence, e.g. 1x1024,8x4096 (default: 1-8 x 1K-8K on "
                             "CUDA, 1-2 x 32 on CPU)")
    parser.add_argument("--reprice", metavar="DIR", default=None,
                        help="price a saved run (an --out folder) with this tree's cost model; needs no GPU")
    parser.add_argument("--cluster", default=None,
                        help="with --reprice: the preset to price against (default: the one the run was compared with)")
    parser.add_argument("--fit-host", action="store_true",
                        help="with --reprice: fit the GPU host times and optimizer bandwidth on the saved rows")
    args = parser.parse_args(argv)
    if (args.cluster or args.fit_host) and not args.reprice:
        parser.error("--cluster and --fit-host go with --reprice DIR")
    if args.reprice:
        try:
            return run_reprice(args)
        except BadInput as error:
            print(f"gpu_check: {error}", file=sys.stderr)
            return 2
    args.warmup = args.warmup if args.warmup is not None else 1 if args.quick else 2
    args.steps = args.steps if args.steps is not None else 2 if args.quick else 5
    if args.warmup < 1 or args.steps < 1:
        parser.error(f"--warmup {args.warmup} --steps {args.steps}: both must be at least 1")
    try:
        return run(args)
    except (BadInput, ConfigError) as error:
        print(f"gpu_check: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
