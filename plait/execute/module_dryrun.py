"""The first step of a per-operator plan, run in this one process before any rank starts: `plait train` and
`plait check` refuse a plan whose step would crash (in one line naming the module and why), and `plait check
--dry-run` shows what each pipeline rank holds and sends.

For the first rank of every pipeline stage, under a `fake` process group of the plan's world size (collectives
move nothing and cost nothing; torch builds meshes of any size on it), the executor's own construction
(plait.execute.operators.apply_operator_sharding: placements, planned reads, fully_shard over dp; a stage cut as
plait.execute.operators_pipeline cuts it) and one micro-batch's forward and backward through it. A module of up to
REAL_BYTES runs on real CPU tensors, so every kernel's own checks run (GroupNorm's backward on a channel-split
input, an embedding's ids); a larger one on `meta` (shapes, placements and the executor's rules only).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from plait.errors import ConfigError
from plait.plan import Plan

REAL_BYTES = 256 * 2**20
"""Largest module (parameter bytes, whole) whose dry run computes on real CPU tensors."""


@dataclass
class ModuleStageReport:
    """What the first rank of pipeline rank `pp_rank` holds, and the collectives its step issued."""

    pp_rank: int
    rank: int
    params: int = 0
    local_bytes: float = 0.0
    full_bytes: float = 0.0
    collectives: dict[str, int] = field(default_factory=dict)
    device: str = "cpu"


def dry_run_module(plan: Plan) -> list[ModuleStageReport]:
    """Build and step the plan's first rank of every pipeline stage here (module docstring); ConfigError in one line
    naming the module and the error when the step fails."""
    if dist.is_initialized():
        raise RuntimeError("dry_run_module needs a process without a process group (it starts a fake one)")
    name = plan.model.source.removeprefix("module:")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # fully_shard and DTensor warn about what a fake group does not do
            return _stages(plan)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever the user's module raises, said in one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConfigError(f"module {name!r} cannot run the plan {plan.describe()} ({plan.operators.describe()}): its "
                          f"first step, dry-run on this machine, fails with {type(e).__name__}: {first[:300]}; plan "
                          f"it with other pins, or change the module") from None


def _stages(plan: Plan) -> list[ModuleStageReport]:
    from plait.torch_internals import FakeStore

    from plait.execute.operators import make_batch
    from plait.execute.mesh import forget_meshes
    from plait.operators import batch as batches

    device = "cpu" if _module_bytes(plan) <= REAL_BYTES else "meta"
    batch = make_batch(plan.operators.batch, plan.micro_batch, 0, 0, torch.float32)
    if device == "meta":
        batch = batches.to_device(batch, "meta")
    reports, hidden = [], None
    for position in range(plan.pp):
        rank = position * plan.dp * plan.tp
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=plan.num_devices)
        try:
            report, hidden = _stage_step(plan, position, rank, batch, hidden, device)
            reports.append(report)
        finally:
            dist.destroy_process_group()
            forget_meshes()  # DTensor's caches name this group's collectives: the next stage's is another
    return reports


def _module_bytes(plan: Plan) -> float:
    from plait.execute.operators import build_module

    meta = build_module(plan.model.source, seed=0, dtype=torch.float32, device="meta")
    return sum(p.numel() * p.element_size() for p in meta.parameters())


def _stage_step(plan: Plan, position: int, rank: int, batch, hidden, device: str):
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental import implicit_replication

    from plait.execute.operators import apply_operator_sharding, build_mesh, build_module, shard_over_dp
    from plait.execute.dryrun import CollectiveCounter
    from plait.operators import batch as batches
    from plait.operators.capture import forward_on_meta

    mesh = build_mesh(plan)
    module = build_module(plan.model.source, seed=0, dtype=torch.float32, device=device)
    sharding = None
    if plan.pp > 1:
        from plait.execute.operators_pipeline import stage_layout
        from plait.operators.stages import build_stage

        module = build_stage(module, stage_layout(plan), plan.stage_layers(position), first=position == 0,
                             last=position == plan.pp - 1)
        sharding = plan.operators.stages[position]
    # as the run does; on meta fully_shard comes after the step (it cannot run on meta parameters)
    module = apply_operator_sharding(module, plan, mesh, 0.0, sharding, caller_replicates=True,
                                     data_parallel=device != "meta")
    report = ModuleStageReport(pp_rank=position, rank=rank, device=device)
    counter = CollectiveCounter()
    on_meta = forward_on_meta() if device == "meta" else _nothing()
    with counter, on_meta, implicit_replication():
        if hidden is None:
            out = batches.call(module, batch)
        else:
            out = module(hidden, **{str(i): t for i, t in enumerate(batches.positional(batch))})
        if position == plan.pp - 1:
            if not isinstance(out, torch.Tensor) or out.numel() != 1:
                shape = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise ConfigError(f"module {plan.model.source.removeprefix('module:')!r}: its forward returned "
                                  f"{shape}, not a scalar loss; return the loss (a 0-d tensor) from forward")
            out.backward()
        else:
            out.backward(torch.ones_like(out))
    report.collectives = dict(counter.counts)
    sent = out.detach().requires_grad_() if position < plan.pp - 1 else None
    if device == "meta":
        module = shard_over_dp(module, plan, mesh, sharding or plan.operators)
    for param in module.parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        report.params += 1
        report.local_bytes += local.numel() * local.element_size()
        report.full_bytes += param.numel() * local.element_size()
    return report, sent


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def runnable(plans: list, limit: int | None = None) -> tuple[list, list[str]]:
    """(the first `limit` of `plans` whose first step dry-runs, in their order; why each one skipped did not), so a
    ranking emits no plan that would crash; ConfigError (the first plan's reason) when none does."""
    kept, refused = [], []
    for plan in plans:
        if limit is not None and len(kept) >= limit:
            break
        try:
            dry_run_module(plan)
        except ConfigError as e:
            refused.append(str(e))
            continue
        kept.append(plan)
    if not kept and refused:
        raise ConfigError(refused[0])
    return kept, refused


def refuse_off_cpu(plan: Plan) -> None:
    """ConfigError in one line for a per-operator plan of accelerators: its executor builds CPU meshes over gloo
    (plait.execute.operators.build_mesh), so such a plan is planned and priced, not run, here."""
    if plan.cluster.device_type != "cpu":
        raise ConfigError(f"the plan is for {plan.cluster.name} ({plan.cluster.device_type}); per-operator plans run "
                          f"on CPU ranks (gloo) only: plan for a CPU cluster (--cluster local-cpu) to train or check "
                          f"this module here")


def samples_note(plan: Plan) -> str | None:
    """A line for a module whose loss is not a mean over its samples (an in-batch softmax, batch statistics), when
    the plan's calls see fewer samples than the step (data parallelism, micro-batches): how many each call sees.
    Told by running the forward (one process, no gradients) on one call's samples and on its two halves (apart by
    more than float32's rounding);
    None for a loss that is a mean over samples, a call of one sample, or a module beyond REAL_BYTES (not run)."""
    from plait.execute.operators import build_module, make_batch
    from plait.operators import batch as batches

    calls = plan.dp * plan.num_micro_batches
    if calls == 1 or plan.micro_batch < 2 or plan.micro_batch % 2 or _module_bytes(plan) > REAL_BYTES:
        return None
    module = build_module(plan.model.source, seed=0, dtype=torch.float32)
    batch = make_batch(plan.operators.batch, plan.micro_batch, 0, 0, torch.float32)
    with torch.no_grad():
        whole = batches.call(module, batch).item()
        halves = sum(batches.call(module, batches.split(batch, 2, i)).item() for i in range(2)) / 2
    if abs(whole - halves) <= 1e-5 * max(abs(whole), 1e-30):
        return None
    synced = (f" (BatchNorm's statistics, synchronised over the dp ranks, span {plan.dp * plan.micro_batch})"
              if plan.operators.synchronised_norms and plan.dp > 1 else "")
    return (f"the loss of {plan.model.source.removeprefix('module:')} is not a mean over its samples (on one call's "
            f"{plan.micro_batch} samples it is {whole:.6g}, over their halves {halves:.6g}: an in-batch softmax, batch "
            f"statistics): each of a step's {calls} calls (dp{plan.dp} x {plan.num_micro_batches} micro-batches) "
            f"computes it over its own {plan.micro_batch} samples{synced}, not the step's {plan.train.global_batch}; the "
            f"step's loss is their mean, and `plait check` compares with one process computing the same")
