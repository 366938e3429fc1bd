"""In-memory image datasets shared by every loader, partitioner and method.

Images stay as ``uint8`` tensors of shape ``(N, C, H, W)`` for the whole run (a 60k MNIST
train split is 47 MB); :meth:`ImageDataset.batch` converts the rows a step needs to floats
in ``[0, 1]`` on the fly. No per-epoch reloads, no DataLoader workers.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch


class DataFormatError(ValueError):
    """A dataset file is missing, truncated or not in the expected on-disk format."""


@dataclass
class ImageDataset:
    """Images ``x`` (uint8, N x C x H x W) with integer labels ``y`` (int64, N)."""

    x: torch.Tensor
    y: torch.Tensor
    num_classes: int
    name: str = ""
    class_names: list[str] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.x.dim() != 4:
            raise DataFormatError(f"{self.name}: images must be N x C x H x W, got {tuple(self.x.shape)}")
        if self.x.dtype != torch.uint8:
            raise DataFormatError(f"{self.name}: images must be uint8, got {self.x.dtype}")
        if self.y.dim() != 1 or self.y.shape[0] != self.x.shape[0]:
            raise DataFormatError(
                f"{self.name}: {self.x.shape[0]} images but labels of shape {tuple(self.y.shape)}"
            )
        self.y = self.y.long()
        if len(self.y) and (int(self.y.min()) < 0 or int(self.y.max()) >= self.num_classes):
            raise DataFormatError(
                f"{self.name}: labels must lie in [0, {self.num_classes}), "
                f"got [{int(self.y.min())}, {int(self.y.max())}]"
            )

    def __len__(self) -> int:
        return int(self.x.shape[0])

    @property
    def shape(self) -> tuple[int, int, int]:
        """(channels, height, width) of one image."""
        _, c, h, w = self.x.shape
        return int(c), int(h), int(w)

    def subset(self, index: torch.Tensor | list[int]) -> ImageDataset:
        index = torch.as_tensor(index, dtype=torch.long)
        return ImageDataset(self.x[index], self.y[index], self.num_classes, self.name, self.class_names)

    def digest(self) -> str:
        """sha256 over the images' and labels' bytes (shapes included): equal digests, equal data."""
        h = hashlib.sha256(f"{tuple(self.x.shape)} {tuple(self.y.shape)}\n".encode())
        h.update(self.x.cpu().contiguous().numpy().tobytes())
        h.update(self.y.cpu().to(torch.int64).contiguous().numpy().tobytes())
        return h.hexdigest()

    def label_counts(self) -> torch.Tensor:
        return torch.bincount(self.y, minlength=self.num_classes)

    def batch(self, index: torch.Tensor, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``index`` as float images in [0, 1] and labels, on ``device``."""
        x = self.x[index].to(device, non_blocking=True).float().div_(255.0)
        return x, self.y[index].to(device, non_blocking=True)


@dataclass
class DatasetSplits:
    """The official train and test splits of one dataset, and a validation share held out of the
    training split (:func:`hold_out`) or None."""

    train: ImageDataset
    test: ImageDataset
    val: ImageDataset | None = None
    # sha256 of the source files' names and bytes, where the data is the user's (a folder, an array file,
    # a registered loader): the clients' upload-cache keys name it, so changed files are never stale
    sha256: str | None = None

    @property
    def num_classes(self) -> int:
        return self.train.num_classes

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.train.shape


def hold_out(splits: DatasetSplits, fraction: float, seed: int) -> DatasetSplits:
    """``fraction`` of each class of the training split, drawn with a generator seeded by ``seed``, as a
    validation split; the rest stays the training split (in its original order), which the clients'
    partition then divides. Every engine calls this with the config's seed, so the server and every
    client hold out the same samples. ValueError if a class would be left without training samples."""
    if fraction <= 0:
        return splits
    y = splits.train.y
    g = torch.Generator().manual_seed(seed)
    chosen = []
    for c in range(splits.num_classes):
        members = (y == c).nonzero().flatten()
        if len(members) == 0:
            continue
        k = max(1, round(fraction * len(members)))
        if k >= len(members):
            raise ValueError(f"validation: {fraction} leaves class {c} ({len(members)} samples) without "
                             "training samples")
        chosen.append(members[torch.randperm(len(members), generator=g)[:k]])
    val = torch.cat(chosen).sort().values
    keep = torch.ones(len(y), dtype=torch.bool)
    keep[val] = False
    return DatasetSplits(splits.train.subset(keep.nonzero().flatten()), splits.test, splits.train.subset(val),
                         splits.sha256)
