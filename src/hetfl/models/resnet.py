"""CIFAR-style ResNet-18 (He et al., CVPR 2016, Sec. 4.2 adaptation for small images).

As used by DENSE (``models/resnet.py``) and KDIA (``resnetcifar.py``): a 3x3 stride-1 stem
with 64 channels and no max-pool, four stages of two BasicBlocks (64/128/256/512
channels, strides 1/2/2/2), BatchNorm, global average pool and Linear(512 -> C).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .base import HetflModel, conv_bn


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers with an identity (or 1x1 conv-BN projection) shortcut."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = conv_bn(in_channels, out_channels, 3, stride=stride)
        self.conv2 = conv_bn(out_channels, out_channels, 3, act=None)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = conv_bn(in_channels, out_channels, 1, stride=stride, act=None)

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(self.conv2(self.conv1(x)) + self.shortcut(x))


class ResNet18(HetflModel):
    arch = "resnet18"
    min_image_size = 8  # smallest size supported (the last feature map is then 1x1 or 2x2)

    def __init__(self, in_channels: int, image_size: int, num_classes: int) -> None:
        super().__init__(in_channels, image_size, num_classes)
        layers: list[nn.Module] = [conv_bn(in_channels, 64, 3)]
        width = 64
        for out, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [BasicBlock(width, out, stride), BasicBlock(out, out, 1)]
            width = out
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(width, num_classes)
        self._record_feature_shape()
