"""The equivalence proof behind `plait check` and tests/dist: K AdamW steps of a plan on its
ranks against the same K steps on one process, from the same seed and data."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from plait.execute.batches import batch_for_step, dp_shard
from plait.execute.parallelize import parallelize
from plait.execute.reference import single_process_reference
from plait.plan import Plan


@dataclass(frozen=True, kw_only=True)
class CheckSettings:
    steps: int = 3
    seed: int = 0
    lr: float = 1e-3
    max_norm: float | None = None
    """Clip gradients to this global norm each step (None: no clipping)."""
    weight_decay: float = 0.0
    verify_load: bool = False
    """Also load a changed full state dict and read it back (tests load_full_state_dict under the plan)."""


@dataclass(frozen=True, kw_only=True)
class CheckResult:
    plan: str
    """plan.describe()"""
    losses: list[float]
    reference_losses: list[float]
    max_param_diff: float
    """Largest |parallel - reference| over every element of every parameter after the last step."""
    worst_param: str
    grad_norms: list[float] = field(default_factory=list)
    """Global gradient norms before clipping, per step (when clipping)."""
    reference_grad_norms: list[float] = field(default_factory=list)
    runtime: dict = field(default_factory=dict)
    """Rank 0's ParallelModel.runtime_summary(): the building blocks that actually ran."""

    @property
    def max_grad_norm_rel_diff(self) -> float:
        pairs = zip(self.grad_norms, self.reference_grad_norms)
        return max((abs(a - b) / max(abs(b), 1e-12) for a, b in pairs), default=0.0)

    @property
    def loss_rel_diffs(self) -> list[float]:
        return [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(self.losses, self.reference_losses)]

    @property
    def max_loss_rel_diff(self) -> float:
        return max(self.loss_rel_diffs, default=0.0)

    def passed(self, loss_tol: float, param_tol: float) -> bool:
        finite = all(math.isfinite(x) for x in self.losses)
        return (finite and self.max_loss_rel_diff <= loss_tol and self.max_param_diff <= param_tol
                and self.max_grad_norm_rel_diff <= loss_tol)


def run_parallel(plan: Plan, settings: CheckSettings) -> tuple[list[float], list[float], dict[str, torch.Tensor], dict]:
    """On every rank: parallelize, train K steps; returns (losses, grad norms, full final parameters,
    runtime summary)."""
    model = parallelize(plan, seed=settings.seed, precision="fp32")
    optimizer = model.make_optimizer(lr=settings.lr, weight_decay=settings.weight_decay)
    losses, norms = [], []
    for step in range(settings.steps):
        tokens, targets = batch_for_step(plan, settings.seed, step)
        loss = model.train_step(dp_shard(plan, tokens, model.dp_rank), dp_shard(plan, targets, model.dp_rank))
        if settings.max_norm is not None:
            norms.append(model.clip_grad_norm_(settings.max_norm))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss)
    state = model.full_state_dict()
    runtime = model.runtime_summary(optimizer)
    if settings.verify_load:
        runtime["load_roundtrip_max_diff"] = _load_roundtrip(model, state)
    return losses, norms, state, runtime


def _load_roundtrip(model, state: dict[str, torch.Tensor]) -> float:
    """Load state + 1 into the shards, gather it back, restore state; the largest difference seen."""
    shifted = {name: tensor + 1.0 for name, tensor in state.items()}
    model.load_full_state_dict(shifted)
    back = model.full_state_dict()
    model.load_full_state_dict(state)
    if back.keys() != shifted.keys():
        return math.inf
    return max((back[name] - shifted[name]).abs().max().item() for name in shifted)


def compare(plan: Plan, settings: CheckSettings, losses: list[float], state: dict[str, torch.Tensor],
            grad_norms: list[float] | None = None, runtime: dict | None = None) -> CheckResult:
    """Run the single-process reference and measure how far the parallel run is from it."""
    ref_norms: list[float] = []
    ref_losses, ref_state = single_process_reference(
        plan, None, settings.steps, settings.seed, settings.lr, max_norm=settings.max_norm,
        weight_decay=settings.weight_decay, grad_norms=ref_norms)
    missing = ref_state.keys() - state.keys()
    if missing:
        raise RuntimeError(f"the parallel model lacks parameters {sorted(missing)[:3]}")
    diffs = {name: (state[name].float() - ref.float()).abs().max().item() for name, ref in ref_state.items()}
    worst = max(diffs, key=diffs.get)
    return CheckResult(plan=plan.describe(), losses=list(losses), reference_losses=ref_losses,
                       max_param_diff=diffs[worst], worst_param=worst, grad_norms=list(grad_norms or []),
                       reference_grad_norms=ref_norms, runtime=runtime or {})


def check_plan(plan: Plan, settings: CheckSettings) -> CheckResult | None:
    """Collective: the parallel run on every rank, the reference and comparison on rank 0 only
    (which returns the result; other ranks return None)."""
    losses, norms, state, runtime = run_parallel(plan, settings)
    if dist.get_rank() != 0:
        return None
    return compare(plan, settings, losses, state, norms, runtime)
