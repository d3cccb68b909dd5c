"""parallelize(plan) -> ParallelModel: the one place where the techniques are composed.

The order (torchtitan's), and why:

1. **mesh**: a named ("pp", "dp", "tp") DeviceMesh from the plan's degrees (mesh.py).
2. **pipeline split** on the meta model: this rank's virtual stages (uneven, as the plan
   says), each a Transformer missing what it does not own (pipeline.py). Done first so
   everything below runs per stage, on a module whose parameters are this stage's.
3. **apply_tp** per stage: `parallelize_module` plans; SP, vocab-parallel embedding,
   loss-parallel output (tensor.py). Before AC so that the recomputed region contains the
   TP collectives, and before FSDP because fully_shard shards the TP-sharded DTensors
   further over "dp" (2-D).
4. **apply_ac** per stage with the plan's mode for this pipeline rank (recompute.py):
   wraps whole blocks, after TP (which addresses modules inside the block by name) and
   before FSDP (so each FSDP unit is a checkpointed block).
5. **apply_dp**, sharded kinds (ZeRO-2/3; any ZeRO with TP or interleaving) via `fully_shard` on
   meta, then **materialize**: `to_empty` on the device and load the initial weights for
   the seed -- the same tensors the single-process model starts from (data.py, state.py).
6. **apply_dp**, DDP kinds (ZeRO-0/1 otherwise): DDP needs real tensors, so it wraps
   after materialization.
7. **PipelineStage**(group = mesh["pp"]) per stage and the plan's schedule (pipeline.py).
"""

from __future__ import annotations

from contextlib import ExitStack
import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from plait.errors import ConfigError
from plait.execute.data import apply_ddp, apply_dp, build_optimizer, gradient_sync, uses_fully_shard
from plait.execute.mesh import ParallelDims, device_type_of
from plait.execute.pipeline import build_schedule, split_model
from plait.execute.recompute import apply_ac
from plait.execute.state import _plain_names, gather_full_state_dict, load_full_state_dict
from plait.execute.tensor import apply_tp
from plait.launch import in_torchrun, init_distributed
from plait.models import build_model, initial_state_dict
from plait.models.transformer import AttentionCore
from plait.plan import Plan


# ---- legality -----------------------------------------------------------------------
def validate_plan(plan: Plan, world_size: int | None = None) -> None:
    """Raise ConfigError naming the first reason `plan` cannot run on the reference model
    (with `world_size` ranks); pure, so it runs before any process does work."""
    if world_size is not None:
        ParallelDims(pp_degree=plan.pp, dp_degree=plan.dp, tp_degree=plan.tp).check_world(world_size)
    for reason in _tp_problems(plan) + _pp_problems(plan) + _model_problems(plan):
        raise ConfigError(reason)


def _tp_problems(plan: Plan) -> list[str]:
    spec, tp = plan.model, plan.tp
    sizes = {"num_heads": spec.num_heads, "num_kv_heads": spec.num_kv_heads,
             "ffn_hidden_size": spec.ffn_hidden_size, "vocab_size": spec.vocab_size}
    problems = [f"{name}={value} is not divisible by tp={tp}; use a tp that divides it "
                f"(divisors: {_divisors(value)})" for name, value in sizes.items() if value % tp]
    if plan.sequence_parallel and tp > 1 and plan.train.seq_len % tp:
        problems.append(f"seq_len={plan.train.seq_len} is not divisible by tp={tp}, which sequence "
                        f"parallelism needs; pick a multiple of {tp} or turn sequence parallelism off")
    return problems


def _pp_problems(plan: Plan) -> list[str]:
    stages, layers = plan.num_stages, plan.model.num_layers
    if layers < stages:
        return [f"the model has {layers} layers, fewer than the plan's {stages} pipeline stages "
                f"(pp={plan.pp} x interleave={plan.interleave}); use at most {layers} stages"]
    middle_empty = [s for s in range(1, stages - 1) if plan.layers_per_stage[s] == 0]
    if middle_empty:
        return [f"pipeline stages {middle_empty} have no layers (layers_per_stage={list(plan.layers_per_stage)}); "
                "only the first and last stage, which hold the embedding and the output layer, may be empty"]
    if plan.pp > 1 and plan.schedule == "1f1b" and plan.num_micro_batches < plan.pp:
        return [f"schedule 1f1b needs at least pp={plan.pp} micro-batches, the plan has "
                f"num_micro_batches={plan.num_micro_batches}; use gpipe or more micro-batches"]
    rounds = max(1, plan.num_micro_batches // plan.pp)
    if plan.pp > 1 and plan.schedule == "interleaved" and plan.num_micro_batches % rounds:
        return [f"the interleaved schedule needs num_micro_batches={plan.num_micro_batches} to be a multiple "
                f"of {rounds} (its rounds of pp={plan.pp}); use a multiple of pp"]
    return []


def _model_problems(plan: Plan) -> list[str]:
    spec = plan.model
    problems = []
    if plan.train.seq_len > spec.max_seq_len:
        problems.append(f"seq_len={plan.train.seq_len} exceeds the model's max_seq_len={spec.max_seq_len}")
    if spec.tied_embeddings and (plan.tp > 1 or plan.pp > 1):
        problems.append("tied embeddings are supported only without tensor or pipeline parallelism "
                        f"(plan has tp={plan.tp}, pp={plan.pp}); untie them or use data parallelism")
    return problems


def _divisors(value: int) -> str:
    return ", ".join(str(d) for d in range(1, min(value, 64) + 1) if value % d == 0)


# ---- the parallel model ---------------------------------------------------------------
def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of one (micro-)batch; logits [b, s, V], targets [b, s]."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def global_squared_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Squared L2 norm of all `grads` over their shards, with a few collectives per layout.

    Plain tensors are whole on this rank (DDP replicas). DTensor gradients are grouped by
    (mesh, placements); per group, pending Partial sums (e.g. norm weights under sequence
    parallelism) are reduced on the concatenated group, then the squared norms are summed over
    the mesh dims where the group is sharded (replicated dims count once). One reduction per
    parameter instead costs ~17x more here (95 ms against 5.5 ms for 69 tensors on 2 ranks)."""
    squared = torch.zeros((), device=device)
    groups: dict[tuple, list[torch.Tensor]] = {}
    for grad in grads:
        if isinstance(grad, DTensor):
            groups.setdefault((grad.device_mesh, grad.placements), []).append(grad.to_local())
        else:
            squared += torch.linalg.vector_norm(grad).float() ** 2
    for (mesh, placements), locals_ in groups.items():
        partial_dims = [d for d, p in enumerate(placements) if p.is_partial()]
        if partial_dims:
            flat = torch.cat([t.reshape(-1).float() for t in locals_])
            for dim in partial_dims:
                dist.all_reduce(flat, group=mesh.get_group(dim))
                if placements[dim].reduce_op == "avg":
                    flat /= mesh.size(dim)
            local = flat.square().sum()
        else:
            local = torch.stack([torch.linalg.vector_norm(t).float() for t in locals_]).square().sum()
        for dim, placement in enumerate(placements):
            # sharded = neither replicated nor partial: Shard, and FSDP's _StridedShard over a
            # TP-sharded weight, which is not a Shard subclass (is_shard() is False) in torch 2.13
            if not (placement.is_replicate() or placement.is_partial()):
                dist.all_reduce(local, group=mesh.get_group(dim))
        squared += local
    return squared


def _scalar(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


class ParallelModel:
    """This rank's share of a model parallelized by a Plan; see parallelize().

    Attributes: plan; mesh (named ("pp", "dp", "tp")); model_parts (this rank's stage
    modules, in chunk order); stage_ids (their virtual stage indices); device."""

    def __init__(self, plan: Plan, mesh: DeviceMesh, model_parts: list[nn.Module], stage_ids: list[int],
                 device: torch.device, mixed_precision: torch.dtype | None) -> None:
        self.plan = plan
        self.mesh = mesh
        self.model_parts = model_parts
        self.stage_ids = stage_ids
        self.device = device
        self.mixed_precision = mixed_precision
        self.schedule = None
        if plan.pp > 1:
            self.schedule = build_schedule(plan, stage_ids, model_parts, mesh["pp"], device, cross_entropy)

    # ---- ranks ------------------------------------------------------------------
    @property
    def dp_rank(self) -> int:
        return self.mesh["dp"].get_local_rank()

    @property
    def tp_rank(self) -> int:
        return self.mesh["tp"].get_local_rank()

    @property
    def pp_rank(self) -> int:
        return self.mesh["pp"].get_local_rank()

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last_stage(self) -> bool:
        return self.plan.num_stages - 1 in self.stage_ids

    def parameters(self) -> list[nn.Parameter]:
        return [p for part in self.model_parts for p in part.parameters()]

    # ---- training -----------------------------------------------------------------
    def make_optimizer(self, lr: float, weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.95),
                       eps: float = 1e-8) -> torch.optim.Optimizer:
        """AdamW over this rank's parameters; ZeRO-1 over DDP shards its states (ZeroRedundancyOptimizer),
        the fully_shard kinds shard them with the parameters."""
        return build_optimizer(self.model_parts, zero=self.plan.zero, dp_mesh=self.mesh["dp"], lr=lr,
                               weight_decay=weight_decay, betas=betas, eps=eps)

    def _compute_context(self) -> ExitStack:
        stack = ExitStack()
        if self.plan.tp > 1:
            stack.enter_context(loss_parallel())  # forward and backward of the loss both need it
        sharded = uses_fully_shard(self.plan.zero, self.plan.tp > 1, self.plan.pp > 1)
        if self.mixed_precision is not None and not sharded:  # fully_shard casts via its MixedPrecisionPolicy
            stack.enter_context(torch.autocast(self.device.type, dtype=self.mixed_precision))
        return stack

    def train_step(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """Forward and backward over this dp rank's rows ([micro_batch · num_micro_batches, seq]);
        returns the mean token cross-entropy over the global batch, the same on every rank.
        Gradients are left in the parameters (the optimizer is not stepped)."""
        expected = (self.plan.micro_batch * self.plan.num_micro_batches, self.plan.train.seq_len)
        if tuple(tokens.shape) != expected or tuple(targets.shape) != expected:
            raise ValueError(f"tokens/targets must be {list(expected)} (this dp rank's rows), got "
                             f"{list(tokens.shape)} and {list(targets.shape)}")
        tokens, targets = tokens.to(self.device), targets.to(self.device)
        with self._compute_context():
            local = self._pipeline_step(tokens, targets) if self.schedule else self._accumulate(tokens, targets)
        return self._global_mean(local)

    def _accumulate(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Gradient accumulation over micro-batches; the dp reduction runs only on the last one."""
        count = self.plan.num_micro_batches
        total = torch.zeros((), device=self.device)
        model = self.model_parts[0]
        for index, (tok, tgt) in enumerate(zip(tokens.chunk(count), targets.chunk(count))):
            with gradient_sync(self.model_parts, enabled=index == count - 1, keep_gathered=self.plan.zero < 3):
                loss = cross_entropy(model(tok), tgt) / count
                loss.backward()
            total += _scalar(loss.detach())
        return total

    def _pipeline_step(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        args = (tokens,) if self.has_first_stage else ()
        if not self.has_last_stage:
            self.schedule.step(*args)
            return torch.zeros((), device=self.device)
        losses: list[torch.Tensor] = []
        self.schedule.step(*args, target=targets, losses=losses)
        return torch.stack([_scalar(loss.detach()).float() for loss in losses]).mean()

    def _global_mean(self, local: torch.Tensor) -> float:
        """Only the last pipeline rank holds the loss; tensor ranks hold equal copies."""
        value = local.detach().float().reshape(1).clone()
        if self.plan.pp > 1:
            dist.all_reduce(value, group=self.mesh["pp"].get_group())
        if self.plan.dp > 1:
            dist.all_reduce(value, group=self.mesh["dp"].get_group())
        return value.item() / self.plan.dp

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale gradients so their global L2 norm is at most max_norm; returns the norm before.

        Pipeline ranks hold disjoint parameters, so their squared norms add (one all-reduce
        over "pp"); within a rank see `global_squared_norm`."""
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        squared = global_squared_norm(grads, self.device)
        if self.plan.pp > 1:
            dist.all_reduce(squared, group=self.mesh["pp"].get_group())
        total = squared.sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch.nn.utils.clip_grad_norm_'s formula
        for grad in grads:
            grad.mul_(coef)
        return total.item()

    def runtime_summary(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, object]:
        """Which PyTorch building blocks this rank actually runs (for tests and reports)."""
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

        def data_parallel(part: nn.Module) -> str:
            if isinstance(part, FSDPModule):
                return "fully_shard"
            return type(part).__name__ if isinstance(part, nn.parallel.DistributedDataParallel) else "none"

        modules = [m for part in self.model_parts for m in part.modules()]
        return {
            "data_parallel": sorted({data_parallel(part) for part in self.model_parts}),
            "checkpointed_blocks": sum(isinstance(m, CheckpointWrapper) for m in modules),
            "selective_blocks": sum(isinstance(m, CheckpointWrapper) and isinstance(m._checkpoint_wrapped_module,
                                                                                   AttentionCore) for m in modules),
            "dtensor_params": sum(isinstance(p, DTensor) for p in self.parameters()),
            "params": len(self.parameters()),
            "schedule": type(self.schedule).__name__ if self.schedule else None,
            "stages": list(self.stage_ids),
            "optimizer": type(optimizer).__name__ if optimizer is not None else None,
        }

    # ---- weights ----------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full unsharded parameters keyed like the single-process model, on every rank (collective)."""
        return gather_full_state_dict(self.model_parts, self.mesh["pp"])

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load full tensors (every rank passes the same) into this rank's shards (collective)."""
        load_full_state_dict(self.model_parts, state)

    @torch.no_grad()
    def eval_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [b, s, V] of the whole model for `tokens`, on every rank (collective).

        Gathers the full weights into a single-process model: meant for sampling text from
        small models, not for speed."""
        model = build_model(self.plan.model, device="cpu")
        model.load_state_dict(self.full_state_dict())
        return model(tokens.cpu())


def _mixed_precision(plan: Plan, device: torch.device) -> torch.dtype | None:
    """16-bit compute where the plan asks for it and the device is an accelerator; CPU runs fp32
    (16-bit matmuls there are slow and would only blur the equality checks)."""
    if device.type == "cpu" or plan.train.precision == "fp32":
        return None
    return torch.bfloat16 if plan.train.precision == "bf16" else torch.float16


def parallelize(plan: Plan, *, seed: int = 0, device: str | torch.device | None = None,
                timeout_s: float = 120.0, precision: str | None = None) -> ParallelModel:
    """Build this rank's share of `plan.model`, parallelized as `plan` says, starting from the
    single-process initial weights for `seed`.

    Needs torch.distributed initialized (plait.launch.init_distributed; done here with
    `timeout_s` when running under torchrun and not yet done) with world size ==
    plan.num_devices. Refuses with ConfigError, before any work, a plan that does not fit
    (degrees vs heads/kv-heads/ffn/vocab, layers vs stages, world size, schedule needs).
    `device` defaults to this rank's accelerator, or CPU; `precision` overrides the plan's
    ("fp32" forces full precision, as check does)."""
    if not dist.is_initialized():
        if not in_torchrun():
            raise ConfigError("torch.distributed is not initialized; run under torchrun or plait.launch.run_local, "
                              "or call plait.launch.init_distributed() first")
        init_distributed(timeout_s=timeout_s)
    validate_plan(plan, dist.get_world_size())
    device = torch.device(device) if device is not None else _default_device()
    if precision is not None:
        plan = plan.replace(train=dataclasses.replace(plan.train, precision=precision))
    mixed = _mixed_precision(plan, device)
    dims = ParallelDims(pp_degree=plan.pp, dp_degree=plan.dp, tp_degree=plan.tp)
    mesh = dims.build_mesh(device_type_of(device))
    pp_rank = mesh["pp"].get_local_rank()
    stage_ids, parts = split_model(build_model(plan.model, device="meta"), plan, pp_rank)
    parts = [_shard_stage(part, plan, mesh, pp_rank, mixed) for part in parts]
    for part in parts:
        _materialize(part, plan, seed, device)
    if not uses_fully_shard(plan.zero, plan.tp > 1, plan.pp > 1) and plan.dp > 1:
        parts = [apply_ddp(part, mesh["dp"]) if any(True for _ in part.parameters()) else part for part in parts]
    return ParallelModel(plan, mesh, parts, stage_ids, device, mixed)


def _shard_stage(part: nn.Module, plan: Plan, mesh: DeviceMesh, pp_rank: int,
                 mixed: torch.dtype | None) -> nn.Module:
    """Steps 3-5 of the order above, on one meta stage module."""
    if plan.tp > 1:
        apply_tp(part, mesh["tp"], sequence_parallel=plan.sequence_parallel)
    apply_ac(part, plan.recompute[pp_rank])
    if uses_fully_shard(plan.zero, plan.tp > 1, plan.pp > 1):
        policy = MixedPrecisionPolicy(param_dtype=mixed, reduce_dtype=torch.float32) if mixed else None
        part = apply_dp(part, mesh["dp"], zero=plan.zero, under_pipeline=plan.pp > 1,
                        mp_policy=policy)
    return part


def _materialize(part: nn.Module, plan: Plan, seed: int, device: torch.device) -> None:
    part.to_empty(device=device)
    names = [name for name, _ in _plain_names(part)]
    if names:
        load_full_state_dict([part], initial_state_dict(plan.model, seed, names))


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
