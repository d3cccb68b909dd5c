"""A small vision transformer (patch embedding, pre-norm blocks, class-token head), for per-operator sharding.

    build() -> the module; forward(images, labels) returns the cross-entropy loss.
    batch(batch_size, generator) -> (images [b, 3, 16, 16], labels [b]).
Attention is written out (q·kᵀ, softmax, ·v) so every operator has a DTensor rule on CPU.
"""

import torch
import torch.nn.functional as F
from torch import nn

IMAGE, PATCH, WIDTH, HEADS, DEPTH, CLASSES = 16, 4, 128, 4, 2, 10


class Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        split = lambda y: y.view(b, t, self.heads, w // self.heads).transpose(1, 2)  # noqa: E731 [b, h, t, d]
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        scores = torch.softmax(q @ k.transpose(-2, -1) / (w // self.heads) ** 0.5, dim=-1)
        return self.out((scores @ v).transpose(1, 2).reshape(b, t, w))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class ViT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Linear(3 * PATCH * PATCH, WIDTH)
        self.pos = nn.Parameter(torch.randn(1, (IMAGE // PATCH) ** 2, WIDTH) * 0.02)
        self.blocks = nn.ModuleList(Block(WIDTH, HEADS) for _ in range(DEPTH))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        b = images.shape[0]
        patches = images.unfold(2, PATCH, PATCH).unfold(3, PATCH, PATCH)         # [b, 3, 4, 4, P, P]
        patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(b, -1, 3 * PATCH * PATCH)
        x = self.patch(patches) + self.pos
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.norm(x).mean(dim=1)), labels)


def build() -> nn.Module:
    return ViT()


def batch(batch_size: int, generator: torch.Generator):
    return (torch.randn(batch_size, 3, IMAGE, IMAGE, generator=generator),
            torch.randint(0, CLASSES, (batch_size,), generator=generator))
