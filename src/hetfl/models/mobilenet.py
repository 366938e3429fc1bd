"""CIFAR-style MobileNetV2 (Sandler et al., CVPR 2018).

The ImageNet architecture (inverted residual blocks with ReLU6 and linear bottlenecks,
width 1.0, last conv 1280) with the usual small-image changes: stride-1 stem and a
stride-1 second stage, so a 32 px input is down-sampled 8x (to 4x4) instead of 32x.
Residual connections only where stride is 1 and the width is unchanged, as in the paper.
"""

from __future__ import annotations

from torch import Tensor, nn

from .base import HetflModel, conv_bn

# (expansion t, output channels c, repeats n, first stride s); paper Table 2 except the
# stem and the 24-channel stage use stride 1.
_CONFIG = (
    (1, 16, 1, 1),
    (6, 24, 2, 1),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)


class InvertedResidual(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, expansion: int, stride: int) -> None:
        super().__init__()
        hidden = in_channels * expansion
        layers: list[nn.Module] = []
        if expansion != 1:
            layers.append(conv_bn(in_channels, hidden, 1, act=nn.ReLU6))
        layers += [
            conv_bn(hidden, hidden, 3, stride=stride, groups=hidden, act=nn.ReLU6),
            conv_bn(hidden, out_channels, 1, act=None),
        ]
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and in_channels == out_channels

    def forward(self, x: Tensor) -> Tensor:
        out = self.block(x)
        return x + out if self.residual else out


class MobileNetV2(HetflModel):
    arch = "mobilenetv2"
    min_image_size = 8  # smallest size supported (the last feature map is then 1x1 or 2x2)

    def __init__(self, in_channels: int, image_size: int, num_classes: int) -> None:
        super().__init__(in_channels, image_size, num_classes)
        width = 32
        layers: list[nn.Module] = [conv_bn(in_channels, width, 3, act=nn.ReLU6)]
        for t, c, n, s in _CONFIG:
            for i in range(n):
                layers.append(InvertedResidual(width, c, t, s if i == 0 else 1))
                width = c
        layers += [
            conv_bn(width, 1280, 1, act=nn.ReLU6),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        ]
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(1280, num_classes)
        self._record_feature_shape()
