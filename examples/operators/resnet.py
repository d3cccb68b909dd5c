"""A small ResNet-style CNN (conv, BatchNorm, ReLU, residual blocks, pooled linear head), for per-operator
sharding.

    build() -> the module; forward(images, labels) returns the cross-entropy loss.
    batch(batch_size, generator) -> (images [b, 3, 16, 16], labels [b]).

BatchNorm: its statistics are over the batch each rank sees. Tensor-parallel ranks see the whole micro-batch
(the batch enters replicated on tp), so they agree with one process; over data-parallel ranks plait sums them
over the dp ranks (plan.operators.synchronised_norms, plait.execute.batchnorm), so dp > 1 equals one process too.
"""

import torch
import torch.nn.functional as F
from torch import nn

CHANNELS, CLASSES, IMAGE = 32, 10, 16


class Residual(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(y)))


class ResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, CHANNELS, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(CHANNELS)
        self.blocks = nn.Sequential(Residual(CHANNELS), Residual(CHANNELS))
        self.head = nn.Linear(CHANNELS, CLASSES)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.blocks(F.relu(self.bn(self.stem(images))))              # [b, C, H, W]
        return F.cross_entropy(self.head(x.mean(dim=(2, 3))), labels)


def build() -> nn.Module:
    return ResNet()


def batch(batch_size: int, generator: torch.Generator):
    return (torch.randn(batch_size, 3, IMAGE, IMAGE, generator=generator),
            torch.randint(0, CLASSES, (batch_size,), generator=generator))
