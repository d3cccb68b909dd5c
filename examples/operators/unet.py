"""A small U-Net (a down path and an up path joined by skip connections, GroupNorm after each convolution), as
image diffusion and segmentation models are built; the loss is the mean squared error against a target image.

    build() -> the module; forward(images, targets) returns the loss.
    batch(batch_size, generator) -> (images [b, 3, 16, 16], targets [b, 3, 16, 16]).

GroupNorm normalises over groups of channels: a plan that splits the channels must keep each group's statistics
whole (plait keeps the normalised tensor's channels whole where the split would cut a group).
"""

import torch
import torch.nn.functional as F
from torch import nn

BASE, GROUPS, IMAGE = 16, 4, 16


def conv_block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(GROUPS, cout), nn.SiLU())


class UNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.down1, self.down2 = conv_block(3, BASE), conv_block(BASE, 2 * BASE)
        self.middle = conv_block(2 * BASE, 2 * BASE)
        self.up2 = conv_block(4 * BASE, BASE)
        self.up1 = conv_block(2 * BASE, BASE)
        self.out = nn.Conv2d(BASE, 3, 1)

    def forward(self, images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        d1 = self.down1(images)                                   # [b, BASE, 16, 16]
        d2 = self.down2(F.avg_pool2d(d1, 2))                      # [b, 2 BASE, 8, 8]
        m = self.middle(F.avg_pool2d(d2, 2))                      # [b, 2 BASE, 4, 4]
        u2 = self.up2(torch.cat([F.interpolate(m, scale_factor=2.0), d2], dim=1))
        u1 = self.up1(torch.cat([F.interpolate(u2, scale_factor=2.0), d1], dim=1))
        return F.mse_loss(self.out(u1), targets)


def build() -> nn.Module:
    return UNet()


def batch(batch_size: int, generator: torch.Generator):
    return (torch.randn(batch_size, 3, IMAGE, IMAGE, generator=generator),
            torch.randn(batch_size, 3, IMAGE, IMAGE, generator=generator))
