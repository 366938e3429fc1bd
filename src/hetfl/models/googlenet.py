"""A small CIFAR-style GoogLeNet (Szegedy et al., CVPR 2015).

Layout of the common CIFAR adaptation of GoogLeNet (3x3 stride-1 stem, no early
down-sampling, Inception blocks 3a-3b / max-pool / 4a-4e / max-pool / 5a-5b, global
average pool, Linear), with BatchNorm after every conv and the 5x5 branch factorised
into two 3x3 convs (Inception-v2 style).  To keep it client-sized every width of the
CIFAR GoogLeNet (~6.2 M parameters) is halved, giving ~1.6 M parameters and a 512-d
feature vector.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .base import HetflModel, conv_bn

# (1x1, 3x3 reduce, 3x3, 5x5 reduce, 5x5, pool proj) per block at full CIFAR width;
# "pool" marks a 3x3 stride-2 max-pool between stages.
_FULL_CONFIG: tuple[tuple[int, ...] | str, ...] = (
    (64, 96, 128, 16, 32, 32),  # 3a
    (128, 128, 192, 32, 96, 64),  # 3b
    "pool",
    (192, 96, 208, 16, 48, 64),  # 4a
    (160, 112, 224, 24, 64, 64),  # 4b
    (128, 128, 256, 24, 64, 64),  # 4c
    (112, 144, 288, 32, 64, 64),  # 4d
    (256, 160, 320, 32, 128, 128),  # 4e
    "pool",
    (256, 160, 320, 32, 128, 128),  # 5a
    (384, 192, 384, 48, 128, 128),  # 5b
)
_FULL_STEM = 192
_WIDTH = 0.5


class Inception(nn.Module):
    """Four parallel branches (1x1 ; 1x1-3x3 ; 1x1-3x3-3x3 ; maxpool-1x1) concatenated."""

    def __init__(
        self, in_channels: int, n1: int, n3_red: int, n3: int, n5_red: int, n5: int, pool: int
    ) -> None:
        super().__init__()
        self.b1 = conv_bn(in_channels, n1, 1)
        self.b3 = nn.Sequential(conv_bn(in_channels, n3_red, 1), conv_bn(n3_red, n3, 3))
        self.b5 = nn.Sequential(
            conv_bn(in_channels, n5_red, 1), conv_bn(n5_red, n5, 3), conv_bn(n5, n5, 3)
        )
        self.bp = nn.Sequential(nn.MaxPool2d(3, stride=1, padding=1), conv_bn(in_channels, pool, 1))
        self.out_channels = n1 + n3 + n5 + pool

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([self.b1(x), self.b3(x), self.b5(x), self.bp(x)], dim=1)


class GoogLeNet(HetflModel):
    arch = "googlenet"
    min_image_size = 8  # smallest size supported (the last feature map is then 1x1 or 2x2)

    def __init__(self, in_channels: int, image_size: int, num_classes: int) -> None:
        super().__init__(in_channels, image_size, num_classes)
        width = int(_FULL_STEM * _WIDTH)
        layers: list[nn.Module] = [conv_bn(in_channels, width, 3)]
        for entry in _FULL_CONFIG:
            if entry == "pool":
                layers.append(nn.MaxPool2d(3, stride=2, padding=1))
                continue
            block = Inception(width, *(int(c * _WIDTH) for c in entry))
            layers.append(block)
            width = block.out_channels
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(width, num_classes)
        self._record_feature_shape()
