"""Unlabeled auxiliary images: another dataset's training images adapted to a task's shape.

FedDF distils on them on the server; HFLDD's clients compute soft labels on the same seeded sample
(D_g), each from its own data root. Defaults (:data:`AUXILIARY`): Fashion-MNIST for MNIST and MNIST for
Fashion-MNIST (FedDF's choice), CIFAR-100 for CIFAR-10, and so on; ``synthetic`` is another draw of
synthetic patterns of the same shape.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from hetfl.data.base import ImageDataset

AUXILIARY = {"mnist": "fmnist", "fmnist": "mnist", "emnist": "mnist", "cifar10": "cifar100",
             "cifar100": "cifar10", "svhn": "cifar10", "cinic10": "cifar100", "synthetic": "synthetic"}


def adapt(images: torch.Tensor, shape: tuple[int, int, int]) -> torch.Tensor:
    """uint8 images to the task's (channels, size): resize bilinearly, average or repeat channels."""
    c, h, w = shape
    x = images
    if x.shape[1] != c:  # grey <-> colour: average the channels, repeat to the task's count
        x = x.float().mean(dim=1, keepdim=True).repeat(1, c, 1, 1)
    if tuple(x.shape[2:]) != (h, w):
        x = F.interpolate(x.float(), size=(h, w), mode="bilinear", align_corners=False)
    return x.round().clamp(0, 255).to(torch.uint8)


def auxiliary_images(name: str, root: str | Path, shape: tuple[int, int, int], num_classes: int, size: int,
                     seed: int, sample_seed: int) -> ImageDataset:
    """``size`` images (0: all) of dataset ``name``'s training split, drawn with ``sample_seed``, adapted to
    ``shape``; labels zero (unused). ``seed``: the run's seed (a synthetic set draws its patterns from
    ``seed + 1000``)."""
    from hetfl.data import load_dataset

    if name == "synthetic":  # another draw of patterns: same shape, different prototypes
        c, h, _ = shape
        data = load_dataset("synthetic", options={"classes": num_classes, "channels": c, "size": h,
                                                  "train_per_class": max(size // num_classes, 10),
                                                  "seed": seed + 1000}).train
    else:
        data = load_dataset(name, root).train
    if size and size < len(data):
        g = torch.Generator().manual_seed(sample_seed)
        data = data.subset(torch.randperm(len(data), generator=g)[:size])
    x = adapt(data.x, shape)
    return ImageDataset(x, torch.zeros(len(x), dtype=torch.long), num_classes, f"{name} (unlabeled)")
