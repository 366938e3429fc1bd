"""The local training settings of a client (:class:`TrainConfig`): the ``client:`` section of a config."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from hetfl.fl.params import check
from hetfl.fl.precision import check_precision

TRAIN_RANGES = {"grad_clip": {"type": "float", "ge": 0}}  # None: no clipping


def train_defaults() -> dict[str, Any]:
    return {f.name: f.default for f in fields(TrainConfig)}


@dataclass(frozen=True)
class TrainConfig:
    """Local optimiser settings (the paper defaults of DENSE/FedHydra client training)."""

    epochs: int = 20
    batch_size: int = 128
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 0.0
    grad_clip: float | None = None
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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
