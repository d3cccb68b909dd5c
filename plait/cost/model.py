"""predict(plan): step time and memory of a Plan, by part.

Step time = the pipeline's makespan over the micro-batches (simulated per stage; a single
stage simply runs them back to back) + the data-parallel communication that backward and
forward cannot hide + the optimizer step, on the slowest pipeline rank.

Parts: compute, recompute, tp_comm, cp_comm (context parallelism's key/value exchange), ep_comm
(expert parallelism's token dispatch), loss (the loss beyond the head: tensor parallelism's vocabulary-parallel
cross-entropy) (each on the bottleneck rank), pp_comm (the transfers on the
critical path of filling and draining the pipeline), bubble (the rest of the makespan the
bottleneck rank sits idle), dp_comm (exposed part only), optimizer.

Data parallelism is priced as plait's executor runs it (`_dp_comm`): DDP all-reduces run under
the last micro-batch's backward, bucket by bucket, only the last bucket exposed when backward is
long enough (ZeRO-1 then broadcasts the updated shards, exposed); fully_shard gathers each unit
under the previous unit's forward, exposing the first, and reduce-scatters under the last
backward. On GPUs hidden communication still costs OVERLAP_SLOWDOWN of itself; CPU processes
have no spare engine, so there all of it counts.

Where CPU ranks share cores (ClusterSpec.oversubscription > 1), a pipeline's idle stages lend
theirs to the busy ones (`lent_cores_factor`); where parameters are DTensors, the step pays host
time per parameter tensor (HostOverheads.dtensor_param_overhead_s), and fully_shard's hooks host time per
layer pass (HostOverheads.fsdp_layer_overhead_s); a pipeline's schedule, per stage and micro-batch pass
(HostOverheads.pipeline_overhead_s). Every step pays a fixed host time
(HostOverheads.step_overhead_s), counted with the optimizer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from plait.cost import comm
from plait.cost.activations import FP32_BYTES
from plait.cost.compute import (EndsCost, LayerCost, block_loads, ends_cost, model_flops_per_step, optimizer_time,
                                param_tensors, sliced_layer_cost)
from plait.cost.layout import Setting
from plait.plan import Layout
from plait.cost.memory import (LayoutMemory, expert_params, first_stage_params, last_stage_params, layer_params,
                               optimizer_shards)
from plait.cost.schedule import makespan
from plait.cost.trainable import adapter_layer_params, trained
from plait.plan import V_SCHEDULES
from plait.plan import Plan, Prediction
from plait.spec.model import ModelSpec


@dataclass(frozen=True)
class StageTimes:
    """Per virtual stage, per micro-batch: forward and backward seconds, and their split by kind."""

    fwd: tuple[float, ...]
    bwd: tuple[float, ...]
    compute: tuple[float, ...]
    recompute: tuple[float, ...]
    tp_comm: tuple[float, ...]
    cp_comm: tuple[float, ...] = ()
    ep_comm: tuple[float, ...] = ()
    loss: tuple[float, ...] = ()
    """The loss beyond the head (EndsCost.loss_fwd + loss_bwd): the last stage's, 0 elsewhere."""


def stage_times(lc: LayerCost | list[LayerCost], ends: EndsCost | list[EndsCost], layers: tuple[float, ...],
                modes: tuple[str, ...], stage_host: float | list[float] = 0.0) -> StageTimes:
    """`layers[k]` layers (or mean-block time loads: plait.cost.compute.block_loads) on virtual stage k,
    recomputed with `modes[k]`; each stage's forward and backward of a micro-batch also pay `stage_host` seconds
    (HostOverheads.pipeline_overhead_s, under a pipeline). `lc`, `ends` and `stage_host` may be one per stage (the
    stages of a mixed cluster run on different device groups)."""
    last = len(layers) - 1
    per = lambda x: x if isinstance(x, list) else [x] * len(layers)  # noqa: E731
    lcs, endss, hosts = per(lc), per(ends), per(stage_host)
    fwd, bwd, compute, recompute, tp, cp, ep, loss = [], [], [], [], [], [], [], []
    for k, (n, mode) in enumerate(zip(layers, modes)):
        lc, ends, stage_host = lcs[k], endss[k], hosts[k]
        c = n * (lc.fwd + lc.bwd) + 2 * stage_host
        t = n * (lc.tp_fwd + lc.tp_bwd)
        f = n * (lc.fwd + lc.comm_fwd) + stage_host
        r = n * lc.recompute[mode]
        loss_k = ends.loss_fwd + ends.loss_bwd if k == last else 0.0
        if k == 0:
            c += ends.embed_fwd + ends.embed_bwd
            t += ends.embed_tp
            f += ends.embed_fwd + ends.embed_tp
        if k == last:
            c += ends.head_fwd + ends.head_bwd
            t += ends.head_tp
            f += ends.head_fwd + ends.head_tp / 2 + ends.loss_fwd
        x, e = n * (lc.cp_fwd + lc.cp_bwd), n * (lc.ep_fwd + lc.ep_bwd)
        fwd.append(f)
        bwd.append(c + t + x + e + r + loss_k - f)
        compute.append(c)
        recompute.append(r)
        tp.append(t)
        cp.append(x)
        ep.append(e)
        loss.append(loss_k)
    return StageTimes(tuple(fwd), tuple(bwd), tuple(compute), tuple(recompute), tuple(tp), tuple(cp), tuple(ep),
                      tuple(loss))


def p2p_time(setting: Setting, layout: Layout, cross_group: bool = False) -> float:
    """One stage-to-stage transfer of a micro-batch's activations (or their gradient).

    Megatron's scatter/gather: each tensor rank sends 1/t of b·s·h over the network, then the
    receivers all-gather over the fast link (already sharded under sequence parallelism)."""
    if layout.pp == 1:
        return 0.0
    nbytes = layout.micro_batch * setting.seq_len / layout.cp * setting.model.hidden_size * setting.dtype_bytes
    group = comm.axis_group(layout.degrees, "pp")
    crosses = comm.spans_nodes(group, setting.cluster.devices_per_node)
    t = comm.p2p(nbytes / layout.tp, crosses, setting.cluster)
    if cross_group and setting.cluster.between_groups is not None:  # a boundary between device groups
        link = setting.cluster.between_groups
        t = max(t, link.latency_s + nbytes / layout.tp / link.bandwidth)
    if layout.tp > 1 and not layout.sp:
        t += comm.all_gather(nbytes, comm.Group(layout.tp, 1), setting.cluster)
    return t


def rank_params(setting: Setting, layout: Layout, rank: int, layers: float) -> float:
    """Parameters pipeline rank `rank` holds with `layers` blocks (experts split over ep included)."""
    model, tp = setting.model, layout.tp
    total = layers * layer_params(model, tp, layout.ep)
    if rank == 0:
        total += first_stage_params(model, tp)
    if rank == layout.last_rank:
        total += last_stage_params(model, tp, shares_embedding_rank=rank == 0 and layout.pp == 1)
    return total


def rank_trained_params(setting: Setting, layout: Layout, rank: int, layers: float) -> float:
    """Of `rank_params`, those with gradients and optimizer states (all, or a LoRA run's adapters:
    plait.cost.trainable)."""
    return trained(setting.model, rank_params(setting, layout, rank, layers),
                   layers * adapter_layer_params(setting.model, layout.tp))


BUCKET_BYTES = 25 * 2**20
"""DDP's gradient bucket (PyTorch's default bucket_cap_mb = 25): the last one's all-reduce is exposed."""

NCCL_CHANNEL_SMS = 24
"""Streaming multiprocessors a large NCCL ring collective holds on an NVSwitch node: one thread block per channel,
and NCCL opens 16-24 channels there at large messages (an all-gather on H100 runs 24 blocks in Nsight Systems
profiles of FSDP's prefetch)."""
DEVICE_SMS = 120
"""Streaming multiprocessors of the GPUs the presets describe: 108 on A100, 132 on H100 (datasheets)."""
OVERLAP_SLOWDOWN = round(NCCL_CHANNEL_SMS / DEVICE_SMS, 2)
"""Communication hidden under compute still slows that compute: while a collective runs, its blocks hold
NCCL_CHANNEL_SMS of the device's SMs, and the GEMMs it hides under run on the others, NCCL_CHANNEL_SMS /
DEVICE_SMS = 0.2 slower (0.18 on H100, 0.22 on A100). Derived, not fitted; a GEMM sized to exactly one wave of
blocks can lose more (a second, mostly idle wave). It is what keeps, e.g., ZeRO-3 over hundreds of replicas from
looking free whenever its gathers fit under the compute. Checked against torchtitan's Llama 3.1 8B on 8 and 128
H100s (the same work per GPU, more of it hidden communication at 128): the model's drop is 0.5%, the published
2.7% -- the rest is the inter-node links, whose bandwidth the presets take from the adapters' line rate."""


def dp_exposed(setting: Setting, layout: Layout, params: float, fwd_mb: float, bwd_mb: float,
               units: int = 1, experts: float = 0.0, grads: float | None = None) -> float:
    """Data-parallel communication of one rank that compute does not hide (see module docstring).
    `units`: the FSDP units (layers + the root) the rank's parameters are sharded in; `experts`: the rank's expert
    parameters (of `params`), sharded in units of their own over their copies (one per layer); `grads`: of the dense
    parameters, those with gradients to reduce (default all; a LoRA run's adapters)."""
    if layout.shard_degree == 1:
        return 0.0
    total, exposed = _dp_comm(setting, layout, params - experts, fwd_mb, bwd_mb, units, experts, grads)
    if setting.cluster.device_type == "cpu":
        # CPU ranks have no spare engine to overlap with: gloo runs collectives on the cores the
        # ranks compute on (one thread per core), so every second of communication adds to the step.
        return total
    return exposed + OVERLAP_SLOWDOWN * (total - exposed)


def dtensor_step_overhead(setting: Setting, layout: Layout, layers: int, first: bool, last: bool) -> float:
    """Host time of a step spent on the rank's parameters as DTensors (HostOverheads.dtensor_param_overhead_s),
    where they are: under tensor parallelism (plus HostOverheads.tp_param_overhead_s), or data parallelism on
    fully_shard."""
    if layout.tp == 1 and not on_fully_shard(layout):
        return 0.0
    host = setting.cluster.host
    per_tensor = host.dtensor_param_overhead_s + (host.tp_param_overhead_s if layout.tp > 1 else 0.0)
    return per_tensor * param_tensors(setting.model, layers, first, last)


def with_fsdp_hooks(lc: LayerCost, seconds: float) -> LayerCost:
    """`lc` with fully_shard's host time per layer pass (HostOverheads.fsdp_layer_overhead_s): forward 1x,
    backward 2x, and a recomputed forward runs the forward hooks again."""
    if seconds == 0:
        return lc
    recompute = {mode: t + (seconds if mode != "none" else 0.0) for mode, t in lc.recompute.items()}
    return dataclasses.replace(lc, fwd=lc.fwd + seconds, bwd=lc.bwd + 2 * seconds, recompute=recompute)


def on_fully_shard(layout: Layout) -> bool:
    """Whether this layout has data parallelism and plait's executor runs it on fully_shard: its parameters
    are then DTensors, and its hooks run on every unit's forward and backward (plait.legality says when)."""
    return layout.dp_mode.carrier == "fully_shard"


def _dp_comm(setting: Setting, layout: Layout, params: float, fwd_mb: float, bwd_mb: float,
             units: int = 1, experts: float = 0.0, grads: float | None = None) -> tuple[float, float]:
    """(all data-parallel communication of the step, the part not under compute), as plait's executor runs it.

    DDP all-reduces the gradients once per step, after the last micro-batch's backward, bucket by bucket;
    ZeRO-1 then broadcasts each rank's updated shard (one message per rank: an all-gather's volume).
    fully_shard gathers each unit's parameters once per step and reduce-scatters its gradients once, after
    the last micro-batch (ZeRO-3 without a pipeline instead re-gathers every unit for each micro-batch's
    forward and backward). Its `units` calls each pay the ring's latency again: negligible on NVLink,
    milliseconds between busy CPU processes. The `experts` (split by expert or tensor parallelism) are units of
    their own, one per layer, over their copies ("edp_cp", Layout.expert_shards), on the same stream: their
    gathers and reduce-scatters add to the dense ones'.

    Gradients travel in fp32 on every carrier: DDP's are the fp32 parameters' (16-bit runs autocast), and
    fully_shard reduces in fp32 (MixedPrecisionPolicy(reduce_dtype=float32), as torchtitan does); fully_shard
    gathers parameters in the compute dtype, ZeRO-1 broadcasts DDP's fp32 parameters. `grads`: the parameters whose
    gradients are reduced, where not all of `params` (a frozen LoRA base gathers, but reduces its adapters' alone;
    frozen experts reduce nothing)."""
    cluster, m = setting.cluster, layout.num_micro_batches
    syncs = m if layout.grad_sync == "micro_batch" else 1  # reductions a step: after every micro-batch, or the last
    grads = params if grads is None else grads
    if layout.dp_mode.carrier == "ddp":
        group, grad_bytes = comm.axis_group(layout.degrees, "dp_cp"), grads * FP32_BYTES
        full = comm.all_reduce(grad_bytes, group, cluster)
        last = comm.all_reduce(min(grad_bytes, BUCKET_BYTES), group, cluster)
        sync = comm.all_gather(grad_bytes, group, cluster) if layout.zero == 1 else 0.0
        return syncs * full + sync, syncs * max(full - bwd_mb, last) + sync
    volumes = _fsdp_volumes(setting, layout, params, "dp_cp", layout.shard_degree, units, grads)
    if experts and layout.expert_shards > 1:
        volumes = [a + b for a, b in zip(volumes, _fsdp_volumes(setting, layout, experts, "edp_cp",
                                                                  layout.expert_shards, max(units - 1, 1),
                                                                  trained(setting.model, experts)))]
    gather, scatter, unit_gather, unit_scatter = volumes
    scatter_exposed = syncs * max(scatter - bwd_mb, unit_scatter)
    scatter *= syncs
    if layout.dp_mode.reshard_after_forward:
        exposed = m * (max(gather - fwd_mb, 0.0) + max(gather - bwd_mb, 0.0)) + unit_gather + scatter_exposed
        return 2 * m * gather + scatter, exposed
    return gather + scatter, unit_gather + max(gather - fwd_mb, 0.0) + scatter_exposed


def _fsdp_volumes(setting: Setting, layout: Layout, params: float, axis: str, shards: int, units: int,
                  grads: float | None = None) -> tuple[float, float, float, float]:
    """fully_shard's seconds for `params` in `units` units over the `shards` ranks of mesh axis `axis`: all its
    all-gathers and reduce-scatters of a step (once each), and one unit's of each; `grads` of them reduce their
    gradients (default all)."""
    cluster, group = setting.cluster, comm.axis_group(layout.degrees, axis)
    grad_bytes, param_bytes = (params if grads is None else grads) * FP32_BYTES, params * setting.dtype_bytes
    calls = (units - 1) * (shards - 1)
    gather = comm.all_gather(param_bytes, group, cluster) + calls * comm.bus(group, cluster, "all_gather")[0]
    scatter = comm.reduce_scatter(grad_bytes, group, cluster) + calls * comm.bus(group, cluster, "reduce_scatter")[0]
    return (gather, scatter, comm.all_gather(param_bytes / units, group, cluster),
            comm.reduce_scatter(grad_bytes / units, group, cluster))


def pipeline_stage_times(setting: Setting, layout: Layout, layers: tuple[int, ...], recompute: tuple[str, ...]
                         ) -> tuple[StageTimes, list[tuple[float, float, float]]]:
    """The per-micro-batch forward and backward times of every virtual stage the step is priced with (fully_shard's
    hooks and the schedule's host time included, each stage on its own rank's device group), and the stages'
    (time, parameter, activation) loads. The report's timeline draws these very times (plait.report.plan_report)."""
    rank_of = {k: r for r, stages in enumerate(layout.rank_stages) for k in stages}
    if not layout.stage_groups:  # a uniform cluster: every rank on the same hardware
        per_stage = [rank_costs(setting, layout)] * len(layers)
    else:
        costs, priced = {}, []  # ranks on the same hardware cost the same
        for r in set(rank_of.values()):
            at = setting.at(layout, r)
            same = next((cost for seen, cost in priced if seen is at or seen == at), None)
            if same is None:
                same = rank_costs(at, layout)
                priced.append((at, same))
            costs[r] = same
        per_stage = [costs[rank_of[k]] for k in range(len(layers))]
    modes = tuple(recompute[rank_of[k]] for k in range(len(layers)))
    loads = block_loads(setting.model, setting.seq_len, layers)
    st = stage_times([c[0] for c in per_stage], [c[1] for c in per_stage], tuple(load[0] for load in loads), modes,
                     [c[2] for c in per_stage])
    return st, loads


def pipeline_part(parts: dict[str, float]) -> float:
    """The pipeline's share of a step (its makespan): every part but the data-parallel tail and the optimizer."""
    return sum(v for k, v in parts.items() if k not in ("dp_comm", "optimizer"))


@dataclass(frozen=True)
class StepTime:
    total: float
    parts: dict[str, float]
    bubble_fraction: float


def step_time(setting: Setting, layout: Layout, layers: tuple[int, ...], recompute: tuple[str, ...],
              exact: bool = True) -> StepTime:
    """Step time of the layout with `layers` per virtual stage and `recompute` per pipeline rank.

    exact=False replaces the schedule simulation by its closed form (the search's estimate). On a mixed
    cluster every pipeline rank is priced on its own device group's hardware (Setting.at)."""
    pp, m = layout.pp, layout.num_micro_batches
    owned = layout.rank_stages
    at = [setting.at(layout, r) for r in range(pp)]
    st, loads = pipeline_stage_times(setting, layout, layers, recompute)
    work = [m * sum(st.fwd[k] + st.bwd[k] for k in owned[r]) for r in range(pp)]
    bottleneck = max(range(pp), key=lambda r: work[r])
    cross_group = bool(layout.stage_groups) and len(set(layout.stage_groups)) > 1
    c = max(p2p_time(a, layout, cross_group) for a in {id(a): a for a in at}.values())  # once per distinct setting
    if pp == 1:
        pipe, transfers = work[0], 0.0
    elif exact:
        pipe = makespan(st.fwd, st.bwd, pp, m, layout.schedule, c)
        transfers = _fill_transfers(layout, c)
    else:
        pipe = closed_form_makespan(st, layout, c)
        transfers = _fill_transfers(layout, c)
    idle = pipe - min(transfers, max(pipe - work[bottleneck], 0.0))
    tail, opt, seen = [], [], {}
    for r in range(pp):
        mine = owned[r]
        n = sum(layers[k] for k in mine)
        first, last = 0 in mine, layout.num_stages - 1 in mine
        key = (n, first, last, sum(st.fwd[k] for k in mine), sum(st.bwd[k] for k in mine),
               sum(loads[k][1] for k in mine), at[r].cluster.name)
        if key not in seen:  # ranks with the same share cost the same: most of them
            seen[key] = rank_tail(at[r], layout, r, n, first, last, key[3], key[4], key[5])
        tail.append(seen[key][0])
        opt.append(seen[key][1])
    last = max(range(pp), key=lambda r: tail[r] + opt[r])
    on = owned[bottleneck]
    lent = lent_cores_factor(setting.cluster, layout, st, pipe, c)
    parts = {
        "compute": lent * m * sum(st.compute[k] for k in on),
        "recompute": lent * m * sum(st.recompute[k] for k in on),
        "tp_comm": lent * m * sum(st.tp_comm[k] for k in on),
        "cp_comm": lent * m * sum(st.cp_comm[k] for k in on),
        "ep_comm": lent * m * sum(st.ep_comm[k] for k in on),
        "loss": lent * m * sum(st.loss[k] for k in on),
        "bubble": lent * max(idle - work[bottleneck], 0.0),
        "pp_comm": lent * max(pipe - idle, 0.0),
        "dp_comm": tail[last],
        "optimizer": opt[last],
    }
    total = sum(parts.values())
    return StepTime(total=total, parts=parts, bubble_fraction=parts["bubble"] / (lent * pipe) if pipe > 0 else 0.0)


def rank_tail(setting: Setting, layout: Layout, rank: int, layers: int, first: bool, last: bool, fwd: float,
              bwd: float, param_load: float) -> tuple[float, float]:
    """(the data-parallel communication compute does not hide, the optimizer step with the step's host time) of
    pipeline rank `rank` holding `layers` blocks (`param_load` mean blocks of parameters; the first and the last
    virtual stage where `first`, `last`) whose micro-batch takes `fwd` and `bwd` seconds (what step_time adds after
    the makespan, on the rank that ends last). The exposed part only falls as `fwd` and `bwd` grow."""
    params = rank_params(setting, layout, rank, param_load)
    experts = param_load * expert_params(setting.model, layout.tp, layout.ep)
    # what trains (all, or a LoRA run's adapters: plait.cost.trainable) is reduced and stepped; experts are frozen
    steps, stepped_experts = rank_trained_params(setting, layout, rank, param_load), trained(setting.model, experts)
    return (dp_exposed(setting, layout, params, fwd, bwd, units=layers + 1, experts=experts,
                       grads=steps - stepped_experts),
            optimizer_time(setting.cluster, (steps - stepped_experts) / optimizer_shards(layout)
                           + stepped_experts / layout.expert_shards)
            + dtensor_step_overhead(setting, layout, layers, first, last)
            + setting.cluster.host.step_overhead_s)


def tail_lower_bound(setting: Setting, layout: Layout) -> float:
    """A lower bound on what `step_time` adds after the pipeline's makespan (the data-parallel tail and the optimizer
    step of the rank that ends last), whatever the split of the blocks, on a uniform cluster.

    That is max_r (tail_r + opt_r) >= tail + opt of the rank holding the most parameters, which holds at least the
    mean, P/pp (P: every rank's blocks and ends); both grow with the parameters. The tail grows with the rank's
    fully_shard units in its collectives' latency and shrinks with them in the one unit's exposed gather and
    reduce-scatter, so each is taken at the end of the range that lowers it (v + 1 units: a block per virtual stage,
    and the root; L - (pp - 1)·v + 1: every block the other stages leave); the overlap, at its best (compute long
    enough to hide all but one unit's or bucket's). Dense models only: experts are sharded over other ranks, and
    their tail is left at 0 (the optimizer then at the larger of the two shardings)."""
    model, pp, v = setting.model, layout.pp, layout.interleave
    layers = model.num_layers
    # every rank's rank_params: the blocks, the embedding on rank 0 and the head on the last stage's rank
    total = (layers * layer_params(model, layout.tp, layout.ep) + first_stage_params(model, layout.tp)
             + last_stage_params(model, layout.tp, shares_embedding_rank=pp == 1))
    mean = total / pp
    stepped = trained(model, mean, layers * adapter_layer_params(model, layout.tp) / pp)  # plait.cost.trainable
    host = setting.cluster.host.step_overhead_s
    experts = expert_params(model, layout.tp, layout.ep)
    if experts:
        shards = max(optimizer_shards(layout), layout.expert_shards)
        return optimizer_time(setting.cluster, stepped / shards) + host
    opt = optimizer_time(setting.cluster, stepped / optimizer_shards(layout)) + host
    if layout.shard_degree == 1:
        return opt
    fewest, most = (layers + 1,) * 2 if pp == 1 else (v + 1, layers - (pp - 1) * v + 1)
    inf = float("inf")
    all_comm = _dp_comm(setting, layout, mean, inf, inf, fewest, grads=stepped)[0]
    if setting.cluster.device_type == "cpu":  # no overlap there: dp_exposed counts all of it
        return all_comm + opt
    exposed = _dp_comm(setting, layout, mean, inf, inf, most, grads=stepped)[1]
    return (1 - OVERLAP_SLOWDOWN) * exposed + OVERLAP_SLOWDOWN * all_comm + opt


def rank_costs(setting: Setting, layout: Layout) -> tuple[LayerCost, EndsCost, float]:
    """(one layer, the ends, a stage pass's host time) for one micro-batch on `setting`'s hardware."""
    lc = sliced_layer_cost(setting.model, setting.cluster, setting.seq_len, layout.micro_batch, layout.slicing,
                           setting.dtype_bytes, setting.train.document_len)
    if on_fully_shard(layout):
        lc = with_fsdp_hooks(lc, setting.cluster.host.fsdp_layer_overhead_s)
    ends = ends_cost(setting.model, setting.cluster, setting.seq_len, layout.micro_batch, layout.slicing,
                     setting.dtype_bytes)
    if layout.pp == 1:
        return lc, ends, 0.0
    # host time per schedule action: forward and backward (2 a micro-batch); the V schedules split the backward
    # into input and weight gradients (3), and stage_times charges two passes
    actions = 3 if layout.schedule in V_SCHEDULES else 2
    return lc, ends, setting.cluster.host.pipeline_overhead_s * actions / 2


def lent_cores_factor(cluster, layout: Layout, st: StageTimes, pipe: float, p2p: float) -> float:
    """How much faster a pipeline runs where ranks share cores (ClusterSpec.oversubscription o > 1).

    Stage times are priced at the rate every rank gets while all compute. A stage waiting in the
    pipeline's fill or drain lends its cores to the busy ones, each of which then runs up to o times
    faster: the schedule is simulated with the cores shared among the ranks computing at each moment
    (plait.cost.schedule.simulate_shared), and the makespan's parts shrink in proportion. 1 without
    a pipeline or shared cores."""
    o = cluster.oversubscription
    if layout.pp == 1 or o <= 1.0 or pipe <= 0:
        return 1.0
    shared = makespan(st.fwd, st.bwd, layout.pp, layout.num_micro_batches, layout.schedule, p2p, oversubscription=o)
    return min(1.0, shared / pipe)


def _fill_transfers(layout: Layout, p2p: float) -> float:
    """Transfers on the critical path of filling and draining the pipeline: forward and backward over each of
    the pp·v - 1 stage boundaries, of which a rank waits on 1/v (the rest overlap its other chunks)."""
    return 2 * (layout.num_stages - 1) * p2p / layout.interleave


def closed_form_makespan(st: StageTimes, layout: Layout, p2p: float) -> float:
    """Σ stages + (m - 1)·slowest for GPipe/1F1B; for interleaved m·(slowest rank) + the other ranks' work
    over v; on a V (ZB-V, DualPipeV) the latest of the ranks' m micro-batches of work after their first forward
    arrives (all exact for uniform stages without transfers), plus the fill/drain transfers."""
    pp, m, v = layout.pp, layout.num_micro_batches, layout.interleave
    s = [f + b for f, b in zip(st.fwd, st.bwd)]
    if layout.schedule in V_SCHEDULES:
        # zero bubble on a V: once the first micro-batch's forward reaches rank r (through stages 0 .. r-1), the
        # rank is never idle again (exact for uniform stages; never above the simulation, and within 0.2% of it on
        # the median of random stage times: tests/unit/test_schedule.py)
        per_rank = [sum(s[k] for k in stages) for stages in layout.rank_stages]
        idle = max(m * per_rank[r] + sum(st.fwd[:r]) for r in range(pp))
    elif layout.schedule == "interleaved":
        per_rank = [sum(s[r::pp]) for r in range(pp)]
        idle = m * max(per_rank) + (sum(per_rank) - max(per_rank)) / v
    else:
        idle = sum(s) + (m - 1) * max(s)
    return idle + _fill_transfers(layout, p2p)


def memory_parts_per_rank(setting: Setting, layout: Layout, layers: tuple[int, ...], recompute: tuple[str, ...]
                          ) -> list[dict[str, float]]:
    """Every pipeline rank's memory at its peak, by part (the report's memory plot draws these); a Hugging Face
    class's activations beyond plait's reference layer of its shape apart (`with_class_activations`)."""
    per_rank = _parts_per_rank(setting, layout, layers, recompute)
    twin = reference_twin(setting.model)
    if twin is None:
        return per_rank
    reference = _parts_per_rank(dataclasses.replace(setting, model=twin), layout, layers, recompute)
    return [with_class_activations(mine, theirs) for mine, theirs in zip(per_rank, reference)]


CLASS_ACTIVATIONS = "class_activations"
"""The memory part a Hugging Face class keeps for backward beyond what plait's reference layer of the same shape
keeps (measured on meta: plait.models.saved_bytes): transformers' RMSNorm keeps its fp32 upcast of a 16-bit input,
under autocast every linear keeps its own 16-bit cast of a norm's fp32 output, GPT-2's gelu_new keeps its tanh
intermediates. Split out of "activations" so that a plan says how much of its memory is the class's own."""


def reference_twin(model: ModelSpec) -> ModelSpec | None:
    """plait's reference layer of a measured model's shape, where its blocks are that layer (the same parameters:
    a family the closed forms describe, named by its config.json); None otherwise."""
    if not model.blocks or model.source == "plait":
        return None
    twin = model.replace(blocks=(), pre_params=None, post_params=None, source="plait")
    if any(abs(b.params - twin.params_per_layer) > 0.005 * twin.params_per_layer for b in model.blocks):
        return None
    return twin


def with_class_activations(parts: dict[str, float], reference: dict[str, float]) -> dict[str, float]:
    """`parts` with what they hold beyond the `reference` layer's peak (more, never less: the two may peak at
    different moments, and the block a backward recomputes holds the class's own too) as CLASS_ACTIVATIONS, taken
    from the activations, then the temporaries."""
    extra = max(0.0, sum(parts.values()) - sum(reference.values()))
    extra = min(extra, parts["activations"] + parts["temporaries"])
    from_activations = min(extra, parts["activations"])
    return {**parts, "activations": parts["activations"] - from_activations,
            "temporaries": parts["temporaries"] - (extra - from_activations), CLASS_ACTIVATIONS: extra}


def _parts_per_rank(setting: Setting, layout: Layout, layers: tuple[int, ...], recompute: tuple[str, ...]
                    ) -> list[dict[str, float]]:
    per_rank, memories = [], []  # one LayoutMemory per device group's setting: every rank's, on a uniform cluster
    loads = block_loads(setting.model, setting.seq_len, layers)
    for r in range(layout.pp):
        at = setting.at(layout, r)
        memory = next((mem for seen, mem in memories if seen is at or seen == at), None)
        if memory is None:
            memory = LayoutMemory(at, layout)
            memories.append((at, memory))
        mem = memory.rank(r, recompute[r])
        mine = [loads[k] for k in layout.rank_stages[r]]
        per_rank.append(mem.parts(sum(load[1] for load in mine), sum(load[2] for load in mine)))
    return per_rank


def peak_memory(setting: Setting, layout: Layout, layers: tuple[int, ...], recompute: tuple[str, ...]
                ) -> tuple[tuple[float, ...], dict[str, float]]:
    """(memory of each pipeline rank, parts of the peak rank)."""
    per_rank = memory_parts_per_rank(setting, layout, layers, recompute)
    totals = tuple(sum(p.values()) for p in per_rank)
    peak = max(range(layout.pp), key=lambda r: totals[r])
    return totals, per_rank[peak]


def mean_peak(cluster) -> float:
    """Peak FLOP/s per device, averaged over a mixed cluster's devices (what MFU divides by)."""
    if not cluster.groups:
        return cluster.peak_flops
    return sum(g.num_devices * g.peak_flops for g in cluster.groups) / cluster.num_devices


def rank_capacities(setting: Setting, layout: Layout) -> list[float]:
    """Memory of one device of each pipeline rank (its group's, on a mixed cluster)."""
    return [setting.at(layout, r).cluster.memory_bytes for r in range(layout.pp)]


def predict(plan: Plan) -> Prediction:
    """Everything the Plan carries -> its predicted step time and memory, by part."""
    setting = Setting(plan.model, plan.cluster, plan.train)
    return predict_layout(setting, plan.layout, plan.layers_per_stage, plan.recompute)


def predict_layout(setting: Setting, layout: Layout, layers: tuple[int, ...], recompute: tuple[str, ...],
                   exact: bool = True) -> Prediction:
    step = step_time(setting, layout, layers, recompute, exact)
    totals, parts = peak_memory(setting, layout, layers, recompute)
    devices = layout.degrees.world_size
    train = setting.train
    tflops = model_flops_per_step(setting.model, train.global_batch, train.seq_len) / step.total / devices / 1e12
    return Prediction(
        step_time_s=step.total,
        step_time_parts=step.parts,
        peak_memory_bytes=max(totals),
        memory_parts=parts,
        memory_per_stage=totals,
        tokens_per_s=train.tokens_per_step / step.total,
        model_tflops_per_device=tflops,
        mfu=tflops * 1e12 / mean_peak(setting.cluster),
        bubble_fraction=step.bubble_fraction,
    )
