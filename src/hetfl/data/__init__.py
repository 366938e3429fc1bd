"""Datasets (real, offline) and client partitions."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from hetfl.data.base import DataFormatError, DatasetSplits, ImageDataset, hold_out
from hetfl.data.partition import PARTITION_KINDS, Partition, PartitionError, make_partition
from hetfl.data.synthetic import load_synthetic

DATASET_NAMES = (
    "mnist", "fmnist", "emnist", "svhn", "cifar10", "cifar100", "cinic10", "tinyimagenet", "synthetic",
)


def load_dataset(name: str, root: str | Path = "data", options: dict[str, Any] | None = None) -> DatasetSplits:
    """Load dataset ``name`` (train + test) from ``root``; ``options`` go to its loader."""
    options = dict(options or {})
    if name not in DATASET_NAMES:
        raise ValueError(f"unknown dataset {name!r}; choose one of: {', '.join(DATASET_NAMES)}")
    if name == "synthetic":
        loader = load_synthetic
        call = lambda: loader(**options)  # noqa: E731
    else:
        from hetfl.data.loaders import LOADERS

        loader = LOADERS[name]
        call = lambda: loader(root, **options)  # noqa: E731
    params = inspect.signature(loader).parameters
    valid = [p for p in params if p != "root"]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"dataset {name!r} does not take {unknown}; valid options: {valid or 'none'}")
    return call()


__all__ = [
    "DATASET_NAMES", "DataFormatError", "DatasetSplits", "ImageDataset", "PARTITION_KINDS", "hold_out",
    "Partition", "PartitionError", "load_dataset", "make_partition",
]
