"""What plait plans for: the model, the cluster and the training step (no weights, no devices)."""

from plait.spec.cluster import ClusterSpec, Efficiency, HostOverheads, LinkSpec
from plait.spec.model import ModelSpec
from plait.spec.train import TrainSpec

__all__ = ["ClusterSpec", "Efficiency", "HostOverheads", "LinkSpec", "ModelSpec", "TrainSpec"]
