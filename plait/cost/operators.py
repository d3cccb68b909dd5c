"""Costs of per-operator sharding on one mesh axis: compute, redistribution and memory of each captured call's
strategies (plait.operators), as the numbers plait.search.sharding solves over.

* Compute: the call's forward FLOPs (FlopCounterMode's formulas) plus twice that for its backward; a call with
  no formula (elementwise, norms, views) counts one FLOP per output element forward and two backward. Divided
  by the axis size when the strategy splits the work (an argument sharded), at the device's GEMM rate
  (peak x efficiency.matmul).
* Redistribution (plait.cost.comm's alpha-beta model over the axis's group): Partial -> Replicate all-reduce,
  Shard -> Replicate all-gather, Partial -> Shard reduce-scatter, Shard(i) -> Shard(j) all-to-all of a shard,
  Replicate -> Shard or Partial a local slice (free). Each forward redistribution has a backward image:
  DTensor redistributes the gradient back to the producer's placement (Partial read as Replicate), and the
  gradient arriving is Partial where the consumer read a replicated input into split work (the gradient of a
  matmul's replicated input under a sharded weight: Megatron's backward all-reduce). Readers of one replicated
  value that each return such a Partial gradient share one all-reduce (`joins_gradient_sum`), made at the value
  (the executor reduces a replicated value's summed Partial gradient there; left to DTensor, the pending sum
  would travel on to a row-split matmul's backward, which gathers the weight).
* Memory per device: a parameter's weights, gradients and two AdamW moments (4 copies) over the axis when
  sharded; each call's floating outputs that autograd saves for the backward (the capture's saved_tensors_hooks;
  a view of a saved tensor counted once), over the axis when sharded; and, beside them at the peak, the largest
  output autograd does not save (whole: a transient). Over dp > 1, what the plan's ZeRO stage's carrier holds
  (DataParallelCarry): a pipeline stage's fully_shard, one unit on the stage, holds its 4 copies over dp and the
  gathered weights from the forward to the end of the backward and the whole gradients until they are
  reduce-scattered (FSDP2 keeps the root unit's parameters after the forward): 2 more copies of this rank's
  tensor-parallel shard at the peak. Recomputed blocks (`recomputed_blocks`) keep nothing between the forward and
  the backward but their inputs; one block's activations come back in its backward.
* Data-parallel synchronisation (DataParallelCarry; a pipeline stage's fully_shard: one all-gather of the weights
  before the forward and one reduce-scatter of the gradients after the backward, per step, the schedule keeping
  the weights gathered and the gradients unreduced until its last micro-batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from plait.cost import comm
from plait.cost.activations import FP32_BYTES
from plait.spec.cluster import ClusterSpec

if TYPE_CHECKING:
    from plait.cost.memory import StateBytes
    from plait.legality import DataParallelMode
    from plait.operators.capture import TensorRef

BACKWARD_FLOPS = 2.0
"""Backward FLOPs per forward FLOP of a call (a GEMM's two gradient GEMMs)."""
ADAMW_COPIES = 4
"""Parameter, gradient and AdamW's two moments."""
FUSED_TABLE_COPIES = 1
"""An embedding table under a fused row-wise SGD (plait.execute.embedding_tables): its weights alone."""


def fused_table_copies(optimizer: str, ref: "TensorRef") -> float:
    """Copies of a fused table's bytes a rank holds: the weights, and under row-wise Adagrad one float32
    accumulator per row (1 / the row's width more)."""
    if optimizer == "rowwise_adagrad":
        return FUSED_TABLE_COPIES + 4.0 / (ref.shape[-1] * ref.dtype.itemsize)
    return FUSED_TABLE_COPIES
FSDP_GATHERED_COPIES = 2
"""Over dp > 1: the weights gathered for the forward and backward and the whole gradients before their
reduce-scatter, on top of the sharded copies (see the module docstring)."""


COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
"""The collectives a redistribution makes, as plans count them (OperatorSharding.comm_counts) and the executor's
counts name them (plait.execute.dryrun.CollectiveCounter)."""


@dataclass(frozen=True)
class Redistribution:
    collective: str
    """One of COLLECTIVES, or "" (none, or a local slice)."""
    seconds: float
    nbytes: float
    """Bytes of the whole tensor the collective produces or reduces (the logical payload)."""


NONE = Redistribution("", 0.0, 0.0)


def redistribution(src: str, dst: str, nbytes: float, group: comm.Group, cluster: ClusterSpec) -> Redistribution:
    """What it takes to turn a tensor of `nbytes` placed `src` into `dst` on `group` (placements as
    plait.operators.strategies names them: R, P, S<d>)."""
    if src == dst or group.size <= 1 or dst == "P" and src == "R" or src == "R":
        return NONE
    if src == "P" and dst == "R":
        return Redistribution("all_reduce", comm.all_reduce(nbytes, group, cluster), nbytes)
    if src == "P":
        return Redistribution("reduce_scatter", comm.reduce_scatter(nbytes, group, cluster), nbytes)
    if dst == "R":
        return Redistribution("all_gather", comm.all_gather(nbytes, group, cluster), nbytes)
    if dst == "P":  # a shard read as a pending sum: gather it (DTensor has no cheaper path)
        return Redistribution("all_gather", comm.all_gather(nbytes, group, cluster), nbytes)
    return Redistribution("all_to_all", comm.all_to_all(nbytes / group.size, group, cluster), nbytes / group.size)


UNRUNNABLE_S = 1e3
"""Seconds the planner prices a redistribution DTensor cannot run correctly at (see `runs_on_layout`): larger
than any step, so the solver avoids it whenever any other choice exists, and finite, so the program stays one."""


def runs_on_layout(src: str, dst: str, ref: "TensorRef") -> bool:
    """Whether DTensor (torch 2.13) can redistribute `ref` from `src` to `dst` and keep its strides consistent.
    A collective or a slice makes the local tensor contiguous while the DTensor keeps the global stride it had; on
    a non-contiguous tensor (a transposed view: attention's heads) a later view, reshape or contiguous() that
    trusts the global stride then fails on the local one. Free changes (none, or replicated read as a pending
    sum) keep the layout."""
    return src == dst or (src == "R" and dst == "P") or _is_contiguous(ref)


def _is_contiguous(ref: "TensorRef") -> bool:
    expected = 1
    for size, stride in reversed(list(zip(ref.shape, ref.stride))):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def gradient_placement(strategy_inputs: Sequence[str], k: int) -> str:
    """The placement of the gradient a call's backward returns for its k-th argument, given the placements its
    strategy reads: Partial where a replicated argument feeds split work, Replicate for a Partial argument (the
    gradient of a pending sum is the same on every rank), otherwise the argument's own."""
    own = strategy_inputs[k]
    if own == "R":
        return "P" if any(p.startswith("S") for p in strategy_inputs) else "R"
    return "R" if own == "P" else own


def edge_time(src: str, dst: str, grad: str, ref: "TensorRef", group: comm.Group, cluster: ClusterSpec,
              needs_grad: bool = True) -> tuple[float, Redistribution, Redistribution]:
    """Seconds of one producer -> consumer edge, forward and backward, and the two redistributions. A tensor no
    gradient flows to (a constant, RoPE's tables, anything computed from the batch alone) has no backward image."""
    # an uneven shard moves as the largest shard, padded, on every rank (DTensor pads before the collective)
    forward = redistribution(src, dst, padded_bytes(ref, src, dst, group.size), group, cluster)
    back_to = "R" if src == "P" else src
    backward = redistribution(grad, back_to, padded_bytes(ref, grad, back_to, group.size), group, cluster) \
        if ref.is_float and needs_grad else NONE
    return forward.seconds + backward.seconds, forward, backward


def padded_bytes(ref: "TensorRef", src: str, dst: str, axis_size: int) -> float:
    """The bytes a redistribution from `src` to `dst` carries: the tensor's, or where either side splits a dimension
    the axis does not divide, the largest shard's on every rank."""
    split = [shard_bytes(ref, p, axis_size) * axis_size for p in (src, dst) if p.startswith("S")]
    return max([float(ref.nbytes), *split])


def joins_gradient_sum(src: str, dst: str, grad: str) -> bool:
    """Whether one reader's backward image is a share of its value's single pending sum rather than a collective
    of its own: a replicated value read as it is (no forward redistribution) into split work returns a Partial
    gradient, autograd adds the Partial gradients of every such reader, and the executor reduces the sum once
    (ViT's q, k and v read one replicated input: one all-reduce, not three). The planner prices that all-reduce
    once per value (its gradient-sum node) and refunds each such reader's own."""
    return src == "R" and dst == "R" and grad == "P"


def is_split(strategy_inputs: Sequence[str]) -> bool:
    return any(p.startswith("S") for p in strategy_inputs)


def compute_time(flops: float, outputs: Sequence["TensorRef"], split: bool, axis_size: int,
                 cluster: ClusterSpec) -> float:
    """Forward + backward seconds of one call (see the module docstring)."""
    work = flops * (1 + BACKWARD_FLOPS)
    if flops == 0:
        work = 3.0 * sum(_numel(ref) for ref in outputs)
    if split:
        work /= axis_size
    return work / (cluster.peak_flops * cluster.efficiency.matmul)


def activation_bytes(outputs: Sequence["TensorRef"], placements: Sequence[str], axis_size: int,
                     saved: Sequence[bool] = ()) -> float:
    """Bytes per device a call's outputs keep for the backward: those autograd saves (`saved`, from the capture;
    () counts every floating output, an upper bound), their shard where split."""
    keep = saved or [True] * len(outputs)
    return sum(shard_bytes(ref, p, axis_size) for ref, p, k in zip(outputs, placements, keep) if ref.is_float and k)


def parameter_bytes(ref: "TensorRef", placement: str, axis_size: int, dp_shards: int = 1,
                    copies: int = ADAMW_COPIES) -> float:
    """Per device: weights, gradients and AdamW moments (`copies`), over the axis when sharded (the largest shard
    where the axis does not divide the dimension) and over the data-parallel ranks when fully_shard shards them
    further, with the copies fully_shard gathers (FSDP_GATHERED_COPIES)."""
    local = shard_bytes(ref, placement, axis_size)
    if dp_shards <= 1:
        return copies * local
    return local * (FSDP_GATHERED_COPIES + copies / dp_shards)


def shard_bytes(ref: "TensorRef", placement: str, axis_size: int) -> float:
    """Bytes of the largest shard of `ref` placed `placement` over `axis_size` ranks: DTensor's Shard gives the
    first ranks ceil(size / axis_size) rows (torch.chunk's split) where the axis does not divide the dimension."""
    if not placement.startswith("S") or axis_size <= 1:
        return float(ref.nbytes)
    size = ref.shape[int(placement[1:])]
    return ref.nbytes / size * -(-size // axis_size) if size else 0.0


def row_exchange_time(rows_bytes: float, ids_bytes: float, dp: int, cluster: ClusterSpec, dp_group: comm.Group,
                      tables: int = 1) -> tuple[float, bool]:
    """(seconds, whether it sends distinct rows) of a fused table's exchange of its looked-up rows' gradients over
    dp, the cheaper of: each rank's distinct rows, their gradients summed (`rows_bytes`), padded to the most rows a
    rank touched, which one all-reduce of a number a table finds first for all the step's `tables` (a share of it
    each); and every id's row (`ids_bytes`, the same count on every rank: nothing to find). Distinct rows save
    bytes where ids repeat; the count's all-reduce costs latency (many data-parallel ranks)."""
    if dp <= 1:
        return 0.0, False
    distinct = comm.all_reduce(8.0 * tables, dp_group, cluster) / tables + comm.all_gather(rows_bytes * dp, dp_group,
                                                                                           cluster)
    every = comm.all_gather(ids_bytes * dp, dp_group, cluster)
    return (distinct, True) if distinct < every else (every, False)


def fused_table_sync_time(rows_bytes: float, placement: str, axis_size: int, dp: int, cluster: ClusterSpec,
                          dp_group: comm.Group, optimizer: str = "sgd", lookups: int = 0,
                          tp_group: comm.Group | None = None, tables: int = 1,
                          ids_bytes: float | None = None) -> float:
    """Cost of a fused table's update per step: over dp, the exchange of its looked-up rows' gradients
    (`row_exchange_time`; `rows_bytes` the distinct rows', `ids_bytes` every id's, the same where None; a column
    split exchanges its columns only); under row-wise Adagrad split by columns, the all-reduce over tp of each
    looked-up row's sum of squares (`lookups` rows, all dp ranks' once gathered), which the row's accumulator needs
    whole."""
    seconds = 0.0
    if dp > 1:
        share = axis_size if placement == "S1" else 1
        seconds += row_exchange_time(rows_bytes / share, (rows_bytes if ids_bytes is None else ids_bytes) / share,
                                     dp, cluster, dp_group, tables)[0]
    if optimizer == "rowwise_adagrad" and placement == "S1" and tp_group is not None and axis_size > 1:
        seconds += comm.all_reduce(4.0 * lookups * max(dp, 1), tp_group, cluster)
    return seconds


@dataclass(frozen=True)
class DataParallelCarry:
    """How a per-operator plan without a pipeline carries data parallelism, priced parameter by parameter. The
    carrier is the decoder path's rule (plait.legality.data_parallel_mode, read through Layout.dp_mode): one
    replica; DDP for ZeRO 0/1 of plain replicas (tp = 1; ZeroRedundancyOptimizer shards AdamW's states under
    ZeRO-1); fully_shard otherwise, resharded after forward under ZeRO-3. What the carrier holds per parameter is
    the decoder path's owner's (plait.cost.memory.state_bytes: bytes per fp32 parameter). The executor makes
    fully_shard's units one per repeated block (`blocks`, `num_blocks`) and the root (the rest), so a block's
    parameter is gathered (ZeRO-3) and its whole gradient held (before its reduce-scatter) a block at a time: two
    blocks' worth at the peak, the one in use and the one prefetched; the root unit stays gathered from the forward
    to the end of the backward (FSDP2 does not reshard its root after forward). Collectives as the decoder path's
    plait.cost.model._dp_comm counts them: DDP all-reduces the fp32 gradients once a step (ZeRO-1 then gathers the
    updated shards); fully_shard gathers each unit's weights once a step, twice per micro-batch for a resharded
    block (forward and backward), and reduce-scatters the gradients once."""

    mode: "DataParallelMode"
    zero: int
    dp: int
    state: "StateBytes | None" = None
    """Bytes per fp32 parameter the carrier holds (None over one replica: 4 copies)."""
    micro_batches: int = 1
    dtype_bytes: int = 4
    blocks: str = ""
    num_blocks: int = 0

    def in_block(self, name: str) -> bool:
        return bool(self.blocks) and self.num_blocks > 1 and name.startswith(self.blocks + ".")

    def unit_share(self, name: str) -> float:
        """The fraction of this parameter's fully_shard unit's gathered bytes held at the peak: the root's all of
        it; a block's parameter two blocks of its num_blocks (one in use, one prefetched)."""
        return min(2, self.num_blocks) / self.num_blocks if self.in_block(name) else 1.0

    def copies(self, name: str) -> float:
        """Bytes held per byte of the parameter's fp32 (tensor-parallel) shard."""
        if self.state is None:
            return float(ADAMW_COPIES)
        s = self.state
        held = s.params + s.optimizer + s.buckets + (s.accumulated_grads if self.micro_batches > 1 else s.step_grads)
        if self.mode.carrier == "fully_shard":
            share = self.unit_share(name)
            if s.gathered_units:  # ZeRO-3: weights gathered a unit at a time
                held += self.dtype_bytes * share
            if self.micro_batches == 1:  # the unit's whole gradient until its reduce-scatter
                held += FP32_BYTES * share
        return held / FP32_BYTES

    def sync_time(self, local_bytes: float, name: str, cluster: ClusterSpec, dp_group: comm.Group) -> float:
        """Seconds of the step's data-parallel collectives for a parameter of `local_bytes` (its fp32
        tensor-parallel shard)."""
        if self.dp <= 1 or self.mode.carrier == "none":
            return 0.0
        if self.mode.carrier == "ddp":
            seconds = comm.all_reduce(local_bytes, dp_group, cluster)
            return seconds + (comm.all_gather(local_bytes, dp_group, cluster) if self.zero == 1 else 0.0)
        gathers = 2 * self.micro_batches if self.mode.reshard_after_forward and self.in_block(name) else 1
        return gathers * comm.all_gather(local_bytes * self.dtype_bytes / FP32_BYTES, dp_group, cluster) + \
            comm.reduce_scatter(local_bytes, dp_group, cluster)



def data_parallel_carry(dp: int, tp: int, zero: int, cluster: ClusterSpec, micro_batches: int = 1,
                        blocks: str = "", num_blocks: int = 0) -> DataParallelCarry:
    """The DataParallelCarry of a dp x tp per-operator plan without a pipeline (fp32, as per-operator plans run)."""
    from plait.cost.layout import Setting
    from plait.cost.memory import state_bytes
    from plait.plan import Layout
    from plait.spec.train import TrainSpec

    layout = Layout.make(dp=dp, tp=tp, zero=zero, num_micro_batches=micro_batches)
    if layout.dp_mode.carrier == "none":
        return DataParallelCarry(layout.dp_mode, zero, dp, None, micro_batches, FP32_BYTES, blocks, num_blocks)
    # state_bytes reads the cluster and the precision alone (the model's shape is the capture's business here)
    setting = Setting(model=None, cluster=cluster, train=TrainSpec(global_batch=1, seq_len=1, precision="fp32"))
    return DataParallelCarry(layout.dp_mode, zero, dp, state_bytes(setting, layout), micro_batches,
                             setting.dtype_bytes, blocks, num_blocks)


def gradient_sync_time(ref: "TensorRef", placement: str, axis_size: int, dp: int, cluster: ClusterSpec,
                       dp_group: comm.Group) -> float:
    """Data-parallel cost of a parameter per step under fully_shard: one all-gather of the weights and one
    reduce-scatter of the gradients, of this rank's tensor-parallel shard (see the module docstring)."""
    if dp <= 1:
        return 0.0
    local = shard_bytes(ref, placement, axis_size)
    return comm.all_gather(local, dp_group, cluster) + comm.reduce_scatter(local, dp_group, cluster)


RECOMPUTED_WORK = (2 + BACKWARD_FLOPS) / (1 + BACKWARD_FLOPS)
"""A recomputed call's work against a kept one's: its forward runs again in the backward."""


@dataclass(frozen=True)
class Recomputed:
    calls: frozenset[int] = frozenset()
    """Captured calls inside a recomputed block: nothing of theirs kept between the forward and the backward."""
    held_bytes: float = 0.0
    """What recomputation holds instead: every block's input (the checkpoint keeps it) and, in one block's
    backward, that block's activations rematerialised (the largest block's)."""


def recomputed_blocks(graph, blocks: str, axis_size: int) -> Recomputed:
    """The price of recomputing every block under `blocks` (a module path; "": none) in the backward: each block's
    calls keep nothing (RECOMPUTED_WORK for their compute; the planner adds the forward redistributions into them
    again), and `held_bytes` beside the other activations, counted whole (unsplit) whatever the placements the solve
    then chooses: an upper bound over a tensor-parallel axis. Upper bounds both: torch's non-reentrant checkpoint
    stops recomputing once the tensors the backward needs are back, so a block's last calls may not run again."""
    if not blocks:
        return Recomputed()
    prefix = blocks + "."
    per_block: dict[str, float] = {}
    calls = set()
    for call in graph.calls:
        if call.module.startswith(prefix):
            block = prefix + call.module[len(prefix):].split(".", 1)[0]
            calls.add(call.index)
            per_block[block] = per_block.get(block, 0.0) + activation_bytes(
                call.outputs, ["R"] * len(call.outputs), 1, call.saved)
    inputs = sum(ref.nbytes for name, ref in graph.module_inputs.items() if name in per_block and ref.is_float)
    return Recomputed(frozenset(calls), inputs + max(per_block.values(), default=0.0))


def _numel(ref: "TensorRef") -> int:
    numel = 1
    for size in ref.shape:
        numel *= size
    return numel


def pipeline_step(stage_s: Sequence[float], stage_sync_s: Sequence[float], pp: int, num_micro_batches: int,
                  schedule: str, p2p_s: float) -> tuple[float, float]:
    """(seconds, bubble fraction) of a pipeline's step from its stages' seconds per micro-batch (forward and backward,
    `stage_s`, without the data-parallel synchronisation, which runs once a step: `stage_sync_s`): the schedule
    simulator's makespan (plait.cost.schedule; the forward is 1 / (1 + BACKWARD_FLOPS) of a stage's time, as
    compute_time counts it, and `p2p_s` each hop), plus the slowest stage's synchronisation."""
    from plait.cost import schedule as timeline

    fwd = [t / (1 + BACKWARD_FLOPS) for t in stage_s]
    bwd = [t - f for t, f in zip(stage_s, fwd)]
    span = timeline.makespan(fwd, bwd, pp, num_micro_batches, schedule, p2p_s)
    bubble = timeline.simulate(fwd, bwd, pp, num_micro_batches, schedule, p2p_s).bubble_fraction
    return span + max(stage_sync_s, default=0.0), bubble
