"""The choices a cost is computed for: a Plan without its stage split and recompute modes.

The search prices thousands of these before it builds a single Plan; the Plan's own
fields map one to one (`Layout.of(plan)`).
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.plan import Plan
from plait.spec import ClusterSpec, ModelSpec, TrainSpec


@dataclass(frozen=True)
class Setting:
    """What is fixed during one search: the model, the cluster and the training step."""

    model: ModelSpec
    cluster: ClusterSpec
    train: TrainSpec

    @property
    def dtype_bytes(self) -> int:
        return self.train.param_bytes

    @property
    def seq_len(self) -> int:
        return self.train.seq_len


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    sp: bool
    zero: int
    micro_batch: int
    num_micro_batches: int
    schedule: str
    interleave: int

    @property
    def num_stages(self) -> int:
        return self.pp * self.interleave

    @classmethod
    def of(cls, plan: Plan) -> "Layout":
        schedule = plan.schedule if plan.pp > 1 else "1f1b"
        return cls(dp=plan.dp, tp=plan.tp, pp=plan.pp, sp=plan.sequence_parallel and plan.tp > 1, zero=plan.zero,
                   micro_batch=plan.micro_batch, num_micro_batches=plan.num_micro_batches, schedule=schedule,
                   interleave=plan.interleave)
