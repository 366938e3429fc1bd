"""CIFAR-style ShuffleNetV2, 1x width (Ma et al., ECCV 2018).

Stage widths 116/232/464 with 4/8/4 units and a final 1x1 conv to 1024 channels, as in
the paper's Table 5; for small images the stem is a stride-1 3x3 conv (24 channels)
without max-pool, so a 32 px input is down-sampled 8x (to 4x4).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .base import HetflModel, conv_bn

_STAGES = ((116, 4), (232, 8), (464, 4))  # (output channels, units incl. the stride-2 one)


def channel_shuffle(x: Tensor, groups: int) -> Tensor:
    n, c, h, w = x.shape
    return x.reshape(n, groups, c // groups, h, w).transpose(1, 2).reshape(n, c, h, w)


class ShuffleUnit(nn.Module):
    """Stride 1: split channels, transform one half.  Stride 2: transform both copies."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        half = out_channels // 2
        branch_in = in_channels if stride == 2 else in_channels // 2
        self.right = nn.Sequential(
            conv_bn(branch_in, half, 1),
            conv_bn(half, half, 3, stride=stride, groups=half, act=None),
            conv_bn(half, half, 1),
        )
        self.left: nn.Module = nn.Identity()
        if stride == 2:
            self.left = nn.Sequential(
                conv_bn(in_channels, in_channels, 3, stride=2, groups=in_channels, act=None),
                conv_bn(in_channels, half, 1),
            )

    def forward(self, x: Tensor) -> Tensor:
        if self.stride == 1:
            left, right = x.chunk(2, dim=1)
        else:
            left, right = x, x
        return channel_shuffle(torch.cat([self.left(left), self.right(right)], dim=1), 2)


class ShuffleNetV2(HetflModel):
    arch = "shufflenetv2"
    min_image_size = 8  # smallest size supported (the last feature map is then 1x1 or 2x2)

    def __init__(self, in_channels: int, image_size: int, num_classes: int) -> None:
        super().__init__(in_channels, image_size, num_classes)
        width = 24
        layers: list[nn.Module] = [conv_bn(in_channels, width, 3)]
        for out, units in _STAGES:
            layers.append(ShuffleUnit(width, out, 2))
            layers += [ShuffleUnit(out, out, 1) for _ in range(units - 1)]
            width = out
        layers += [conv_bn(width, 1024, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(1024, num_classes)
        self._record_feature_shape()
