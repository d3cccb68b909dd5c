"""The training loop one rank runs: plan -> parallel model -> optimizer -> steps -> metrics and plot.

Every rank runs `run(config)` under torchrun (or `plait.runtime.launch.run_local`). Rank 0 alone
writes metrics.jsonl, draws the progress bar and the loss plot; every rank takes part in the
collectives (train step, gradient clipping, the final full state dict).
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from plait.runtime.launch import note_progress
from plait.plan import Plan
from plait.train.chat import unanswered_note
from plait.train.checkpoint import export_at_end, pretrained_dir
from plait.train.config import Config, lr_at  # noqa: F401  (lr_at: plait.train.island_loop imports it)
from plait.train.data import BatchLoader, rank_tokens
from plait.train.documents import packing_for
from plait.train.hooks import TrainState, make_checkpoint_hooks
from plait.train.adapt import Adaptation, switch_plan
from plait.train.measure import (
    RunMeasurements, calibration_advice, print_comparison, queued_seconds, write_measured,
)
from plait.train.evaluate import Evaluator
from plait.train.metrics import ProgressDisplay, StepMetrics, Throughput, model_flops_per_token
from plait.train.sinks import RunSinks
from plait.runtime.faults import maybe_inject, planned_fault
from plait.train.resolve import check_outputs, plan_for_world, write_plan

DIST_TIMEOUT_S = float(os.environ.get("PLAIT_DIST_TIMEOUT_S", "300"))
"""Collective timeout: a dead or hung peer becomes an error after this long (the env var shortens it in tests)."""


@dataclass(frozen=True, kw_only=True)
class RunResult:
    """What a finished run leaves behind (rank 0 fills the paths)."""

    steps: int
    first_loss: float
    last_loss: float
    metrics_path: Path
    plot_path: Path | None
    model_path: Path | None


def run(config: Config) -> RunResult:
    """Train as one rank of the plan's world (the process group is started here if needed)."""
    from plait.runtime.launch import ending_together, init_distributed, restart_round

    check_outputs(config)  # under a bare torchrun no launcher has checked them
    world = int(os.environ["WORLD_SIZE"])
    plan = plan_for_world(config, world)  # every rank resolves the same plan (the launcher passes a plan file)
    init_distributed(plan.cluster.backend, DIST_TIMEOUT_S)
    if config.plan.file == "auto" and dist.get_rank() == 0 and (restart_round() or config.plan.devices not in (None, world)):
        print(f"plait: this round has {world} ranks: planned {plan.describe()} for them", file=sys.stderr, flush=True)
    with ending_together():
        return _train(config, plan)


def _device(plan: Plan) -> torch.device:
    if plan.cluster.device_type == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def _train(config: Config, plan: Plan) -> RunResult:
    rank = dist.get_rank()
    device = _device(plan)
    if rank == 0 and config.plan.file != str(Path(config.log.dir, "plan.json").resolve()):
        write_plan(plan, config.log.dir)  # under a bare torchrun no launcher has written it
    began = time.perf_counter()
    model, optimizer, loader = _build(config, plan, device, weights=pretrained_dir(config, plan))
    build_s = time.perf_counter() - began
    state = TrainState(config=config, plan=plan, model=model, optimizer=optimizer, loader=loader)
    hooks = make_checkpoint_hooks(config)
    hooks.resume(state)
    log_dir = Path(config.log.dir)
    metrics = RunSinks(config, plan, enabled=rank == 0, resumed_at=state.step)  # metrics.jsonl, TensorBoard, W&B
    measured = RunMeasurements(plan, model)
    adaptation = Adaptation(config, plan, log_dir, build_s, rank) if config.plan.adapt else None
    evaluator = Evaluator(config, plan, model) if config.eval.every else None
    losses = _steps(state, hooks, metrics, measured, device, adaptation, evaluator)
    metrics.close()
    _report_measured(measured.finish(), log_dir)
    if rank == 0 and state.loader.unanswered_windows:
        print(f"plait: note: {unanswered_note(state.loader.unanswered_windows)}", file=sys.stderr, flush=True)
    export_at_end(state)
    model_path = _save_full_model(state, log_dir) if config.log.save_model else None
    plot_path = _plot(metrics.path) if rank == 0 and losses else None
    return RunResult(steps=state.step, first_loss=losses[0] if losses else math.nan,
                     last_loss=losses[-1] if losses else math.nan, metrics_path=metrics.path,
                     plot_path=plot_path, model_path=model_path)


def _build(config: Config, plan: Plan, device: torch.device, weights: Any = None) -> tuple[Any, Any, BatchLoader]:
    """This rank's share of the model under `plan`, its optimizer and its data loader (at the data's start);
    `weights`: a Hugging Face folder to load instead of the seed's initialisation (the run's first build)."""
    from plait.execute import parallelize

    if plan.operators is not None:  # a module of any shape, placed per operator
        from plait.execute.module_model import parallelize_module

        model = parallelize_module(plan, seed=config.train.seed, device=device, lr=config.optimizer.lr)
    else:
        model = parallelize(plan, seed=config.train.seed, device=device, weights=weights)
    opt = config.optimizer
    optimizer = model.make_optimizer(lr=opt.lr, weight_decay=opt.weight_decay, betas=opt.betas, eps=opt.eps)
    return model, optimizer, _loader(config, plan, model)


def _loader(config: Config, plan: Plan, model: Any) -> BatchLoader:
    if plan.operators is not None:  # the module's own batches (plait.train.module_run)
        from plait.train.module_run import module_loader

        return module_loader(config, plan, model)
    tokens = rank_tokens(config, plan.model)
    dp_mesh = model.mesh["dp"]
    return BatchLoader(tokens, global_batch=config.train.global_batch, seq_len=config.train.seq_len,
                       seed=config.train.seed, dp_rank=dp_mesh.get_local_rank(), dp_degree=dp_mesh.size(),
                       packing=packing_for(config, plan.model))


def _throughput(plan: Plan) -> Throughput:
    if plan.operators is not None:  # samples, not tokens; the module's own FLOPs
        from plait.execute.module_model import flops_per_step

        return Throughput(tokens_per_step=plan.train.global_batch, flops_per_step=flops_per_step(plan),
                          peak_flops_total=plan.num_devices * plan.cluster.peak_flops)
    tokens = plan.train.global_batch * plan.train.seq_len
    return Throughput(tokens_per_step=tokens,
                      flops_per_step=tokens * model_flops_per_token(plan.model, plan.train.seq_len),
                      peak_flops_total=plan.num_devices * plan.cluster.peak_flops)


def _steps(state: TrainState, hooks: Any, metrics: RunSinks, measured: RunMeasurements, device: torch.device,
           adaptation: Adaptation | None = None, evaluator: Evaluator | None = None) -> list[float]:
    config = state.config
    total = config.train.steps
    throughput = _throughput(state.plan)
    losses: list[float] = []
    start = time.perf_counter()
    rank = dist.get_rank()
    fault = planned_fault()  # PLAIT_FAULT (plait.runtime.faults): fires with or without checkpoints
    with ProgressDisplay(total, enabled=rank == 0 and config.log.progress, every=config.log.every,
                         max_seconds=config.train.max_seconds) as progress:
        while state.step < total:
            note_progress(f"step {state.step + 1}", state.step + 1)  # names the rank that hangs, if one does
            m = _one_step(state, throughput, device, measured, elapsed_s=time.perf_counter() - start)
            losses.append(m.loss)
            metrics.write(m)
            progress.update(m)
            final = state.step == total or _out_of_time(config.train.max_seconds, start)
            hooks.after_step(state, final=final)
            if evaluator is not None:
                evaluator.after_step(state, metrics, final)
            maybe_inject(rank, state.step, fault)
            if final:
                break
            new_plan = adaptation.check(state.step, total, measured) if adaptation is not None else None
            if new_plan is not None:  # [plan] adapt: a faster plan for the measured speeds (plait/train/adapt.py)
                switch_plan(state, new_plan, lambda plan: _build(config, plan, device), hooks)
                measured.start(new_plan, state.model)
                if evaluator is not None:  # the held-out rows follow the new plan's data-parallel layout
                    evaluator = evaluator.for_model(new_plan, state.model)
    return losses


def _next_batch(loader: Any, device: torch.device) -> tuple:
    """train_step's arguments: a token loader's (tokens, targets, document positions), or a module's own batch."""
    if isinstance(loader, BatchLoader):
        rows = loader.next_rows()
        return rows.tokens.to(device), rows.targets.to(device), rows.positions
    return loader.next_batch()


def _one_step(state: TrainState, throughput: Throughput, device: torch.device, measured: RunMeasurements,
              elapsed_s: float) -> StepMetrics:
    config = state.config
    lr = lr_at(state.step, config.optimizer, state.schedule_span())
    for group in state.optimizer.param_groups:
        group["lr"] = lr
    batch = _next_batch(state.loader, device)
    began, began_cpu, began_queued = time.perf_counter(), time.process_time(), queued_seconds()
    state.optimizer.zero_grad(set_to_none=True)
    forward = time.perf_counter()
    loss = state.model.train_step(*batch)
    trained, trained_queued = time.perf_counter(), queued_seconds()
    grad_norm = state.model.clip_grad_norm_(config.optimizer.clip) if config.optimizer.clip > 0 else None
    state.optimizer.step()
    ended = time.perf_counter()
    step_time = ended - began
    state.step += 1
    queued = queued_seconds()
    recorded = None not in (began_queued, trained_queued, queued)  # the kernel reports the run-queue delay
    measured.add(state.step, step_time, trained - forward, ended - trained, time.process_time() - began_cpu,
                 queued - began_queued if recorded else None, trained_queued - began_queued if recorded else None)
    state.tokens += throughput.tokens_per_step
    return StepMetrics(step=state.step, loss=float(loss), lr=lr,
                       grad_norm=None if grad_norm is None else float(grad_norm), step_time_s=step_time,
                       tokens_per_s=throughput.tokens_per_s(step_time), mfu=throughput.mfu(step_time),
                       tokens=state.tokens, elapsed_s=elapsed_s + step_time, precision=_computed_in(state.model))


def _computed_in(model: Any) -> str:
    return "bf16" if model.mixed_precision == torch.bfloat16 else "fp32"


def _report_measured(segments: list, log_dir: Path) -> None:
    """Rank 0 writes every rank's timings (LOG_DIR/measured.json) and prints predicted against measured by part."""
    if dist.get_rank() != 0 or not segments:
        return
    write_measured(log_dir, segments)
    print_comparison(segments)
    # the advice fits the decoder cost model's terms (plait tune --from-run), which a per-operator plan is not priced by
    per_operator = any(segment.plan.get("operators") for segment in segments)
    advice = None if per_operator else calibration_advice(segments, log_dir, dist.get_world_size())
    if advice:
        print(f"plait: note: {advice}", file=sys.stderr, flush=True)


def _out_of_time(max_seconds: float, start: float) -> bool:
    """Whether to stop for the time limit; rank 0's clock decides so that every rank stops together."""
    if max_seconds <= 0:
        return False
    flag = torch.tensor([1 if time.perf_counter() - start >= max_seconds else 0])
    dist.broadcast(flag, src=0)
    return bool(flag.item())


def _save_full_model(state: TrainState, log_dir: Path) -> Path | None:
    """Gather the full weights (a collective: every rank calls it) and write them from rank 0."""
    full = state.model.full_state_dict()
    if dist.get_rank() != 0:
        return None
    path = log_dir / "model.pt"
    torch.save({k: v.detach().cpu() for k, v in full.items()}, path)
    return path


def _plot(metrics_path: Path) -> Path | None:
    from plait.report import plot_loss_curve

    return Path(plot_loss_curve(metrics_path, metrics_path.parent / "loss.png"))
