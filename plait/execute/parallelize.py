"""parallelize(plan) -> ParallelModel: the one place where the techniques are composed.

The order (torchtitan's), and why:

1. **legality**: plait.legality.check, the rules the planner prunes with, asserted here too.
2. **mesh**: one named DeviceMesh over the plan's axes (mesh.py).
3. **model**: the plan's model adapter builds the whole model on `meta` (plait.models), and **apply_lora**
   gives it the plan's LoRA adapters on a frozen base (ModelAdapter.build_adapted, plait.models.lora: before
   the split, so every step below takes the adapters as parameters of their blocks); the **pipeline split**
   cuts this rank's virtual stages out of it (uneven, as the plan says), each a Stage that keeps the
   single-process names (pipeline.py). Done first so everything below runs per stage, on a module whose
   parameters are this stage's.
4. **apply_cp** per stage (context.py: the sequence split and key/value exchange), then **apply_tp**: the
   adapter's tensor plan as ParallelStyles; SP, vocab-parallel embedding, loss-parallel output (tensor.py); LoRA
   adapters placed with their projections (lora.py); then **apply_experts** over ep (expert.py). Before AC so
   that the recomputed region contains the TP collectives, and before FSDP because fully_shard shards the
   TP-sharded DTensors further (2-D).
5. **apply_ac** per stage with the plan's mode for this pipeline rank (recompute.py): wraps whole
   blocks, after TP (which addresses modules inside the block by name) and before FSDP (so each FSDP
   unit is a checkpointed block).
6. **apply_fully_shard** where the plan's data parallelism rides on it (data.py; the rule is
   plait.legality.data_parallel_mode), on meta; then **materialize**: `to_empty` on the device, the
   adapter's non-persistent buffers again, and the initial weights for the seed -- the same tensors the
   single-process model starts from (state.py).
7. **apply_ddp** where it rides on DDP: DDP needs real tensors, so it wraps after materialization.
8. **PipelineStage**(group = mesh["pp"]) per stage and the plan's schedule (pipeline.py); tied embeddings
   across the first and last stage sum their gradients every step (tied.py).
"""

from __future__ import annotations

import dataclasses
import functools
from contextlib import ExitStack, contextmanager
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from plait import legality
from plait.errors import ConfigError
from plait.execute.data import apply_ddp_if, apply_fully_shard, build_optimizer, gradient_sync
from plait.execute.context import ContextParallelAttention, apply_cp, cp_positions
from plait.execute.expert import apply_experts
from plait.execute.lora import adapter_names
from plait.execute.mesh import Meshes, build_mesh, data_mesh, device_type_of, pipeline_position, rank_order
from plait.runtime.throttle import apply_throttle, planned_throttle
from plait.execute.pipeline import build_schedule, split_model
from plait.execute.recompute import apply_ac
from plait.execute.step_loss import StepLoss
from plait.execute.state import gather_full_state_dict, load_full_state_dict, plain_named_parameters
from plait.execute.tensor import apply_tp
from plait.execute.tied import ReplicatedGradients, TiedGradients
from plait.runtime.launch import in_torchrun, init_distributed
from plait.models import ModelAdapter, adapter_for, initial_state_dict
from plait.models.moe import set_aux_scale
from plait.plan import Plan
from plait.spec.train import untrainable_precision


def global_squared_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Squared L2 norm of all `grads` over their shards, with a few collectives per layout.

    Plain tensors are whole on this rank (DDP replicas). DTensor gradients are grouped by
    (mesh, placements); per group, pending Partial sums (e.g. norm weights under sequence
    parallelism) are reduced on the concatenated group, then the squared norms are summed over
    the mesh dims where the group is sharded (replicated dims count once). One reduction per
    parameter instead costs ~17x more here (95 ms against 5.5 ms for 69 tensors on 2 ranks)."""
    squared = torch.zeros((), device=device, dtype=torch.float64)
    groups: dict[tuple, list[torch.Tensor]] = {}
    for grad in grads:
        if isinstance(grad, DTensor):
            groups.setdefault((grad.device_mesh, grad.placements), []).append(grad.to_local())
        else:
            squared += torch.linalg.vector_norm(grad).double() ** 2
    for (mesh, placements), locals_ in groups.items():
        partial_dims = [d for d, p in enumerate(placements) if p.is_partial()]
        if partial_dims:
            flat = torch.cat([t.reshape(-1).double() for t in locals_])
            for dim in partial_dims:
                dist.all_reduce(flat, group=mesh.get_group(dim))
                if placements[dim].reduce_op == "avg":
                    flat /= mesh.size(dim)
            local = flat.square().sum()
        else:
            local = torch.stack([torch.linalg.vector_norm(t).double() for t in locals_]).square().sum()
        for dim, placement in enumerate(placements):
            # sharded = neither replicated nor partial: Shard, and FSDP's _StridedShard over a
            # TP-sharded weight, which is not a Shard subclass (is_shard() is False) in torch 2.13
            if not (placement.is_replicate() or placement.is_partial()):
                dist.all_reduce(local, group=mesh.get_group(dim))
        squared += local
    return squared


def clip_grad_norm(params, max_norm: float, pp_group=None, *, counted=None,
                   device: torch.device | None = None) -> torch.Tensor:
    """Scale the gradients of `params` so their global L2 norm is at most `max_norm`, as one process clips the whole
    model (torch.nn.utils.clip_grad_norm_'s formula); returns the norm before, on every rank. The norm is each rank's
    `global_squared_norm` (over its shards) summed over `pp_group`, whose ranks hold disjoint parameters (one
    all-reduce; None without a pipeline). `counted`: the parameters whose gradients count (default: all of
    `params`; a tied copy is scaled but left out). `device`: where the norm lives (default: the gradients')."""
    params = list(params)
    grads = [p.grad for p in params if p.grad is not None]
    counted = grads if counted is None else [p.grad for p in counted if p.grad is not None]
    if device is None:
        device = grads[0].device if grads else torch.device("cpu")
    squared = global_squared_norm(counted, device)
    if pp_group is not None:
        dist.all_reduce(squared, group=pp_group)
    total = squared.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch.nn.utils.clip_grad_norm_'s formula
    for grad in grads:
        grad.mul_(coef.to(grad.dtype))
    return total


def _no_outputs_kwargs() -> dict[str, bool]:
    """Ask the pipeline schedule not to keep every micro-batch's logits to concatenate them after the step (plait
    reads the losses only): m logits tensors held on the last stage, b·s·V each (torch >= 2.7 has the flag)."""
    import inspect

    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    return {"return_outputs": False} if "return_outputs" in inspect.signature(PipelineScheduleSingle.step).parameters else {}


_NO_OUTPUTS = _no_outputs_kwargs()


def _scalar(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


class ParallelModel:
    """This rank's share of a model parallelized by a Plan; see parallelize().

    Attributes: plan; adapter (the model family's, plait.models); mesh (named plait.axes.AXES);
    model_parts (this rank's Stage modules, in chunk order); stage_ids (their virtual stage indices);
    device."""

    def __init__(self, plan: Plan, adapter: ModelAdapter, mesh: Meshes, model_parts: list[nn.Module],
                 stage_ids: list[int], device: torch.device, mixed_precision: torch.dtype | None,
                 pipeline_buffers: str = "pool") -> None:
        self.plan = plan
        self.adapter = adapter
        self.mesh = mesh
        self.model_parts = model_parts
        self.stage_ids = stage_ids
        self.device = device
        self.mixed_precision = mixed_precision
        # fully_shard casts through its MixedPrecisionPolicy; every other layout (one replica, DDP) autocasts
        fsdp_casts = device.type != "cpu" and any(isinstance(p, FSDPModule) for p in model_parts)
        self.autocast = None if fsdp_casts else mixed_precision
        self.tied = TiedGradients(model_parts, adapter.tied, mesh, plan)
        self.replicated = [ReplicatedGradients(model_parts, "dp_replicated", data_mesh(mesh), data_mesh(mesh).size()),
                           ReplicatedGradients(model_parts, "experts_replicated", mesh["edp_cp"], data_mesh(mesh).size())]
        self.cp_positions = cp_positions(plan.train.seq_len, plan.cp, mesh["cp"].get_local_rank())
        self.step_loss = StepLoss(adapter.loss_sum)  # the step's token mean, whatever the layout (step_loss.py)
        self._stages = [getattr(part, "module", part) for part in model_parts]  # the Stage modules (DDP wraps)
        self._plain_positions = [stage.ctx.positions for stage in self._stages]
        self._chunk_positions: tuple[torch.Tensor, ...] | None = None
        self._context_cores = [m for stage in self._stages for m in stage.modules()
                               if isinstance(m, ContextParallelAttention)]
        self.schedule = None
        if plan.pp > 1:
            self.schedule = build_schedule(plan, stage_ids, model_parts, mesh["pp"], device, self.step_loss,
                                           buffers=pipeline_buffers, scale_grads=False)
            for part in model_parts:  # the balance loss weighs like the loss: each micro-batch's share of the step
                set_aux_scale(part, 1.0 / plan.num_micro_batches)
            for index, stage in enumerate(_pipeline_stages(self.schedule)):
                stage.before_chunk = functools.partial(self._enter_chunk, index)

    # ---- ranks ------------------------------------------------------------------
    @property
    def dp_rank(self) -> int:
        return self.mesh["dp"].get_local_rank()

    @property
    def tp_rank(self) -> int:
        return self.mesh["tp"].get_local_rank()

    @property
    def pp_rank(self) -> int:
        return pipeline_position(self.mesh)

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last_stage(self) -> bool:
        return self.plan.num_stages - 1 in self.stage_ids

    def parameters(self) -> list[nn.Parameter]:
        return [p for part in self.model_parts for p in part.parameters()]

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(single-process name, parameter) of this rank's stages."""
        for part in self.model_parts:
            yield from plain_named_parameters(part)

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
        if self.autocast is not None:
            stack.enter_context(torch.autocast(self.device.type, dtype=self.autocast))
        return stack

    def train_step(self, tokens: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None = None) -> float:
        """Forward and backward over this dp rank's rows ([micro_batch · num_micro_batches, seq]);
        returns the step's loss, the mean cross-entropy over the trained tokens of the global batch (step_loss.py),
        the same on every rank. Gradients are left in the parameters, complete (tied copies summed), those of that
        mean; the optimizer is not stepped. `positions` [rows, seq]: each token's position in its document, for
        packed documents kept apart (plait.train.documents; the adapter must take_positions)."""
        expected = (self.plan.micro_batch * self.plan.num_micro_batches, self.plan.train.seq_len)
        if tuple(tokens.shape) != expected or tuple(targets.shape) != expected or \
                (positions is not None and tuple(positions.shape) != expected):
            raise ValueError(f"tokens/targets/positions must be {list(expected)} (this dp rank's rows), got "
                             f"{list(tokens.shape)}, {list(targets.shape)}"
                             f"{'' if positions is None else ' and ' + str(list(positions.shape))}")
        tokens, targets, positions = self._local(tokens, targets, positions)
        self._start_step(targets)
        with self._compute_context(), self._documents(positions):
            local = self._pipeline_step(tokens, targets) if self.schedule else self._accumulate(tokens, targets)
        for replicated in self.replicated:
            replicated.sync()
        self.tied.sync()
        return self._global_mean(local)

    def _local(self, tokens: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None):
        """This context rank's tokens of every sequence (plait/execute/context.py), on the device."""
        if positions is not None and not self.adapter.takes_positions:
            raise ValueError(f"{self.plan.model.name} takes no document positions (its attention spans documents)")
        if self.plan.cp > 1:
            tokens, targets = tokens[:, self.cp_positions], targets[:, self.cp_positions]
            positions = None if positions is None else positions[:, self.cp_positions]
        positions = None if positions is None else positions.to(self.device)
        return tokens.to(self.device), targets.to(self.device), positions

    @contextmanager
    def _documents(self, positions: torch.Tensor | None) -> Iterator[None]:
        """Each micro-batch's documents' positions for its forward (`_enter_chunk`), the plain ones again after."""
        self._chunk_positions = None if positions is None else positions.chunk(self.plan.num_micro_batches)
        for core in self._context_cores:  # context parallelism keeps them apart itself
            core.documents = positions is not None
        try:
            yield
        finally:
            self._chunk_positions = None
            if positions is not None:
                for stage, plain in zip(self._stages, self._plain_positions):
                    stage.ctx.positions = plain

    def _enter_chunk(self, part: int, chunk: int) -> None:
        """Stage `part` is about to run micro-batch `chunk`: its positions (the recomputed forwards of activation
        checkpointing reuse what the block was called with, so a later micro-batch changing them is harmless)."""
        if self._chunk_positions is not None:
            self._stages[part].ctx.positions = self._chunk_positions[chunk]

    def _start_step(self, targets: torch.Tensor) -> None:
        """The step's trained tokens, counted over the data and context ranks (one all-reduce of a count)."""
        shared = data_mesh(self.mesh)
        self.step_loss.start(targets, shared.get_group() if shared.size() > 1 else None, shared.size())

    def _accumulate(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Gradient accumulation over micro-batches; the dp reduction runs only on the last one."""
        count = self.plan.num_micro_batches
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        model = self.model_parts[0]
        keep = not self.plan.dp_mode.reshard_after_forward
        set_aux_scale(model, 1.0 / count)  # the balance loss weighs like the loss, divided by the micro-batches
        every = self.plan.grad_sync == "micro_batch"  # reduce-scatter every micro-batch: sharded gradients
        for index, (tok, tgt) in enumerate(zip(tokens.chunk(count), targets.chunk(count))):
            last = index == count - 1
            self._enter_chunk(0, index)
            with gradient_sync(self.model_parts, enabled=every or last, keep_gathered=keep, last=last):
                loss = self.step_loss(model(tok), tgt)
                loss.backward()
            total += _scalar(loss.detach()).double()
        return total

    def _pipeline_step(self, tokens: torch.Tensor, targets: torch.Tensor, forward_only: bool = False) -> torch.Tensor:
        args = (tokens,) if self.has_first_stage else ()
        run = self.schedule.eval if forward_only else self.schedule.step
        if not self.has_last_stage:
            run(*args)
            return torch.zeros((), device=self.device, dtype=torch.float64)
        losses: list[torch.Tensor] = []
        run(*args, target=targets, losses=losses, **_NO_OUTPUTS)
        return torch.stack([_scalar(loss.detach()).double() for loss in losses]).sum()  # each its share already

    @torch.no_grad()
    def eval_loss(self, tokens: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None = None) -> float:
        """The loss `train_step` would return for these rows, forward only (no gradients, nothing synced); the same
        on every rank (collective). A pipeline runs its schedule's forward-only path (schedule.eval)."""
        tokens, targets, positions = self._local(tokens, targets, positions)
        self._start_step(targets)
        with self._compute_context(), self._documents(positions):
            if self.schedule is not None:
                local = self._pipeline_step(tokens, targets, forward_only=True)
            else:
                count = self.plan.num_micro_batches
                local = torch.zeros((), device=self.device, dtype=torch.float64)
                for index, (tok, tgt) in enumerate(zip(tokens.chunk(count), targets.chunk(count))):
                    self._enter_chunk(0, index)
                    local += _scalar(self.step_loss(self.model_parts[0](tok), tgt)).double()
        return self._global_mean(local)

    def _global_mean(self, local: torch.Tensor) -> float:
        """The step's loss from this rank's shares (step_loss.py): only the last pipeline rank holds them; tensor
        ranks hold equal copies; data and context ranks each their pieces'."""
        value = local.detach().double().reshape(1).clone()
        if self.plan.pp > 1:
            dist.all_reduce(value, group=self.mesh["pp"].get_group())
        shared = data_mesh(self.mesh)
        if shared.size() > 1:
            dist.all_reduce(value, group=shared.get_group())
        return self.step_loss.value(value.item())

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale gradients so their global L2 norm is at most max_norm; returns the norm before (clip_grad_norm;
        a tied output layer's copy of the embedding is scaled but not counted twice)."""
        counted = [p for p in self.parameters() if self.tied.counts_in_norm(p)]
        pp_group = self.mesh["pp"].get_group() if self.plan.pp > 1 else None
        return clip_grad_norm(self.parameters(), max_norm, pp_group, counted=counted, device=self.device).item()

    def runtime_summary(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, object]:
        """Which PyTorch building blocks this rank actually runs (for tests and reports)."""
        from plait.torch_internals import CheckpointWrapper

        def data_parallel(part: nn.Module) -> str:
            if isinstance(part, FSDPModule):
                return "fully_shard"
            return type(part).__name__ if isinstance(part, nn.parallel.DistributedDataParallel) else "none"

        stages = [getattr(part, "module", part) for part in self.model_parts]
        return {
            "data_parallel": sorted({data_parallel(part) for part in self.model_parts}),
            "checkpointed_blocks": sum(isinstance(b, CheckpointWrapper) for s in stages for b in s.stage_blocks().values()),
            "selective_blocks": sum(getattr(s, "selective_units", 0) for s in stages),
            "dtensor_params": sum(isinstance(p, DTensor) for p in self.parameters()),
            "params": len(self.parameters()),
            "schedule": type(self.schedule).__name__ if self.schedule else None,
            "stages": list(self.stage_ids),
            "optimizer": type(optimizer).__name__ if optimizer is not None else None,
            "tied_synced": len(self.tied.params) if self.tied.group is not None else 0,
        }

    # ---- weights ----------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full unsharded parameters keyed like the single-process model, on every rank (collective)."""
        return gather_full_state_dict(self.model_parts, self.mesh["pp"], self.adapter.tied)

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load full tensors (every rank passes the same) into this rank's shards (collective)."""
        load_full_state_dict(self.model_parts, state, self.adapter.tied)

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Full gradients keyed like the single-process model, on every rank (collective; for checks)."""
        local = {}
        for name, param in self.named_parameters():
            if not self.tied.counts_in_norm(param) or param.grad is None:
                continue
            grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
            local[name] = grad.detach().cpu().clone()
        if self.plan.pp > 1:
            gathered: list = [None] * self.plan.pp
            dist.all_gather_object(gathered, local, group=self.mesh["pp"].get_group())
            local = {name: g for piece in gathered for name, g in piece.items()}
        return local

    @torch.no_grad()
    def eval_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [b, s, V] of the whole model for `tokens`, on every rank (collective).

        Gathers the full weights into a single-process model: meant for sampling text from
        small models, not for speed."""
        model = single_process_model(self.plan, self.full_state_dict())
        return self.adapter.forward(model, tokens.cpu())


def _pipeline_stages(schedule) -> list:
    """The PipelineStages of a schedule, in the order of its model parts (one for the single-stage schedules)."""
    stages = getattr(schedule, "_stages", None)
    return list(stages) if stages is not None else [schedule._stage]


def single_process_model(plan: Plan, state: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> nn.Module:
    """The whole model of `plan` on CPU holding `state` (full tensors, aliases left out)."""
    adapter = adapter_for(plan.model)
    model = adapter.build_adapted("cpu")
    if dtype is not None:
        model.to(dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - set(adapter.tied):
        raise KeyError(f"state dict does not fit {plan.model.name}: missing {sorted(missing)[:3]}, "
                       f"unexpected {sorted(unexpected)[:3]}")
    adapter.reset_buffers(model)
    return model


def _mixed_precision(plan: Plan, device: torch.device) -> torch.dtype | None:
    """The 16-bit compute dtype the plan asks for (None: fp32). bf16 runs on CPU too, under CPU autocast: a plan
    that says bf16 computes in bf16. fp16 needs a loss scaler, which plait does not have: refused in one line."""
    refusal = untrainable_precision(plan.train.precision)
    if refusal:
        raise ConfigError(refusal)
    return None if plan.train.precision == "fp32" else torch.bfloat16


@contextmanager
def default_dtype(dtype: torch.dtype | None) -> Iterator[None]:
    if dtype is None:
        yield
        return
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def parallelize(plan: Plan, *, seed: int = 0, device: str | torch.device | None = None,
                timeout_s: float = 120.0, precision: str | None = None, dtype: torch.dtype | None = None,
                initial_state: dict[str, torch.Tensor] | None = None, weights: str | None = None,
                pipeline_buffers: str = "pool") -> ParallelModel:
    """Build this rank's share of `plan.model`, parallelized as `plan` says, starting from the
    single-process initial weights for `seed` (or `initial_state`, full tensors, or the Hugging Face checkpoint
    in the directory `weights`, each rank reading only its own shards: plait/hf/checkpoint.py).

    Needs torch.distributed initialized (plait.runtime.launch.init_distributed; done here with `timeout_s`
    when running under torchrun and not yet done) with world size == plan.num_devices. Refuses with
    ConfigError (plait.legality), before any work, a plan that cannot run. `device` defaults to this
    rank's accelerator, or CPU; `precision` overrides the plan's ("fp32" forces full precision, as
    check does); `dtype` builds the parameters in that dtype (check runs float64); `pipeline_buffers`: "pool" holds
    the pipeline's receive buffers in flight only, "torch" leaves them to torch (plait.execute.pipeline.PIPELINE_BUFFERS,
    for the benchmarks' before-and-after)."""
    if not dist.is_initialized():
        if not in_torchrun():
            raise ConfigError("torch.distributed is not initialized; run under torchrun or plait.runtime.launch.run_local, "
                              "or call plait.runtime.launch.init_distributed() first")
        init_distributed(timeout_s=timeout_s)
    legality.check(plan, dist.get_world_size())
    device = torch.device(device) if device is not None else _default_device()
    if precision is not None:
        plan = plan.replace(train=dataclasses.replace(plan.train, precision=precision))
    mixed = _mixed_precision(plan, device)
    # On CPU (gloo) parameters and collectives stay fp32 and autocast computes in bf16; on accelerators
    # fully_shard casts through its MixedPrecisionPolicy.
    sharded_mixed = None if device.type == "cpu" else mixed
    adapter = adapter_for(plan.model)
    mesh = build_mesh(plan.degrees, device_type_of(device), rank_order(plan))
    pp_rank = pipeline_position(mesh)
    with default_dtype(dtype):
        stage_ids, parts = split_model(adapter, adapter.build_adapted("meta"), plan, pp_rank)
    parts = [shard_stage(part, plan, mesh, pp_rank, sharded_mixed) for part in parts]
    for part in parts:
        _materialize(part, adapter, plan, seed, device, initial_state, weights)
    apply_throttle([b for part in parts for b in part.stage_blocks().values()], planned_throttle(dist.get_rank(), plan, pp_rank))
    parts = [apply_ddp_if(part, mesh["dp"], plan.dp_mode) for part in parts]
    return ParallelModel(plan, adapter, mesh, parts, stage_ids, device, mixed, pipeline_buffers)


def shard_stage(part: nn.Module, plan: Plan, mesh: Meshes, pp_rank: int, mixed: torch.dtype | None,
                before_data_parallel=None) -> nn.Module:
    """Steps 4-6 of the order above up to fully_shard (materializing is the caller's), on one meta Stage; `plait
    check --dry-run` builds with this very function, tracing the stage in `before_data_parallel(part)` (after tensor
    parallelism and recompute, before fully_shard)."""
    frozen = {name for name, param in part.named_parameters() if not param.requires_grad}
    if plan.cp > 1:
        apply_cp(part, mesh["cp"], plan.train.seq_len, plan.context_parallel)
    if plan.tp > 1:
        apply_tp(part, mesh["tp"], sequence_parallel=plan.sequence_parallel)
    if plan.model.num_experts:
        apply_experts(part, mesh, sequence_parallel=plan.sequence_parallel)
    # what was frozen stays frozen (a LoRA base): torch's SequenceParallel re-registers the norms' weights trainable
    for name, param in part.named_parameters():
        param.requires_grad_(name not in frozen)
    apply_ac(part, plan.recompute[pp_rank])
    if before_data_parallel is not None:
        before_data_parallel(part)
    policy = MixedPrecisionPolicy(param_dtype=mixed, reduce_dtype=torch.float32) if mixed else None
    return apply_fully_shard(part, data_mesh(mesh), plan.dp_mode, policy, expert_mesh=mesh["edp_cp"])


def _materialize(part: nn.Module, adapter: ModelAdapter, plan: Plan, seed: int, device: torch.device,
                 initial_state: dict[str, torch.Tensor] | None, weights: str | None = None) -> None:
    part.to_empty(device=device)
    part.retie()
    adapter.reset_buffers(part)
    names = [name for name, _ in plain_named_parameters(part, remove_duplicate=False)]
    if not names:
        return
    if weights is not None:
        from plait.hf.checkpoint import load_hf_weights

        load_hf_weights([part], adapter.tied, weights)  # the base; LoRA adapters start from the seed
        names = adapter_names(names)
        if not names:
            return
        initial_state = None
    if initial_state is None:
        canonical = sorted({adapter.canonical(n) for n in names})
        initial_state = initial_state_dict(plan.model, seed, canonical)
    dtype = next(part.parameters()).dtype
    load_full_state_dict([part], {k: v.to(dtype) for k, v in initial_state.items()}, adapter.tied,
                         only=set(names) if weights is not None else None)


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
