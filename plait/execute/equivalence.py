"""The equivalence proof behind `plait check` and tests/dist: K AdamW steps of a plan on its ranks against the same K
steps on one process, from the same weights and data, both in float64 by default.

Why float64: a parallel run sums in another order than one process (an all-reduce of partial matmuls, a
gradient averaged over replicas), so in fp32 the two differ by ~1e-7 relative; AdamW then divides each update
by the square root of the gradient's second moment, which turns that noise into differences of the order of
the learning rate wherever a gradient is tiny (a parameter diff of 1e-4 after one step at lr 1e-3, for a plan
that is right). In float64 the same noise is ~1e-15, and the check can be decisive.

The verdict (`Tolerance`) looks at three things, each relative to the size of what it compares, so one
threshold fits every parameter:

* the loss of every step;
* every parameter's gradient after the first backward, before clipping and the optimizer:
  ||g_parallel - g_one|| / ||g_one|| per tensor, floored at a millionth of the whole gradient's norm (a
  tensor whose true gradient is zero holds only rounding noise); this catches a missing or doubled
  reduction directly;
* every parameter's value after K steps: ||p_parallel - p_one|| per tensor, in units of AdamW's full
  step (lr per element per step).

A correct plan measures ~1e-13 on plait's own models and up to ~1e-7 on Hugging Face models that compute
their norms in fp32 whatever the input's dtype (Gemma); a plan that drops a gradient reduction measures
~1e-1. The default tolerances (1e-5) sit between, orders of magnitude from both.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from plait.execute.batches import batch_for_step, chat_batch_for_step, dp_shard
from plait.execute.parallelize import parallelize
from plait.execute.reference import single_process_reference
from plait.models import adapter_for
from plait.plan import Plan

DTYPES = {"float64": torch.float64, "float32": torch.float32}


@dataclass(frozen=True, kw_only=True)
class Tolerance:
    """Largest differences accepted (see the module docstring for why these are decisive)."""

    loss: float = 1e-9
    """Relative difference of each step's loss (and of the global gradient norm when clipping)."""
    grad: float = 1e-5
    """Per-tensor relative difference of the first step's gradients."""
    update: float = 1e-5
    """Per-tensor difference of each parameter after K steps, in AdamW steps (lr per element per step)."""

    @classmethod
    def for_dtype(cls, dtype: str) -> "Tolerance":
        """float32 runs carry ~1e-7 reduction-order noise, which AdamW magnifies: only loose limits hold there."""
        return cls() if dtype == "float64" else cls(loss=1e-5, grad=1e-3, update=1e-1)


@dataclass(frozen=True, kw_only=True)
class CheckSettings:
    steps: int = 3
    seed: int = 0
    lr: float = 1e-3
    max_norm: float | None = None
    """Clip gradients to this global norm each step (None: no clipping)."""
    weight_decay: float = 0.0
    dtype: str = "float64"
    """The dtype of both runs ("float64" makes the verdict decisive; "float32" is what training runs)."""
    verify_load: bool = False
    """Also load a changed full state dict and read it back (tests load_full_state_dict under the plan)."""
    optimizer: str = "adamw"
    """The reference's optimizer: "adamw", or "sgd" (plain SGD: what DiLoCo at H = 1 equals, plait/train/islands_check.py)."""
    weights: str | None = None
    """A Hugging Face checkpoint directory both sides start from (the parallel side reads its shards; the
    reference loads it with from_pretrained); None: the seed's initial weights."""
    chat: bool = False
    """Mask the targets as chat training does (plait.execute.batches.chat_batch_for_step): rows training different
    numbers of tokens, one none; the step's loss must still be its token mean under every plan."""

    def batches(self, plan: Plan):
        """step -> (tokens, targets, positions or None) of the whole global batch, the same on every rank and on the
        reference; chat batches pack documents where the model keeps them apart (ModelAdapter.takes_positions)."""
        if not self.chat:
            return lambda step: (*batch_for_step(plan, self.seed, step), None)
        documents = adapter_for(plan.model).takes_positions
        return lambda step: chat_batch_for_step(plan, self.seed, step, documents)


@dataclass(frozen=True, kw_only=True)
class CheckResult:
    plan: str
    """plan.describe()"""
    losses: list[float]
    reference_losses: list[float]
    grad_rel_diffs: dict[str, float]
    """Per parameter: relative difference of the first step's gradient (see the module docstring)."""
    update_rel_diffs: dict[str, float]
    """Per parameter: difference after the last step, in units of AdamW's full step."""
    max_param_diff: float
    """Largest |parallel - reference| over every element of every parameter after the last step."""
    grad_norms: list[float] = field(default_factory=list)
    """Global gradient norms before clipping, per step (when clipping)."""
    reference_grad_norms: list[float] = field(default_factory=list)
    runtime: dict = field(default_factory=dict)
    """Rank 0's ParallelModel.runtime_summary(): the building blocks that actually ran."""

    @property
    def loss_rel_diffs(self) -> list[float]:
        return [abs(a - b) / max(abs(b), 1e-300) for a, b in zip(self.losses, self.reference_losses)]

    @property
    def max_loss_rel_diff(self) -> float:
        return max(self.loss_rel_diffs, default=0.0)

    @property
    def max_grad_norm_rel_diff(self) -> float:
        pairs = zip(self.grad_norms, self.reference_grad_norms)
        return max((abs(a - b) / max(abs(b), 1e-300) for a, b in pairs), default=0.0)

    @property
    def worst_grad(self) -> tuple[str, float]:
        name = max(self.grad_rel_diffs, key=self.grad_rel_diffs.get)
        return name, self.grad_rel_diffs[name]

    @property
    def worst_update(self) -> tuple[str, float]:
        name = max(self.update_rel_diffs, key=self.update_rel_diffs.get)
        return name, self.update_rel_diffs[name]

    def failures(self, tol: Tolerance) -> list[str]:
        """What exceeds `tol`, one line each (empty: EQUAL)."""
        out = []
        if not all(math.isfinite(x) for x in self.losses):
            out.append(f"non-finite loss {self.losses}")
        if self.max_loss_rel_diff > tol.loss:
            out.append(f"loss differs by {self.max_loss_rel_diff:.1e} (relative; tolerance {tol.loss:g})")
        if self.max_grad_norm_rel_diff > tol.loss:
            out.append(f"gradient norm differs by {self.max_grad_norm_rel_diff:.1e} (tolerance {tol.loss:g})")
        name, value = self.worst_grad
        if value > tol.grad:
            out.append(f"gradient of {name} differs by {value:.1e} (relative; tolerance {tol.grad:g})")
        name, value = self.worst_update
        if value > tol.update:
            out.append(f"update of {name} differs by {value:.1e} (relative; tolerance {tol.update:g})")
        return out

    def passed(self, tol: Tolerance) -> bool:
        return not self.failures(tol)

    def to_dict(self) -> dict:
        grad, update = self.worst_grad, self.worst_update
        return {"plan": self.plan, "losses": self.losses, "reference_losses": self.reference_losses,
                "loss_rel_diffs": self.loss_rel_diffs, "max_loss_rel_diff": self.max_loss_rel_diff,
                "worst_grad": list(grad), "worst_update": list(update), "max_param_diff": self.max_param_diff,
                "grad_norms": self.grad_norms, "reference_grad_norms": self.reference_grad_norms,
                "max_grad_norm_rel_diff": self.max_grad_norm_rel_diff, "runtime": self.runtime}


@dataclass
class ParallelRun:
    losses: list[float]
    grad_norms: list[float]
    first_grads: dict[str, torch.Tensor]
    params: dict[str, torch.Tensor]
    runtime: dict


def run_parallel(plan: Plan, settings: CheckSettings, initial_state: dict[str, torch.Tensor] | None = None
                 ) -> ParallelRun:
    """On every rank: parallelize, train K steps; returns what rank 0 compares."""
    model = parallelize(plan, seed=settings.seed, precision="fp32", dtype=DTYPES[settings.dtype],
                        initial_state=initial_state, weights=settings.weights)
    optimizer = model.make_optimizer(lr=settings.lr, weight_decay=settings.weight_decay)
    losses, norms, first_grads = [], [], {}
    batches = settings.batches(plan)
    for step in range(settings.steps):
        tokens, targets, positions = batches(step)
        loss = model.train_step(dp_shard(plan, tokens, model.dp_rank), dp_shard(plan, targets, model.dp_rank),
                                None if positions is None else dp_shard(plan, positions, model.dp_rank))
        if step == 0:
            first_grads = model.full_gradients()
        if settings.max_norm is not None:
            norms.append(model.clip_grad_norm_(settings.max_norm))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss)
    state = model.full_state_dict()
    runtime = model.runtime_summary(optimizer)
    if settings.verify_load:
        runtime["load_roundtrip_max_diff"] = _load_roundtrip(model, state)
    return ParallelRun(losses, norms, first_grads, state, runtime)


def _load_roundtrip(model, state: dict[str, torch.Tensor]) -> float:
    """Load state + 1 into the shards, gather it back, restore state; the largest difference seen."""
    shifted = {name: tensor + 1.0 for name, tensor in state.items()}
    model.load_full_state_dict(shifted)
    back = model.full_state_dict()
    model.load_full_state_dict(state)
    if back.keys() != shifted.keys():
        return math.inf
    return max((back[name] - shifted[name]).abs().max().item() for name in shifted)


def _norm(t: torch.Tensor) -> float:
    return t.double().norm().item()


def compare(plan: Plan, settings: CheckSettings, run: ParallelRun,
            initial_state: dict[str, torch.Tensor] | None = None) -> CheckResult:
    """Run the single-process reference and measure how far the parallel run is from it."""
    ref = single_process_reference(plan, settings.batches(plan), settings.steps, settings.seed, settings.lr,
                                   max_norm=settings.max_norm, weight_decay=settings.weight_decay,
                                   dtype=DTYPES[settings.dtype], initial_state=initial_state,
                                   weights=settings.weights, optimizer=settings.optimizer)
    missing = ref.params.keys() - run.params.keys()
    if missing:
        raise RuntimeError(f"the parallel model lacks parameters {sorted(missing)[:3]}")
    # A tensor whose true gradient is zero (a key bias: softmax ignores a shift of every score) holds only
    # rounding noise on both sides; its error is measured against a millionth of the whole gradient instead.
    floor = 1e-6 * math.sqrt(sum(_norm(g) ** 2 for g in ref.first_grads.values()))
    grads = {name: _norm(run.first_grads[name].double() - g.double()) / max(_norm(g), floor)
             if name in run.first_grads else math.inf for name, g in ref.first_grads.items()}
    # Updates in units of AdamW's full step: lr per element per step (what every element with a gradient
    # well above eps moves); a per-tensor ratio would divide by nothing where gradients are zero.
    updates = {}
    for name, final in ref.params.items():
        unit = settings.lr * settings.steps * math.sqrt(final.numel())
        updates[name] = _norm(run.params[name].double() - final.double()) / unit
    max_diff = max((run.params[n].double() - p.double()).abs().max().item() for n, p in ref.params.items())
    return CheckResult(plan=plan.describe(), losses=list(run.losses), reference_losses=ref.losses,
                       grad_rel_diffs=grads, update_rel_diffs=updates, max_param_diff=max_diff,
                       grad_norms=list(run.grad_norms), reference_grad_norms=ref.grad_norms, runtime=run.runtime)


def check_plan(plan: Plan, settings: CheckSettings, initial_state: dict[str, torch.Tensor] | None = None
               ) -> CheckResult | None:
    """Collective: the parallel run on every rank, the reference and comparison on rank 0 only (which returns
    the result; other ranks return None). LoRA's adapter dropout is off on both sides, as every dropout plait runs:
    random masks differ between layouts."""
    lora = plan.model.lora
    if lora is not None and lora.dropout:
        plan = plan.replace(model=plan.model.replace(lora=dataclasses.replace(lora, dropout=0.0)))
    run = run_parallel(plan, settings, initial_state)
    if dist.get_rank() != 0:
        return None
    return compare(plan, settings, run, initial_state)
