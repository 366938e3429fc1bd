"""hetfl: federated learning under data and model heterogeneity.

The Python API (the objects ``hetfl run`` and the registries the config uses)::

    import hetfl

    result = hetfl.run("configs/demo-mnist.yaml", methods=["fedavg"])   # or a dict
    result.accuracy("fedavg"), result.bytes("fedavg"), result.model("fedavg")
    hetfl.load_run("runs/demo-mnist")

    @hetfl.register_model("mynet")            # factory(in_channels, image_size, num_classes) -> nn.Module
    @hetfl.register_dataset("mydata")         # loader(root, **options) -> hetfl.data.DatasetSplits
    @hetfl.register_method("mymethod")        # a hetfl.fl.method.RoundMethod or OneShotMethod subclass

Attributes load on first use, so ``import hetfl`` stays light.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "run": ("hetfl.api", "run"),
    "load_run": ("hetfl.api", "load_run"),
    "Result": ("hetfl.api", "Result"),
    "register_model": ("hetfl.models", "register_model"),
    "register_dataset": ("hetfl.data", "register_dataset"),
    "register_method": ("hetfl.fl.method", "register_method"),
    "client_task": ("hetfl.fl.client", "client_task"),
    "HetflModel": ("hetfl.models", "HetflModel"),
    "DatasetSplits": ("hetfl.data", "DatasetSplits"),
    "ImageDataset": ("hetfl.data", "ImageDataset"),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'hetfl' has no attribute {name!r}")
    import importlib

    module, attr = _LAZY[name]
    if name == "register_method":
        import hetfl.methods  # noqa: F401  (the built-in methods first, so a clash is caught)
    return getattr(importlib.import_module(module), attr)
