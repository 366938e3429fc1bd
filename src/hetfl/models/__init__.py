"""Model zoo: a registry of small image classifiers split into ``extract`` / ``classify``.

>>> from hetfl.models import build_model
>>> model = build_model("cnn2", in_channels=1, image_size=28, num_classes=10)
>>> model.feature_shape
(1568,)
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from torch import nn

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

# name -> a HetflModel class, or a user's factory(in_channels, image_size, num_classes) -> nn.Module
_REGISTRY: dict[str, Callable[..., nn.Module]] = {
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


def register_model(cls: type[HetflModel] | str | None = None, *, name: str | None = None) -> Any:
    """Add a model to the registry, as a class decorator or a factory decorator:

    * ``@register_model`` on a :class:`HetflModel` subclass: under its ``arch`` name;
    * ``@register_model("name")`` on a class or on ``factory(in_channels, image_size, num_classes) ->
      nn.Module`` (a plain module works with every method that needs only ``forward``).

    A name already taken by another class raises ``ValueError``."""
    if isinstance(cls, str) or (cls is None and name):
        return lambda obj: _register(obj, cls if isinstance(cls, str) else name)
    if not (isinstance(cls, type) and issubclass(cls, HetflModel)) or not getattr(cls, "arch", None):
        raise ValueError(f"register_model needs a HetflModel subclass with an arch name, got {cls!r}")
    return _register(cls, cls.arch)


def _register(obj: Any, name: str | None) -> Any:
    if not name or not isinstance(name, str) or ":" in name:
        raise ValueError(f"register_model: {name!r} is not a usable model name")
    if not callable(obj):
        raise ValueError(f"register_model({name!r}) needs a class or a factory, got {obj!r}")
    if _REGISTRY.get(name, obj) is not obj:
        raise ValueError(f"model name {name!r} is taken by {getattr(_REGISTRY[name], '__name__', _REGISTRY[name])}")
    _REGISTRY[name] = obj
    return obj


def is_factory(name: str) -> bool:
    """``package.module:factory``: a user's model factory rather than a registered name."""
    return isinstance(name, str) and ":" in name


def model_factory(name: str) -> Callable[[int, int, int], nn.Module]:
    """The callable ``factory(in_channels, image_size, num_classes) -> nn.Module`` that ``package.module:factory``
    names; ``ValueError`` saying what is wrong (module not importable, no such attribute, not callable)."""
    module_name, _, attr = name.partition(":")
    if not module_name or not attr:
        raise ValueError(f"model {name!r}: write a factory as package.module:factory")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"model {name!r}: cannot import {module_name!r} ({err}); is it on PYTHONPATH?") from err
    factory = module
    for part in attr.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise ValueError(f"model {name!r}: module {module_name!r} has no {attr!r}")
    if not callable(factory):
        raise ValueError(f"model {name!r}: {attr!r} is not callable")
    return factory  # type: ignore[return-value]


def check_model_name(name: object) -> None:
    """``ValueError`` unless ``name`` is a registered model or an importable factory."""
    if is_factory(name):  # type: ignore[arg-type]
        model_factory(name)  # type: ignore[arg-type]
    elif name not in _REGISTRY:
        raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(model_names())}, "
                         "or package.module:factory")


def get_model_class(name: str) -> type[HetflModel]:
    """The model class registered as ``name``; ``ValueError`` listing valid names otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown model {name!r}; choose one of: {', '.join(model_names())}"
        ) from None


def build_model(name: str, in_channels: int, image_size: int, num_classes: int) -> HetflModel:
    """Build a freshly initialised model (weights drawn from torch's global RNG): a registered name, or
    ``package.module:factory`` called as ``factory(in_channels, image_size, num_classes)`` (any
    ``nn.Module``; methods that need ``extract`` / ``classify`` check for them before training).

    Raises ``ValueError`` for an unknown name or an input the model cannot take.
    """
    factory = model_factory(name) if is_factory(name) else get_model_class(name)
    model = factory(in_channels, image_size, num_classes)
    if not isinstance(model, nn.Module):
        raise ValueError(f"model {name!r}: the factory returned {type(model).__name__}, not a torch nn.Module")
    return model  # type: ignore[return-value]


def missing_attributes(model: nn.Module, needs: tuple[str, ...]) -> list[str]:
    """Which of ``needs`` (e.g. extract, classify, feature_shape) ``model`` lacks."""
    return [a for a in needs if not hasattr(model, a)]


__all__ = [
    "MODEL_NAMES",
    "HetflModel",
    "ModelSpec",
    "build_model",
    "check_model_name",
    "is_factory",
    "missing_attributes",
    "model_factory",
    "count_flops",
    "count_parameters",
    "get_model_class",
    "model_names",
    "register_model",
]
