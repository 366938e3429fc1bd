"""The "simple CNN" of MOON (Li et al., CVPR 2021) and KDIA (Ma et al.; ``ModelFedMine``).

Extractor: Conv5x5(6)-MaxPool2-ReLU-Conv5x5(16)-MaxPool2-ReLU, a 16x5x5 map at 32 px.
Inputs smaller than 32 px (e.g. 28 px MNIST) pad the first conv by 2 so they also give
16x5x5.  Other sizes (e.g. 64 px, which gives 16x13x13) end with an adaptive average
pool to 5x5; at 28 and 32 px that pool is an exact identity and is skipped (:class:`FitMap`).

Classifier: Flatten(400) -> FC120-ReLU -> FC84-ReLU -> FC84-ReLU -> FC 84->256 (the
projection ``z`` used by MOON's contrastive loss) -> FC 256->C.

``extract`` returns the unflattened (N, 16, 5, 5) map so that KDIA's feature generator
output can be fed straight into ``classify``.
"""

from __future__ import annotations

from torch import Tensor, nn

from .base import HetflModel

FEATURE_MAP = (16, 5, 5)


class FitMap(nn.AdaptiveAvgPool2d):
    """An adaptive average pool that returns a map already of its output size as it is (the pool
    would divide each pixel by 1: the same values, at a cost in every forward and backward pass)."""

    def forward(self, x: Tensor) -> Tensor:
        if tuple(x.shape[-2:]) == tuple(self.output_size):
            return x
        return super().forward(x)


class SimpleCNN(HetflModel):
    arch = "simplecnn"
    min_image_size = 12

    def __init__(self, in_channels: int, image_size: int, num_classes: int) -> None:
        super().__init__(in_channels, image_size, num_classes)
        pad = 2 if image_size < 32 else 0
        self.extractor = nn.Sequential(
            nn.Conv2d(in_channels, 6, 5, padding=pad),
            nn.MaxPool2d(2),
            nn.ReLU(inplace=True),
            nn.Conv2d(6, 16, 5),
            nn.MaxPool2d(2),
            nn.ReLU(inplace=True),
            FitMap(FEATURE_MAP[1:]),
        )
        c, h, w = FEATURE_MAP
        self.body = nn.Sequential(
            nn.Flatten(),
            nn.Linear(c * h * w, 120),
            nn.ReLU(inplace=True),
            nn.Linear(120, 84),
            nn.ReLU(inplace=True),
            nn.Linear(84, 84),
            nn.ReLU(inplace=True),
            nn.Linear(84, 256),
        )
        self.head = nn.Linear(256, num_classes)
        self._record_feature_shape()

    def extract(self, x: Tensor) -> Tensor:
        return self.extractor(x)

    def projection(self, h: Tensor) -> Tensor:
        """The 256-d representation ``z`` (input of the last Linear) for features ``h``."""
        return self.body(h)

    def classify(self, h: Tensor) -> Tensor:
        return self.head(self.projection(h))
