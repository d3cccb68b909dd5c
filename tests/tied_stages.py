"""A module whose output layer is its embedding's weight, with repeated blocks pipeline stages cut between: the
first and the last stage each hold a copy of the tied weight (tests of per-operator pipelines)."""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH, BLOCKS = 48, 16, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def build() -> nn.Module:
    return TiedLM()


def batch(batch_size: int, generator: torch.Generator):
    tokens = torch.randint(0, VOCAB, (batch_size, 6), generator=generator)
    return tokens, tokens.roll(-1, dims=1)
