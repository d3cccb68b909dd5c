"""Apply a per-operator plan (plan.operators) with DTensor, and prove it equal to one process.

apply_operator_sharding: each parameter becomes a DTensor on the tensor-parallel axis with the placement the plan
chose; the module's batch arguments enter replicated on that axis; during the forward, each torch-level call
(F.linear, torch.cat, ...) gets its tensor arguments redistributed to the placements the plan's strategies read them
in (PlannedReads, from plan.operators.function_reads), so DTensor's eager dispatch, which picks each operator's
strategy from its inputs' placements, runs the strategies that were priced, and the backward carries each
redistribution's gradient image (the communication step_collectives measures is the plan's); a replicated value's
Partial gradient, summed over its readers, is all-reduced once at the value, where the plan prices it
(_summed_gradient); the loss leaves replicated. Then the plan's ZeRO stage carries the data-parallel axis
(shard_over_dp): DDP for ZeRO 0/1 of plain replicas, else fully_shard, which shards the (already tensor-parallel)
parameters further, as for a hand-written tensor plan (2-D DTensors), one unit per repeated block and the root,
0-d parameters and fused tables left out. Under recompute "full" the repeated blocks are checkpointed first. Over
a tensor-parallel axis of one rank the parameters stay plain tensors. A plan written before
function_reads redistributes at module boundaries only (its inputs, outputs and param_reads). Normalisations read
their statistics dimensions whole (NormsReadWhole, plait.operators.norms).

The model is a user's `package.module:factory` returning an nn.Module whose forward takes the batch factory's
tensors and returns the loss; batches come from the factory named in the plan (`package.module:function`,
called as function(batch_size, generator); plait.operators.batch). The run builds on this through
plait.execute.module_model (the training loop's model) and `check_plan` proves it equal to one process computing
the same calls (step_calls).
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
from plait.torch_internals import (ddp_ignore, implicit_replication_on, tree_flatten, tree_map, tree_map_only,
                                   tree_unflatten)
from torch.distributed.tensor.experimental import implicit_replication

from plait.models.adapter import get_module
from plait.models.factory import build_factory_module
from plait.execute.dryrun import CollectiveCounter
from plait.execute.equivalence import DTYPES, CheckResult, CheckSettings
from plait.execute.batchnorm import synchronise_batch_norms
from plait.execute.embedding_tables import FusedTables
from plait.operators import batch as batches
from plait.operators import norms, table_wise
from plait.operators.capture import FunctionKeys
from plait.operators.strategies import placement_of, register_plait_rules, register_replicated
from plait.operators.solution import OperatorSharding
from plait.plan import Plan


def build_module(source: str, *, seed: int, dtype: torch.dtype, device: str = "cpu") -> nn.Module:
    """The user's module with the seed's initial weights (every rank and the reference build the same)."""
    torch.manual_seed(seed)
    model = build_factory_module(source, device)
    return model.to(dtype) if device != "meta" else model


def make_batch(source: str, batch_size: int, seed: int, step: int, dtype: torch.dtype):
    """The global batch of `step`: the factory's tensors, floats cast to the run's dtype (plait.operators.batch)."""
    return batches.step_batch(source, batch_size, seed, step, dtype)


def dp_slice(batch, dp: int, dp_rank: int):
    return batches.split(batch, dp, dp_rank)


def build_mesh(plan: Plan) -> DeviceMesh:
    """("dp", "tp"), or ("pp", "dp", "tp") under a pipeline (pipeline stages outermost, as plait.execute.mesh)."""
    if plan.pp > 1:
        return init_device_mesh("cpu", (plan.pp, plan.dp, plan.tp), mesh_dim_names=("pp", "dp", "tp"))
    return init_device_mesh("cpu", (plan.dp, plan.tp), mesh_dim_names=("dp", "tp"))


def apply_operator_sharding(model: nn.Module, plan: Plan, mesh: DeviceMesh, lr: float = 0.0,
                            sharding: OperatorSharding | None = None, caller_replicates: bool = False,
                            data_parallel: bool = True) -> nn.Module:
    """Parameters to their planned placements, module outputs redistributed as planned, the batch in and the loss
    out replicated; then fully_shard over dp when dp > 1. Fused tables (plan.operators.fused_tables) update their
    rows in the lookup's backward at `lr` (model.fused_tables.lr, which a training loop sets each step) and stay
    out of fully_shard. `sharding`: a pipeline stage's own (plan.operators.stages[k]) for that stage's module.
    `caller_replicates`: the caller runs forward and backward inside one implicit_replication (a pipeline schedule
    interleaves them; the context does not nest: leaving an inner one turns it off for the outer).
    `data_parallel=False` stops before fully_shard (shard_over_dp then applies it: a dry run on meta traces the
    step in between, as fully_shard cannot run on meta parameters)."""
    sharding = sharding or plan.operators
    tp_mesh = mesh["tp"]
    register_plait_rules()  # the rules the planner priced with (CPU attention)
    owners = {name: table_wise.owner_of(p) for name, p in sharding.params.items() if table_wise.is_table_wise(p)}
    use_fused_tables(model, sharding.fused_tables, lr, mesh["dp"].get_group() if plan.dp > 1 else None, owners, tp_mesh,
                     sharding.distinct_exchange)
    if plan.tp == 1:  # nothing to place on an axis of one rank: plain tensors (no DTensor rule needed, none asked)
        recompute_blocks(model, plan, sharding)
        return shard_over_dp(model, plan, mesh, sharding) if data_parallel else model
    for call_name in sharding.replicated_ops:  # no DTensor rule: replicated, as the planner priced them
        register_replicated(call_name)
    by_function = bool(sharding.function_reads)
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for leaf, param in list(module.named_parameters(recurse=False)):
            if prefix + leaf in owners:  # a table-wise table stays a plain tensor on its owner
                continue
            shard = distribute_tensor(param.detach(), tp_mesh, [placement_of(sharding.params.get(prefix + leaf, "R"))])
            module.register_parameter(leaf, nn.Parameter(shard, requires_grad=param.requires_grad))
        for leaf, buffer in list(module.named_buffers(recurse=False)):
            placement = placement_of(sharding.params.get(prefix + leaf, "R"))
            module.register_buffer(leaf, distribute_tensor(buffer, tp_mesh, [placement]),
                                   persistent=leaf not in module._non_persistent_buffers_set)
        if not by_function:  # a plan written before function_reads: redistribute at module boundaries only
            _redistribute_at_module_boundaries(module, prefix, module_name, sharding, tp_mesh)
    planned = PlannedReads(tp_mesh, sharding.function_reads) if by_function else None
    model.forward = _with_constants_replicated(model.forward, planned, not caller_replicates)
    recompute_blocks(model, plan, sharding, planned)  # after the placements: they are found by the names
    model.register_forward_pre_hook(_replicate_inputs(tp_mesh), with_kwargs=True)
    model.register_forward_hook(lambda m, a, out: out.full_tensor() if isinstance(out, DTensor) else out)
    return shard_over_dp(model, plan, mesh, sharding) if data_parallel else model


def shard_over_dp(model: nn.Module, plan: Plan, mesh: DeviceMesh, sharding: OperatorSharding) -> nn.Module:
    """The last step of apply_operator_sharding: when dp > 1, BatchNorm synchronised over dp, then the plan's
    data-parallel carrier (Plan.dp_mode, the decoder path's rule plait.legality.data_parallel_mode, which the
    planner priced: plait.cost.operators.DataParallelCarry): DDP for ZeRO 0/1 of plain replicas (replicate_with_ddp;
    ZeRO-1's sharded AdamW is the optimizer's, plait.execute.data.adamw), otherwise fully_shard, resharded after
    forward under ZeRO-3, with one unit per repeated block (sharding.blocks, without a pipeline) and the root; the
    fused tables and 0-d parameters left out of fully_shard."""
    if plan.dp == 1:
        return model
    synchronise_batch_norms(model, sharding.synchronised_norms, mesh["dp"].get_group())
    mode = plan.dp_mode
    if mode.carrier == "ddp":
        return replicate_with_ddp(model, mesh, sharding)
    from torch.distributed.fsdp import fully_shard

    kept = model.fused_tables.parameters(model) | replicate_over_dp(model)
    units = list(get_module(model, sharding.blocks).children()) if plan.pp == 1 and sharding.blocks else []
    for unit in units:
        fully_shard(unit, mesh=mesh["dp"], ignored_params=kept or None,
                    reshard_after_forward=mode.reshard_after_forward)
    # the root unit as FSDP2 treats a root left to its default: gathered from the forward through the backward (its
    # weights are needed again at once; plait.cost.operators.DataParallelCarry prices it so)
    root = {} if mode.reshard_after_forward else {"reshard_after_forward": False}
    fully_shard(model, mesh=mesh["dp"], ignored_params=kept or None, **root)
    return model


def replicate_with_ddp(model: nn.Module, mesh: DeviceMesh, sharding: OperatorSharding) -> nn.Module:
    """DDP over dp around `model`, kept beside it (model.data_parallel_runner: the forward runs through it, the
    parameters keep their names); the fused tables, which update their own rows, left out. Buffers are not
    broadcast: every rank holds the same (synchronised BatchNorm statistics). Where the forward the planner captured
    reads some parameter not at all (sharding.unread_params), DDP looks for the parameters without a gradient each
    step (find_unused_parameters): otherwise its reducer stops the second step. On meta (a dry run's shapes)
    nothing: DDP moves no parameter."""
    from torch.nn.parallel import DistributedDataParallel

    if any(p.is_meta for p in model.parameters()):
        return model
    fused = model.fused_tables.parameters(model)
    ddp_ignore(model, [name for name, p in model.named_parameters() if p in fused])
    # init_sync=False: every rank built the same initial weights from the seed
    model.__dict__["data_parallel_runner"] = DistributedDataParallel(
        model, process_group=mesh["dp"].get_group(), init_sync=False, broadcast_buffers=False,
        find_unused_parameters=bool(sharding.unread_params))
    return model


def recompute_blocks(model: nn.Module, plan: Plan, sharding: OperatorSharding,
                     planned: "PlannedReads | None" = None) -> None:
    """Under recompute "full" (a plan without a pipeline), every repeated block of sharding.blocks checkpointed as
    the decoder path checkpoints its blocks (plait.execute.recompute.checkpointed: only the block's input kept, the
    block run again in the backward). Over a tensor-parallel axis (`planned`: the forward's PlannedReads) the
    recomputation reads as the forward read: the planned redistributions, numbered from where the block's forward
    began (replayed_reads), and the normalisations whole, so it recomputes the very DTensors autograd kept. A wrapped
    block's parameter names gain `_checkpoint_wrapped_module.` (plait.execute.state.clean_name strips it; its state
    dict has the plain names)."""
    if plan.pp > 1 or plan.recompute[0] != "full":
        return
    from plait.execute.recompute import checkpointed

    if not sharding.blocks:
        raise ValueError("recompute full of a per-operator plan needs its repeated blocks (plan.operators.blocks)")
    container = get_module(model, sharding.blocks)
    replay = functools.partial(replayed_reads, planned) if planned is not None else None
    for name, block in list(container.named_children()):
        container.register_module(name, checkpointed(block, replay))


def replayed_reads(planned: "PlannedReads"):
    """checkpoint's (forward, recompute) contexts for one block's forward: nothing more in the forward (the
    model's PlannedReads and NormsReadWhole are active); in the recompute, a PlannedReads of the same reads whose
    call numbering starts where this block's forward started, NormsReadWhole, and implicit_replication where the
    backward runs without it (it does not nest: an inner one's exit would turn the caller's off)."""
    start = dict(planned.keys.seen)

    @contextmanager
    def recompute():
        again = PlannedReads(planned.mesh, {})
        again.reads, again.keys.seen = planned.reads, dict(start)
        replicating = implicit_replication_on()
        with nullcontext() if replicating else implicit_replication(), NormsReadWhole(), again:
            yield

    return nullcontext(), recompute()


def replicate_over_dp(model: nn.Module) -> set[nn.Parameter]:
    """Parameters fully_shard cannot shard (0-d ones: CLIP's logit scale) stay whole on every data-parallel rank,
    marked `dp_replicated`: the step averages their gradients over dp (plait.execute.module_model)."""
    kept = {p for p in model.parameters() if p.dim() == 0}
    for param in kept:
        param.dp_replicated = True
    return kept


def use_fused_tables(model: nn.Module, tables: dict[str, str], lr: float, dp_group=None,
                     table_wise: dict[str, int] | None = None, tp_mesh: DeviceMesh | None = None,
                     distinct: tuple[str, ...] = ()) -> FusedTables:
    """Route the plan's fused tables through their fused lookup (the parallel run and one process's alike); those
    placed table-wise (`table_wise`: weight -> owner rank on `tp_mesh`) through the owner's lookup."""
    fused = FusedTables(lr, dp_group)
    fused.apply(model, tables, table_wise, tp_mesh, distinct)
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


class NormsReadWhole(TorchFunctionMode):
    """A normalisation (F.group_norm, F.layer_norm, F.batch_norm, F.rms_norm) whose input is split along a
    dimension its statistics span reads it replicated, redistributed here, above autograd (plait.operators.norms:
    the planner prices the same). Left to DTensor's dispatch, GroupNorm's backward fails on a channel-split input."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dims = norms.function_statistics_dims(func, args, kwargs)
        first = args[0] if args else None
        if dims is not None and isinstance(first, DTensor) and any(
                p.is_shard() and p.dim in dims for p in first.placements):
            args = (first.redistribute(first.device_mesh, [Replicate()] * first.device_mesh.ndim), *args[1:])
        return func(*args, **kwargs)


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
        with implicit_replication() if replicate else nullcontext(), NormsReadWhole():
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
        return tree_map(replicated, (args, kwargs))
    return hook


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


CHECK_BETAS = (0.9, 0.999)
"""AdamW's betas on both sides of `plait check` (torch's defaults)."""


def run_parallel(plan: Plan, settings: CheckSettings):
    """K AdamW steps of `plan` on its ranks through the run's own model (plait.execute.module_model); (losses,
    gradient norms before clipping, first gradients, final parameters), full tensors of every stage on every
    rank."""
    from plait.execute.module_model import parallelize_module

    dtype = DTYPES[settings.dtype]
    model = parallelize_module(plan, seed=settings.seed, dtype=dtype, lr=settings.lr)
    optimizer = model.make_optimizer(lr=settings.lr, weight_decay=settings.weight_decay, betas=CHECK_BETAS)
    losses, norms, first = [], [], {}
    for step in range(settings.steps):
        batch = dp_slice(make_batch(plan.operators.batch, plan.train.global_batch, settings.seed, step, dtype),
                         plan.dp, model.dp_rank)
        losses.append(model.train_step(batch))
        if step == 0:
            first = _every_stage(plan, {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None})
        if settings.max_norm is not None:
            norms.append(model.clip_grad_norm_(settings.max_norm))
        optimizer.step()
        optimizer.zero_grad()
    whole = model.model_parts[0].fused_tables.gather_table_wise(model.model_parts[0])
    return losses, norms, first, _every_stage(plan, {**{n: _full(p) for n, p in model.named_parameters()}, **whole})


def _every_stage(plan: Plan, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every stage's full tensors on every rank (the models plait checks are small)."""
    tensors = {n: t.detach().clone() for n, t in tensors.items()}
    if plan.pp == 1:
        return tensors
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, tensors)
    return {n: t for part in parts for n, t in part.items()}


def reference_steps(plan: Plan, settings: CheckSettings):
    """The same K steps on one process, like with like: each step's loss is the mean of the module's loss over the
    step's calls (dp x micro-batches, each on its rows, as the ranks call it), every call's forward before the one
    backward, so a loss over the batch's own samples (an in-batch softmax's negatives, BatchNorm's statistics)
    sees on one process the samples it sees on the ranks (step_calls), and fused tables update from the step's
    weights."""
    dtype = DTYPES[settings.dtype]
    model = build_module(plan.model.source, seed=settings.seed, dtype=dtype)
    tables = use_fused_tables(model, plan.operators.fused_tables, settings.lr)
    fused = tables.parameters(model)
    trained = [p for p in model.parameters() if p not in fused]
    optimizer = torch.optim.AdamW(trained, lr=settings.lr, weight_decay=settings.weight_decay, betas=CHECK_BETAS,
                                  foreach=False)
    losses, norms, first = [], [], {}
    for step in range(settings.steps):
        calls = step_calls(plan, make_batch(plan.operators.batch, plan.train.global_batch, settings.seed, step, dtype))
        loss = sum(batches.call(model, call) for call in calls) / len(calls)
        tables.defer()  # the fused tables' rows updated once, as the run's step does
        loss.backward()
        tables.flush()
        losses.append(loss.item())
        if step == 0:
            first = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        if settings.max_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(trained, settings.max_norm)))
        optimizer.step()
        optimizer.zero_grad()
    return losses, norms, first, {n: p.detach().clone() for n, p in model.named_parameters()}


def step_calls(plan: Plan, batch) -> list:
    """The samples each forward of a step sees, as one process runs them: each data-parallel rank's share of the
    batch cut into the plan's micro-batches (dp x micro-batches calls); where the plan synchronises BatchNorm over
    dp, micro-batch i of every data-parallel rank together (m calls: the statistics span the dp ranks)."""
    dp, m = plan.dp, plan.num_micro_batches
    shares = [batches.split(batch, dp, r) for r in range(dp)]
    if plan.operators.synchronised_norms and dp > 1:
        return [batches.concat([batches.split(share, m, i) for share in shares]) for i in range(m)]
    return [batches.split(share, m, i) for share in shares for i in range(m)]


def check_plan(plan: Plan, settings: CheckSettings) -> CheckResult | None:
    """Collective: the parallel run on every rank; rank 0 runs one process's and compares (others: None)."""
    losses, norms, grads, params = run_parallel(plan, settings)
    if dist.get_rank() != 0:
        return None
    ref_losses, ref_norms, ref_grads, ref_params = reference_steps(plan, settings)
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
            loss = batches.call(model, batch)
            with implicit_replication():  # the backward of a constant made in forward (RoPE's tables)
                loss.backward()
        return counter.nbytes, counter.counts, debug.get_total_counts()
