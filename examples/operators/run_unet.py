"""A small U-Net denoiser with GroupNorm: two resolutions, a skip connection, the noise it was given as the target.
GroupNorm's statistics are over a group's channels: a plan that splits channels keeps each norm's channels whole
(plait.operators.norms), where splitting them would compute each rank's statistics over its own channels.

    build() -> the module; forward(images, noise) returns the mean squared error of the predicted noise.
    batch(batch_size, generator) -> (images [b, 3, 16, 16], noise [b, 3, 16, 16]).
"""

import torch
import torch.nn.functional as F
from torch import nn

CHANNELS, GROUPS, SIZE = 16, 4, 16


def _conv(cin: int, cout: int, **kwargs) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, **kwargs), nn.GroupNorm(GROUPS, cout), nn.SiLU())


class UNet(nn.Module):
    def __init__(self, c: int = CHANNELS) -> None:
        super().__init__()
        self.enc = _conv(3, c)
        self.down = _conv(c, 2 * c, stride=2)
        self.mid = _conv(2 * c, 2 * c)
        self.up = nn.ConvTranspose2d(2 * c, c, 2, stride=2)
        self.dec = _conv(2 * c, c)
        self.out = nn.Conv2d(c, 3, 1)

    def forward(self, images: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        skip = self.enc(images + noise)
        hidden = self.up(self.mid(self.down(skip)))
        predicted = self.out(self.dec(torch.cat([hidden, skip], dim=1)))
        return F.mse_loss(predicted, noise)


def build() -> nn.Module:
    return UNet()


def batch(batch_size: int, generator: torch.Generator):
    return (torch.randn(batch_size, 3, SIZE, SIZE, generator=generator),
            0.5 * torch.randn(batch_size, 3, SIZE, SIZE, generator=generator))
