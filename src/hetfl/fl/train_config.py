"""The local training settings of a client (:class:`TrainConfig`): the ``client:`` section of a config."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from hetfl.fl.precision import check_precision


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
    channels_last: bool = True  # 1.7x faster cnn2 training on AVX-512 CPUs, same accuracy

    def __post_init__(self) -> None:
        if self.epochs < 0 or self.batch_size < 1 or self.lr <= 0:
            raise ValueError(f"bad local training config: {self}")
        check_precision(self.precision)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
