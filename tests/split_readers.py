"""A module for the per-operator executor's tests whose blocks read their input straight into split work: each block
is Linear -> ReLU -> Linear with no norm or residual in front, so under Megatron's pattern (`MEGATRON`, as pins) a
block's first call is a column-split linear reading the previous block's row-split output (a pending sum, read
replicated) or, on a pipeline stage's first block, the hidden states the stage received.

    build() -> the module; its forward(x, y) returns the loss.
    batch(batch_size, generator) -> (x, y), the forward's arguments.
"""

import torch
from torch import nn

WIDTH, HIDDEN, TOKENS, DEPTH = 64, 256, 8, 4
MEGATRON = {name: placement for i in range(DEPTH)
            for name, placement in ((f"blocks.{i}.0.weight", "S0"), (f"blocks.{i}.2.weight", "S1"))}
"""Pins: every block's first linear split by columns (its output features), its second by rows."""


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, WIDTH))
                                    for _ in range(DEPTH))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)                                # [b, t, width]
        return ((x - y) ** 2).mean()


def build() -> nn.Module:
    return Stack()


def batch(batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(batch_size, TOKENS, WIDTH, generator=generator)
    return x, torch.randn(batch_size, TOKENS, WIDTH, generator=generator)
