"""`plait train` of a per-operator plan: a module of any shape, its own batches and the loss it returns.

    [model] module = "dlrm:build"            # an nn.Module whose forward takes the batch and returns the loss
            path = "examples/auto"           # where to import it from
    [data]  batch = "dlrm:batch"             # batch(batch_size, generator) -> the forward's tensors
    [plan]  devices = 2, pins = {tp = 2, memory_budget = 2.3, table_optimizer = "sgd", place = {"fc.weight" = "S0"}}
            # pins = {pp = 2} cuts pipeline stages between the module's repeated blocks (plait.operators.pipeline)
            # or file = "plan.json" from `plait plan --model module:... --batch ... --json`

The launcher plans here (plait.operators.planner.auto_plan: tp from the pins, default every device; dp the rest),
writes the plan next to the metrics and starts its ranks; each rank runs `run_auto`: the executor's model
(plait.execute.autoshard), AdamW with the config's schedule and clipping, the batch of step k drawn from
(train.seed, k) and split over dp (what `plait check` runs), the loss logged to metrics.jsonl, and checkpoints
through plait's own checkpointer (sharded DCP, resumable). Fused tables follow the schedule's learning rate.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from plait.errors import ConfigError

PLAN_PINS = ("tp", "pp", "schedule", "num_micro_batches", "memory_budget", "table_optimizer", "place")
"""[plan] pins a per-operator run takes: tp degree, pipeline stages (pp, cut between the module's repeated blocks;
schedule gpipe or 1f1b; micro-batches per step, default pp), a per-device budget in MiB, the fused table optimizer,
and placements pinned by parameter or module name."""


def is_per_operator(config: Any) -> bool:
    return config.data.batch is not None


def plan_per_operator(config: Any, nproc: int | None) -> Any:
    """The per-operator plan of this config (planned here for plan.file = "auto")."""
    from plait.plan import Plan

    if not config.model.module:
        raise ConfigError(f"data.batch = {config.data.batch!r} trains a module that returns its loss: set model.module "
                          "= 'package.module:factory' (an nn.Module whose forward takes the batch)")
    if config.model.path:
        from plait.train.resolve import import_path

        import_path(config.model.path)
    if config.plan.file != "auto":
        plan = Plan.from_json(config.plan.file)
        if plan.operators is None:
            raise ConfigError(f"plan.file {config.plan.file!r} has no per-operator placements; write one with "
                              "`plait plan --model module:... --batch ... --json FILE`")
        plan.operators.check_stages(plan.pp)
        return plan
    pins = dict(config.plan.pins)
    unknown = sorted(set(pins) - set(PLAN_PINS))
    if unknown:
        raise ConfigError(f"plan.pins key {unknown[0]!r} does not apply to a per-operator run; it takes "
                          f"{', '.join(PLAN_PINS)}")
    devices = config.plan.devices or nproc or 2
    pp = pins.get("pp", 1)
    if not isinstance(pp, int) or pp < 1 or devices % pp:
        raise ConfigError(f"plan.pins pp = {pp!r} must be a whole number dividing the {devices} devices")
    tp = pins.get("tp", devices // pp)
    if not isinstance(tp, int) or tp < 1 or devices % (tp * pp):
        raise ConfigError(f"plan.pins tp = {tp!r} must be a whole number dividing the {devices // pp} devices of "
                          f"each pipeline stage (pp = {pp})")
    budget = pins.get("memory_budget")
    if budget is not None and not (isinstance(budget, (int, float)) and budget > 0):
        raise ConfigError(f"plan.pins memory_budget = {budget!r} must be a positive number of MiB")
    from plait.operators.planner import auto_plan
    from plait.spec.load import load_cluster

    return auto_plan(config.model.module, config.data.batch, load_cluster(config.plan.cluster),
                     global_batch=config.train.global_batch, dp=devices // (tp * pp), tp=tp,
                     pins=pins.get("place") or None, memory_limit=budget * 2**20 if budget else None,
                     table_optimizer=pins.get("table_optimizer"), pp=pp,
                     num_micro_batches=pins.get("num_micro_batches"), schedule=pins.get("schedule", "1f1b"))


def launch_per_operator(config_path: str | None, config: Any, overrides: list[str], *, nproc: int | None,
                        timeout_s: float | None) -> int:
    from plait.launch import run_local
    from plait.train.hooks import checkpointer_class
    from plait.train.resolve import check_outputs, write_plan

    check_outputs(config)
    checkpointer_class(config)
    plan = plan_per_operator(config, nproc)
    path = write_plan(plan, config.log.dir).resolve()
    print(f"plait train: {plan.describe()} per operator ({plan.operators.describe()}) on {plan.num_devices} local "
          f"processes; logs in {config.log.dir}", file=sys.stderr, flush=True)
    argv = ["train"] + ([config_path] if config_path else [])
    for item in overrides + [f'plan.file="{path}"']:
        argv += ["--set", item]
    return run_local(plan.num_devices, argv, timeout_s=timeout_s)


class _Parts:
    """What plait's checkpointer reads of a model: its parts (one here)."""

    def __init__(self, module) -> None:
        self.model_parts = [module]


class _Steps:
    """The data position: batches are a function of (seed, step), so the step alone resumes them."""

    def state_dict(self) -> dict[str, int]:
        return {}

    def load_state_dict(self, state: dict[str, int]) -> None:
        pass


def run_auto(config: Any) -> list[float]:
    """One rank of a per-operator run (under torchrun); rank 0 returns the losses."""
    import torch
    import torch.distributed as dist

    from plait.execute.autoshard import (apply_operator_sharding, build_mesh, build_module, dp_slice, make_batch,
                                         mean_over_dp)
    from plait.execute.parallelize import clip_grad_norm
    from plait.launch import ending_together, init_distributed
    from plait.train.hooks import TrainState, make_checkpoint_hooks
    from plait.train.loop import DIST_TIMEOUT_S, lr_at

    plan = plan_per_operator(config, None)
    init_distributed(plan.cluster.backend, DIST_TIMEOUT_S)
    with ending_together():
        mesh = build_mesh(plan)
        schedule = None
        if plan.pp > 1:  # this rank's pipeline stage, run by the plan's schedule
            from plait.execute.autoshard_pipeline import build_pipeline_stage, pipeline_losses

            position, model, schedule = build_pipeline_stage(plan, mesh, seed=config.train.seed, dtype=torch.float32,
                                                             lr=config.optimizer.lr)
        else:
            model = build_module(plan.model.source, seed=config.train.seed, dtype=torch.float32)
            model = apply_operator_sharding(model, plan, mesh, config.optimizer.lr)
        opt = config.optimizer
        trained = [p for name, p in model.named_parameters() if name not in plan.operators.fused_tables]
        optimizer = torch.optim.AdamW(trained, lr=opt.lr, betas=opt.betas, eps=opt.eps,
                                      weight_decay=opt.weight_decay, foreach=False)
        state = TrainState(config=config, plan=plan, model=_Parts(model), optimizer=optimizer, loader=_Steps())
        hooks = make_checkpoint_hooks(config)
        hooks.resume(state)
        dp_rank, dp_group = mesh["dp"].get_local_rank(), mesh["dp"].get_group()
        rank0 = dist.get_rank() == 0
        metrics = Path(config.log.dir, "metrics.jsonl")
        if rank0 and state.step == 0:  # a new run rewrites the metrics, as plait's token runs do
            metrics.unlink(missing_ok=True)
        losses = []
        while state.step < config.train.steps:
            start = time.perf_counter()
            lr = lr_at(state.step, opt, state.schedule_span())
            for group in optimizer.param_groups:
                group["lr"] = lr
            model.fused_tables.lr = lr
            batch = make_batch(plan.operators.batch, plan.train.global_batch, config.train.seed, state.step,
                               torch.float32)
            if schedule is not None:
                loss = pipeline_losses(schedule, plan, position, dp_slice(batch, plan.dp, dp_rank), mesh)
            else:
                loss = model(*dp_slice(batch, plan.dp, dp_rank))
                loss.backward()
            if opt.clip > 0:  # over every stage's gradients under a pipeline
                clip_grad_norm(trained, opt.clip, mesh["pp"].get_group() if schedule is not None else None)
            optimizer.step()
            optimizer.zero_grad()
            state.step += 1
            state.tokens += plan.train.global_batch  # samples: a module's batch has no tokens
            losses.append(mean_over_dp(loss, plan.dp, dp_group))
            if rank0:
                _log(metrics, state.step, losses[-1], lr, time.perf_counter() - start, config.log.every,
                     config.train.steps)
            hooks.after_step(state, final=state.step == config.train.steps)
        return losses


def _log(path: Path, step: int, loss: float, lr: float, seconds: float, every: int, total: int) -> None:
    with path.open("a") as f:
        f.write(json.dumps({"step": step, "loss": loss, "lr": lr, "step_time_s": seconds}) + "\n")
    if step == 1 or step == total or every > 0 and step % every == 0:
        print(f"step {step}/{total}  loss {loss:.4f}  lr {lr:.2e}  {seconds * 1e3:.0f} ms", flush=True)
