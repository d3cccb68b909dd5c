"""What plait plans for: the model, the cluster and the training step (no weights, no devices)."""

from plait.spec.cluster import ClusterSpec, Efficiency, LinkSpec
from plait.spec.model import ModelSpec
from plait.spec.train import TrainSpec

__all__ = ["ClusterSpec", "Efficiency", "LinkSpec", "ModelSpec", "TrainSpec"]
