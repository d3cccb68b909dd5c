"""Per-operator plans under a pipeline (pp > 1): stages cut between a module's repeated blocks, per-operator
placements inside each stage over its tensor-parallel axis, the pipeline priced by the cost model.

1. The whole module is captured and solved once (plait.operators.planner, its repeated block solved once by
   `tie`): what each block and the parts around the blocks cost per micro-batch.
2. The stage split: the layers of each stage are the plan's pin (`layers_per_stage`) or plait's exact stage split
   over those costs (plait.search.partition.min_max_split, the embedding-side parts the first stage's fixed time,
   the head-side parts the last's).
3. Each stage (plait.operators.stages.build_stage, the module the executor runs) is captured on its own, with the
   received hidden states as an input a gradient flows back to; its blocks take the placements the whole module's
   solution gave the same blocks (the repeated block's solution reused on every stage; where that does not fit the
   memory, or does not run from the stage's replicated input, the stage is solved freely), the parts it holds
   besides are solved there, its activations counted once per micro-batch it holds in flight
   (plait.cost.memory.in_flight_all). Hidden states cross a stage boundary replicated (its output is read as R).
4. The step: plait.cost.operators.pipeline_step (the schedule simulator: bubble, point-to-point hops) over the
   stages' times, the data-parallel synchronisation once a step.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np
import torch
from torch import nn

from plait import legality
from plait.cost import comm
from plait.cost import operators as price
from plait.errors import ConfigError
from plait.operators import batch as batches
from plait.operators import planner
from plait.operators.solution import OperatorSharding
from plait.operators.stages import StageLayout, build_stage, find_layout
from plait.search import sharding
from plait.spec.cluster import ClusterSpec

PIPELINE_SCHEDULES = ("gpipe", "1f1b")
"""Schedules per-operator pipelines run (one stage per pipeline rank)."""


@dataclasses.dataclass(frozen=True)
class PipelineSettings:
    pp: int
    num_micro_batches: int
    schedule: str = "1f1b"
    layers_per_stage: tuple[int, ...] = ()
    """Blocks per stage; () lets the stage split choose."""


def check_settings(settings: PipelineSettings, layout: StageLayout) -> None:
    """ConfigError in one line for what a per-operator pipeline cannot run (plait.legality's stage and schedule
    rules, asked here)."""
    if settings.schedule not in PIPELINE_SCHEDULES:
        raise ConfigError(f"schedule {settings.schedule!r}: per-operator plans pipeline with "
                          f"{' or '.join(PIPELINE_SCHEDULES)} (one stage per pipeline rank)")
    problems = legality.stage_problems(layout.num_blocks, settings.pp, 1, settings.layers_per_stage) + \
        legality.schedule_problems(settings.schedule, settings.pp, settings.num_micro_batches, 1)
    if problems:
        raise ConfigError(f"{problems[0].message} [rule {problems[0].rule}]")
    if settings.layers_per_stage and (len(settings.layers_per_stage) != settings.pp or
                                      sum(settings.layers_per_stage) != layout.num_blocks or
                                      min(settings.layers_per_stage) < 1):
        raise ConfigError(f"layers_per_stage={list(settings.layers_per_stage)} must hold pp={settings.pp} entries of "
                          f"at least 1 block summing to the {layout.num_blocks} blocks of {layout.blocks_path}")


def check_boundary_pins(pins: dict[str, str], layout: StageLayout, stage_blocks: list[range]) -> None:
    """A pin on a block whose output crosses to the next stage must be R: hidden states travel whole."""
    for blocks in stage_blocks[:-1]:
        name = f"{layout.blocks_path}.{blocks.stop - 1}"
        if pins.get(name, "R") != "R":  # this cut only: another split or no pipeline may hold the pin
            raise planner.PinRefused(
                f"pin {name!r} = {pins[name]!r}: that block's output is the hidden states pipeline stage "
                f"{stage_blocks.index(blocks)} sends to the next, which travel replicated; pin R, drop the pin, or cut "
                f"the stages elsewhere (layers_per_stage)")


def _block_of(name: str, layout: StageLayout) -> int | None:
    prefix = layout.blocks_path + "."
    if not name.startswith(prefix):
        return None
    return int(name[len(prefix):].split(".", 1)[0])


def node_parts(built: planner.Built, layout: StageLayout) -> list[int | None]:
    """Per node of the whole module's problem, where it lives: -1 before the blocks, i in block i, num_blocks after
    them; None for the batch, constants and the problem's own nodes."""
    where: list[int | None] = [None] * built.problem.num_nodes
    first_block = min((c.index for c in built.graph.calls if _block_of(c.module, layout) is not None), default=0)
    for call in built.graph.calls:
        block = _block_of(call.module, layout)
        where[built.call_node[call.index]] = block if block is not None else \
            (-1 if call.index < first_block else layout.num_blocks)
    for name, ref in {**built.graph.params, **built.graph.buffers}.items():
        block = _block_of(name, layout)
        before = any(name == p or name.startswith(p + ".") for p in layout.pre)
        where[built.value_node[ref.value]] = block if block is not None else (-1 if before else layout.num_blocks)
    return where


def stage_memory_lower_bound(whole: planner.Built, layout: StageLayout, ranges: list[range],
                             flight: np.ndarray) -> tuple[int, float]:
    """(the stage, its bytes) of the stage no placement fits in fewer bytes: each stage's parameters and
    activations (those of every micro-batch it holds) at the least any placement allowed needs, from the whole
    module's problem (the first stage holds what runs before the blocks, the last what runs after). A stage's own
    problem holds these nodes and more, so its least memory is no lower."""
    problem = whole.problem
    where = node_parts(whole, layout)
    calls = set(whole.call_node.values())
    least = [float(m[a].min()) for m, a in zip(problem.node_memory, problem.allowed)]
    worst = (0, 0.0)
    for s, blocks in enumerate(ranges):
        held = set(blocks) | ({-1} if s == 0 else set()) | ({layout.num_blocks} if s == len(ranges) - 1 else set())
        total = sum(least[i] * (flight[s] if i in calls else 1) for i, w in enumerate(where) if w in held)
        if total > worst[1]:
            worst = (s, total)
    return worst


def part_times(built: planner.Built, choice: tuple[int, ...], layout: StageLayout) -> tuple[float, np.ndarray, float]:
    """(before the blocks, per block, after the blocks): seconds per micro-batch of the whole module's solution,
    without the data-parallel synchronisation (once a step). Each node counts where its call or parameter lives,
    each edge with its consumer (a gradient-sum node's with its producer)."""
    problem = built.problem
    where = node_parts(built, layout)
    sums = set(built.gradient_sums.values())
    times = np.zeros(layout.num_blocks + 2)  # [before, blocks..., after]
    params = {built.value_node[ref.value] for ref in built.graph.params.values()}
    for i in range(problem.num_nodes):
        if where[i] is not None and i not in params:
            times[where[i] + 1] += problem.node_cost[i][choice[i]]
    for u, v, m in problem.edges:
        side = where[u] if v in sums or where[v] is None else where[v]
        times[(side if side is not None else layout.num_blocks) + 1] += m[choice[u], choice[v]]
    return float(times[0]), times[1:-1], float(times[-1])


def stage_split(built: planner.Built, choice: tuple[int, ...], layout: StageLayout, pp: int) -> tuple[int, ...]:
    """Blocks per stage from plait's exact stage split over the whole solution's times (the mean block: the
    split's kernel prices a stage's blocks alike; memory is held to the limit by each stage's own solve)."""
    from plait.search.partition import min_max_split

    before, blocks, after = part_times(built, choice, layout)
    fixed = np.zeros(pp)
    fixed[0] += before
    fixed[-1] += after
    layer = np.full((pp, 1), float(blocks.mean()))
    split = min_max_split(layout.num_blocks, fixed, layer, np.zeros((pp, 1)), np.zeros((pp, 1)), np.full(pp, np.inf))
    return split.layers


def _reuse_blocks(stage: planner.Built, whole: planner.Built, choice: tuple[int, ...]) -> None:
    """Each of the stage's block nodes keeps the strategy the whole module's solution gave the same node of the same
    block (where the two captures agree on the block and the pins allow it)."""
    whole_blocks = planner.block_nodes(whole)
    for prefix, members in planner.block_nodes(stage).items():
        theirs = whole_blocks.get(prefix)
        if theirs is None or [k for _, k in theirs] != [k for _, k in members]:
            continue
        for (mine, _), (other, _) in zip(members, theirs):
            mask = stage.problem.allowed[mine]
            if len(mask) == len(whole.problem.allowed[other]) and mask[choice[other]]:
                only = np.zeros_like(mask)
                only[choice[other]] = True
                stage.problem.allowed[mine] = only


def _in_flight(settings: PipelineSettings, dp: int, tp: int, micro_batch: int) -> np.ndarray:
    from plait.axes import Degrees
    from plait.plan import Layout
    from plait.cost.memory import in_flight_all

    layout = Layout(degrees=Degrees(pp=settings.pp, dp=dp, tp=tp), zero=planner.zero_stage(dp),
                    micro_batch=micro_batch, num_micro_batches=settings.num_micro_batches,
                    schedule=settings.schedule, interleave=1)
    return in_flight_all(layout)


def plan_pipeline(model: nn.Module, batch: tuple[torch.Tensor, ...], settings: PipelineSettings, *, batch_source: str,
                  tp: int, dp: int, cluster: ClusterSpec, pins: dict[str, str], solver: str,
                  memory_limit: float | None, table_optimizer: str | None, name: str = "the model",
                  graphs: dict | None = None, prove: bool = True, give_up_above: float | None = None
                  ) -> tuple[OperatorSharding, tuple[int, ...], float]:
    """(the per-operator plan with its stages, blocks per stage, bubble fraction) of `model` (on meta) for one
    micro-batch `batch` (on meta). `graphs`: captures kept between calls (planner.captured); `prove`: the stages'
    gaps (planner.solve); `give_up_above`: a search's best step so far: Dominated, before the stages are solved,
    where no stage split can beat it (`step_lower_bound`)."""
    start = time.perf_counter()
    if batches.positional(batch) is None:
        raise ConfigError(f"{name}: batches {batch_source!r} return a {type(batch).__name__}; pipeline stages take "
                          f"the batch as a tuple of tensors (return one), or use pp=1")
    batch = batches.positional(batch)
    layout = find_layout(model, batch, name)
    check_settings(settings, layout)
    fused = planner.fused_tables(model, table_optimizer)
    # the whole module is solved for its parts' times only: a stage holds a part of it, so no memory limit here
    whole = planner.build_problem(planner.captured_loss(model, batch, graphs, batch_source), tp, dp, cluster, math.inf,
                                  fused=fused)
    planner.apply_pins(whole, pins)
    solution = planner.solve_or_refuse(whole, solver, pins, fused, model, prove=False)
    if give_up_above is not None and step_lower_bound(whole, solution, settings) > give_up_above:
        raise Dominated(f"no stage split of {settings.pp} stages beats {give_up_above:.4g} s")
    split = settings.layers_per_stage or stage_split(whole, solution.choice, layout, settings.pp)
    ranges = [range(sum(split[:s]), sum(split[:s + 1])) for s in range(settings.pp)]
    check_boundary_pins(pins, layout, ranges)
    flight = _in_flight(settings, dp, tp, batch[0].shape[0])
    limit = memory_limit if memory_limit is not None else cluster.memory_bytes
    stage, needs = stage_memory_lower_bound(whole, layout, ranges, flight)
    if needs > limit:  # before any stage is captured: a stage that cannot fit
        raise planner.DoesNotFit(f"no placement fits {limit / 2**20:.2f} MiB per device"
                                 + (f" with pins {pins}" if pins else "") + f": pipeline stage {stage} of "
                                 f"{settings.pp} (blocks {ranges[stage].start}-{ranges[stage].stop - 1}) needs at "
                                 f"least {needs / 2**20:.2f} MiB", needs)
    norms = planner.batch_norms_to_synchronise(model, dp)
    stages, syncs, hidden = [], [], None
    for s, blocks in enumerate(ranges):
        stage_start = time.perf_counter()
        module = build_stage(model, layout, blocks, first=s == 0, last=s == settings.pp - 1)
        inputs = batch if hidden is None else (hidden, *batch)
        graph = planner.captured(module, inputs, graphs, ("stage", blocks.start, blocks.stop, settings.pp))
        names = {*graph.params, *graph.buffers, *graph.module_outputs}
        stage_pins = {k: v for k, v in pins.items() if k in names}
        built = planner.build_problem(graph, tp, dp, cluster, memory_limit,
                                      fused={n: o for n, o in fused.items() if n in names})
        for node in built.call_node.values():  # activations of every micro-batch this stage holds
            built.problem.node_memory[node] = built.problem.node_memory[node] * flight[s]
        planner.apply_pins(built, stage_pins)
        reused = dataclasses.replace(built, problem=dataclasses.replace(
            built.problem, allowed=[m.copy() for m in built.problem.allowed]))
        _reuse_blocks(reused, whole, solution.choice)
        try:
            stage_solution = planner.solve(reused, solver, prove=False)
        except sharding.Infeasible:
            stage_solution = None
        if stage_solution is None or stage_solution.cost >= price.UNRUNNABLE_S:
            # the whole module's block placements do not fit here, or do not run from the stage's replicated input
            # (a read DTensor would postpone): the stage is solved freely
            reused = built
            stage_solution = planner.solve_or_refuse(built, solver, pins, fused, model, prove)
        elif solver == "program":  # the reused blocks are a restriction: proven against the stage's own program
            stage_solution = dataclasses.replace(stage_solution, status="tied", lower_bound=sharding.relaxation_bound(
                built.problem) if prove else -math.inf)
        described = planner.describe(reused, stage_solution, batch_source, stage_pins, tp, dp, cluster,
                                     time.perf_counter() - stage_start)
        stages.append(dataclasses.replace(described, fused_tables={k: v for k, v in fused.items() if k in names},
                                          synchronised_norms=tuple(n for n in norms
                                                                   if any(m.startswith(n) for m in names))))
        syncs.append(_sync_seconds(reused, stage_solution.choice))
        if s < settings.pp - 1:
            out = graph.output
            hidden = torch.empty(out.shape, dtype=out.dtype, device="meta", requires_grad=True)
    hop = comm.p2p(hidden.nbytes if hidden is not None else 0.0,
                   comm.spans_nodes(comm.Group(settings.pp, dp * tp), cluster.devices_per_node), cluster)
    step, bubble = price.pipeline_step([st.step_time_s - sy for st, sy in zip(stages, syncs)], syncs, settings.pp,
                                       settings.num_micro_batches, settings.schedule, hop)
    counts: dict[str, int] = {}
    for st in stages:
        for kind, n in st.comm_counts.items():
            counts[kind] = counts.get(kind, 0) + n
    dp_only = planner.data_parallel_time(whole, tp * settings.pp, dp, cluster, settings.num_micro_batches)
    peak = max(stages, key=lambda st: st.peak_memory_bytes)
    gaps = [st.proven_gap for st in stages]
    sharding_ = OperatorSharding(
        batch=batch_source, params={k: v for st in stages for k, v in st.params.items()}, pins=pins,
        step_time_s=step, data_parallel_step_time_s=dp_only, comm_bytes=sum(st.comm_bytes for st in stages),
        comm_counts=counts, peak_memory_bytes=peak.peak_memory_bytes, solver=solution.solver,
        solver_status=weakest_status([st.solver_status for st in stages]),
        proven_gap=None if any(g is None for g in gaps) else max(gaps), memory_parts=peak.memory_parts,
        solve_time_s=time.perf_counter() - start,
        costliest=tuple(sorted((c for st in stages for c in st.costliest),
                               key=lambda c: -(c.compute_s + c.comm_s))[:planner.COSTLIEST]),
        replicated_ops=tuple(dict.fromkeys(op for st in stages for op in st.replicated_ops)),
        fused_tables=fused, synchronised_norms=norms,
        blocks=layout.blocks_path, stages=tuple(stages))
    return sharding_, tuple(split), bubble


class Dominated(Exception):
    """A pipeline shape that cannot beat the best step a search has found (plan_pipeline's give_up_above)."""


def step_lower_bound(whole: planner.Built, solution, settings: PipelineSettings) -> float:
    """No pipeline of these settings steps faster: its micro-batches' work (the whole module's per micro-batch,
    without the data-parallel synchronisation) spread evenly over the stages with no bubble. The whole module's
    solution is the cheapest placement of all of it at this tensor-parallel degree; a stage's own solve places
    fewer operators, under the memory limit, no cheaper in sum."""
    sync = _sync_seconds(whole, solution.choice)
    return DOMINANCE_SLACK * (solution.cost - sync) * settings.num_micro_batches / settings.pp


DOMINANCE_SLACK = 0.9
"""The whole module's solve is tied (its repeated block solved once), which may sit above the untied optimum
(Llama 3 8B's: proven within 5.5%): the bound is taken this much lower."""


def weakest_status(statuses: list[str]) -> str:
    """The status that proves least among several solves (a pipeline's stages)."""
    order = ("heuristic", "time limit", "tied", "optimal", "forced")
    return min(statuses, key=lambda s: order.index(s) if s in order else -1, default="")


def _sync_seconds(built: planner.Built, choice: tuple[int, ...]) -> float:
    """The data-parallel synchronisation in a solution's total: its parameters' own costs (fully_shard's gathers
    and reduce-scatters, or a fused table's row exchange), once a step."""
    return float(sum(built.problem.node_cost[built.value_node[ref.value]][choice[built.value_node[ref.value]]]
                     for ref in built.graph.params.values()))
