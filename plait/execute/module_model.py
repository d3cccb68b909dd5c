"""parallelize_module(plan) -> ModuleModel: this rank's share of a per-operator plan (plan.operators), with what the
training loop, validation, checkpoints and the run's measurements read of a model: ParallelModel's interface
(plait.execute.parallelize), so a module of any shape trains through the one loop (plait.train.loop).

The module is the user's (`package.module:factory`, its forward takes the batch factory's tensors and returns the
loss, plait.operators.batch). Built with the seed's weights on every rank, placed by
plait.execute.operators.apply_operator_sharding (tensor-parallel placements, then fully_shard over dp), or, under a
pipeline, cut into this rank's stage and run by the plan's schedule (plait.execute.operators_pipeline).

A step's loss is the mean of the module's loss over the step's calls: each data-parallel rank's share of the batch
split into the plan's micro-batches, one forward per micro-batch, as `plait check`'s one process computes it
(plait.execute.operators.check_plan): a loss over the batch's own samples (an in-batch softmax) sees a
micro-batch's samples, on one process as on many.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.experimental import implicit_replication

from plait.execute.operators import apply_operator_sharding, build_mesh, build_module
from plait.execute.parallelize import clip_grad_norm
from plait.operators import batch as batches
from plait.plan import Plan


class ModuleModel:
    """This rank's share of a per-operator plan; see the module docstring. Attributes as ParallelModel's: plan,
    mesh (named "dp", "tp", and "pp" under a pipeline), model_parts (the one module or stage), device,
    mixed_precision (torch.bfloat16: the step computes under CPU autocast; None: fp32)."""

    def __init__(self, plan: Plan, mesh, module: nn.Module, device: torch.device,
                 mixed_precision: torch.dtype | None, schedule: Any = None, position: int = 0,
                 dtype: torch.dtype = torch.float32) -> None:
        self.plan, self.mesh, self.device = plan, mesh, device
        self.mixed_precision = mixed_precision
        self.model_parts = [module]
        # what the forward runs through: DDP beside the module under ZeRO 0/1 of plain replicas, else the module
        self.runner = module.__dict__.get("data_parallel_runner", module)
        self.schedule, self.position = schedule, position
        module.first = position == 0  # what the run's clock reads of a stage (plait.train.measure)
        self.fused = module.fused_tables
        fused = self.fused.parameters(module)
        self.trained = [p for p in module.parameters() if p not in fused]
        self.replicated = [p for p in module.parameters() if getattr(p, "dp_replicated", False)]
        self.tied = TiedAcrossStages(module, getattr(module, "tied_parameters", ()), mesh, dtype) \
            if plan.pp > 1 else None
        self.optimizer: torch.optim.Optimizer | None = None

    # ---- ranks ------------------------------------------------------------------
    @property
    def dp_rank(self) -> int:
        return self.mesh["dp"].get_local_rank()

    @property
    def tp_rank(self) -> int:
        return self.mesh["tp"].get_local_rank()

    @property
    def pp_rank(self) -> int:
        return self.position

    @property
    def has_first_stage(self) -> bool:
        return self.position == 0

    @property
    def has_last_stage(self) -> bool:
        return self.position == self.plan.pp - 1

    def parameters(self) -> list[nn.Parameter]:
        return list(self.model_parts[0].parameters())

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Named as in the user's module (a recomputed block's checkpoint wrapper left out of the names)."""
        from plait.execute.state import clean_name

        return ((clean_name(name), p) for name, p in self.model_parts[0].named_parameters())

    # ---- training -----------------------------------------------------------------
    def make_optimizer(self, lr: float, weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.95),
                       eps: float = 1e-8) -> torch.optim.Optimizer:
        """AdamW over the parameters the fused tables do not train (those update their rows in their lookup's
        backward, at the optimizer's learning rate: train_step passes it on); ZeRO-1 over DDP shards its states
        (plait.execute.data.adamw)."""
        from plait.execute.data import adamw

        self.optimizer = adamw(self.trained, zero=self.plan.zero, dp_mesh=self.mesh["dp"],
                               on_ddp=self.runner is not self.model_parts[0], lr=lr, weight_decay=weight_decay,
                               betas=betas, eps=eps, foreach=False)
        return self.optimizer

    def _compute(self) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.enter_context(implicit_replication())  # the backward of a constant made in forward meets DTensors
        if self.mixed_precision is not None:
            stack.enter_context(torch.autocast(self.device.type, dtype=self.mixed_precision))
        return stack

    def train_step(self, batch: Any) -> float:
        """Forward and backward of this data-parallel rank's share of the step's batch; the step's loss (the mean
        over its calls, the same on every rank). Gradients are left complete in the parameters."""
        if self.optimizer is not None:
            self.fused.lr = self.optimizer.param_groups[0]["lr"]
        batch = batches.to_device(batch, self.device)
        self.fused.defer()  # the step's row updates at once, after every micro-batch's backward (embedding_tables.py)
        with self._compute():
            local = self._pipeline(batch) if self.schedule is not None else self._accumulate(batch)
        # a schedule divides the other gradients by the micro-batches after its backward (scale_grads): these too
        self.fused.flush(1 / self.plan.num_micro_batches if self.schedule is not None else 1.0)
        self._sync_replicated()
        if self.tied is not None:
            self.tied.sync()
        return self._global_mean(local)

    def _accumulate(self, batch: Any, backward: bool = True) -> torch.Tensor:
        """The step's micro-batches one after the other, their gradients accumulated: the data-parallel reduction
        after the last one only, and fully_shard's gathered weights kept until then where not resharded after
        forward (plait.execute.data.gradient_sync, the decoder path's step assembly)."""
        from plait.execute.data import gradient_sync

        count = self.plan.num_micro_batches
        keep = not self.plan.dp_mode.reshard_after_forward
        total = torch.zeros((), dtype=torch.float64)
        for index in range(count):
            last = index == count - 1
            with gradient_sync([self.runner], enabled=last, keep_gathered=keep, last=last) if backward \
                    else contextlib.nullcontext():
                loss = _scalar(batches.call(self.runner, batches.split(batch, count, index))) / count
                if backward:
                    loss.backward()
            total += _local(loss.detach()).double()
        return total

    def _pipeline(self, batch: Any, forward_only: bool = False) -> torch.Tensor:
        from plait.execute.operators_pipeline import pipeline_losses

        return pipeline_losses(self.schedule, self.plan, self.position, batch, self.mesh, forward_only=forward_only)

    def _sync_replicated(self) -> None:
        """Parameters kept out of fully_shard (0-d ones, which it cannot shard) average their gradients over dp, as
        fully_shard's reduce-scatter averages the others'."""
        if self.plan.dp == 1:
            return
        for param in self.replicated:
            if param.grad is not None:
                grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
                dist.all_reduce(grad, group=self.mesh["dp"].get_group())
                grad.div_(self.plan.dp)

    def _global_mean(self, local: torch.Tensor) -> float:
        value = local.detach().double().reshape(1).clone()
        if self.plan.dp > 1:
            dist.all_reduce(value, group=self.mesh["dp"].get_group())
        return value.item() / self.plan.dp

    @torch.no_grad()
    def eval_loss(self, batch: Any) -> float:
        """The loss `train_step` would return for this share of a batch, forward only (collective)."""
        batch = batches.to_device(batch, self.device)
        with self._compute():
            local = self._pipeline(batch, True) if self.schedule is not None else self._accumulate(batch, False)
        return self._global_mean(local)

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Over every stage's gradients; a parameter several stages hold counts once (its first holder's)."""
        pp_group = self.mesh["pp"].get_group() if self.plan.pp > 1 else None
        counted = [p for p in self.trained if self.tied is None or id(p) not in self.tied.copies]
        return clip_grad_norm(self.trained, max_norm, pp_group, counted=counted, device=self.device).item()

    def runtime_summary(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, object]:
        from torch.distributed.fsdp import FSDPModule

        module = self.model_parts[0]
        carrier = "fully_shard" if isinstance(module, FSDPModule) else "ddp" if self.runner is not module else "none"
        return {"data_parallel": [carrier], "zero": self.plan.zero, "recompute": self.plan.recompute[0],
                "micro_batches": self.plan.num_micro_batches,
                "dtensor_params": sum(isinstance(p, DTensor) for p in self.parameters()),
                "params": len(self.parameters()), "replicated_over_dp": len(self.replicated),
                "schedule": type(self.schedule).__name__ if self.schedule else None,
                "fused_tables": list(self.fused.modules),
                "optimizer": type(optimizer).__name__ if optimizer is not None else None}

    # ---- weights ----------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full parameters and persistent buffers keyed like the single-process module, on every rank
        (collective)."""
        module = self.model_parts[0]
        local = {name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()
                 for name, t in module.state_dict().items()}
        local.update(module.fused_tables.gather_table_wise(module))  # tables held whole by one rank
        if self.plan.pp == 1:
            return local
        gathered: list = [None] * self.plan.pp
        dist.all_gather_object(gathered, local, group=self.mesh["pp"].get_group())
        return {name: t for piece in gathered for name, t in piece.items()}


class TiedAcrossStages:
    """One parameter held by parts on several pipeline stages (an output layer tied to the embedding): each stage
    trains its copy from the same initial value; after every backward their gradients are summed across the
    pipeline ranks (each copy's full gradient, all-reduced over the "pp" group, every stage taking part in the same
    order, a stage without a copy adding zeros; each rank keeps its own shard of the sum), so every copy takes the
    same optimizer step and they stay one parameter. The copies may be placed differently on their stages: the sum
    is of full gradients. Gradient clipping counts the parameter once (`copies`: the later holders')."""

    def __init__(self, stage: nn.Module, tied: tuple, mesh, dtype: torch.dtype) -> None:
        held = dict(stage.named_parameters(remove_duplicate=False))
        self.groups = [(group, next((held[n] for n in group.names if n in held), None)) for group in tied]
        self.group = mesh["pp"].get_group()
        self.dtype = dtype
        # the stage holding a group's first name counts it in the gradient norm; the others hold copies
        self.copies = {id(param) for group, param in self.groups
                       if param is not None and group.names[0] not in held}

    def sync(self) -> None:
        for group, param in self.groups:
            grad = None if param is None else param.grad
            if grad is None:
                full = torch.zeros(group.shape, dtype=param.dtype if param is not None else self.dtype)
            else:
                full = grad.full_tensor() if isinstance(grad, DTensor) else grad.detach().clone()
            dist.all_reduce(full, group=self.group)
            if grad is None:
                continue
            if isinstance(grad, DTensor):
                mesh = grad.device_mesh
                mine = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
                grad.to_local().copy_(mine.redistribute(mesh, grad.placements).to_local())
            else:
                grad.copy_(full)


def _scalar(loss: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = list(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"the module's forward returned {shape}, not a scalar loss")
    return loss.reshape(())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def parallelize_module(plan: Plan, *, seed: int = 0, device: str | torch.device | None = None,
                       dtype: torch.dtype = torch.float32, lr: float = 0.0) -> ModuleModel:
    """This rank's ModuleModel of `plan` (a per-operator plan), from the seed's initial weights; needs
    torch.distributed initialized with the plan's world size."""
    from plait.execute.parallelize import _mixed_precision

    device = torch.device(device or "cpu")
    mixed = _mixed_precision(plan, device)
    mesh = build_mesh(plan)
    if plan.pp > 1:
        from plait.execute.operators_pipeline import build_pipeline_stage

        position, module, schedule = build_pipeline_stage(plan, mesh, seed=seed, dtype=dtype, lr=lr)
        return ModuleModel(plan, mesh, module, device, mixed, schedule, position, dtype)
    # forward and backward under one implicit_replication (ModuleModel._compute): it does not nest
    module = apply_operator_sharding(build_module(plan.model.source, seed=seed, dtype=dtype), plan, mesh, lr,
                                     caller_replicates=True)
    return ModuleModel(plan, mesh, module, device, mixed)


def flops_per_step(plan: Plan) -> float:
    """Model FLOPs of a step of `plan`'s module: its forward's (torch's FLOP counter, on meta at the plan's micro-
    batch) times 3 (forward and backward), over every micro-batch of the global batch. What MFU counts."""
    from torch.utils.flop_counter import FlopCounterMode

    from plait.execute.operators import build_module, make_batch
    from plait.operators.capture import forward_on_meta

    module = build_module(plan.model.source, seed=0, dtype=torch.float32, device="meta")
    batch = batches.to_device(make_batch(plan.operators.batch, plan.micro_batch, 0, 0, torch.float32), "meta")
    counter = FlopCounterMode(display=False)
    with forward_on_meta(), counter:
        batches.call(module, batch)
    return 3.0 * counter.get_total_flops() * plan.train.global_batch / plan.micro_batch
