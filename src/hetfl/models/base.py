"""Base class shared by every model in the zoo.

A :class:`HetflModel` is split into a feature extractor (``extract``) and a head
(``classify``), with ``forward(x) == classify(extract(x))``.  Feature-space methods
(FedGen, KDIA, MOON) call ``classify`` directly on generated features, so the split
is part of the public contract.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class ModelSpec:
    """Everything needed to build a model: registry name and input/output sizes."""

    name: str
    in_channels: int
    image_size: int
    num_classes: int

    def build(self) -> HetflModel:
        """A freshly initialised model (weights drawn from torch's global RNG)."""
        from . import build_model  # the registry lives in the package __init__

        return build_model(self.name, self.in_channels, self.image_size, self.num_classes)


class HetflModel(nn.Module):
    """An image classifier ``forward = classify . extract``.

    Subclasses set the class attributes ``arch`` (registry name) and
    ``min_image_size`` (smallest input side they can process), build their layers
    in ``__init__`` after calling ``super().__init__`` and finish with
    ``self._record_feature_shape()``.
    """

    arch: ClassVar[str] = ""
    min_image_size: ClassVar[int] = 1

    def __init__(self, in_channels: int, image_size: int, num_classes: int) -> None:
        super().__init__()
        if in_channels < 1 or num_classes < 1:
            raise ValueError(
                f"model {self.arch!r}: in_channels and num_classes must be positive, "
                f"got in_channels={in_channels}, num_classes={num_classes}"
            )
        if image_size < self.min_image_size:
            raise ValueError(
                f"model {self.arch!r} cannot take image_size={image_size}; "
                f"it needs image_size >= {self.min_image_size}"
            )
        self.in_channels = in_channels
        self.image_size = image_size
        self.num_classes = num_classes
        self.feature_shape: tuple[int, ...] = ()

    @property
    def spec(self) -> ModelSpec:
        """The :class:`ModelSpec` that rebuilds this architecture (with fresh weights)."""
        return ModelSpec(self.arch, self.in_channels, self.image_size, self.num_classes)

    def extract(self, x: Tensor) -> Tensor:
        """Map images ``(N, C, S, S)`` to penultimate features ``(N, *feature_shape)``;
        default: ``self.features(x)``."""
        return self.features(x)

    def classify(self, h: Tensor) -> Tensor:
        """Map features ``(N, *feature_shape)`` to logits ``(N, num_classes)``; default: ``self.fc(h)``."""
        return self.fc(h)

    def forward(self, x: Tensor) -> Tensor:
        return self.classify(self.extract(x))

    def _record_feature_shape(self) -> None:
        self.feature_shape = probe_shape(self.extract, self, self.in_channels, self.image_size)

    def extra_repr(self) -> str:
        return (
            f"arch={self.arch!r}, in_channels={self.in_channels}, "
            f"image_size={self.image_size}, num_classes={self.num_classes}"
        )


@torch.no_grad()
def probe_shape(
    fn: Callable[[Tensor], Tensor], module: nn.Module, in_channels: int, image_size: int
) -> tuple[int, ...]:
    """Shape of one sample's output of ``fn`` on a dummy zero image.

    ``module`` (the owner of ``fn``'s layers) is put in eval mode for the probe so that
    BatchNorm running statistics are left untouched, and its mode is restored after.
    No random numbers are drawn, so the caller's RNG stream is unaffected.
    """
    was_training = module.training
    module.eval()
    try:
        out = fn(torch.zeros(1, in_channels, image_size, image_size))
    finally:
        module.train(was_training)
    return tuple(out.shape[1:])


def conv_bn(
    in_channels: int,
    out_channels: int,
    kernel_size: int,
    stride: int = 1,
    groups: int = 1,
    act: type[nn.Module] | None = nn.ReLU,
) -> nn.Sequential:
    """``Conv(k, 'same' padding, no bias) -> BatchNorm -> activation`` (activation optional)."""
    layers: list[nn.Module] = [
        nn.Conv2d(
            in_channels,
            out_channels,
            kernel_size,
            stride=stride,
            padding=kernel_size // 2,
            groups=groups,
            bias=False,
        ),
        nn.BatchNorm2d(out_channels),
    ]
    if act is not None:
        layers.append(act(inplace=True))
    return nn.Sequential(*layers)
