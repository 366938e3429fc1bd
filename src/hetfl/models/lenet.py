"""LeNet-5 (LeCun et al., 1998) as used for MNIST/FMNIST by Co-Boosting (Dai et al., ICLR 2024).

Conv5x5(6)-ReLU-MaxPool ; Conv5x5(16)-ReLU-MaxPool ; FC 120-ReLU ; FC 84-ReLU ; FC C.
Inputs smaller than 32 px (e.g. 28 px MNIST) pad the first conv by 2, so that 28 px
inputs give the classic 16x5x5 map.  ``extract`` returns the 84-d vector.

``lenet5_valid``: the same without padding (a 16x4x4 map at 28 px, 44,426 parameters at 1x28x28 with
10 classes), the MNIST CNN of HFLDD.
"""

from __future__ import annotations

from torch import Tensor, nn

from .base import HetflModel, probe_shape


class LeNet5(HetflModel):
    arch = "lenet5"
    min_image_size = 12  # padded: 12 -> 12 -> 6 -> 2 -> 1
    pad_small_inputs = True

    def __init__(self, in_channels: int, image_size: int, num_classes: int) -> None:
        super().__init__(in_channels, image_size, num_classes)
        pad = 2 if image_size < 32 and self.pad_small_inputs else 0
        self.conv = nn.Sequential(
            nn.Conv2d(in_channels, 6, 5, padding=pad),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Flatten(),
        )
        (flat,) = probe_shape(self.conv, self, in_channels, image_size)
        self.fc = nn.Sequential(
            nn.Linear(flat, 120),
            nn.ReLU(inplace=True),
            nn.Linear(120, 84),
            nn.ReLU(inplace=True),
        )
        self.head = nn.Linear(84, num_classes)
        self._record_feature_shape()

    def extract(self, x: Tensor) -> Tensor:
        return self.fc(self.conv(x))

    def classify(self, h: Tensor) -> Tensor:
        return self.head(h)


class LeNet5Valid(LeNet5):
    arch = "lenet5_valid"
    min_image_size = 16  # unpadded: 16 -> 12 -> 6 -> 2 -> 1
    pad_small_inputs = False
