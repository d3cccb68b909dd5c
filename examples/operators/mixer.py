"""A small MLP-Mixer (token-mixing and channel-mixing MLPs over patches), for per-operator sharding.

    build() -> the module; forward(images, labels) returns the cross-entropy loss.
    batch(batch_size, generator) -> (images [b, 3, 16, 16], labels [b]).
"""

import torch
import torch.nn.functional as F
from torch import nn

IMAGE, PATCH, WIDTH, TOKEN_HIDDEN, CHANNEL_HIDDEN, DEPTH, CLASSES = 16, 4, 128, 64, 512, 2, 10
TOKENS = (IMAGE // PATCH) ** 2


class MixerBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.token1, self.token2 = nn.Linear(TOKENS, TOKEN_HIDDEN), nn.Linear(TOKEN_HIDDEN, TOKENS)
        self.channel1, self.channel2 = nn.Linear(WIDTH, CHANNEL_HIDDEN), nn.Linear(CHANNEL_HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:                       # [b, tokens, width]
        mixed = self.token2(F.gelu(self.token1(self.norm1(x).transpose(1, 2))))  # across tokens
        x = x + mixed.transpose(1, 2)
        return x + self.channel2(F.gelu(self.channel1(self.norm2(x))))           # across channels


class Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Linear(3 * PATCH * PATCH, WIDTH)
        self.blocks = nn.ModuleList(MixerBlock() for _ in range(DEPTH))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        b = images.shape[0]
        patches = images.unfold(2, PATCH, PATCH).unfold(3, PATCH, PATCH)
        x = self.patch(patches.permute(0, 2, 3, 1, 4, 5).reshape(b, TOKENS, 3 * PATCH * PATCH))
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.norm(x).mean(dim=1)), labels)


def build() -> nn.Module:
    return Mixer()


def batch(batch_size: int, generator: torch.Generator):
    return (torch.randn(batch_size, 3, IMAGE, IMAGE, generator=generator),
            torch.randint(0, CLASSES, (batch_size,), generator=generator))
