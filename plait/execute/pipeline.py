"""Pipeline parallelism: cut the model into the plan's (uneven, virtual) stages and run them
with torch.distributed.pipelining's schedules.

Stage cutting is torchtitan's: copy the meta-device model once per virtual stage this rank
holds, drop the layers the stage does not own (the ModuleDict keeps the global names),
keep the embeddings only on the first stage and the final norm and output layer only on
the last. Virtual stage k lives on pipeline rank k % pp (see plait.plan).
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from plait.models import Transformer
from plait.plan import Plan

SCHEDULE_CLASSES: dict[str, type] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved": ScheduleInterleaved1F1B,
}


def cut_stage(model: Transformer, plan: Plan, stage: int) -> Transformer:
    """A copy of `model` (on meta) holding only what virtual stage `stage` runs."""
    part = copy.deepcopy(model)
    keep = {str(i) for i in plan.stage_layers(stage)}
    for name in [n for n in part.layers.keys() if n not in keep]:
        del part.layers[name]
    if stage != 0:
        part.tok_embeddings = None
        part.pos_embeddings = None
    if stage != plan.num_stages - 1:
        part.norm = None
        part.output = None
    return part


def split_model(model: Transformer, plan: Plan, pp_rank: int) -> tuple[list[int], list[Transformer]]:
    """The virtual stages of pipeline rank `pp_rank` and their modules, in chunk order."""
    if plan.num_stages == 1:
        return [0], [model]
    stages = plan.stages_of_rank(pp_rank)
    return stages, [cut_stage(model, plan, s) for s in stages]


def build_schedule(plan: Plan, stage_ids: list[int], parts: list[nn.Module], pp_mesh: DeviceMesh,
                   device: torch.device, loss_fn: Callable) -> PipelineScheduleSingle | PipelineScheduleMulti:
    """PipelineStages over the mesh's "pp" group and the plan's schedule.

    scale_grads=True: the schedule divides gradients by the number of micro-batches, so with
    a per-micro-batch mean loss the gradient is that of the mean over the whole batch."""
    group = pp_mesh.get_group()
    stages = [PipelineStage(part, stage_id, plan.num_stages, device, group=group)
              for stage_id, part in zip(stage_ids, parts)]
    schedule_class = SCHEDULE_CLASSES[plan.schedule]
    if issubclass(schedule_class, PipelineScheduleSingle):
        return schedule_class(stages[0], n_microbatches=plan.num_micro_batches, loss_fn=loss_fn, scale_grads=True)
    return schedule_class(stages, n_microbatches=plan.num_micro_batches, loss_fn=loss_fn, scale_grads=True)
