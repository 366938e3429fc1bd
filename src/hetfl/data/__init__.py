"""Datasets (real, offline; users' folders, array files and registered loaders) and client partitions."""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hetfl.data.base import DataFormatError, DatasetSplits, ImageDataset, hold_out
from hetfl.data.partition import PARTITION_KINDS, Partition, PartitionError, make_partition
from hetfl.data.synthetic import load_synthetic
from hetfl.data.user import USER_KINDS, dataset_label, load_user_dataset

BUILTIN_DATASETS = (
    "mnist", "fmnist", "emnist", "svhn", "cifar10", "cifar100", "cinic10", "tinyimagenet", "synthetic",
)
DATASET_NAMES = BUILTIN_DATASETS  # the built-in names; dataset_names() adds the registered ones
# name -> loader(root, **options) -> DatasetSplits, added by register_dataset
_REGISTERED: dict[str, Callable[..., DatasetSplits]] = {}


def dataset_names() -> tuple[str, ...]:
    """Every name a config's ``dataset:`` may give: the built-in ones and those of :func:`register_dataset`."""
    return (*BUILTIN_DATASETS, *sorted(_REGISTERED))


def register_dataset(name: str) -> Callable[[Callable[..., DatasetSplits]], Callable[..., DatasetSplits]]:
    """Decorator: ``loader(root, **options) -> DatasetSplits`` becomes ``dataset: name`` (``data:`` holds its
    options; ``root`` is the run's ``data_root``). A name already taken raises ``ValueError``."""
    if not isinstance(name, str) or not name or name in USER_KINDS:
        raise ValueError(f"register_dataset: {name!r} is not a usable dataset name")

    def deco(loader: Callable[..., DatasetSplits]) -> Callable[..., DatasetSplits]:
        if name in BUILTIN_DATASETS or _REGISTERED.get(name, loader) is not loader:
            raise ValueError(f"dataset name {name!r} is taken")
        _REGISTERED[name] = loader
        return loader

    return deco


def _content_sha256(splits: DatasetSplits) -> str:
    digest = hashlib.sha256()
    for part in (splits.train, splits.test):
        digest.update(part.digest().encode())
    return digest.hexdigest()


def load_dataset(name: str | dict[str, Any], root: str | Path = "data",
                 options: dict[str, Any] | None = None, test_only: bool = False) -> DatasetSplits:
    """Load a dataset (train + test): a registered ``name`` from ``root`` (``options`` go to its loader), or a
    ``{kind: folder | arrays, path: ...}`` mapping (:mod:`hetfl.data.user`; ``test_only``: its test split
    alone, for a Flower server whose SuperNodes serve their own data)."""
    options = dict(options or {})
    if isinstance(name, dict):
        if options:
            raise ValueError(f"data: options {sorted(options)} do not apply to dataset kind {name.get('kind')!r} "
                             "(its settings go under dataset:)")
        return load_user_dataset(name, test_only)
    if name not in dataset_names():
        raise ValueError(f"unknown dataset {name!r}; choose one of: {', '.join(dataset_names())}, "
                         "or {kind: folder | arrays, path: ...}")
    if name == "synthetic":
        loader = load_synthetic
        call = lambda: loader(**options)  # noqa: E731
    else:
        from hetfl.data.loaders import LOADERS

        loader = LOADERS.get(name) or _REGISTERED[name]
        call = lambda: loader(root, **options)  # noqa: E731
    params = inspect.signature(loader).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        valid = [p for p in params if p != "root"]
        if unknown := sorted(set(options) - set(valid)):
            raise ValueError(f"dataset {name!r} does not take {unknown}; valid options: {valid or 'none'}")
    splits = call()
    if name in _REGISTERED:
        if not isinstance(splits, DatasetSplits):
            raise ValueError(f"dataset {name!r}: its loader returned {type(splits).__name__}, not DatasetSplits")
        if splits.sha256 is None:
            splits.sha256 = _content_sha256(splits)
    return splits


__all__ = [
    "BUILTIN_DATASETS", "DATASET_NAMES", "DataFormatError", "DatasetSplits", "ImageDataset", "PARTITION_KINDS",
    "Partition", "PartitionError", "USER_KINDS", "dataset_label", "dataset_names", "hold_out", "load_dataset",
    "make_partition", "register_dataset",
]
