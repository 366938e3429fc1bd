"""Model zoo: a registry of small image classifiers split into ``extract`` / ``classify``.

>>> from hetfl.models import build_model
>>> model = build_model("cnn2", in_channels=1, image_size=28, num_classes=10)
>>> model.feature_shape
(1568,)
"""

from __future__ import annotations

from .base import HetflModel, ModelSpec
from .cnn import CNN2, CNN3
from .flops import count_flops, count_parameters
from .googlenet import GoogLeNet
from .lenet import LeNet5, LeNet5Valid
from .mobilenet import MobileNetV2
from .resnet import ResNet18
from .shufflenet import ShuffleNetV2
from .simplecnn import SimpleCNN
from .vgg import VGG9

_REGISTRY: dict[str, type[HetflModel]] = {
    cls.arch: cls
    for cls in (
        CNN2,
        CNN3,
        GoogLeNet,
        LeNet5,
        LeNet5Valid,
        MobileNetV2,
        ResNet18,
        ShuffleNetV2,
        SimpleCNN,
        VGG9,
    )
}

MODEL_NAMES: tuple[str, ...] = tuple(sorted(_REGISTRY))  # the built-in models


def model_names() -> tuple[str, ...]:
    """Every model a config may name: the built-in ones and those added by :func:`register_model`."""
    return tuple(sorted(_REGISTRY))


def register_model(cls: type[HetflModel]) -> type[HetflModel]:
    """Add a :class:`HetflModel` subclass under its ``arch`` name (usable as a class decorator); a name
    already taken by another class raises ``ValueError``."""
    if not (isinstance(cls, type) and issubclass(cls, HetflModel)) or not getattr(cls, "arch", None):
        raise ValueError(f"register_model needs a HetflModel subclass with an arch name, got {cls!r}")
    if _REGISTRY.get(cls.arch, cls) is not cls:
        raise ValueError(f"model name {cls.arch!r} is taken by {_REGISTRY[cls.arch].__name__}")
    _REGISTRY[cls.arch] = cls
    return cls


def get_model_class(name: str) -> type[HetflModel]:
    """The model class registered as ``name``; ``ValueError`` listing valid names otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown model {name!r}; choose one of: {', '.join(model_names())}"
        ) from None


def build_model(name: str, in_channels: int, image_size: int, num_classes: int) -> HetflModel:
    """Build a freshly initialised model (weights drawn from torch's global RNG).

    Raises ``ValueError`` for an unknown name or an input the model cannot take.
    """
    return get_model_class(name)(in_channels, image_size, num_classes)


__all__ = [
    "MODEL_NAMES",
    "HetflModel",
    "ModelSpec",
    "build_model",
    "count_flops",
    "count_parameters",
    "get_model_class",
    "model_names",
    "register_model",
]
