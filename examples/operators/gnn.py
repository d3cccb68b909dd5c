"""A small graph network: message passing over a fixed graph (its normalised adjacency, a buffer), node features
through repeated layers (a ModuleList: pipeline stages can cut between them), node classification.

    build() -> the module; forward(features, labels) returns the cross-entropy over the nodes.
    batch(batch_size, generator) -> (features [b, NODES, FEATURES], labels [b, NODES]): b graphs of the same shape.
"""

import torch
import torch.nn.functional as F
from torch import nn

NODES, FEATURES, HIDDEN, LAYERS, CLASSES = 64, 32, 128, 4, 8


def ring_adjacency(nodes: int) -> torch.Tensor:
    """Each node linked to itself and its two neighbours on a ring, rows normalised (a mean over neighbours)."""
    adjacency = torch.eye(nodes) + torch.roll(torch.eye(nodes), 1, 0) + torch.roll(torch.eye(nodes), -1, 0)
    return adjacency / adjacency.sum(dim=1, keepdim=True)


class GraphLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.message = nn.Linear(HIDDEN, HIDDEN)
        self.update = nn.Linear(2 * HIDDEN, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)

    def forward(self, h: torch.Tensor, adjacency: torch.Tensor) -> torch.Tensor:
        messages = adjacency @ self.message(h)                    # [b, NODES, HIDDEN]
        return h + F.relu(self.update(torch.cat([self.norm(h), messages], dim=-1)))


class GraphNetwork(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(FEATURES, HIDDEN)
        self.layers = nn.ModuleList(GraphLayer() for _ in range(LAYERS))
        self.head = nn.Linear(HIDDEN, CLASSES)
        self.register_buffer("adjacency", ring_adjacency(NODES), persistent=False)

    def forward(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(features)
        for layer in self.layers:
            h = layer(h, self.adjacency)
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def build() -> nn.Module:
    return GraphNetwork()


def batch(batch_size: int, generator: torch.Generator):
    return (torch.randn(batch_size, NODES, FEATURES, generator=generator),
            torch.randint(0, CLASSES, (batch_size, NODES), generator=generator))
