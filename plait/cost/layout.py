"""The choices a cost is computed for: a Plan without its stage split and recompute modes.

The search prices thousands of these before it builds a single Plan; the Plan's own
fields map one to one (`Layout.of(plan)`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

from plait.axes import ALL_AXES, Degrees
from plait.cost.compute import Slicing
from plait.legality import DataParallelMode, data_parallel_mode, expert_shards
from plait.plan import Plan
from plait.spec import ClusterSpec, ModelSpec, TrainSpec


@lru_cache(maxsize=1024)
def _rank_stages(schedule: str, pp: int, interleave: int) -> tuple[tuple[int, ...], ...]:
    from plait.cost.schedule import V_SCHEDULES

    if schedule in V_SCHEDULES and pp > 1:
        return tuple((rank, 2 * pp - 1 - rank) for rank in range(pp))
    return tuple(tuple(rank + chunk * pp for chunk in range(interleave)) for rank in range(pp))


def slicing_of(degrees: Degrees, sp: bool, context_parallel: str) -> Slicing:
    """Layout.slicing of a layout with these degrees, sequence parallelism and key/value exchange."""
    d = degrees
    return Slicing(tp=d.tp, sp=sp, cp=d.cp, cp_kind=context_parallel, ep=d.ep)


@dataclass(frozen=True)
class Setting:
    """What is fixed during one search: the model, the cluster and the training step."""

    model: ModelSpec
    cluster: ClusterSpec
    train: TrainSpec

    @property
    def dtype_bytes(self) -> int:
        """Bytes of the compute dtype as the executor runs it: the plan's precision on GPUs; CPU processes run
        fp32 whatever the plan says (plait.execute.parallelize: 16-bit matmuls are slow there)."""
        return 4 if self.cluster.device_type == "cpu" else self.train.param_bytes

    @property
    def seq_len(self) -> int:
        return self.train.seq_len

    def at(self, layout: "Layout", rank: int) -> "Setting":
        """The setting pipeline rank `rank` is priced in: its device group's hardware on a mixed cluster."""
        if not layout.stage_groups:
            return self
        return Setting(self.model, self.cluster.view(layout.stage_groups[rank]), self.train)


@dataclass(frozen=True)
class Layout:
    degrees: Degrees
    sp: bool
    zero: int
    micro_batch: int
    num_micro_batches: int
    schedule: str
    interleave: int
    data_parallel: str | None = None
    """As Plan.data_parallel; None: the rule's choice."""
    stage_groups: tuple[str, ...] = ()
    """As Plan.stage_groups: each pipeline rank's device group on a mixed cluster."""
    context_parallel: str = "all_gather"
    """As Plan.context_parallel: how context-parallel ranks exchange keys and values (one value when cp = 1)."""
    grad_sync: str = "step"
    """As Plan.grad_sync: data-parallel gradients reduced once a step, or after every micro-batch."""

    def __post_init__(self) -> None:
        if self.data_parallel is None or self.degrees.dp * self.degrees.cp == 1:
            object.__setattr__(self, "data_parallel", data_parallel_mode(self.degrees, self.zero).carrier)
        if self.degrees.cp == 1:
            object.__setattr__(self, "context_parallel", "all_gather")
        if self.num_micro_batches == 1 or self.degrees.dp * self.degrees.cp == 1:  # nothing to choose: one value
            object.__setattr__(self, "grad_sync", "step")

    @cached_property
    def slicing(self) -> Slicing:
        """How one device's share of a layer is cut (tensor, context and expert parallelism)."""
        return slicing_of(self.degrees, self.sp, self.context_parallel)

    @property
    def shard_degree(self) -> int:
        """Ranks the dense weights' gradients are reduced (and, on fully_shard, sharded) over: dp, and cp, whose
        ranks hold other tokens of the same sequences (the executor's "dp_cp" mesh)."""
        return self.degrees.dp * self.degrees.cp

    @property
    def expert_shards(self) -> int:
        """Ranks each expert's weights are sharded over (plait.legality.expert_shards)."""
        return expert_shards(self.degrees, self.dp_mode)

    @cached_property
    def dp_mode(self) -> DataParallelMode:
        """How the executor carries this layout's data parallelism (the one rule: plait.legality)."""
        mode = data_parallel_mode(self.degrees, self.zero)
        return mode if self.data_parallel == mode.carrier else DataParallelMode(self.data_parallel, False, self.zero)

    @property
    def dp(self) -> int:
        return self.degrees.dp

    @property
    def tp(self) -> int:
        return self.degrees.tp

    @property
    def pp(self) -> int:
        return self.degrees.pp

    @property
    def cp(self) -> int:
        return self.degrees.cp

    @property
    def ep(self) -> int:
        return self.degrees.ep

    @property
    def num_stages(self) -> int:
        return self.pp * self.interleave

    def stages_of(self, rank: int) -> list[int]:
        """Virtual stages on pipeline rank `rank` in model order (a loop, or a V for the zero-bubble V schedules:
        plait.cost.schedule.stage_rank's inverse)."""
        return list(self.rank_stages[rank])

    @property
    def rank_stages(self) -> tuple[tuple[int, ...], ...]:
        """`stages_of` every pipeline rank (shared: the search asks for it thousands of times)."""
        return _rank_stages(self.schedule, self.pp, self.interleave)

    @property
    def last_rank(self) -> int:
        """The pipeline rank of the last virtual stage (pp - 1, or 0 on a V)."""
        from plait.cost.schedule import stage_rank

        return stage_rank(self.schedule, self.pp, self.num_stages - 1)

    @classmethod
    def make(cls, **fields) -> "Layout":
        """Layout(...) with the degrees given as keywords (dp=2, tp=8, ...)."""
        axes = {a: fields.pop(a) for a in ALL_AXES if a in fields}
        return cls(degrees=Degrees(fields.pop("degrees", None), **axes), **fields)

    @classmethod
    def of(cls, plan: Plan) -> "Layout":
        schedule = plan.schedule if plan.pp > 1 else "1f1b"
        return cls(degrees=plan.degrees, sp=plan.sequence_parallel and plan.tp > 1, zero=plan.zero,
                   micro_batch=plan.micro_batch, num_micro_batches=plan.num_micro_batches, schedule=schedule,
                   interleave=plan.interleave, data_parallel=plan.data_parallel, stage_groups=plan.stage_groups,
                   context_parallel=plan.context_parallel, grad_sync=plan.grad_sync)
