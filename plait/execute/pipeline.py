"""Pipeline parallelism: cut the model into the plan's (uneven, virtual) stages and run them with
torch.distributed.pipelining's schedules.

Each virtual stage is a plait.models.stage.Stage: the embedding on the first, the head on the last, and
its blocks keyed by their global index (so names stay the single-process ones). Virtual stage k lives on
pipeline rank k % pp (see plait.plan).

On a mixed cluster the pipeline ranks need not follow the global ranks' order (the slow group may hold the
first stage, its processes the last ranks). torch's process groups always number their members in global-rank
order, and torch.distributed.pipelining takes a member's number for its pipeline position; `PlacedStage`
gives it the mesh's position instead and maps positions to global ranks for its sends and receives. Without it
the stages silently ran on the group-number order: the slow group computed the fast group's layers.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

from plait.cost.live_set import TORCH_SCHEDULES, LiveBuffers, peak_buffers, torch_order, with_receives
from plait.execute.buffers import PoolMixin, RankBuffers, SendLedger
from plait.models import ModelAdapter, Stage, build_stage
from plait.plan import Plan

PIPELINE_BUFFERS = ("pool", "torch")
"""How the executor holds pipeline receive buffers: "pool", as many as are in flight (plait/execute/buffers.py);
"torch", torch.distributed.pipelining's own (one per micro-batch and stage, for the life of the schedule; sends kept
until the step ends): the reference benchmarks/pipeline_bubble.py and memory_accuracy.py compare against."""

STAGE_HOOKS = ("_setup_forward_recv_info", "_resolve_peer_global_rank")
"""The PipelineStage internals plait overrides (torch 2.12 and later): the pooled receive buffers and the
positions a mixed cluster reorders. Older torch (2.11 on a GPU machine) has neither: its own buffers run instead,
and a reordered pipeline is refused (`check_stage_support`)."""


def stage_hooks_missing(stage_class: type = PipelineStage) -> list[str]:
    """Which of STAGE_HOOKS `stage_class` lacks (none on the torch plait is built against)."""
    return [name for name in STAGE_HOOKS if not hasattr(stage_class, name)]


def check_stage_support(position_ranks: list[int], stage_class: type = PipelineStage) -> bool:
    """Whether this torch's stages take plait's pooled buffers; refuses, naming the fix, a pipeline whose positions
    are not its group's rank order (a mixed cluster's slow group first) where the stage cannot be told them."""
    missing = stage_hooks_missing(stage_class)
    if missing and position_ranks != sorted(position_ranks):
        raise RuntimeError(f"this pipeline places its stages out of rank order ({position_ranks}), which needs "
                           f"torch.distributed.pipelining's {', '.join(missing)} (torch 2.12 or later; this is "
                           f"torch {torch.__version__}): install torch>=2.13, or order the cluster's groups by rank")
    return not missing


# zero bubble (zbv, dualpipev): backward split into input and weight gradients, on a V (Plan.stages_of_rank).
# fully_shard must not reshard after forward under them (silently wrong gradients otherwise): plait never does under
# a pipeline (plait.legality.data_parallel_mode).
SCHEDULE_CLASSES: dict[str, type] = {name: getattr(torch_schedules, cls) for name, cls in TORCH_SCHEDULES.items()}
"""The torch class that runs each schedule (the table lives with the cost model's live set, which reads their
orders too)."""


def split_model(adapter: ModelAdapter, root: nn.Module, plan: Plan, pp_rank: int) -> tuple[list[int], list[Stage]]:
    """The virtual stages of pipeline rank `pp_rank` and their Stage modules, in chunk order."""
    stages = plan.stages_of_rank(pp_rank) if plan.num_stages > 1 else [0]
    last = plan.num_stages - 1
    return stages, [build_stage(adapter, root, plan.stage_layers(s), first=s == 0, last=s == last,
                                seq_len=plan.train.seq_len) for s in stages]


class PlacedStage(PipelineStage):
    """A PipelineStage at pipeline position `position` of a pp group whose global ranks, position by position,
    are `position_ranks` (any order; see the module docstring)."""

    def __init__(self, *args, position: int, position_ranks: list[int], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.group_rank = position  # what the schedules read as this stage's pipeline rank
        self.position_ranks = position_ranks
        self.before_chunk: Callable[[int], None] | None = None
        """Called with the micro-batch's index before each forward (its documents' positions, parallelize.py)."""

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        if self.before_chunk is not None:
            self.before_chunk(fwd_chunk_id)
        return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def _resolve_peer_global_rank(self, stage_idx: int) -> int:
        return self.position_ranks[self.stage_index_to_group_rank[stage_idx]]

    def _get_init_p2p_neighbors_ops(self):
        import torch.distributed as dist

        ops = []
        for op in super()._get_init_p2p_neighbors_ops():  # peers given as positions: name their global ranks
            peer = self.position_ranks[op.group_peer]
            ops.append(dist.P2POp(op.op, op.tensor, peer, self.group))
        return ops


class PooledStage(PoolMixin, PlacedStage):
    """A PlacedStage whose receive buffers come from its rank's pool (plait/execute/buffers.py)."""


def live_buffers_of(plan: Plan, schedule, position: int) -> LiveBuffers:
    """The receive buffers this rank's pool is sized for: plait.cost.live_set's count over the order torch runs --
    the multi-stage runtime's own ``pipeline_order_with_comms`` (the order the cost model prices with too); the
    single-stage loops post each receive right before its compute, as plait.cost.live_set.with_receives lowers
    them."""
    order = getattr(schedule, "pipeline_order_with_comms", None)
    if order is not None:
        return peak_buffers(torch_order(order[position]))
    return peak_buffers(with_receives(plan.schedule, plan.pp, plan.num_micro_batches, plan.interleave)[position])


def _waiting_sends(schedule_class: type) -> type:
    """`schedule_class` whose step waits, at its end, for the sends its stages posted themselves."""

    class Pooled(schedule_class):
        def step(self, *args, **kwargs):
            result = super().step(*args, **kwargs)
            for stage in self._stages:
                stage.wait_sends()
            return result

    Pooled.__name__ = Pooled.__qualname__ = schedule_class.__name__  # reported as the schedule it runs
    return Pooled


def build_schedule(plan: Plan, stage_ids: list[int], parts: list[nn.Module], pp_mesh: DeviceMesh,
                   device: torch.device, loss_fn: Callable, buffers: str = "pool", scale_grads: bool = True
                   ) -> PipelineScheduleSingle | PipelineScheduleMulti:
    """PipelineStages over the mesh's "pp" group and the plan's schedule; `buffers` one of PIPELINE_BUFFERS.

    `scale_grads`: the schedule divides the gradients by the number of micro-batches (a per-micro-batch mean loss);
    False where `loss_fn` weighs each micro-batch by its share of the step's trained tokens already
    (plait.execute.step_loss.StepLoss), which that division would undo."""
    if buffers not in PIPELINE_BUFFERS:
        raise ValueError(f"pipeline buffers {buffers!r}: expected one of {', '.join(PIPELINE_BUFFERS)}")
    group = pp_mesh.get_group()
    position_ranks = [int(r) for r in pp_mesh.mesh.tolist()]
    position = position_ranks.index(torch.distributed.get_rank())
    schedule_class = SCHEDULE_CLASSES[plan.schedule]
    single = issubclass(schedule_class, PipelineScheduleSingle)
    pooled = check_stage_support(position_ranks) and buffers == "pool"  # older torch: its own buffers
    pools = RankBuffers.sized(LiveBuffers(0, 0))
    stages = []
    for stage_id, part in zip(stage_ids, parts):
        stage = (PooledStage if pooled else PlacedStage)(part, stage_id, plan.num_stages, device, group=group,
                                                          position=position, position_ranks=position_ranks)
        if pooled:
            stage.use_pools(pools, own_sends=not single)
        stages.append(stage)
    kwargs = dict(n_microbatches=plan.num_micro_batches, loss_fn=loss_fn, scale_grads=scale_grads)
    if single:
        schedule = schedule_class(stages[0], **kwargs)
    else:
        schedule = (_waiting_sends(schedule_class) if pooled else schedule_class)(stages, **kwargs)
    if pooled:
        live = live_buffers_of(plan, schedule, position)
        pools.inputs.capacity, pools.grads.capacity = live.inputs, live.grads
        if not single:  # the multi-stage runtime: its whole order says when a send has arrived
            ledger = SendLedger(schedule.pipeline_order_with_comms, lambda s: schedule.stage_index_to_group_rank[s])
            for stage in stages:
                stage.use_ledger(ledger)
    schedule.buffer_pools = pools if pooled else None
    return schedule
