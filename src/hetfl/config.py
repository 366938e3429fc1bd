"""Experiment configuration: YAML in, validated dictionary out.

Every key is checked before any data is loaded or any model trained: unknown keys, models, datasets
and partition kinds fail with the list of valid names. The methods' parameters are checked by
:mod:`hetfl.methods.checks`, which sees the method registry.
"""

from __future__ import annotations

import copy
import re
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml

from hetfl.data import dataset_names
from hetfl.data.partition import validate_spec
from hetfl.data.user import check_spec
from hetfl.fl.params import ParamError, check
from hetfl.fl.train_config import TrainConfig
from hetfl.models import check_model_name


class ConfigError(ValueError):
    """A configuration is invalid; the message names the key and the valid choices."""


TOP_KEYS = {
    "name": "experiment", "seed": 0, "dataset": None, "data": {}, "data_root": "data",
    "partition": None, "clients": None, "client": {}, "server": {}, "methods": None,
    "device": "auto", "eval_every": 1, "min_clients": 1, "flower": {}, "simulator": {},
    # a stratified, seeded share of the training split held out before partitioning (0: none)
    "validation": 0.0,
    # the user's modules, imported before the rest is checked (they register datasets, models, methods)
    "plugins": [],
}
# Settings of the Flower engine (ignored by the in-process simulator): seconds to wait for the
# uploads of one exchange, and for the SuperNodes to connect before the first exchange.
# ``node_data``: every SuperNode serves its own training data (``--node-config "data-dir=DIR"``) instead of
# a partition of ``dataset``, of which the server reads the test split only.
FLOWER_KEYS = {"timeout": 600.0, "node_wait": 120.0, "node_data": False}
# Settings of the in-process simulator (ignored by the Flower engine): ``batch_clients`` trains the
# clients of one exchange whose requests allow it (from-scratch classifiers of one architecture and
# training config) as one vectorised batch, for accelerators that one small model leaves
# idle. Their uploads then differ in the last bits from one-at-a-time training and are cached apart.
# ``flush_denormal`` flushes subnormal floats to zero on the CPU (hetfl.host.flush_denormals) for the
# whole run: a client whose loss has reached 0 (one class, or a few) otherwise spends most of its
# time on subnormal gradients (several times slower); results
# change in the last bits, so its uploads are cached apart too.
# ``state_memory_mb``: clients' state (MOON's, FedCOG's previous local model) kept in memory; beyond it the
# states of the clients used least recently wait on disk (hetfl.fl.clientstate).
SIMULATOR_KEYS = {"batch_clients": False, "flush_denormal": False, "state_memory_mb": 2048.0}
_ANY = {"type": "any"}
TOP_RANGES = {"clients": {"type": "int", "ge": 1}, "min_clients": {"ge": 1}, "validation": {"ge": 0, "lt": 0.5},
              **{k: _ANY for k in ("dataset", "data", "partition", "client", "server", "methods", "flower",
                                   "simulator", "plugins")}}
FLOWER_RANGES = {"timeout": {"gt": 0}, "node_wait": {"gt": 0}}
CLIENT_KEYS = {"model"} | {f.name for f in fields(TrainConfig)}
SERVER_KEYS = {"model"}
REQUIRED = ("dataset", "partition", "clients", "methods")


class YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's floats: ``1e-5`` and ``3E4`` are numbers, not strings
    (YAML 1.1, which PyYAML follows, wants a dot: ``1.0e-5``)."""


YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                  |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
                  |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                  |[-+]?\.(?:inf|Inf|INF)
                  |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))


def load_yaml(text: str) -> Any:
    """Parse YAML text as every hetfl config is read (safe; ``1e-5`` is a float)."""
    return yaml.load(text, Loader=YamlLoader)  # noqa: S506 - YamlLoader is a SafeLoader


def parse_value(text: str) -> Any:
    """``--set`` values are YAML scalars/lists: ``2`` -> int, ``0.1`` or ``1e-5`` -> float, ``[a, b]`` -> list."""
    return load_yaml(text)


def apply_overrides(cfg: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key.sub=value`` overrides; unknown top-level keys are rejected."""
    cfg = copy.deepcopy(cfg)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        dotted, raw = item.split("=", 1)
        keys = dotted.strip().split(".")
        if keys[0] not in TOP_KEYS:
            raise ConfigError(f"--set {dotted}: unknown key {keys[0]!r}; valid: {', '.join(TOP_KEYS)}")
        node = cfg
        for key in keys[:-1]:
            if node.get(key) is None:
                node[key] = {}
            if not isinstance(node[key], dict):
                raise ConfigError(f"--set {dotted}: {key!r} is not a mapping")
            node = node[key]
        node[keys[-1]] = parse_value(raw)
    return cfg


def _check_keys(section: str, given: dict[str, Any], valid: set[str]) -> None:
    unknown = sorted(set(given) - valid)
    if unknown:
        raise ConfigError(f"{section}: unknown key(s) {unknown}; valid: {', '.join(sorted(valid))}")


def _check_model(where: str, name: Any) -> None:
    try:
        check_model_name(name)
    except ValueError as err:
        raise ConfigError(f"{where}: {err}") from err


def import_plugins(modules: Any, where: str = "plugins") -> list[str]:
    """Import the user's modules (``package.module`` names), which register datasets, models and methods
    with :func:`hetfl.register_dataset`, :func:`hetfl.register_model` and :func:`hetfl.register_method`."""
    import importlib

    if isinstance(modules, str):
        modules = [modules]
    if not isinstance(modules, list) or not all(isinstance(m, str) and m for m in modules):
        raise ConfigError(f"{where}: a list of module names such as [my_package.my_module], got {modules!r}")
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as err:
            raise ConfigError(f"{where}: cannot import {name!r} ({err}); is it on PYTHONPATH?") from err
    return list(modules)


def _check_dataset(spec: Any) -> None:
    if isinstance(spec, dict):
        try:
            check_spec(spec)
        except ValueError as err:
            raise ConfigError(str(err)) from err
    elif spec not in dataset_names():
        raise ConfigError(f"dataset: unknown {spec!r}; choose one of: {', '.join(dataset_names())}, "
                          "or {kind: folder | arrays, path: ...}")


def client_archs(cfg: dict[str, Any]) -> list[str]:
    """One architecture per client: a single name, or a list assigned round-robin."""
    model = cfg["client"].get("model", "cnn2")
    names = [model] if isinstance(model, str) else list(model)
    return [names[i % len(names)] for i in range(int(cfg["clients"]))]


DEVICE_FORMS = "auto, cpu, cuda, cuda:N, mps"


def check_device(name: Any) -> None:
    """``device`` must name a torch device type this library supports (whether this machine has it
    is checked when the experiment starts, since a config may be written on another machine)."""
    if not isinstance(name, str) or not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", name):
        raise ConfigError(f"device: {name!r} is not one of {DEVICE_FORMS}")


def validate(cfg: dict[str, Any]) -> dict[str, Any]:
    """Fill defaults and check every key; returns a new dictionary."""
    if not isinstance(cfg, dict):
        raise ConfigError("a config must be a YAML mapping")
    for key in REQUIRED:
        if cfg.get(key) in (None, {}, ""):
            raise ConfigError(f"config: '{key}' is required")
    cfg = copy.deepcopy(_checked("config", TOP_KEYS, cfg, TOP_RANGES, ""))
    cfg["plugins"] = import_plugins(cfg["plugins"] or [])  # first: they add names the checks below accept
    _check_dataset(cfg["dataset"])
    check_device(cfg["device"])
    if not isinstance(cfg["partition"], dict):
        raise ConfigError("partition must be a mapping such as {kind: dirichlet, alpha: 0.1}")
    try:
        validate_spec(cfg["partition"])
    except ValueError as err:
        raise ConfigError(f"partition: {err}") from err
    cfg["client"] = dict(cfg["client"] or {})
    cfg["server"] = dict(cfg["server"] or {})
    _check_keys("client", cfg["client"], CLIENT_KEYS)
    _check_keys("server", cfg["server"], SERVER_KEYS)
    cfg["client"].setdefault("model", "cnn2")
    for arch in set(client_archs(cfg)):
        _check_model("client.model", arch)
    cfg["server"].setdefault("model", client_archs(cfg)[0])
    _check_model("server.model", cfg["server"]["model"])
    try:
        TrainConfig.checked({k: v for k, v in cfg["client"].items() if k != "model"})
    except ValueError as err:
        raise ConfigError(str(err)) from err
    if not isinstance(cfg["methods"], dict):
        raise ConfigError("methods must be a mapping of label -> {method: name, parameters}")
    for label, params in cfg["methods"].items():
        if params is not None and not isinstance(params, dict):
            raise ConfigError(f"methods.{label}: parameters must be a mapping, got {params!r}")
        cfg["methods"][label] = dict(params or {})
    cfg["flower"] = _checked("flower", FLOWER_KEYS, dict(cfg["flower"] or {}), FLOWER_RANGES, "flower")
    cfg["simulator"] = _checked("simulator", SIMULATOR_KEYS, dict(cfg["simulator"] or {}),
                                {"state_memory_mb": {"ge": 0}}, "simulator")
    if cfg["flower"]["node_data"] and cfg["validation"]:
        raise ConfigError("validation: the SuperNodes serve their own data (flower.node_data), so no validation "
                          "share can be held out of it; set validation: 0")
    return cfg


def _checked(name: str, defaults: dict[str, Any], values: dict[str, Any], ranges: dict[str, Any],
             where: str) -> dict[str, Any]:
    """:func:`hetfl.fl.params.check` with its error as a :class:`ConfigError`."""
    if not isinstance(values, dict):
        raise ConfigError(f"{where or name}: must be a mapping, got {values!r}")
    try:
        return check(name, defaults, values, ranges, where=where)
    except ParamError as err:
        raise ConfigError(str(err)) from err


def load_config(path: str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = load_yaml(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from err
    return validate(apply_overrides(raw or {}, overrides or []))
