"""A residual MLP regressor that is not a decoder, for automatic per-operator sharding (README, "Any module").

    build() -> the module; its forward(x, y) returns the loss.
    batch(batch_size, generator) -> (x, y), the forward's arguments.
"""

import torch
from torch import nn

WIDTH, HIDDEN, TOKENS = 64, 256, 8


class ResidualMLP(nn.Module):
    def __init__(self, width: int = WIDTH, hidden: int = HIDDEN, depth: int = 2) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(depth))
        self.ups = nn.ModuleList(nn.Linear(width, hidden) for _ in range(depth))
        self.downs = nn.ModuleList(nn.Linear(hidden, width) for _ in range(depth))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for norm, up, down in zip(self.norms, self.ups, self.downs):
            x = x + down(torch.relu(up(norm(x))))      # [b, t, width]
        return ((x - y) ** 2).mean()


def build() -> nn.Module:
    return ResidualMLP()


def batch(batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(batch_size, TOKENS, WIDTH, generator=generator)
    return x, torch.randn(batch_size, TOKENS, WIDTH, generator=generator)
