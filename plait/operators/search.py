"""The joint search for a module of any shape: every mesh shape a device count allows, each solved per operator.

`search(...)` enumerates the shapes (`shapes`): dp x tp x pp over the devices (pp only where the module has
repeated blocks to cut between, at most one block per stage), under a pipeline the number of micro-batches per
step (`micro_batch_counts`), without one the ZeRO stage (`zeros`) and recompute per repeated block
(`recomputes`); each shape is planned by the per-operator program
(plait.operators.planner for pp = 1, plait.operators.pipeline for stages, whose repeated block is solved once and
reused on every stage), under the per-device memory limit; the plans are ranked by predicted step time (then peak
memory). Pins of any degree (--dp, --tp, --pp, --micro-batch, --schedule, --zero, --recompute) narrow the
shapes; placement pins hold on every shape (over one rank every placement is the whole tensor; a degree a pinned
placement cannot take refuses that shape, named).

What the search does not vary, and why:

* Tensor-parallel degrees beyond a node (the cluster's devices_per_node), unless pinned or allowed
  (--allow-cross-node-tp), as the decoder search.
* The pipeline schedule: 1F1B. GPipe runs the same stages with every micro-batch in flight; the schedule simulator
  never prices its step below 1F1B's and its memory is never lower, so it is ranked only where pinned
  (--schedule gpipe). Interleaved and zero-bubble schedules need several stages per pipeline rank or split
  backwards, which per-operator stages do not run: a pin of one is refused in one line.
* Without a pipeline, more than one micro-batch per step only where one does not fit (`accumulated`: the fewest
  that do; more only add the per-micro-batch costs of ZeRO-3's gathers and smaller kernels) or where pinned.
* ZeRO stages that run alike on a mesh (plait.search.space.distinct_zeros: fully_shard runs 0, 1 and 2 alike),
  ZeRO-3 where the module has no one list of repeated blocks (fully_shard's units: FSDP2 keeps its root unit
  gathered, so the root alone runs ZeRO-3 as ZeRO-2), and under a pipeline (its stages stay gathered through the
  schedule: plait.legality.data_parallel_mode): one stage is listed, the others only when pinned.
* Recompute under a pipeline (the executor's stages are not checkpointed): refused per shape when pinned. Where
  a shape fits keeping every activation (with accumulation if need be), its recomputing twin only adds work: it is
  left unsolved (counted with the bounded-out shapes) unless pinned.

When no shape fits, the error names the smallest per-device budget that fits one (each shape's least memory: the
smallest placement of every node, plait.operators.planner.least_memory) and the smallest device count, among
2x, 4x ... MAX_DEVICE_GROWTH x the devices, at which one shape's least memory fits the budget.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch
from torch import nn

from plait.cost import operators as price
from plait.errors import ConfigError
from plait.operators import batch as batches
from plait.operators import planner
from plait.operators.pipeline import Dominated
from plait.operators.solution import OperatorSharding
from plait.spec.cluster import ClusterSpec

SEARCHED_SCHEDULES = ("1f1b",)
"""Schedules the search ranks unpinned (see the module docstring); plait.operators.pipeline runs gpipe too."""
MICRO_BATCH_CHOICES = 3
"""Micro-batch counts tried per pipeline shape (micro_batch_counts): the fewest, the most, and the most halved."""
RECOMPUTE_CHOICES = ("none", "full")
"""Recompute modes per operator: the decoder path's "selective" picks a decoder's attention core or GEMMs."""
MAX_DEVICE_GROWTH = 64
"""The largest device count the refusal's suggestion looks at, as a multiple of the devices asked for."""


@dataclass(frozen=True)
class Shape:
    """One point of the search: the mesh and, under a pipeline, its micro-batches per step and schedule."""

    dp: int
    tp: int
    pp: int = 1
    num_micro_batches: int = 1
    schedule: str = "1f1b"
    zero: int = -1
    """The ZeRO stage (-1: planner.zero_stage's, what a pipeline runs)."""
    recompute: str = "none"
    """"full": every repeated block recomputed in the backward; "none"."""

    def describe(self) -> str:
        mesh = f"dp{self.dp} x tp{self.tp}" + (f" x pp{self.pp}" if self.pp > 1 else "")
        extra = [f"zero{self.zero}"] if self.dp > 1 and self.pp == 1 else [self.schedule] if self.pp > 1 else []
        extra += ["recompute"] if self.recompute != "none" else []
        extra += [f"{self.num_micro_batches} micro-batches"] if self.num_micro_batches > 1 or self.pp > 1 else []
        return mesh + (f" ({', '.join(extra)})" if extra else "")

    @property
    def zero_stage(self) -> int:
        return self.zero if self.zero >= 0 else planner.zero_stage(self.dp)


@dataclass(frozen=True)
class Refusal:
    shape: Shape
    reason: str
    needs_bytes: float = 0.0
    """Where the shape did not fit: the least bytes per device any placement of it needs (0: refused otherwise)."""


@dataclass(frozen=True)
class DegreePins:
    """The search's pins of the mesh and the pipeline (None: searched)."""

    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    micro_batch: int | None = None
    schedule: str | None = None
    zero: int | None = None
    recompute: str | None = None
    max_tp: int | None = None
    """The largest tensor-parallel degree searched unpinned (the cluster's devices per node: tensor-parallel
    collectives run every operator and belong on a node's links); None: any."""


@dataclass(frozen=True)
class SearchResult:
    plans: tuple
    """Plans that fit, best first (plait.plan.Plan, each with its OperatorSharding)."""
    refused: tuple[Refusal, ...]
    seconds: float
    solver: str = "program"
    dominated: int = 0
    """Shapes left unsolved: pipelines no stage split of which could beat a plan already found (their bound,
    plait.operators.pipeline.step_lower_bound), and recomputing twins of shapes that fit keeping every
    activation."""

    @property
    def candidates_evaluated(self) -> int:
        return len(self.plans) + len(self.refused) + self.dominated

    @property
    def points(self) -> list[tuple[float, float]]:
        """(step seconds, peak bytes) of every plan that fits, for the report's scatter."""
        return [(p.predicted.step_time_s, p.predicted.peak_memory_bytes) for p in self.plans]

    complete = True
    """Every shape was priced (the search has no time limit)."""


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def micro_batch_counts(per_replica: int, pp: int, pinned_micro_batch: int | None) -> list[int]:
    """Micro-batches per step of a pp-stage pipeline whose data-parallel replica takes `per_replica` samples: the
    fewest (pp: the largest micro-batch), the most (micro-batches of one sample: the smallest bubble and memory)
    and the most halved, where they divide the samples (MICRO_BATCH_CHOICES of them)."""
    if pinned_micro_batch is not None:
        return [per_replica // pinned_micro_batch] if per_replica % pinned_micro_batch == 0 and \
            per_replica // pinned_micro_batch >= pp else []
    fitting = [m for m in divisors(per_replica) if m >= pp]
    if not fitting:
        return []
    wanted = [fitting[0], fitting[-1]] + [m for m in fitting[-2::-1] if m * 2 <= fitting[-1]][:1]
    return sorted(set(wanted))[:MICRO_BATCH_CHOICES]


def shapes(devices: int, global_batch: int, num_blocks: int, pins: DegreePins, unit_blocks: bool = False
           ) -> list[Shape]:
    """Every shape the search prices: dp x tp x pp = devices, dp dividing the global batch, pp at most
    `num_blocks` (1 where the module has no repeated blocks); without a pipeline, each ZeRO stage that runs
    differently (zeros) and recompute or not (recomputes); pins narrow each axis. `unit_blocks`: the module has
    one list of repeated blocks (fully_shard's units, what recompute checkpoints)."""
    found = []
    for pp in divisors(devices):
        if pp > max(num_blocks, 1) or (pins.pp is not None and pp != pins.pp):
            continue
        for tp in divisors(devices // pp):
            dp = devices // (pp * tp)
            if (pins.tp is not None and tp != pins.tp) or (pins.dp is not None and dp != pins.dp) or global_batch % dp:
                continue
            if pins.tp is None and pins.max_tp is not None and tp > pins.max_tp:
                continue
            per_replica = global_batch // dp
            if pp == 1:
                if pins.micro_batch is not None and per_replica % pins.micro_batch:
                    continue
                m = per_replica // pins.micro_batch if pins.micro_batch else 1
                found.extend(Shape(dp, tp, 1, m, "1f1b", zero, recompute) for zero in zeros(dp, tp, pins, unit_blocks)
                             for recompute in recomputes(tp, pins, unit_blocks))
                continue
            schedules = (pins.schedule,) if pins.schedule else SEARCHED_SCHEDULES
            zero = -1 if pins.zero is None else pins.zero
            for m in micro_batch_counts(per_replica, pp, pins.micro_batch):
                found.extend(Shape(dp, tp, pp, m, s, zero, pins.recompute or "none") for s in schedules)
    return found


def zeros(dp: int, tp: int, pins: DegreePins, unit_blocks: bool) -> list[int]:
    """The ZeRO stages searched without a pipeline: those that run differently on dp x tp (the decoder search's
    plait.search.space.distinct_zeros: DDP for ZeRO 0 and 1 of plain replicas, fully_shard otherwise), ZeRO-3 only
    where the module has repeated blocks to make units of (FSDP2 keeps its root unit gathered through the step:
    with the root alone ZeRO-3 runs as ZeRO-2); the pinned one."""
    if pins.zero is not None:
        return [pins.zero]
    from plait.axes import Degrees
    from plait.search.space import distinct_zeros

    return [z for z in distinct_zeros(Degrees(dp=dp, tp=tp)) if z != 3 or unit_blocks]


def recomputes(tp: int, pins: DegreePins, unit_blocks: bool) -> list[str]:
    """Recompute modes searched without a pipeline: none, and full per repeated block where the module has them
    (plan_shape refuses the rest, named); the pinned one."""
    if pins.recompute is not None:
        return [pins.recompute]
    return ["none", "full"] if unit_blocks else ["none"]


def explain_no_shape(devices: int, global_batch: int, num_blocks: int, pins: DegreePins) -> str:
    """Why no shape exists (pins that contradict the devices or the batch), in one line."""
    given = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in dataclasses.asdict(pins).items()
                      if v is not None and k != "max_tp")
    if pins.pp is not None and pins.pp > 1 and pins.pp > num_blocks:
        return f"--pp {pins.pp}: the module has {num_blocks or 'no'} repeated blocks to cut pipeline stages between"
    return (f"no dp x tp x pp of {devices} devices with dp dividing the global batch {global_batch}"
            + (f" matches {given}" if given else "") + "; change the pins, --devices or --global-batch")


@dataclass
class _Module:
    """The module on meta, its sources, and its captures' batches by micro-batch size (built once per search)."""

    source: str
    batch_source: str
    model: nn.Module
    name: str
    num_blocks: int
    no_blocks_reason: str
    unit_blocks: str = ""
    """The path of the module's one list of repeated blocks ("" without one): fully_shard's units and the blocks
    recompute checkpoints, without a pipeline (whatever the batch's form)."""
    unit_count: int = 0
    batches: dict = dataclasses.field(default_factory=dict)
    graphs: dict = dataclasses.field(default_factory=dict)
    """Captures by stage and input shapes (plait.operators.planner.captured)."""

    def batch(self, size: int) -> tuple[torch.Tensor, ...]:
        if size not in self.batches:
            self.batches[size] = planner.meta_batch(self.batch_source, size)
        return self.batches[size]


def load_module(model_source: str, batch_source: str, find_blocks: bool = True) -> _Module:
    """The module on meta; with `find_blocks`, its repeated blocks counted (plait.operators.stages.find_layout),
    or why it has none to pipeline."""
    from plait.models.factory import build_factory_module
    from plait.operators.stages import find_layout

    model = build_factory_module(model_source, "meta")  # the file imported as Python imports it, the model on meta
    name = model_source.removeprefix("module:").split(":")[0].rsplit(".", 1)[-1]
    module = _Module(model_source, batch_source, model, name, 0, "")
    module.unit_blocks, module.unit_count = repeated_blocks(model, name)
    if not find_blocks:
        return module
    if batches.positional(module.batch(1)) is None:  # a dict batch: stages take the batch positionally
        module.no_blocks_reason = (f"model {name!r}: batches {batch_source!r} are a "
                                   f"{type(module.batch(1)).__name__}; pipeline stages take the batch as a tuple of "
                                   f"tensors (return one), or use pp=1")
        return module
    try:
        module.num_blocks = find_layout(model, module.batch(1), f"model {name!r}").num_blocks
    except ConfigError as e:
        module.no_blocks_reason = str(e)
    return module


def repeated_blocks(model: nn.Module, name: str) -> tuple[str, int]:
    """(path, count) of the module's one list of two or more identical blocks (plait.operators.stages.find_blocks);
    ("", 0) without one."""
    from plait.operators.stages import find_blocks, get_module

    try:
        path = find_blocks(model, f"model {name!r}")
    except ConfigError:
        return "", 0
    return path, len(get_module(model, path))


def refuse_recompute(module: _Module, shape: Shape) -> None:
    """planner.PinRefused where `shape` recomputes what the executor cannot: recompute runs per repeated block,
    without a pipeline (a pipeline stage is checkpointed by no one here)."""
    if shape.recompute == "none":
        return
    why = ("the module has no one list of repeated blocks to recompute" if not module.unit_blocks else
           "per-operator recomputation runs without a pipeline" if shape.pp > 1 else "")
    if why:
        raise planner.PinRefused(f"recompute full at {shape.describe()}: {why}")


def refuse_zero(shape: Shape) -> None:
    """planner.PinRefused where a ZeRO pin asks a pipeline for a stage its stages do not run: a per-operator
    pipeline's data parallelism is planner.zero_stage's (fully_shard over dp, kept gathered through the schedule)."""
    if shape.pp > 1 and shape.zero >= 0 and shape.zero != planner.zero_stage(shape.dp):
        raise planner.PinRefused(f"zero {shape.zero} at {shape.describe()}: a per-operator pipeline's stages run "
                                 f"ZeRO-{planner.zero_stage(shape.dp)} over dp {shape.dp} (fully_shard kept "
                                 f"gathered through the schedule); the ZeRO stage is chosen without a pipeline")


def plan_shape(module: _Module, cluster: ClusterSpec, shape: Shape, *, global_batch: int, pins: dict[str, str],
               solver: str, memory_limit: float | None, table_optimizer: str | None,
               layers_per_stage: tuple[int, ...] = (), prove: bool = True, give_up_above: float | None = None):
    """The Plan of one shape (planner.DoesNotFit or planner.PinRefused where it cannot hold; pipeline.Dominated
    where a pipeline cannot beat `give_up_above`). `prove`: the solves' proven gaps (planner.solve)."""
    from plait.models.factory import import_roots
    from plait.plan import Plan, Prediction
    from plait.spec import ModelSpec, TrainSpec
    from plait.spec.model import BlockCost

    micro_batch = global_batch // shape.dp // shape.num_micro_batches
    refuse_recompute(module, shape)
    refuse_zero(shape)
    batch = module.batch(micro_batch)
    split, bubble = (), 0.0
    if shape.pp > 1:
        from plait.operators.pipeline import PipelineSettings, plan_pipeline

        settings = PipelineSettings(shape.pp, shape.num_micro_batches, shape.schedule, tuple(layers_per_stage))
        ops, split, bubble = plan_pipeline(
            module.model, batch, settings, batch_source=module.batch_source, tp=shape.tp, dp=shape.dp,
            cluster=cluster, pins=dict(pins), solver=solver, memory_limit=memory_limit,
            table_optimizer=table_optimizer, name=f"model {module.name!r}", graphs=module.graphs, prove=prove,
            give_up_above=give_up_above)
    else:
        carry = price.data_parallel_carry(shape.dp, shape.tp, shape.zero_stage, cluster, shape.num_micro_batches,
                                    module.unit_blocks, module.unit_count)
        ops = planner.plan_module(module.model, batch, batch_source=module.batch_source, tp=shape.tp, dp=shape.dp,
                                  cluster=cluster, pins=pins, solver=solver, memory_limit=memory_limit,
                                  table_optimizer=table_optimizer, graphs=module.graphs, prove=prove, carry=carry,
                                  recompute=module.unit_blocks if shape.recompute == "full" else "")
    num_params = sum(p.numel() for p in module.model.parameters())
    layers = sum(split) or 1  # the module's blocks under a pipeline (the stages' unit), else the module as one
    source = module.source if module.source.startswith("module:") else f"module:{module.source}"
    spec = ModelSpec(name=module.name, source=source, num_layers=layers, hidden_size=1, num_heads=1, vocab_size=1,
                     max_seq_len=1, pre_params=0, post_params=0,
                     blocks=tuple(BlockCost(params=num_params // layers, flops_per_token=0.0) for _ in range(layers)))
    prediction = Prediction(step_time_s=ops.step_time_s, step_time_parts=step_parts(ops, shape, bubble),
                            peak_memory_bytes=ops.peak_memory_bytes, memory_parts=dict(ops.memory_parts),
                            memory_per_stage=tuple(st.peak_memory_bytes for st in ops.stages),
                            bubble_fraction=bubble)
    # where the module and its batches come from: plait check and plait train find them from any folder
    ops = dataclasses.replace(ops, import_paths=import_roots(module.source, module.batch_source))
    return Plan.of(dp=shape.dp, tp=shape.tp, pp=shape.pp, model=spec,
                   train=TrainSpec(global_batch=global_batch, seq_len=1, precision="fp32"),
                   cluster=cluster.with_devices(shape.dp * shape.tp * shape.pp), micro_batch=micro_batch,
                   num_micro_batches=shape.num_micro_batches, schedule=shape.schedule, layers_per_stage=tuple(split),
                   zero=shape.zero_stage, recompute=shape.recompute, predicted=prediction, operators=ops)


def step_parts(ops: OperatorSharding, shape: Shape, bubble: float) -> dict[str, float]:
    """Additive parts of the step (plait.search.explain's names): compute, tp_comm and dp_comm of the solve; under
    a pipeline the slowest stage's compute and tp_comm over the micro-batches, its synchronisation, and the rest of
    the schedule's makespan (its bubble and point-to-point hops) as "bubble"."""
    if not ops.stages:
        return dict(ops.time_parts)
    slowest = max(ops.stages, key=lambda st: st.step_time_s - st.time_parts.get("dp_comm", 0.0))
    m = shape.num_micro_batches
    parts = {"compute": m * slowest.time_parts.get("compute", 0.0),
             "tp_comm": m * slowest.time_parts.get("tp_comm", 0.0),
             "dp_comm": max(st.time_parts.get("dp_comm", 0.0) for st in ops.stages)}
    parts["bubble"] = max(0.0, ops.step_time_s - sum(parts.values()))
    return parts


def search(model_source: str, batch_source: str, cluster: ClusterSpec, *, devices: int, global_batch: int,
           degrees: DegreePins = DegreePins(), pins: dict[str, str] | None = None, solver: str = "program",
           memory_limit: float | None = None, table_optimizer: str | None = None,
           layers_per_stage: tuple[int, ...] = (), allow_cross_node_tp: bool = False) -> SearchResult:
    """Every shape of `devices` planned per operator, ranked; ConfigError in one line when none fits (naming the
    smallest budget and device count that would) or the pins leave no shape. Unpinned, tp stays within a node
    (the cluster's devices_per_node) unless `allow_cross_node_tp`."""
    start = time.perf_counter()
    pins = dict(pins or {})
    if degrees.schedule is not None:
        from plait.operators.pipeline import PIPELINE_SCHEDULES

        if degrees.schedule not in PIPELINE_SCHEDULES:
            raise ConfigError(f"--schedule {degrees.schedule}: per-operator plans pipeline with "
                              f"{' or '.join(PIPELINE_SCHEDULES)} (one stage per pipeline rank); interleaved and "
                              f"zero-bubble schedules are not run per operator")
    if degrees.recompute not in (None, *RECOMPUTE_CHOICES):
        raise ConfigError(f"--recompute {degrees.recompute}: a per-operator plan recomputes whole repeated blocks or "
                          f"none ({' or '.join(RECOMPUTE_CHOICES)})")
    module = load_module(model_source, batch_source)
    if degrees.max_tp is None and not allow_cross_node_tp:
        degrees = dataclasses.replace(degrees, max_tp=cluster.devices_per_node)
    if degrees.pp is not None and degrees.pp > 1 and module.no_blocks_reason:
        raise ConfigError(module.no_blocks_reason)
    planner.check_pin_names(module.model, module.batch(1), pins)
    found = shapes(devices, global_batch, module.num_blocks, degrees, module.unit_count > 1)
    if not found:
        raise ConfigError(explain_no_shape(devices, global_batch, module.num_blocks, degrees))
    plans, refused, dominated = [], [], 0
    settings = dict(global_batch=global_batch, pins=pins, solver=solver, memory_limit=memory_limit,
                    table_optimizer=table_optimizer, layers_per_stage=layers_per_stage)
    kept = set()  # (dp, tp, pp, zero) of the plans that keep every activation
    # cheap shapes first (a bound), and keeping every activation before recomputing
    for shape in sorted(found, key=lambda s: (s.pp, s.num_micro_batches, s.tp, s.recompute != "none")):
        if shape.recompute != "none" and (shape.dp, shape.tp, shape.pp, shape.zero) in kept:
            dominated += 1  # recomputing only adds work where keeping fits (with accumulation if need be)
            continue
        best = min((p.predicted.step_time_s for p in plans), default=None)
        count = len(plans)
        try:
            plans.append(plan_shape(module, cluster, shape, prove=False, give_up_above=best, **settings))
        except planner.DoesNotFit as e:
            try:
                if degrees.micro_batch is not None or shape.num_micro_batches > 1:
                    raise
                plans.append(accumulated(module, cluster, shape, global_batch, settings, e))
            except planner.DoesNotFit as least:
                refused.append(Refusal(shape, str(least), least.needs_bytes))
        except planner.PinRefused as e:
            refused.append(Refusal(shape, str(e)))
        except Dominated:
            dominated += 1
        if len(plans) > count and shape.recompute == "none":
            kept.add((shape.dp, shape.tp, shape.pp, shape.zero))
    if not plans:
        raise ConfigError(_nothing_fits(module, cluster, devices, global_batch, degrees, refused, memory_limit,
                                        table_optimizer))
    plans.sort(key=lambda p: (p.predicted.step_time_s, p.predicted.peak_memory_bytes, p.tp, p.pp))
    plans[0] = proven(module, cluster, plans[0], settings)
    return SearchResult(tuple(plans), tuple(refused), time.perf_counter() - start, solver, dominated)


def accumulated(module: _Module, cluster: ClusterSpec, shape: Shape, global_batch: int, settings: dict,
                refusal: planner.DoesNotFit):
    """Where one micro-batch per step does not fit a shape without a pipeline (`refusal`): the plan of the fewest
    micro-batches per step (gradients accumulated, plait.execute.data.gradient_sync) that fits, found by bisection
    over the counts that divide each data-parallel rank's samples (memory falls as the micro-batch shrinks); the
    refusal of the most (one sample a micro-batch) where none fits."""
    if shape.pp > 1:
        raise refusal
    counts = [m for m in divisors(global_batch // shape.dp) if m > 1]
    if not counts:
        raise refusal
    # the most first: where one sample a micro-batch does not fit, no count does (one solve, not a bisection's)
    best = plan_shape(module, cluster, dataclasses.replace(shape, num_micro_batches=counts[-1]), prove=False,
                      **settings)
    low, high = 0, len(counts) - 2
    while low <= high:
        middle = (low + high) // 2
        try:
            best = plan_shape(module, cluster, dataclasses.replace(shape, num_micro_batches=counts[middle]),
                              prove=False, **settings)
            high = middle - 1
        except planner.DoesNotFit:
            low = middle + 1
    return best


def proven(module: _Module, cluster: ClusterSpec, plan, settings: dict):
    """`plan` planned again with its solves' gaps proven (the search ranks without: a tied solve's bound is an LP
    over the untied program, seconds on a large graph); the plan itself is the same."""
    ops = plan.operators
    if ops.solver_status not in ("tied", "time limit") and not any(st.solver_status == "tied" for st in ops.stages):
        return plan
    shape = Shape(plan.dp, plan.tp, plan.pp, plan.num_micro_batches, plan.schedule,
                  plan.zero if plan.pp == 1 else -1, plan.recompute[0])
    return plan_shape(module, cluster, shape, **{**settings, "layers_per_stage": plan.layers_per_stage})


def _nothing_fits(module: _Module, cluster: ClusterSpec, devices: int, global_batch: int, degrees: DegreePins,
                  refused: list[Refusal], memory_limit: float | None, table_optimizer: str | None) -> str:
    limit = memory_limit if memory_limit is not None else cluster.memory_bytes
    sized = [r for r in refused if r.needs_bytes > 0]
    if not sized:  # every shape refused a pin
        return refused[0].reason + f" (and at every other shape of {devices} devices)"
    least = min(sized, key=lambda r: r.needs_bytes)
    message = (f"no plan of model {module.name!r} fits {limit / 2**20:.2f} MiB per device on {devices} devices at "
               f"any of {len(refused)} shapes; the smallest budget that fits one is {least.needs_bytes / 2**20:.2f} "
               f"MiB ({least.shape.describe()})")
    grown = smallest_devices(module, cluster, devices, global_batch, degrees, limit, table_optimizer)
    message += f", or {grown} devices fit {limit / 2**20:.2f} MiB" if grown else \
        f"; no device count up to {MAX_DEVICE_GROWTH}x fits {limit / 2**20:.2f} MiB"
    if table_optimizer is None and any(isinstance(m, nn.Embedding) for m in module.model.modules()):
        message += "; a fused table optimizer (--table-optimizer sgd) keeps an embedding table's weights alone"
    return message


def smallest_devices(module: _Module, cluster: ClusterSpec, devices: int, global_batch: int, degrees: DegreePins,
                     limit: float, table_optimizer: str | None) -> int | None:
    """The smallest of 2x, 4x, ... MAX_DEVICE_GROWTH x `devices` at which some shape without a pipeline (the
    degree pins kept, but not dp) has a placement whose least memory fits `limit` (None: none does). Cheap where it
    stops early: each new tensor-parallel degree asks DTensor its strategies."""
    fused = planner.fused_tables(module.model, table_optimizer)
    grow = 2
    while grow <= MAX_DEVICE_GROWTH:
        count = devices * grow
        meshes = {(s.dp, s.tp) for s in shapes(count, global_batch, 0, dataclasses.replace(
            degrees, dp=None, pp=None, micro_batch=None, zero=None, recompute=None))}
        for dp, tp in sorted(meshes, key=lambda mesh: mesh[1]):
            # the least any plan of the mesh holds: one sample a micro-batch, its most sharded ZeRO stage
            carry = price.data_parallel_carry(dp, tp, max(zeros(dp, tp, degrees, module.unit_count > 1)), cluster,
                                              global_batch // dp, module.unit_blocks, module.unit_count)
            graph = planner.captured(module.model, module.batch(1), module.graphs)
            built = planner.build_problem(graph, tp, dp, cluster, limit, fused=fused, carry=carry)
            if planner.least_memory(built) <= limit:
                return count
        grow *= 2
    return None
