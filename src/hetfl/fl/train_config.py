"""The local training settings of a client (:class:`TrainConfig`): the ``client:`` section of a config."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from hetfl.fl.params import check
from hetfl.fl.precision import check_precision

TRAIN_RANGES = {"grad_clip": {"type": "float", "ge": 0},  # None: no clipping
                "steps": {"type": "int", "ge": 1}}  # None: ``epochs`` full epochs


def train_defaults() -> dict[str, Any]:
    return {f.name: f.default for f in fields(TrainConfig)}


@dataclass(frozen=True)
class TrainConfig:
    """Local optimiser settings: SGD at ``lr`` with ``momentum`` (0, PyTorch's default: a config that wants
    momentum names it) and ``weight_decay``, for ``epochs`` epochs or, with ``steps``, that many mini-batch
    steps in all (over as many epochs as they need)."""

    epochs: int = 20
    batch_size: int = 128
    lr: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 0.0
    grad_clip: float | None = None
    steps: int | None = None
    precision: str = "fp32"  # fp32 | bf16 (autocast)
    channels_last: bool = True  # NHWC memory layout: faster convolutions on CPUs, same results

    def __post_init__(self) -> None:
        check("TrainConfig", train_defaults(), asdict(self), TRAIN_RANGES, where="client")
        check_precision(self.precision)

    @classmethod
    def checked(cls, values: dict[str, Any], where: str = "client") -> TrainConfig:
        """``values`` over the defaults; a wrong key, type or range raises :class:`ParamError` naming
        ``where.<key>`` (no TypeError for an unknown key)."""
        return cls(**check("TrainConfig", train_defaults(), values, TRAIN_RANGES, where=where))

    def epochs_needed(self, num_samples: int) -> int:
        """Epochs to run on ``num_samples`` samples: ``epochs``, or as many as ``steps`` needs."""
        if self.steps is None:
            return self.epochs
        return -(-self.steps // max(1, steps_per_epoch(num_samples, self.batch_size)))

    def optimiser(self) -> dict[str, float]:
        """The resolved SGD settings (what a results page's protocol line states)."""
        return {"lr": self.lr, "momentum": self.momentum, "weight_decay": self.weight_decay}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def steps_per_epoch(num_samples: int, batch_size: int, min_batch: int = 2) -> int:
    """Mini-batches of one epoch, as :func:`hetfl.fl.training.minibatches` yields them (a trailing batch
    smaller than ``min_batch`` is dropped unless it is all there is)."""
    full, rest = divmod(num_samples, batch_size)
    return full + (1 if rest >= min(min_batch, num_samples) and rest > 0 else 0)
