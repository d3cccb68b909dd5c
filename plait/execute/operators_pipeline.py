"""Run a per-operator plan's pipeline (plan.operators.stages): each pipeline rank builds its stage of the module
(plait.operators.stages.build_stage, the blocks Plan.stage_layers gives it), applies that stage's own per-operator
placements over its tensor-parallel axis and fully_shard over dp (plait.execute.operators.apply_operator_sharding),
and runs the plan's schedule with torch.distributed.pipelining (plait.execute.pipeline.build_schedule, as plait's
other pipelines). Hidden states travel between stages whole (replicated on tp); every stage is handed the
micro-batch's batch tensors as keyword arguments (torch's schedules pass keyword arguments to every stage), since
the module's forward reads them on every stage (its labels on the last). The last stage's output is the loss of
the micro-batch; the schedule averages the gradients over the micro-batches (scale_grads), as one process's loss
over the whole batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor.experimental import implicit_replication

from plait.execute.operators import apply_operator_sharding, build_module, fake_tensor_parallel_mesh, make_batch
from plait.operators import batch as batches
from plait.execute.pipeline import build_schedule
from plait.errors import ConfigError
from plait.operators.stages import StageLayout, build_stage, find_layout
from plait.plan import Plan


def _loss_is_output(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The last stage returns the module's own loss."""
    return output


def stage_layout(plan: Plan) -> StageLayout:
    """Where the plan's module holds its repeated blocks and what runs around them, found as the planner found them
    (plait.operators.stages.find_layout on meta at the plan's micro-batch); ConfigError when those blocks are not
    the ones the plan's stages cut."""
    meta = build_module(plan.model.source, seed=0, dtype=torch.float32, device="meta")
    micro = make_batch(plan.operators.batch, plan.micro_batch, 0, 0, torch.float32)
    layout = find_layout(meta, batches.positional(batches.to_device(micro, "meta")))
    if layout.blocks_path != plan.operators.blocks:
        raise ConfigError(f"the plan's stages cut {plan.operators.blocks!r}, the module's blocks are "
                          f"{layout.blocks_path!r}: plan again for this module")
    return layout


def build_pipeline_stage(plan: Plan, mesh, *, seed: int, dtype: torch.dtype, lr: float):
    """(this rank's pipeline position, its stage module with the plan's placements, the schedule)."""
    position = int(mesh.get_coordinate()[0])
    layout = stage_layout(plan)
    model = build_module(plan.model.source, seed=seed, dtype=dtype)
    stage = build_stage(model, layout, plan.stage_layers(position), first=position == 0, last=position == plan.pp - 1)
    stage = apply_operator_sharding(stage, plan, mesh, lr, plan.operators.stages[position], caller_replicates=True)
    stage.tied_parameters = layout.tied  # copies on several stages: their gradients summed (module_model)
    schedule = build_schedule(plan, [position], [stage], mesh["pp"], torch.device("cpu"), _loss_is_output)
    return position, stage, schedule


def pipeline_step(schedule, plan: Plan, position: int, batch: tuple[torch.Tensor, ...], forward_only: bool = False
                  ) -> list[torch.Tensor]:
    """One step of the schedule on this data-parallel rank's `batch` (forward only: the schedule's eval); the
    micro-batches' losses (last stage)."""
    losses: list[torch.Tensor] = []
    batch = batches.positional(batch)  # one tensor: a 1-tuple (stages take the batch positionally)
    named = {str(i): t for i, t in enumerate(batch)}
    run = schedule.eval if forward_only else schedule.step
    # forward and backward interleave: one implicit_replication around both (constants made in forward, RoPE's
    # tables, meet DTensors in the backward too)
    with implicit_replication():
        if position == 0:
            run(*batch, losses=losses)
        elif position == plan.pp - 1:
            run(target=torch.zeros(batch[0].shape[0]), losses=losses, return_outputs=False, **named)
        else:
            run(**named)
    return losses


def pipeline_losses(schedule, plan: Plan, position: int, batch: tuple[torch.Tensor, ...], mesh,
                    forward_only: bool = False) -> torch.Tensor:
    """One step on this data-parallel rank's `batch`; the step's loss (the mean of its micro-batches', from the last
    stage) on every stage."""
    micro = pipeline_step(schedule, plan, position, batch, forward_only)
    value = torch.stack([m.detach().double() for m in micro]).mean() if micro else torch.zeros((), dtype=torch.float64)
    dist.all_reduce(value, group=mesh["pp"].get_group())  # the last stage's loss to every stage
    return value


def stage_collectives(plan: Plan) -> list[tuple[float, dict[str, int], int]]:
    """Per stage, (bytes, collectives by kind, planned calls the forward met) of one micro-batch's forward and
    backward on the tensor-parallel axis (dp = 1): every stage built as its pipeline rank builds it, chained in one
    process on a fake tensor-parallel mesh (the hidden states handed on as a send would), against each stage's
    comm_bytes."""
    from plait.execute.dryrun import CollectiveCounter

    with fake_tensor_parallel_mesh(plan.tp) as mesh:
        batch = batches.positional(make_batch(plan.operators.batch, plan.micro_batch, 0, 0, torch.float32))
        layout = stage_layout(plan)
        model = build_module(plan.model.source, seed=0, dtype=torch.float32)
        named = {str(i): t for i, t in enumerate(batch)}
        counters = [CollectiveCounter() for _ in range(plan.pp)]
        outputs, inputs, matched = [], [], []
        with implicit_replication():
            hidden = None
            for s in range(plan.pp):
                stage = build_stage(model, layout, plan.stage_layers(s), first=s == 0, last=s == plan.pp - 1)
                stage = apply_operator_sharding(stage, plan.replace(dp=1), mesh, 0.0, plan.operators.stages[s],
                                                caller_replicates=True)
                with counters[s]:
                    out = stage(*batch) if hidden is None else stage(hidden, **named)
                outputs.append(out)
                inputs.append(hidden)
                planned = getattr(stage.forward, "planned", None)  # none at tp = 1: plain tensors, nothing placed
                matched.append(planned.matched if planned else 0)
                hidden = out.detach().requires_grad_()
            grad = None
            for s in reversed(range(plan.pp)):
                with counters[s]:
                    outputs[s].backward(grad)
                grad = inputs[s].grad if inputs[s] is not None else None
        return [(c.nbytes, c.counts, n) for c, n in zip(counters, matched)]
