"""The Plan: the door between the planner and the executor.

A Plan is a frozen, self-contained description of one way to train one model: the
parallel degrees and every other choice, the model, training and cluster specs it was
made for, and (when the planner made it) what the cost model predicted. It round-trips
through JSON; a hand-written plan file is equally valid input to the executor.

The parallel degrees live in one mapping of mesh axes, `degrees` (plait.axes): a new dimension is one
entry there, not a field here. `plan.dp`, `plan.tp`, ... read it.

Pipeline stages are *virtual* stages in model order: with `pp` devices per pipeline and
`interleave` = v model chunks per device there are pp·v of them, and virtual stage k
lives on pipeline rank k % pp (chunk k // pp) -- the layout of Megatron's and PyTorch's
interleaved 1F1B. The first virtual stage also holds the embedding, the last the final
norm and output layer.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from plait.axes import ALL_AXES, Degrees, OnAxes
from plait.errors import ConfigError
from plait.legality import DataParallelMode, data_parallel_mode, expert_shards
from plait.operators.solution import OperatorSharding
from plait.spec import ClusterSpec, ModelSpec, TrainSpec
from plait.spec._dict import from_dict, to_dict

if TYPE_CHECKING:
    from plait.cost.compute import Slicing

Recompute = Literal["none", "selective", "full"]
Schedule = Literal["gpipe", "1f1b", "interleaved", "zbv", "dualpipev"]
RECOMPUTE_MODES: tuple[str, ...] = ("none", "selective", "full")
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved", "zbv", "dualpipev")
GRAD_SYNCS: tuple[str, ...] = ("step", "micro_batch")
V_SCHEDULES: tuple[str, ...] = ("zbv", "dualpipev")
"""Zero-bubble schedules on a V: pipeline rank r holds virtual stages r and 2·pp - 1 - r (Qi et al. 2024, ZB-V;
DeepSeek's DualPipeV), so the first and last stage share rank 0."""


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """What the cost model expects of a plan. Times in seconds, memory in bytes per device."""

    step_time_s: float
    step_time_parts: dict[str, float] = field(default_factory=dict)
    """Additive parts of step_time_s (e.g. compute, recompute, tp_comm, pp_comm, bubble, dp_comm, optimizer)."""
    peak_memory_bytes: float
    memory_parts: dict[str, float] = field(default_factory=dict)
    """Parts of peak_memory_bytes on the peak stage (params, grads, optimizer, activations, buffers, reserve)."""
    memory_per_stage: tuple[float, ...] = ()
    """Peak memory of each pipeline rank (pp entries)."""
    tokens_per_s: float = 0.0
    model_tflops_per_device: float = 0.0
    """Model FLOPs (no recompute counted) per second per device, in TFLOP/s."""
    mfu: float = 0.0
    """model_tflops_per_device over the device's peak."""
    bubble_fraction: float = 0.0
    """Idle fraction of the pipeline schedule."""
    link_bytes_per_step: float = 0.0
    """On a cluster of islands: bytes each island sends over the slow link per (inner) step, on average."""
    link_busy_fraction: float = 0.0
    """On a cluster of islands: the fraction of the run's time the slow link carries the plan's exchanges."""
    goodput_tokens_per_s: float = 0.0
    """With a failure rate (ClusterSpec.failures): tokens/s after checkpoint writes, lost work and restarts
    or recoveries (plait/cost/failures.py); 0: not priced."""
    checkpoint_interval_s: float = 0.0
    """With a failure rate: the checkpoint interval that maximises goodput (Young/Daly); 0: not priced."""


ISLAND_METHODS: tuple[str, ...] = ("sync", "diloco")
PSEUDO_GRADIENT_PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "int8")


@dataclass(frozen=True, kw_only=True)
class IslandPlan:
    """How the islands of a cluster (ClusterSpec.islands) train together; each runs the Plan's degrees inside.

    "sync": data parallelism across islands, every step's gradients all-reduced over the slow link (HSDP's
    outer replication). "diloco": each island takes `inner_steps` (H) steps of its own, then the islands average
    their pseudo-gradients (start weights minus end weights) and take one outer step (Douillard et al. 2023,
    arXiv 2311.08105); with `fragments` > 1 the model's blocks are exchanged in turn, one fragment every
    H / fragments steps, each exchange overlapped with `overlap` inner steps (streaming DiLoCo, arXiv 2501.18512)."""

    count: int
    """Islands (replica groups), each running the Plan's degrees on its own devices."""
    method: Literal["sync", "diloco"] = "diloco"
    inner_steps: int = 1
    """H: inner steps between two exchanges of a fragment (1 under "sync")."""
    fragments: int = 1
    """Parts of the model exchanged in turn (streaming DiLoCo); 1: the whole model at once."""
    precision: Literal["fp32", "bf16", "int8"] = "fp32"
    """Element type of the pseudo-gradients on the slow link."""
    overlap: int = 0
    """Inner steps a fragment's exchange runs behind the training before it is applied (streaming DiLoCo's tau);
    0: the islands wait for it."""

    def __post_init__(self) -> None:
        for name in ("count", "inner_steps", "fragments"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"islands.{name}={value!r} must be a positive integer"
                                 + (" (H: inner steps between outer steps)" if name == "inner_steps" else ""))
        if self.count < 2:
            raise ValueError(f"islands.count={self.count} must be >= 2")
        if self.method not in ISLAND_METHODS:
            raise ValueError(f"islands.method={self.method!r} is not one of {', '.join(ISLAND_METHODS)}")
        if self.precision not in PSEUDO_GRADIENT_PRECISIONS:
            raise ValueError(f"islands.precision={self.precision!r} is not one of "
                             f"{', '.join(PSEUDO_GRADIENT_PRECISIONS)}")
        if self.method == "sync" and (self.inner_steps, self.fragments, self.overlap) != (1, 1, 0):
            raise ValueError("islands.method='sync' exchanges gradients every step: inner_steps 1, fragments 1, "
                             "overlap 0")
        if self.inner_steps % self.fragments:
            raise ValueError(f"islands.inner_steps={self.inner_steps} must be a multiple of fragments="
                             f"{self.fragments} (one fragment is exchanged every H / fragments steps)")
        if not 0 <= self.overlap < self.inner_steps // self.fragments:
            raise ValueError(f"islands.overlap={self.overlap} must lie in [0, inner_steps / fragments = "
                             f"{self.inner_steps // self.fragments}): a fragment's exchange must land before its next")

    @property
    def sync_every(self) -> int:
        """Inner steps between two exchanges (of successive fragments)."""
        return self.inner_steps // self.fragments

    def exchange(self) -> str:
        """'diloco H=100 frag4 bf16 overlap1' or 'sync'."""
        if self.method == "sync":
            return "sync"
        parts = ["diloco", f"H={self.inner_steps}"]
        if self.fragments > 1:
            parts.append(f"frag{self.fragments}")
        parts.append(self.precision)
        if self.overlap:
            parts.append(f"overlap{self.overlap}")
        return " ".join(parts)

    def describe(self) -> str:
        """'islands2 diloco H=100 frag4 bf16 overlap1' or 'islands2 sync'."""
        return f"islands{self.count} {self.exchange()}"


def stage_rank(schedule: str, pp: int, stage: int) -> int:
    """The pipeline rank that holds virtual stage `stage`: a loop (stage % pp), or a V for ZB-V and DualPipeV
    (rank r holds stages r and 2·pp - 1 - r)."""
    if schedule in V_SCHEDULES and pp > 1:
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


@lru_cache(maxsize=1024)
def rank_stages(schedule: str, pp: int, interleave: int) -> tuple[tuple[int, ...], ...]:
    """Per pipeline rank, its virtual stages in chunk order (`stage_rank`'s inverse; cached: the search asks
    thousands of times)."""
    if schedule in V_SCHEDULES and pp > 1:
        return tuple((rank, 2 * pp - 1 - rank) for rank in range(pp))
    return tuple(tuple(rank + chunk * pp for chunk in range(interleave)) for rank in range(pp))


@dataclass(frozen=True, kw_only=True)
class Layout(OnAxes):
    """How a plan lays the work out: the parallel degrees and every choice the cost depends on except the stage
    split and the recompute modes. The search prices thousands of these before it builds a single Plan; a Plan
    holds one. Its canonical form is made here, once, so equal choices compare equal: sequence parallelism only
    with tp > 1, the 1F1B schedule without a pipeline, the key/value exchange only with cp > 1, when gradients are
    reduced only where there is a choice, and how data parallelism is carried by plait.legality's rule unless
    chosen."""

    degrees: Degrees
    """Degree of every parallel axis (plait.axes.AXES: pp, dp, cp, tp; ep inside dp); a dict is accepted."""
    sequence_parallel: bool = False
    """Shard norms/dropout activations along the sequence over the tensor group (only with tp > 1)."""
    zero: int = 0
    """0: plain data parallel (DDP); 1: optimizer states sharded; 2: + gradients; 3: + parameters (FSDP)."""
    data_parallel: Literal["none", "ddp", "fully_shard"] | None = None
    """How the executor carries data parallelism; None: plait.legality.data_parallel_mode's rule (DDP for
    ZeRO 0/1 of plain replicas, fully_shard otherwise), filled in here."""
    micro_batch: int = 1
    """Sequences per micro-batch."""
    num_micro_batches: int = 1
    """Micro-batches per step per data-parallel replica (pipeline micro-batches, or gradient accumulation)."""
    context_parallel: Literal["all_gather", "all_to_all"] = "all_gather"
    """How context-parallel ranks see each other's keys and values (plait/execute/context.py); one value when
    cp = 1."""
    grad_sync: Literal["step", "micro_batch"] = "step"
    """When data-parallel gradients are reduced under accumulation (num_micro_batches > 1, no pipeline): "step", once
    after the last micro-batch (DDP's no_sync; fully_shard accumulates the whole model's gradients unsharded in fp32
    until then); "micro_batch", after every one (fully_shard keeps them sharded, ZeRO's memory, for m reduce-scatters
    a step). Under a pipeline torch's schedule reduces once ("step"). A plan without it: "step", as plait ran
    before the field."""
    schedule: Schedule = "1f1b"
    """Pipeline schedule; "1f1b" when pp == 1."""
    interleave: int = 1
    """Model chunks per pipeline rank (v); > 1 only with the interleaved schedule."""
    stage_groups: tuple[str, ...] = ()
    """On a mixed cluster (ClusterSpec.groups): the device group of each pipeline rank (pp entries); its
    data-, context- and tensor-parallel ranks all live in that group. () on a uniform cluster."""

    def __post_init__(self) -> None:
        if not isinstance(self.degrees, Degrees):
            object.__setattr__(self, "degrees", Degrees.from_plain(self.degrees))
        for name in ("micro_batch", "num_micro_batches", "interleave"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero={self.zero!r} must be 0, 1, 2 or 3")
        if self.grad_sync not in GRAD_SYNCS:
            raise ValueError(f"grad_sync={self.grad_sync!r} is not one of {', '.join(GRAD_SYNCS)}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} is not one of {', '.join(SCHEDULES)}")
        if self.interleave > 1 and self.schedule not in ("interleaved", *V_SCHEDULES):
            raise ValueError(f"interleave={self.interleave} needs schedule='interleaved', not {self.schedule!r}")
        d = self.degrees
        canonical = {
            "sequence_parallel": bool(self.sequence_parallel) and d.tp > 1,
            "schedule": self.schedule if d.pp > 1 or self.interleave > 1 else "1f1b",
            "context_parallel": self.context_parallel if d.cp > 1 else "all_gather",
            "grad_sync": self.grad_sync if self.num_micro_batches > 1 and d.dp * d.cp > 1 else "step",
        }
        if self.data_parallel is None or d.dp * d.cp == 1:
            canonical["data_parallel"] = data_parallel_mode(d, self.zero).carrier
        for name, value in canonical.items():
            object.__setattr__(self, name, value)

    @classmethod
    def make(cls, **fields: Any) -> "Layout":
        """Layout(...) with the degrees given as keywords (dp=2, tp=8, ...)."""
        axes = {a: fields.pop(a) for a in ALL_AXES if a in fields}
        return cls(degrees=Degrees(fields.pop("degrees", None), **axes), **fields)

    @property
    def sp(self) -> bool:
        """Short for sequence_parallel (in cost formulas)."""
        return self.sequence_parallel

    @property
    def num_devices(self) -> int:
        return self.degrees.world_size

    @property
    def num_stages(self) -> int:
        """Virtual pipeline stages: pp · interleave."""
        return self.degrees.pp * self.interleave

    @property
    def shard_degree(self) -> int:
        """Ranks the dense weights' gradients are reduced (and, on fully_shard, sharded) over: dp, and cp, whose
        ranks hold other tokens of the same sequences (the executor's "dp_cp" mesh)."""
        return self.degrees.dp * self.degrees.cp

    @cached_property
    def dp_mode(self) -> DataParallelMode:
        """How the executor carries data parallelism (plait.legality.data_parallel_mode), as this layout says."""
        mode = data_parallel_mode(self.degrees, self.zero)
        return mode if self.data_parallel == mode.carrier else DataParallelMode(self.data_parallel, False, self.zero)

    @property
    def expert_shards(self) -> int:
        """Ranks each expert's weights are sharded over (plait.legality.expert_shards)."""
        return expert_shards(self.degrees, self.dp_mode)

    @cached_property
    def slicing(self) -> "Slicing":
        """How one device's share of a layer is cut (tensor, context and expert parallelism)."""
        from plait.cost.layout import slicing_of

        return slicing_of(self.degrees, self.sequence_parallel, self.context_parallel)

    @property
    def rank_stages(self) -> tuple[tuple[int, ...], ...]:
        """`stages_of` every pipeline rank."""
        return rank_stages(self.schedule, self.degrees.pp, self.interleave)

    def stages_of(self, rank: int) -> list[int]:
        """Virtual stages held by pipeline rank `rank`, in chunk order (a loop, or a V for ZB-V / DualPipeV)."""
        return list(self.rank_stages[rank])

    def rank_of_stage(self, stage: int) -> int:
        """The pipeline rank that holds virtual stage `stage`."""
        return stage_rank(self.schedule, self.degrees.pp, stage)

    @property
    def last_rank(self) -> int:
        """The pipeline rank of the last virtual stage (pp - 1, or 0 on a V)."""
        return self.rank_of_stage(self.num_stages - 1)


LAYOUT_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Layout))


@dataclass(frozen=True, init=False)
class Plan(OnAxes):
    """One way to train one model: its Layout, the stage split and recompute modes, the specs it was made for,
    and what the cost model predicted. `plan.zero`, `plan.dp`, `plan.stages_of(r)`, ... read its layout."""

    layout: Layout
    recompute: tuple[Recompute, ...] = ()
    """Activation recomputation per pipeline rank (pp entries); () means "none" everywhere."""
    layers_per_stage: tuple[int, ...] = ()
    """Transformer layers of each virtual stage in model order (pp·interleave entries); () means even."""
    model: ModelSpec
    train: TrainSpec
    cluster: ClusterSpec
    predicted: Prediction | None = None
    operators: OperatorSharding | None = None
    """Per-operator placements chosen by plait.operators.planner for a module of any shape (None: the model adapter's
    tensor plan)."""
    islands: IslandPlan | None = None
    """On a cluster of islands: how they train together; the layout is then one island's, and global_batch is every
    island's rows together (island_plan() is what each island runs)."""

    def __init__(self, *, model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, layout: Layout | None = None,
                 recompute: Any = (), layers_per_stage: tuple[int, ...] = (), predicted: Prediction | None = None,
                 operators: OperatorSharding | None = None, islands: IslandPlan | None = None,
                 **choices: Any) -> None:
        """Plan(layout=..., ...) or, as plan files spell it, the layout's fields themselves (degrees=..., zero=...)."""
        if layout is None:
            layout = Layout(**choices)
        elif choices:
            layout = dataclasses.replace(layout, **choices)
        fields = dict(layout=layout, model=model, train=train, cluster=cluster, predicted=predicted,
                      operators=operators, islands=islands, recompute=self._recompute(recompute, layout.pp))
        fields["layers_per_stage"] = self._layers(layers_per_stage, layout, model.num_layers)
        for name, value in fields.items():
            object.__setattr__(self, name, value)
        if islands is not None and (cluster.islands is None or cluster.islands.count != islands.count):
            have = cluster.islands.count if cluster.islands else "no"
            raise ValueError(f"islands.count={islands.count}, but cluster {cluster.name!r} has {have} islands;"
                             f" a plan across islands needs the cluster's islands and the link between them "
                             f"(examples/clusters/islands-local.yaml)")
        batch = layout.dp * layout.micro_batch * layout.num_micro_batches * self.num_islands
        if batch != train.global_batch:
            across = f" x islands={self.num_islands}" if islands else ""
            raise ValueError(
                f"dp={layout.dp} x micro_batch={layout.micro_batch} x num_micro_batches={layout.num_micro_batches}"
                f"{across} = {batch} must equal global_batch={train.global_batch}"
            )

    @staticmethod
    def _recompute(recompute: Any, pp: int) -> tuple[str, ...]:
        recompute = recompute or ("none",) * pp
        if isinstance(recompute, str):
            recompute = (recompute,) * pp
        if len(recompute) == 1 and pp > 1:
            recompute = tuple(recompute) * pp
        if len(recompute) != pp or any(r not in RECOMPUTE_MODES for r in recompute):
            raise ValueError(f"recompute={list(recompute)} must hold {pp} entries (one per pipeline rank) "
                             f"from {', '.join(RECOMPUTE_MODES)}")
        return tuple(recompute)

    @staticmethod
    def _layers(layers: tuple[int, ...], layout: Layout, num_layers: int) -> tuple[int, ...]:
        stages = layout.num_stages
        layers = tuple(layers or even_split(num_layers, stages))
        if len(layers) != stages or sum(layers) != num_layers or min(layers) < 0:
            raise ValueError(
                f"layers_per_stage={list(layers)} must hold {stages} non-negative entries "
                f"(pp={layout.pp} x interleave={layout.interleave}) summing to num_layers={num_layers}"
            )
        return layers

    def __getattr__(self, name: str) -> Any:
        """The layout's fields, properties and methods (plan.zero, plan.dp_mode, plan.stages_of(r)): written once,
        on the Layout."""
        layout = self.__dict__.get("layout")
        if layout is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(layout, name)

    def axis(self, name: str) -> int:
        return self.layout.degrees[name]

    @property
    def num_islands(self) -> int:
        return self.islands.count if self.islands else 1

    @property
    def num_devices(self) -> int:
        """Every device of the plan: one island's degrees times the islands."""
        return self.layout.degrees.world_size * self.num_islands

    def island_plan(self) -> "Plan":
        """What one island runs: this plan on one island's devices and rows, as a plain plan (itself without
        islands)."""
        if self.islands is None:
            return self
        train = dataclasses.replace(self.train, global_batch=self.train.global_batch // self.num_islands)
        return self.replace(islands=None, train=train, cluster=self.cluster.island_view())

    # ---- derived ---------------------------------------------------------------
    def stage_layers(self, stage: int) -> range:
        """Indices of the transformer layers of virtual stage `stage`."""
        start = sum(self.layers_per_stage[:stage])
        return range(start, start + self.layers_per_stage[stage])

    def stages_of_rank(self, pp_rank: int) -> list[int]:
        """Virtual stages held by pipeline rank `pp_rank` (Layout.stages_of)."""
        return self.layout.stages_of(pp_rank)

    def describe(self) -> str:
        """One line a person can read: 'dp2 tp2 pp2 sp zero1 1f1b mb1x4 recompute=none,full layers=3|3' (with
        'cp4 context=all_to_all', 'ep8' where context or expert parallelism is on)."""
        parts = [self.degrees.describe()]
        if self.cp > 1:
            parts.append(f"context={self.context_parallel}")
        if self.sequence_parallel:
            parts.append("sp")
        parts.append(f"zero{self.zero}")
        if self.pp > 1:
            parts.append(self.schedule + (f"(v={self.interleave})" if self.interleave > 1 else ""))
        parts.append(f"mb{self.micro_batch}x{self.num_micro_batches}")
        if self.grad_sync != "step":
            parts.append(f"sync={self.grad_sync}")
        if self.stage_groups:
            parts.append("groups=" + "|".join(self.stage_groups))
        modes = sorted(set(self.recompute))
        parts.append("recompute=" + (modes[0] if len(modes) == 1 else ",".join(self.recompute)))
        if self.num_stages > 1:
            parts.append("layers=" + "|".join(map(str, self.layers_per_stage)))
        if self.islands:
            parts.append(self.islands.describe())
        return " ".join(parts)

    def replace(self, **changes: Any) -> "Plan":
        """A copy with `changes`: the plan's own fields, the layout's (zero=1, schedule="gpipe") or axis names
        (dp=4, cp=2, ...), which change the degrees."""
        axes = {a: changes.pop(a) for a in ALL_AXES if a in changes}
        if axes:
            changes["degrees"] = Degrees(changes.get("degrees", self.layout.degrees), **axes)
        choices = {name: changes.pop(name) for name in LAYOUT_FIELDS if name in changes}
        layout = dataclasses.replace(changes.pop("layout", self.layout), **choices)
        kept = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "layout"}
        return Plan(layout=layout, **{**kept, **changes})

    @classmethod
    def of(cls, **fields: Any) -> "Plan":
        """Plan(...) with the degrees given as keywords: ``Plan.of(dp=2, tp=2, model=..., ...)``."""
        axes = {a: fields.pop(a) for a in ALL_AXES if a in fields}
        return cls(degrees=Degrees(fields.pop("degrees", None), **axes), **fields)

    # ---- JSON ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The plan file's form: the layout's fields at the top level, beside the plan's own."""
        out = to_dict(self.layout)
        out.update((k, v) for k, v in to_dict(self).items() if k != "layout")
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Plan":
        """A Plan from its JSON form. By hand, "model" and "cluster" may name a preset (or a spec file) instead of
        spelling out every field: {"model": "tiny-gpt", "cluster": "local-cpu", ...}."""
        if isinstance(data, dict) and "degrees" not in data and any(a in data for a in ALL_AXES):
            # plan files of plait <= 0.1 held the degrees as top-level keys
            data = dict(data)
            data["degrees"] = {a: data.pop(a) for a in ALL_AXES if a in data}
        named_cluster = isinstance(data, dict) and isinstance(data.get("cluster"), str)
        if isinstance(data, dict) and (named_cluster or isinstance(data.get("model"), str)):
            data = _named_specs(data)
        written = from_dict(_PlanFile, _as_plan_file(data), "plan")
        try:
            plan = written.plan()
        except ValueError as e:  # what the plan's own checks refuse, named like a key's error
            raise ConfigError(f"plan: {e}") from None
        if named_cluster:  # a preset's device count is its own; this plan runs on its degrees' world
            plan = plan.replace(cluster=plan.cluster.with_devices(plan.num_devices))
        return plan

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> "Plan":
        """Read a plan from JSON text, a plan file, or a `plait plan --json` file (its best plan)."""
        text, where = str(text_or_path), "plan"
        if not text.lstrip().startswith("{"):
            path = Path(text)
            if not _is_file(path):
                raise ConfigError(f"plan file {str(path)!r} does not exist; write one with `plait plan --json FILE`")
            from plait.inputs import read_text

            text, where = read_text(path, "plan file"), f"plan file {str(path)!r}"
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
        if isinstance(data, dict) and "plans" in data:
            if not isinstance(data["plans"], list) or not data["plans"]:
                raise ConfigError(f"{where} holds no plans (the search found none that fit)")
            data = data["plans"][0]
        if where == "plan":
            return cls.from_dict(data)
        try:
            return cls.from_dict(data)
        except ConfigError as e:  # name the file: the user may have several
            raise ConfigError(f"{where}: {e}") from None


def _plan_from_file(self) -> Plan:
    fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    layout = Layout(**{name: fields.pop(name) for name in LAYOUT_FIELDS})
    return Plan(layout=layout, **fields)


_PlanFile = dataclasses.make_dataclass(
    "_PlanFile",
    [(f.name, f.type, dataclasses.field(default=f.default) if f.default is not dataclasses.MISSING else
      dataclasses.field()) for f in dataclasses.fields(Plan) if f.name != "layout"],
    bases=(Layout,), frozen=True, kw_only=True,
    namespace={"__module__": __name__, "plan": _plan_from_file,
               "__doc__": "A plan file as written: the layout's fields and the plan's own side by side, made from "
                          "the Plan's fields (what `Plan.from_dict` reads, so that every key is checked, and named, "
                          "at the top level where the file has it)."})


def _as_plan_file(data: Any) -> Any:
    return data if not isinstance(data, Plan) else {**{n: getattr(data.layout, n) for n in LAYOUT_FIELDS},
                                                    **{f.name: getattr(data, f.name)
                                                       for f in dataclasses.fields(data) if f.name != "layout"}}


def _named_specs(data: dict[str, Any]) -> dict[str, Any]:
    from plait.spec.load import load_cluster, load_model

    data = dict(data)
    if isinstance(data.get("model"), str):
        data["model"] = load_model(data["model"])
    if isinstance(data.get("cluster"), str):
        data["cluster"] = load_cluster(data["cluster"])
    return data


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # not a usable path at all (e.g. a name too long: malformed JSON text)
        return False


def even_split(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """Layers per stage as even as possible, the remainder on the middle stages (the ends carry embedding and head)."""
    base, extra = divmod(num_layers, num_stages)
    counts = [base] * num_stages
    order = sorted(range(num_stages), key=lambda s: (s in (0, num_stages - 1), abs(s - (num_stages - 1) / 2)))
    for s in order[:extra]:
        counts[s] += 1
    return tuple(counts)
