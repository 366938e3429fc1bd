"""VGG-9 of FedMHO (``pcode/models/vgg.py: VGG9``), after Simonyan & Zisserman (ICLR 2015).

Conv3x3(64)-ReLU-MaxPool ; Conv3x3(128)-ReLU-MaxPool ; Conv3x3(256)-ReLU ;
Conv3x3(256)-ReLU-MaxPool ; AdaptiveAvgPool(7x7) ; FC 12544->4096-ReLU-Dropout ;
FC 4096->4096-ReLU-Dropout ; FC 4096->C.  Padding 1, no BatchNorm, ~69 M parameters
(almost all in the first FC layer, independent of the input size thanks to the 7x7 pool).
``extract`` returns the output of the second 4096-wide FC block.
"""

from __future__ import annotations

from torch import Tensor, nn

from .base import HetflModel


class VGG9(HetflModel):
    arch = "vgg9"
    min_image_size = 8  # three 2x2 max-pools

    def __init__(self, in_channels: int, image_size: int, num_classes: int) -> None:
        super().__init__(in_channels, image_size, num_classes)
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 64, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(64, 128, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(128, 256, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(256, 256, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.AdaptiveAvgPool2d(7),
            nn.Flatten(),
        )
        self.fc = nn.Sequential(
            nn.Linear(256 * 7 * 7, 4096),
            nn.ReLU(inplace=True),
            nn.Dropout(),
            nn.Linear(4096, 4096),
            nn.ReLU(inplace=True),
            nn.Dropout(),
        )
        self.head = nn.Linear(4096, num_classes)
        self._record_feature_shape()

    def extract(self, x: Tensor) -> Tensor:
        return self.fc(self.features(x))

    def classify(self, h: Tensor) -> Tensor:
        return self.head(h)
