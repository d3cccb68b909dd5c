"""Apply a per-operator plan (plan.operators) with DTensor, and prove it equal to one process.

apply_operator_sharding: each parameter becomes a DTensor on the tensor-parallel axis with the placement the plan
chose; the module's batch arguments enter replicated on that axis; during the forward, each torch-level call
(F.linear, torch.cat, ...) gets its tensor arguments redistributed to the placements the plan's strategies read them
in (PlannedReads, from plan.operators.function_reads), so DTensor's eager dispatch, which picks each operator's
strategy from its inputs' placements, runs the strategies that were priced, and the backward carries each
redistribution's gradient image (the communication step_collectives measures is the plan's); a replicated value's
Partial gradient, summed over its readers, is all-reduced once at the value, where the plan prices it
(_summed_gradient); the loss leaves replicated. Then fully_shard over the data-parallel axis shards the (already
tensor-parallel) parameters further, as for a hand-written tensor plan (2-D DTensors). A plan written before
function_reads redistributes at module boundaries only (its inputs, outputs and param_reads).

The model is a user's `package.module:factory` returning an nn.Module whose forward takes the batch factory's
tensors and returns the loss; batches come from the factory named in the plan (`package.module:function`,
called as function(batch_size, generator)).
"""

from __future__ import annotations

import functools
import math
from contextlib import contextmanager, nullcontext
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.overrides import TorchFunctionMode
from plait.torch_internals import tree_flatten, tree_map_only, tree_unflatten
from torch.distributed.tensor.experimental import implicit_replication

from plait.errors import ConfigError
from plait.models.factory import load_factory
from plait.execute.dryrun import CollectiveCounter
from plait.execute.equivalence import DTYPES, CheckResult, CheckSettings
from plait.execute.parallelize import clip_grad_norm
from plait.execute.batchnorm import synchronise_batch_norms
from plait.execute.tables import FusedTables
from plait.operators.capture import FunctionKeys
from plait.operators.strategies import placement_of, register_plait_rules, register_replicated
from plait.operators.solution import OperatorSharding
from plait.plan import Plan


def load_callable(source: str, what: str) -> Callable:
    """`package.module:function` -> the function (plait.models.factory.load_factory's rules and errors)."""
    return load_factory(source)


def build_module(source: str, *, seed: int, dtype: torch.dtype, device: str = "cpu") -> nn.Module:
    """The user's module with the seed's initial weights (every rank and the reference build the same)."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = load_callable(source, "model")()
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model {source!r}: the factory returned {type(model).__name__}, not an nn.Module")
    return model.to(dtype) if device != "meta" else model


def make_batch(source: str, batch_size: int, seed: int, step: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """The global batch of `step`: the factory's tensors, floats cast to the run's dtype."""
    generator = torch.Generator().manual_seed(seed * 100_003 + step)
    batch = load_callable(source, "batch")(batch_size, generator)
    batch = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in batch)


def dp_slice(batch: tuple[torch.Tensor, ...], dp: int, dp_rank: int) -> tuple[torch.Tensor, ...]:
    return tuple(t.chunk(dp, dim=0)[dp_rank] for t in batch)


def build_mesh(plan: Plan) -> DeviceMesh:
    """("dp", "tp"), or ("pp", "dp", "tp") under a pipeline (pipeline stages outermost, as plait.execute.mesh)."""
    if plan.pp > 1:
        return init_device_mesh("cpu", (plan.pp, plan.dp, plan.tp), mesh_dim_names=("pp", "dp", "tp"))
    return init_device_mesh("cpu", (plan.dp, plan.tp), mesh_dim_names=("dp", "tp"))


def apply_operator_sharding(model: nn.Module, plan: Plan, mesh: DeviceMesh, lr: float = 0.0,
                            sharding: OperatorSharding | None = None, caller_replicates: bool = False) -> nn.Module:
    """Parameters to their planned placements, module outputs redistributed as planned, the batch in and the loss
    out replicated; then fully_shard over dp when dp > 1. Fused tables (plan.operators.fused_tables) update their
    rows in the lookup's backward at `lr` (model.fused_tables.lr, which a training loop sets each step) and stay
    out of fully_shard. `sharding`: a pipeline stage's own (plan.operators.stages[k]) for that stage's module.
    `caller_replicates`: the caller runs forward and backward inside one implicit_replication (a pipeline schedule
    interleaves them; the context does not nest: leaving an inner one turns it off for the outer)."""
    sharding = sharding or plan.operators
    tp_mesh = mesh["tp"]
    register_plait_rules()  # the rules the planner priced with (CPU attention)
    fused = use_fused_tables(model, sharding.fused_tables, lr, mesh["dp"].get_group() if plan.dp > 1 else None)
    for call_name in sharding.replicated_ops:  # no DTensor rule: replicated, as the planner priced them
        register_replicated(call_name)
    by_function = bool(sharding.function_reads)
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for leaf, param in list(module.named_parameters(recurse=False)):
            shard = distribute_tensor(param.detach(), tp_mesh, [placement_of(sharding.params.get(prefix + leaf, "R"))])
            module.register_parameter(leaf, nn.Parameter(shard, requires_grad=param.requires_grad))
        for leaf, buffer in list(module.named_buffers(recurse=False)):
            placement = placement_of(sharding.params.get(prefix + leaf, "R"))
            module.register_buffer(leaf, distribute_tensor(buffer, tp_mesh, [placement]),
                                   persistent=leaf not in module._non_persistent_buffers_set)
        if not by_function:  # a plan written before function_reads: redistribute at module boundaries only
            _redistribute_at_module_boundaries(module, prefix, module_name, sharding, tp_mesh)
    model.forward = _with_constants_replicated(model.forward, PlannedReads(tp_mesh, sharding.function_reads)
                                               if by_function else None, not caller_replicates)
    model.register_forward_pre_hook(_replicate_inputs(tp_mesh), with_kwargs=True)
    model.register_forward_hook(lambda m, a, out: out.full_tensor() if isinstance(out, DTensor) else out)
    if plan.dp > 1:
        from torch.distributed.fsdp import fully_shard

        synchronise_batch_norms(model, sharding.synchronised_norms, mesh["dp"].get_group())
        fully_shard(model, mesh=mesh["dp"], ignored_params=fused.parameters(model) or None)
    return model


def use_fused_tables(model: nn.Module, tables: dict[str, str], lr: float, dp_group=None) -> FusedTables:
    """Route the plan's fused tables through their fused lookup (the parallel run and one process's alike)."""
    fused = FusedTables(lr, dp_group)
    fused.apply(model, tables)
    model.fused_tables = fused
    return fused


def _redistribute_at_module_boundaries(module: nn.Module, prefix: str, module_name: str, sharding, mesh) -> None:
    reads = {leaf: placement_of(sharding.param_reads[prefix + leaf]) for leaf, _ in
             module.named_parameters(recurse=False) if prefix + leaf in sharding.param_reads}
    if reads:
        _read_parameters_as(module, mesh, reads)
    if module_name in sharding.inputs:
        module.register_forward_pre_hook(_redistribute_input(mesh, placement_of(sharding.inputs[module_name])))
    if module_name in sharding.outputs:
        module.register_forward_hook(_redistribute_output(mesh, placement_of(sharding.outputs[module_name])))


class PlannedReads(TorchFunctionMode):
    """During the forward, redistributes each torch-level call's tensor arguments to the placements the plan's
    strategies read them in (plan.operators.function_reads, keyed as capture keyed the calls), so DTensor's eager
    dispatch, which picks an operator's strategy from its inputs' placements, runs the planned one. The
    redistributions are DTensor.redistribute, above autograd: the backward sends each gradient back to the
    producer's placement, the image the cost model prices. `matched` counts the planned calls the last forward
    met (a call the plan names and the forward does not make is only communication DTensor then picks itself:
    the numerics do not depend on placements). Each replicated output a gradient reaches goes through
    _summed_gradient, so its readers' Partial gradients are reduced once, there."""

    def __init__(self, mesh: DeviceMesh, function_reads: dict[str, dict[str, str]]) -> None:
        super().__init__()
        self.mesh = mesh
        self.reads = {key: {int(pos): placement_of(p) for pos, p in placed.items()}
                      for key, placed in function_reads.items()}
        self.keys = FunctionKeys()
        self.matched = 0

    def start(self) -> None:
        self.keys, self.matched = FunctionKeys(), 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, spec = tree_flatten((args, kwargs))
        planned = self.reads.get(self.keys.next(func, flat))
        if planned is not None:
            self.matched += 1
            for position, placement in planned.items():
                arg = flat[position] if position < len(flat) else None
                if isinstance(arg, DTensor) and arg.placements[0] != placement:
                    flat[position] = _read_as(arg, self.mesh, placement)
            args, kwargs = tree_unflatten(flat, spec)
        out = func(*args, **kwargs)
        if not torch.is_grad_enabled():
            return out
        inputs = [a for a in flat if isinstance(a, DTensor)]
        return tree_map_only(DTensor, lambda t: _summed_gradient(t, inputs), out)


def _read_as(value: DTensor, mesh: DeviceMesh, placement) -> DTensor:
    """`value` redistributed to `placement` for one reader. A pending sum read as replicated (a row-split output into
    the next column-split linear) gets its reader's Partial gradient all-reduced here, the edge's backward image the
    plan prices (plait.cost.operators.edge_time): DTensor's redistribute hands a Partial gradient back to a Partial
    producer as it is, and the row-split matmul's backward, having no Partial x Shard strategy, then gathers its
    weight."""
    read = value.redistribute(mesh, [placement])
    if value.placements[0].is_partial() and placement.is_replicate() and read.requires_grad:
        return _ReduceGradient.apply(read)
    return read


class _ReduceGradient(torch.autograd.Function):
    """Identity forward; the backward all-reduces a Partial (pending-sum) gradient: Megatron's f."""

    @staticmethod
    def forward(ctx, value: DTensor) -> DTensor:
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad: DTensor) -> DTensor:
        if any(p.is_partial() for p in grad.placements):
            return grad.redistribute(grad.device_mesh, [Replicate()] * grad.device_mesh.ndim)
        return grad


def _root(t: torch.Tensor) -> torch.Tensor:
    return t._base if t._base is not None else t


def _summed_gradient(value: DTensor, inputs: list[DTensor]) -> DTensor:
    """A replicated value a gradient reaches gets its gradient all-reduced once, where its readers' gradients have
    been added: a reader that reads it as it is into split work (the norm's output into column-split q, k and v)
    returns a Partial gradient, autograd adds those of every reader on this one tensor, and the sum is reduced
    here, at the value, as the planner prices it (plait.operators.planner's gradient-sum node). Left to DTensor,
    the pending sum would travel on backward through the producer (the norm, the residual stream) to a row-split
    matmul's backward, which has no Partial x Shard strategy and gathers the weight. A view of an input is left
    alone: its gradient passes the pending sum on to the value it views, which joins the sum there."""
    if not (value.requires_grad and value.is_floating_point()
            and all(isinstance(p, Replicate) for p in value.placements)):
        return value
    local = _root(value._local_tensor)
    if any(_root(a._local_tensor) is local for a in inputs):
        return value
    return _ReduceGradient.apply(value)


def _redistribute_output(mesh: DeviceMesh, placement) -> Callable:
    def hook(module, args, output):
        if isinstance(output, DTensor):
            return output.redistribute(mesh, [placement])
        if isinstance(output, tuple) and output and isinstance(output[0], DTensor):
            return (output[0].redistribute(mesh, [placement]), *output[1:])
        return output
    return hook


def _with_constants_replicated(forward: Callable, planned: PlannedReads | None = None, replicate: bool = True
                               ) -> Callable:
    """Tensors the forward makes itself (RoPE tables, masks, positions) are plain; DTensor takes them as replicated
    inside implicit_replication, as the planner captured them (constants, replicated). With `planned`, its reads
    hold for the forward (numbered from the forward's first call, as capture numbered them). Without `replicate`
    the caller holds implicit_replication around it."""
    @functools.wraps(forward)
    def run(*args, **kwargs):
        with implicit_replication() if replicate else nullcontext():
            if planned is None:
                return forward(*args, **kwargs)
            planned.start()
            with planned:
                return forward(*args, **kwargs)
    run.planned = planned  # type: ignore[attr-defined] - for checks that the run followed the plan
    return run


def _redistribute_input(mesh: DeviceMesh, placement) -> Callable:
    def hook(module, args):
        if args and isinstance(args[0], DTensor):
            return (args[0].redistribute(mesh, [placement]), *args[1:])
        return None
    return hook


def _read_parameters_as(module: nn.Module, mesh: DeviceMesh, reads: dict) -> None:
    """Parameters kept in one placement and read in another (kept split, gathered for use): during the module's
    forward its `_parameters` hold the redistributed tensors (autograd carries their gradients back to the kept
    ones); DTensor's eager rules for some operators (convolution) do not redistribute a parameter themselves."""
    kept: dict[str, nn.Parameter] = {}

    def before(m, args):
        for leaf, placement in reads.items():
            kept[leaf] = m._parameters[leaf]
            m._parameters[leaf] = kept[leaf].redistribute(mesh, [placement])

    def after(m, args, output):
        for leaf in reads:
            m._parameters[leaf] = kept.pop(leaf)

    module.register_forward_pre_hook(before)
    module.register_forward_hook(after)


def _replicate_inputs(mesh: DeviceMesh) -> Callable:
    """The batch (and a pipeline stage's received hidden states, keyword batches too) enter replicated on tp. Hidden
    states read into split work (a column-split first linear) get Partial gradients; DTensor.from_local's backward
    redistributes their sum to the Replicate they entered as, one all-reduce after autograd has added every
    reader's, which is _summed_gradient's rule for values made inside the forward: the input needs no wrapping."""
    def replicated(a):
        if isinstance(a, torch.Tensor) and not isinstance(a, DTensor):
            return DTensor.from_local(a, mesh, [Replicate()], run_check=False)
        return a

    def hook(module, args, kwargs):
        return tuple(replicated(a) for a in args), {k: replicated(v) for k, v in kwargs.items()}
    return hook


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def mean_over_dp(loss: torch.Tensor, dp: int, dp_group=None) -> float:
    """A step's loss: the mean of the data-parallel ranks' losses, each the mean over as many samples (collective
    over `dp_group` when dp > 1)."""
    value = loss.detach().clone()
    if dp > 1:
        dist.all_reduce(value, group=dp_group)
        value /= dp
    return value.item()


def train_steps(model: nn.Module, plan: Plan, settings: CheckSettings, dp_rank: int = 0, dp: int = 1,
                dp_group=None, clip: Callable | None = None
                ) -> tuple[list[float], list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """K AdamW steps; (losses averaged over dp, gradient norms before clipping, first gradients, final parameters),
    full tensors. With settings.max_norm each step clips by `clip(parameters, max_norm)` (torch's
    clip_grad_norm_ by default: one process's)."""
    dtype = DTYPES[settings.dtype]
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay,
                                  foreach=False)
    clip = clip or torch.nn.utils.clip_grad_norm_
    losses, norms, first = [], [], {}
    for step in range(settings.steps):
        batch = make_batch(plan.operators.batch, plan.train.global_batch, settings.seed, step, dtype)
        loss = model(*dp_slice(batch, dp, dp_rank))
        with implicit_replication():  # the backward of a constant made in forward (RoPE's tables) meets DTensors too
            loss.backward()
        losses.append(mean_over_dp(loss, dp, dp_group))
        if step == 0:
            first = {n: _full(p.grad).detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        if settings.max_norm is not None:
            norms.append(float(clip(list(model.parameters()), settings.max_norm)))
        optimizer.step()
        optimizer.zero_grad()
    params = {n: _full(p).detach().clone() for n, p in model.named_parameters()}
    return losses, norms, first, params


def run_parallel(plan: Plan, settings: CheckSettings):
    if plan.pp > 1:
        from plait.execute.autoshard_pipeline import run_pipeline

        return run_pipeline(plan, settings)
    mesh = build_mesh(plan)
    model = build_module(plan.model.source, seed=settings.seed, dtype=DTYPES[settings.dtype])
    model = apply_operator_sharding(model, plan, mesh, settings.lr)
    return train_steps(model, plan, settings, mesh["dp"].get_local_rank(), plan.dp, mesh["dp"].get_group(),
                       clip=clip_grad_norm)


def check_plan(plan: Plan, settings: CheckSettings) -> CheckResult | None:
    """Collective: the parallel run on every rank; rank 0 runs one process's and compares (others: None)."""
    losses, norms, grads, params = run_parallel(plan, settings)
    if dist.get_rank() != 0:
        return None
    reference = build_module(plan.model.source, seed=settings.seed, dtype=DTYPES[settings.dtype])
    use_fused_tables(reference, plan.operators.fused_tables, settings.lr)
    ref_losses, ref_norms, ref_grads, ref_params = train_steps(reference, plan, settings)
    floor = 1e-6 * math.sqrt(sum(g.double().norm().item() ** 2 for g in ref_grads.values()))
    grad_diffs = {n: ((grads[n].double() - g.double()).norm().item() / max(g.double().norm().item(), floor))
                  if n in grads else math.inf for n, g in ref_grads.items()}
    updates = {n: (params[n].double() - p.double()).norm().item() / (settings.lr * settings.steps * math.sqrt(p.numel()))
               for n, p in ref_params.items()}
    max_diff = max((params[n].double() - p.double()).abs().max().item() for n, p in ref_params.items())
    return CheckResult(plan=plan.describe() + " auto", losses=losses, reference_losses=ref_losses,
                       grad_rel_diffs=grad_diffs, update_rel_diffs=updates, max_param_diff=max_diff,
                       grad_norms=norms, reference_grad_norms=ref_norms,
                       runtime={"operators": plan.operators.describe()})


@contextmanager
def fake_tensor_parallel_mesh(tp: int) -> Iterator[DeviceMesh]:
    """A ("dp", "tp") mesh of 1 x tp on rank 0 of a fake process group, which moves no data: where the executor's
    collectives on the tensor-parallel axis are counted without ranks. Starts and destroys its own process group."""
    from plait.torch_internals import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    try:
        yield init_device_mesh("cpu", (1, tp), mesh_dim_names=("dp", "tp"))
    finally:
        dist.destroy_process_group()


def step_collectives(plan: Plan) -> tuple[float, dict[str, int], int]:
    """(bytes, collectives by kind, CommDebugMode's count) of one forward and backward of `plan` (dp = 1) on a fake
    tensor-parallel mesh: what the executor asks the tensor-parallel axis to carry, against the plan's comm_bytes."""
    from torch.distributed.tensor.debug import CommDebugMode

    with fake_tensor_parallel_mesh(plan.tp) as mesh:
        model = apply_operator_sharding(build_module(plan.model.source, seed=0, dtype=torch.float32), plan, mesh)
        batch = make_batch(plan.operators.batch, plan.train.global_batch, 0, 0, torch.float32)
        counter, debug = CollectiveCounter(), CommDebugMode()
        with debug, counter:
            loss = model(*batch)
            with implicit_replication():  # the backward of a constant made in forward (RoPE's tables)
                loss.backward()
        return counter.nbytes, counter.counts, debug.get_total_counts()
