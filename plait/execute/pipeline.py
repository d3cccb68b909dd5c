"""Pipeline parallelism: cut the model into the plan's (uneven, virtual) stages and run them with
torch.distributed.pipelining's schedules.

Each virtual stage is a plait.models.stage.Stage: the embedding on the first, the head on the last, and
its blocks keyed by their global index (so names stay the single-process ones). Virtual stage k lives on
pipeline rank k % pp (see plait.plan).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

from plait.models import ModelAdapter, Stage, build_stage
from plait.plan import Plan

SCHEDULE_CLASSES: dict[str, type] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved": ScheduleInterleaved1F1B,
    # zero bubble: backward split into input and weight gradients, on a V (Plan.stages_of_rank). fully_shard
    # must not reshard after forward under them (silently wrong gradients otherwise): plait never does under a
    # pipeline (plait.legality.data_parallel_mode).
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}


def split_model(adapter: ModelAdapter, root: nn.Module, plan: Plan, pp_rank: int) -> tuple[list[int], list[Stage]]:
    """The virtual stages of pipeline rank `pp_rank` and their Stage modules, in chunk order."""
    stages = plan.stages_of_rank(pp_rank) if plan.num_stages > 1 else [0]
    last = plan.num_stages - 1
    return stages, [build_stage(adapter, root, plan.stage_layers(s), first=s == 0, last=s == last,
                                seq_len=plan.train.seq_len) for s in stages]


def build_schedule(plan: Plan, stage_ids: list[int], parts: list[nn.Module], pp_mesh: DeviceMesh,
                   device: torch.device, loss_fn: Callable) -> PipelineScheduleSingle | PipelineScheduleMulti:
    """PipelineStages over the mesh's "pp" group and the plan's schedule.

    scale_grads=True: the schedule divides gradients by the number of micro-batches, so with a
    per-micro-batch mean loss the gradient is that of the mean over the whole batch."""
    group = pp_mesh.get_group()
    stages = [PipelineStage(part, stage_id, plan.num_stages, device, group=group)
              for stage_id, part in zip(stage_ids, parts)]
    schedule_class = SCHEDULE_CLASSES[plan.schedule]
    if issubclass(schedule_class, PipelineScheduleSingle):
        return schedule_class(stages[0], n_microbatches=plan.num_micro_batches, loss_fn=loss_fn, scale_grads=True)
    return schedule_class(stages, n_microbatches=plan.num_micro_batches, loss_fn=loss_fn, scale_grads=True)
