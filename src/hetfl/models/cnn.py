"""Small client CNNs of DENSE (Zhang et al., NeurIPS 2022) and Co-Boosting (Dai et al., ICLR 2024).

* ``cnn2`` is DENSE's ``CNNMnist`` (two 5x5 conv-BN-ReLU-pool blocks, one Linear).
* ``cnn3`` is DENSE's ``CNNCifar``, also Co-Boosting's ``cnn``: three unpadded 3x3 convs
  with 128 channels, no BatchNorm, one Linear.

Both repos hard-code the flatten size for one input size; here it is measured with a
dummy forward so every supported input works.
"""

from __future__ import annotations

from torch import nn

from .base import HetflModel, probe_shape


class CNN2(HetflModel):
    """DENSE ``CNNMnist``; ~29 k parameters at 1x28x28 with 10 classes."""

    arch = "cnn2"
    min_image_size = 4

    def __init__(self, in_channels: int, image_size: int, num_classes: int) -> None:
        super().__init__(in_channels, image_size, num_classes)
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 16, 5, padding=2),
            nn.BatchNorm2d(16),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 5, padding=2),
            nn.BatchNorm2d(32),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Flatten(),
        )
        (flat,) = probe_shape(self.features, self, in_channels, image_size)
        self.fc = nn.Linear(flat, num_classes)
        self._record_feature_shape()


class CNN3(HetflModel):
    """DENSE ``CNNCifar``; ~319 k parameters at 3x32x32 with 10 classes."""

    arch = "cnn3"
    min_image_size = 18  # 18 -> 16 -> 8 -> 6 -> 3 -> 1 after the third conv

    def __init__(self, in_channels: int, image_size: int, num_classes: int) -> None:
        super().__init__(in_channels, image_size, num_classes)
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 128, 3),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(128, 128, 3),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(128, 128, 3),
            nn.ReLU(inplace=True),
            nn.Flatten(),
        )
        (flat,) = probe_shape(self.features, self, in_channels, image_size)
        self.fc = nn.Linear(flat, num_classes)
        self._record_feature_shape()
