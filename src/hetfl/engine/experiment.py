"""An experiment ready to run: a validated config with its dataset loaded and partitioned over the
clients (:func:`prepare`), on the device it names (:func:`resolve_device`)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hetfl.config import ConfigError, check_device, client_archs
from hetfl.data import DatasetSplits, ImageDataset, Partition, hold_out, load_dataset, make_partition
from hetfl.methods.checks import check_methods
from hetfl.models import is_factory


def factory_source_sha256(name: str) -> str:
    """sha256 of the file that defines a ``package.module:factory`` model ("" where it has none)."""
    import importlib
    import inspect

    try:
        path = inspect.getsourcefile(importlib.import_module(name.partition(":")[0]))
        return hashlib.sha256(Path(path).read_bytes()).hexdigest() if path else ""
    except (OSError, TypeError):
        return ""


def resolve_device(name: str) -> torch.device:
    """``auto`` = the GPU if torch sees one, else the CPU; a named device must be on this machine
    (a :class:`ConfigError` says so before any data is loaded, instead of torch failing mid-run)."""
    check_device(name)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            built = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise ConfigError(f"device: {name!r} asked for, but torch {torch.__version__} ({built}) sees no "
                              "CUDA GPU here; use device auto or cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"device: {name!r} asked for, but this machine has "
                              f"{torch.cuda.device_count()} CUDA device(s)")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"device: {name!r} asked for, but torch sees no MPS device here; use auto or cpu")
    return device


class ClientViews(Sequence[ImageDataset]):
    """Each client's share of the training split, made when a client is first asked for (a client never
    sampled costs nothing but its index array) and kept."""

    def __init__(self, train: ImageDataset, indices: Sequence[np.ndarray]) -> None:
        self.train, self.indices = train, indices
        self._views: dict[int, ImageDataset] = {}

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, cid: int) -> ImageDataset:  # type: ignore[override]
        if not -len(self) <= cid < len(self):
            raise IndexError(f"client {cid} of {len(self)}")
        cid %= len(self)
        if cid not in self._views:
            self._views[cid] = self.train.subset(torch.from_numpy(self.indices[cid]))
        return self._views[cid]


@dataclass
class Experiment:
    """A validated config with its data loaded and partitioned."""

    cfg: dict[str, Any]
    splits: DatasetSplits
    partition: Partition | None  # None on a remote server, which never sees the clients' data
    archs: list[str]
    device: torch.device
    data_root: str = ""  # where the dataset was read (clients read auxiliary sets there too)
    client_data: ClientViews = field(init=False)
    _model_sources: dict[str, str] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        indices = self.partition.indices if self.partition is not None else []
        self.client_data = ClientViews(self.splits.train, indices)

    def fingerprint(self, client_id: int) -> dict[str, Any]:
        idx = self.partition.indices[client_id]
        return {
            "dataset": self.cfg["dataset"], "data": self.cfg["data"], "partition": self.cfg["partition"],
            "clients": self.cfg["clients"], "seed": self.cfg["seed"], "client": client_id,
            "indices": hashlib.sha256(idx.astype(np.int64).tobytes()).hexdigest(),
            # the indices count in the training split left after the validation share: name the share
            **({"validation": self.cfg["validation"]} if self.cfg.get("validation") else {}),
            # the user's files and model code: an edited file or factory never reuses a stale upload
            **({"sha256": self.splits.sha256} if self.splits.sha256 else {}),
            **({"model_sources": self.model_sources} if self.model_sources else {}),
        }

    @property
    def model_sources(self) -> dict[str, str]:
        """sha256 of the source file of each ``package.module:factory`` model the run uses."""
        if self._model_sources is None:
            archs = {*self.archs, self.cfg["server"]["model"]}
            self._model_sources = {a: factory_source_sha256(a) for a in sorted(archs) if is_factory(a)}
        return self._model_sources


def prepare(cfg: dict[str, Any], data_root: str | None = None, partitioned: bool = True,
            splits: DatasetSplits | None = None) -> Experiment:
    """Load the dataset and make the partition (fails early on bad partitions). A remote
    server (``partitioned=False``) only evaluates on the test split and never partitions. ``splits``:
    the dataset, already loaded with ``cfg``'s dataset and data settings (a caller that prepares many
    cells of one dataset loads it once)."""
    check_methods(cfg)  # an unknown method or parameter fails before the data loads
    device = resolve_device(cfg["device"])
    own_data = not partitioned and cfg["flower"]["node_data"]  # a server whose SuperNodes hold the training data
    if splits is None:
        splits = load_dataset(cfg["dataset"], data_root or cfg["data_root"], cfg["data"], test_only=own_data)
    try:
        splits = hold_out(splits, cfg.get("validation", 0.0), cfg["seed"])
    except ValueError as err:
        raise ConfigError(str(err)) from err
    partition = make_partition(splits.train.y.numpy(), cfg["clients"], cfg["partition"], cfg["seed"],
                               num_classes=splits.num_classes) if partitioned else None
    return Experiment(cfg, splits, partition, client_archs(cfg), device, str(data_root or cfg["data_root"]))
