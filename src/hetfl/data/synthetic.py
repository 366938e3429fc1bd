"""``synthetic``: a small generated image-classification dataset for fast tests and demos.

Each class ``k`` gets a fixed random low-frequency prototype (``channels x size x size``); a sample
is its class prototype with a random brightness, a random shift of up to ``max_shift`` pixels and
Gaussian pixel noise, quantised to uint8. A small CNN learns it well above chance in a few epochs;
``noise`` controls how hard it is. Fully determined by ``seed``.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from hetfl.data.base import DatasetSplits, ImageDataset


def _prototypes(classes: int, channels: int, size: int, rng: np.random.Generator) -> torch.Tensor:
    coarse = torch.from_numpy(rng.random((classes, channels, 4, 4), dtype=np.float32))
    smooth = F.interpolate(coarse, size=(size, size), mode="bilinear", align_corners=False)
    lo = smooth.amin(dim=(1, 2, 3), keepdim=True)
    hi = smooth.amax(dim=(1, 2, 3), keepdim=True)
    return (smooth - lo) / (hi - lo + 1e-6)


def _samples(protos: torch.Tensor, labels: np.ndarray, noise: float, max_shift: int,
             rng: np.random.Generator) -> torch.Tensor:
    n = len(labels)
    x = protos[torch.from_numpy(labels)]
    brightness = torch.from_numpy(rng.uniform(0.6, 1.0, (n, 1, 1, 1)).astype(np.float32))
    x = x * brightness
    if max_shift:
        shifts = rng.integers(-max_shift, max_shift + 1, size=(n, 2))
        for a, b in np.unique(shifts, axis=0):  # one roll per distinct shift, not per sample
            rows = torch.from_numpy(np.flatnonzero((shifts[:, 0] == a) & (shifts[:, 1] == b)))
            x[rows] = torch.roll(x[rows], (int(a), int(b)), dims=(2, 3))
    x = x + noise * torch.from_numpy(rng.standard_normal(x.shape, dtype=np.float32))
    return (x.clamp(0, 1) * 255).round().to(torch.uint8)


def load_synthetic(
    classes: int = 10,
    channels: int = 1,
    size: int = 28,
    train_per_class: int = 200,
    test_per_class: int = 50,
    noise: float = 0.35,
    max_shift: int = 2,
    seed: int = 0,
) -> DatasetSplits:
    """Generate train and test splits with balanced classes."""
    if classes < 2 or channels < 1 or size < 8 or train_per_class < 1 or test_per_class < 1:
        raise ValueError(
            "synthetic needs classes >= 2, channels >= 1, size >= 8, train/test_per_class >= 1"
        )
    rng = np.random.default_rng([seed, 0x5E7])
    protos = _prototypes(classes, channels, size, rng)
    splits = []
    for per_class in (train_per_class, test_per_class):
        labels = rng.permutation(np.repeat(np.arange(classes), per_class))
        x = _samples(protos, labels, noise, max_shift, rng)
        splits.append(ImageDataset(x, torch.from_numpy(labels), classes, "synthetic"))
    return DatasetSplits(*splits)
