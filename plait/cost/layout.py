"""What a cost is computed in: the Setting (model, cluster, training step) fixed during one search, and how a
Layout (plait.plan.Layout: a plan's choices without its stage split and recompute modes) cuts a layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.axes import Degrees
from plait.cost.compute import Slicing
from plait.plan import Layout
from plait.spec import ClusterSpec, ModelSpec, TrainSpec


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
