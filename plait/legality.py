"""What makes a plan runnable, in one place: every rule, pure (no torch).

The search prunes with these rules, `plait train` and `plait check` refuse a plan that breaks one
before any rank starts (exit 2, naming the rule), and the executor asserts them. A rule that could
be lifted instead has been: a vocabulary that tp does not divide is sharded unevenly (DTensor's
uneven shards; no padding, the state dict keeps the model's shapes), and tied embeddings run under
every plan (plait/execute/tied.py).

Each rule returns `Violation`s whose message names the value and what would work. The functions
take the few numbers they need, so the search can ask before it has built a Plan.

Also here, because the cost model and the executor must agree on it: how a plan's data parallelism
is carried (`data_parallel_mode`: DDP or fully_shard, and whether parameters stay gathered).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from plait.axes import Degrees
from plait.errors import ConfigError

if TYPE_CHECKING:
    from plait.plan import Plan
    from plait.spec import ModelSpec


@dataclass(frozen=True)
class Violation:
    rule: str
    """A short name: 'tp-divides-heads', 'world-size', ..."""
    message: str
    """What is wrong, with the values, and what would work."""

    def __str__(self) -> str:
        return f"{self.message} [rule {self.rule}]"


class IllegalPlan(ConfigError):
    """A plan that breaks a legality rule; `violations` holds all of them, the message the first."""

    def __init__(self, violations: list[Violation]) -> None:
        self.violations = violations
        more = f" (and {len(violations) - 1} more)" if len(violations) > 1 else ""
        super().__init__(f"the plan cannot run: {violations[0]}{more}")


# ---- how data parallelism is carried ---------------------------------------------------------
Carrier = Literal["none", "ddp", "fully_shard"]


@dataclass(frozen=True)
class DataParallelMode:
    """How plait's executor runs a plan's data parallelism; the cost model prices exactly this."""

    carrier: Carrier
    """"ddp": DistributedDataParallel (+ ZeroRedundancyOptimizer for ZeRO-1); "fully_shard": FSDP2;
    "none": one replica."""
    reshard_after_forward: bool
    """fully_shard frees gathered parameters after each unit's forward (ZeRO-3) or keeps them until
    backward (ZeRO-2, and ZeRO 0/1 on fully_shard)."""
    held_zero: int
    """The ZeRO stage whose memory a rank holds at its peak."""


def data_parallel_mode(degrees: Degrees, zero: int) -> DataParallelMode:
    """DDP carries ZeRO 0/1 where it can: one replica of plain tensors without a pipeline. DDP takes no
    DTensor parameters (tensor or context parallelism make them), and its reducer breaks under a
    pipeline schedule, which runs several forwards before their backwards ("rebuilt parameter indices
    size is not same"; torchtitan never pairs DDP with PP either); expert parallelism's experts must stay out
    of the data-parallel reduction DDP would run over all of dp; there ZeRO 0/1 ride on
    `fully_shard(reshard_after_forward=False)`: the same numerics, no more memory. ZeRO-3 under a
    pipeline keeps its parameters gathered through the schedule (resharding between a micro-batch's
    forward and backward gives wrong gradients with some schedules and a gather per micro-batch; it is
    torchtitan's default there too), which is ZeRO-2's memory."""
    if degrees.dp == 1 and degrees.cp == 1:
        return DataParallelMode("none", False, 0)
    pipelined = degrees.pp > 1
    if zero <= 1 and degrees.tp == 1 and degrees.cp == 1 and degrees.ep == 1 and not pipelined:
        return DataParallelMode("ddp", False, zero)
    reshard = zero == 3 and not pipelined
    return DataParallelMode("fully_shard", reshard, 2 if zero == 3 and pipelined else zero)


def expert_shards(degrees: Degrees, mode: DataParallelMode) -> int:
    """Ranks the data-parallel carrier shards each expert over: on fully_shard, the ranks holding copies of the
    same experts, edp x cp (edp = dp / ep; torchtitan's FSDP over "dp_mod_ep"); elsewhere none (1). Only experts
    that expert or tensor parallelism splits are apart from the dense weights (plait/execute/data.py)."""
    return degrees.dp // degrees.ep * degrees.cp if mode.carrier == "fully_shard" else 1


# ---- rules ---------------------------------------------------------------------------------------
def _divisors(value: int, limit: int = 64) -> str:
    return ", ".join(str(d) for d in range(1, min(value, limit) + 1) if value % d == 0)


def tensor_problems(model: "ModelSpec", tp: int) -> list[Violation]:
    """Tensor parallelism splits heads, kv-heads and the MLP's inner width evenly (each rank reshapes its
    slice into whole heads); the vocabulary may split unevenly."""
    sizes = {"num_heads": model.num_heads, "num_kv_heads": model.num_kv_heads,
             "ffn_hidden_size": model.ffn_hidden_size}
    if model.source.startswith("hf:") and tp % model.num_kv_heads == 0:
        del sizes["num_kv_heads"]  # fewer kv heads than tp: each is replicated over tp / num_kv_heads ranks
    if model.num_experts:
        sizes["moe_ffn_hidden_size"] = model.moe_ffn_hidden_size
    return [Violation(f"tp-divides-{name}", f"{name}={value} is not divisible by tp={tp}; use a tp that "
                      f"divides it (divisors: {_divisors(value)})")
            for name, value in sizes.items() if tp > 1 and value % tp] + _class_tensor_problems(model, tp)


HF_TP_STYLES = {"colwise": "colwise", "rowwise": "rowwise", "replicated_with_grad_allreduce": "head_norm",
                "packed_colwise": "colwise_packed:2", "colwise_gather_output": "colwise_gather",
                "rowwise_split_input": "rowwise_split", "mla_kv_a_proj": "mla_kv_a:{qk_rope_head_dim}",
                "local_params": "local_params", "moe_tp_experts": "experts", "all_reduce": "replicate_module"}
"""transformers' tensor-parallel styles inside a block that plait runs, -> plait's style (plait.models.adapter.STYLES;
"{key}" is the config's value of key; "all_reduce", a module whose partial output transformers sums after splitting
what it holds, runs whole on every rank instead: the same sum, no split).
A Hugging Face class whose plan (ModelSpec.tp_plan) holds any other style is refused under tp > 1."""
UNPLACED = "unplaced"
"""ModelSpec.tp_plan's mark of a module with parameters a class's tensor-parallel plan places nowhere."""
NO_TENSOR_PLAN = "(none)"
"""ModelSpec.tp_plan's one entry for a Hugging Face class that declares no tensor-parallel plan and whose layers
plait cannot split itself (plait.hf.tensor_plan); its value says why."""
PLAIT_STYLE = "plait:"
"""Prefix of a style plait wrote for a class that declares none (GPT-2: plait.hf.adapter.WRITTEN_TP_PLANS)."""
HF_EP_STYLES = ("grouped_gemm", "ep_dispatch_experts")
"""transformers' expert-parallel styles plait runs (plait/hf/expert_parallel.py): the experts' weights split by
expert, the tokens dispatched to them."""


def under_class_experts(plan: dict[str, str]) -> set[str]:
    """The patterns of a class's tensor plan inside its experts module (style moe_tp_experts): the experts' own
    weights, which plait splits itself, Megatron's way, whatever the plan names them (plait/hf/expert_parallel.py)."""
    experts = [pattern for pattern, style in plan.items() if style == "moe_tp_experts"]
    return {pattern for pattern in plan if any(pattern.startswith(e + ".") for e in experts)}


def under_replicated_modules(plan: dict[str, str]) -> set[str]:
    """The patterns of a tensor plan inside a module plait runs whole on every tensor rank (style
    plait:replicate_module, plait.hf.flow; a class's "all_reduce"): the class's placements there are not
    applied."""
    roots = [pattern for pattern, style in plan.items()
             if style == PLAIT_STYLE + "replicate_module" or HF_TP_STYLES.get(style) == "replicate_module"]
    return {pattern for pattern in plan if any(pattern.startswith(root + ".") for root in roots)}


def _class_tensor_problems(model: "ModelSpec", tp: int) -> list[Violation]:
    """A Hugging Face class (source "hf:") runs tensor parallelism as its own plan declares it (ModelSpec.tp_plan)."""
    if tp == 1 or not model.source.startswith("hf:"):
        return []
    if not model.tp_plan or NO_TENSOR_PLAN in model.tp_plan:
        why = (model.tp_plan or {}).get(NO_TENSOR_PLAN)
        derived = f", and plait cannot split its layers itself: {why}" if why else ""
        return [Violation("tp-needs-class-plan", f"tp={tp}: {model.name} declares no tensor-parallel plan "
                          f"(base_model_tp_plan){derived}; use tp=1 (data parallelism, FSDP and pipelines need no "
                          f"plan)")]
    unplaced = [pattern for pattern, style in model.tp_plan.items() if style == UNPLACED]
    if unplaced:
        return [Violation("tp-places-parameters", f"tp={tp}: {model.name}'s module {unplaced[0]} holds parameters its "
                          f"tensor-parallel plan places nowhere (a tensor rank could see part of its input and keep a "
                          f"partial gradient); use tp=1")]
    inside_experts = under_class_experts(model.tp_plan) | under_replicated_modules(model.tp_plan)
    unknown = [(pattern, style) for pattern, style in model.tp_plan.items() if pattern not in inside_experts
               and style not in HF_TP_STYLES and not style.startswith(PLAIT_STYLE)]
    if unknown:
        pattern, style = unknown[0]
        return [Violation("tp-style-runs", f"tp={tp}: {model.name}'s module {pattern} has tensor-parallel style "
                          f"{style!r}, which plait does not run (it runs {', '.join(HF_TP_STYLES)}); use tp=1")]
    return []


def sequence_problems(model: "ModelSpec", seq_len: int, tp: int, sequence_parallel: bool, cp: int = 1
                      ) -> list[Violation]:
    out = []
    if model.positions == "learned" and seq_len > model.max_seq_len:
        out.append(Violation("seq-len-fits-positions", f"seq_len={seq_len} exceeds {model.name}'s max_seq_len="
                             f"{model.max_seq_len} (a learned position table); use seq_len <= {model.max_seq_len}"))
    if model.sliding_window and seq_len > model.sliding_window and not model.source.startswith("hf:"):
        # a Hugging Face class builds its own window masks (plait.hf.adapter); plait's decoders have no window
        out.append(Violation("seq-len-within-window", f"seq_len={seq_len} exceeds {model.name}'s sliding_window="
                             f"{model.sliding_window}; this model's attention in plait is causal over the whole "
                             f"sequence, which equals a window only up to its length: use seq_len <= "
                             f"{model.sliding_window}, or the model's Hugging Face folder"))
    if sequence_parallel and tp > 1 and (seq_len // cp) % tp:
        out.append(Violation("sp-divides-seq", f"seq_len={seq_len} (per context rank: {seq_len // cp}) is not "
                             f"divisible by tp={tp}, which sequence parallelism needs; pick a multiple of {tp * cp} "
                             f"or turn sequence parallelism off"))
    if cp > 1 and seq_len % (2 * cp):
        out.append(Violation("cp-divides-seq", f"seq_len={seq_len} is not divisible by 2 x cp = {2 * cp} (cp={cp}): context "
                             f"parallelism gives each rank two balanced chunks of every sequence; pick a multiple "
                             f"of {2 * cp}"))
    return out


def context_problems(model: "ModelSpec", degrees: Degrees, kind: str) -> list[Violation]:
    """Context parallelism swaps the attention of a model whose positions plait controls (its own decoders and
    Hugging Face models; a module:factory model computes its positions itself)."""
    if degrees.cp == 1:
        return []
    if model.source.startswith("module:"):
        return [Violation("cp-needs-known-positions", f"cp={degrees.cp}: a module:factory model computes its own "
                          f"positions and attention, which context parallelism must replace; use cp=1")]
    local_heads = model.num_heads // degrees.tp
    if kind == "all_to_all" and local_heads % degrees.cp:
        return [Violation("a2a-cp-divides-heads", f"all-to-all context parallelism splits the {local_heads} heads of a "
                          f"tensor rank over cp={degrees.cp}; use cp among {_divisors(local_heads)} or "
                          f"context_parallel='all_gather'")]
    return []


def expert_problems(model: "ModelSpec", ep: int) -> list[Violation]:
    if ep == 1:
        return []
    if not model.num_experts:
        return [Violation("ep-needs-experts", f"ep={ep} needs a mixture-of-experts model; {model.name} has no "
                          f"experts (use ep=1)")]
    if model.source.startswith("hf:"):
        problems = _class_expert_problems(model, ep)
        if problems:
            return problems
    if model.num_experts % ep:
        return [Violation("ep-divides-experts", f"num_experts={model.num_experts} is not divisible by ep={ep}; "
                          f"use an ep among {_divisors(model.num_experts)}")]
    return []


def _class_expert_problems(model: "ModelSpec", ep: int) -> list[Violation]:
    """A Hugging Face class splits its experts over ep as its own expert-parallel plan declares (ModelSpec.ep_plan):
    the experts' weights by expert, the tokens dispatched to them; any other style is refused."""
    if not model.ep_plan:
        return [Violation("ep-needs-class-plan", f"ep={ep}: {model.name} declares no expert-parallel plan "
                          f"(base_model_ep_plan) for its experts; use ep=1")]
    unknown = [(pattern, style) for pattern, style in model.ep_plan.items() if style not in HF_EP_STYLES]
    if unknown:
        pattern, style = unknown[0]
        return [Violation("ep-style-runs", f"ep={ep}: {model.name}'s module {pattern} has expert-parallel style "
                          f"{style!r}, which plait does not run (it runs {', '.join(HF_EP_STYLES)}); use ep=1")]
    return []


def stage_problems(num_layers: int, pp: int, interleave: int, layers_per_stage: tuple[int, ...] = ()
                   ) -> list[Violation]:
    """Every virtual stage but the first and last holds a layer (the ends may hold only the embedding
    or the output layer)."""
    stages = pp * interleave
    if num_layers < stages - 2 or (num_layers < stages and not layers_per_stage):
        return [Violation("stages-fit-layers", f"the model has {num_layers} layers, fewer than the plan's {stages} "
                          f"pipeline stages (pp={pp} x interleave={interleave}); use at most {num_layers} stages")]
    empty = [s for s in range(1, stages - 1) if layers_per_stage and layers_per_stage[s] == 0]
    if empty:
        return [Violation("middle-stages-hold-layers", f"pipeline stages {empty} have no layers (layers_per_stage="
                          f"{list(layers_per_stage)}); only the first and last stage may be empty")]
    return []


SCHEDULE_NEEDS = {
    "gpipe": "any number of micro-batches",
    "1f1b": "num_micro_batches >= pp",
    "interleaved": "num_micro_batches a multiple of pp and interleave >= 2",
}


def interleave_problems(pp: int, interleave: int) -> list[Violation]:
    """Interleaving splits each pipeline rank's layers into chunks: without a pipeline there is nothing to
    interleave, and a pin that asks for it must not be dropped in silence."""
    if interleave > 1 and pp == 1:
        return [Violation("interleave-needs-pp", f"interleave={interleave} needs pipeline parallelism (pp >= 2), "
                          f"but pp=1; pin a pp of 2 or more, or drop the interleave")]
    return []


def schedule_problems(schedule: str, pp: int, num_micro_batches: int, interleave: int) -> list[Violation]:
    """What torch.distributed.pipelining's schedules need (PyTorch raises mid-run otherwise)."""
    m = num_micro_batches
    if pp == 1:
        return interleave_problems(pp, interleave)
    if schedule == "1f1b" and m < pp:
        return [Violation("1f1b-needs-micro-batches", f"schedule 1f1b needs num_micro_batches >= pp, got "
                          f"{m} < {pp}; use gpipe or more micro-batches")]
    if schedule == "interleaved" and (m % pp or interleave < 2):
        return [Violation("interleaved-needs", f"schedule interleaved needs num_micro_batches % pp == 0 and "
                          f"interleave >= 2, got num_micro_batches={m}, pp={pp}, interleave={interleave}")]
    if schedule in ("zbv", "dualpipev"):
        if interleave != 2:
            return [Violation("v-schedule-needs-two-chunks", f"schedule {schedule} holds exactly two stages per "
                              f"rank (a V); set interleave=2, got {interleave}")]
        if schedule == "dualpipev" and m < 2 * pp:
            return [Violation("dualpipev-needs-micro-batches", f"schedule dualpipev needs num_micro_batches >= "
                              f"2 x pp = {2 * pp}, got {m}")]
        return []
    if schedule != "interleaved" and interleave > 1:
        return [Violation("interleave-needs-interleaved", f"interleave={interleave} needs schedule "
                          f"'interleaved', not {schedule!r}")]
    return []


def carrier_problems(degrees: Degrees, zero: int, carrier: str) -> list[Violation]:
    if carrier == "ddp" and (degrees.tp > 1 or degrees.pp > 1 or degrees.cp > 1 or degrees.ep > 1 or zero >= 2):
        return [Violation("ddp-needs-plain-replicas", f"data_parallel='ddp' cannot carry {degrees.describe()} "
                          f"zero{zero}: DDP takes no DTensor parameters (tp, cp), breaks under a pipeline "
                          f"schedule and shards nothing (ZeRO-2/3); use 'fully_shard'")]
    return []


def grad_sync_problems(pp: int, grad_sync: str) -> list[Violation]:
    if grad_sync == "micro_batch" and pp > 1:
        return [Violation("grad-sync-under-pipeline", f"grad_sync='micro_batch' with pp={pp}: torch's pipeline "
                          "schedules reduce the gradients once, after the last micro-batch; use grad_sync='step'")]
    return []


def group_problems(plan: "Plan") -> list[Violation]:
    """On a mixed cluster every pipeline rank names its device group, and each group's devices are all used by the
    pipeline ranks on it (dp x cp x tp of them each)."""
    cluster, groups = plan.cluster, plan.stage_groups
    if not cluster.mixed:
        if groups:
            return [Violation("groups-need-mixed-cluster", f"stage_groups={list(groups)} given, but cluster "
                              f"{cluster.name!r} has no device groups; drop stage_groups")]
        return []
    names = [g.name for g in cluster.groups]
    if len(groups) != plan.pp or any(g not in names for g in groups):
        return [Violation("stage-groups", f"stage_groups={list(groups)} must name one of {names} for each of the "
                          f"pp={plan.pp} pipeline ranks")]
    block = plan.dp * plan.cp * plan.tp
    out = []
    for g in cluster.groups:
        used = groups.count(g.name) * block
        if used != g.num_devices:
            out.append(Violation("groups-fully-used", f"group {g.name!r} has {g.num_devices} devices but the plan "
                                 f"puts {groups.count(g.name)} pipeline rank(s) of dp x cp x tp = {block} there "
                                 f"({used}); each group's devices must be used by whole pipeline ranks"))
    return out


def world_problems(degrees: Degrees, world_size: int) -> list[Violation]:
    if degrees.world_size == world_size:
        return []
    product = " x ".join(f"{a}={degrees[a]}" for a in ("pp", "dp", "cp", "tp") if degrees[a] > 1) or "1"
    return [Violation("world-size", f"the plan needs {product} = {degrees.world_size} ranks but the world has "
                      f"{world_size}; launch {degrees.world_size} processes (--nproc {degrees.world_size}) or plan "
                      f"for {world_size} devices")]


def check_world(degrees: Degrees, world_size: int) -> None:
    problems = world_problems(degrees, world_size)
    if problems:
        raise IllegalPlan(problems)


def plan_problems(plan: "Plan", world_size: int | None = None) -> list[Violation]:
    """Every rule `plan` breaks (empty: it runs)."""
    d, model = plan.degrees, plan.model
    out = world_problems(d, world_size) if world_size is not None else []
    out += tensor_problems(model, d.tp)
    out += sequence_problems(model, plan.train.seq_len, d.tp, plan.sequence_parallel, d.cp)
    out += context_problems(model, d, plan.context_parallel)
    out += expert_problems(model, d.ep)
    out += stage_problems(model.num_layers, d.pp, plan.interleave, plan.layers_per_stage)
    out += schedule_problems(plan.schedule, d.pp, plan.num_micro_batches, plan.interleave)
    out += carrier_problems(d, plan.zero, plan.data_parallel)
    out += grad_sync_problems(d.pp, plan.grad_sync)
    out += group_problems(plan)
    return out


def check(plan: "Plan", world_size: int | None = None) -> None:
    """Raise IllegalPlan (a ConfigError: exit 2) naming the first rule `plan` breaks."""
    problems = plan_problems(plan, world_size)
    if problems:
        raise IllegalPlan(problems)
