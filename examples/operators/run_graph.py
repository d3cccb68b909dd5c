"""A graph network with a fixed projection and adjacency made at the top of its file, as research code often has
them: module-level tensors, real and on their device whatever plait builds the model on (plait imports the file as
Python imports it; only the model is built on `meta` for planning). Its repeated layers are blocks pipeline stages
cut between.

    build() -> the module; forward(features, labels) returns the node classification loss.
    batch(batch_size, generator) -> (features [b, NODES, FEATURES], labels [b, NODES]); the labels are a function
    of the features through the same fixed projection.
"""

import torch
import torch.nn.functional as F
from torch import nn

NODES, FEATURES, HIDDEN, CLASSES, LAYERS = 12, 8, 32, 4, 4

_fixed = torch.Generator().manual_seed(1234)
PROJECTION = torch.randn(FEATURES, HIDDEN, generator=_fixed) / FEATURES ** 0.5
_edges = (torch.rand(NODES, NODES, generator=_fixed) < 0.3).float()
_edges = ((_edges + _edges.T + torch.eye(NODES)) > 0).float()
ADJACENCY = _edges / _edges.sum(dim=1, keepdim=True)  # row-normalised, self-loops


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(HIDDEN, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.relu(ADJACENCY.to(x.dtype) @ self.linear(self.norm(x)))


class GraphNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(HIDDEN, HIDDEN)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(features @ PROJECTION.to(features.dtype))
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def build() -> nn.Module:
    return GraphNet()


def batch(batch_size: int, generator: torch.Generator):
    features = torch.randn(batch_size, NODES, FEATURES, generator=generator)
    labels = (ADJACENCY @ features @ PROJECTION)[..., :CLASSES].argmax(dim=-1)
    return features, labels
