"""The Python API: :func:`run` a config (a YAML path or a dict) and :func:`load_run` a finished run's folder.

``hetfl run CONFIG`` is this :func:`run` plus printing, so a config gives the same summary from either::

    import hetfl

    result = hetfl.run({"dataset": {"kind": "folder", "path": "scans"}, "partition": {"kind": "iid"},
                        "clients": 10, "methods": {"fedavg": {"rounds": 5}, "kdia": {"rounds": 5}}})
    print(result.table())
    model = result.model("kdia")  # the trained global model, loaded on demand
"""

from __future__ import annotations

import copy
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hetfl.config import ConfigError, apply_overrides, import_plugins
from hetfl.fl.payload import jsonl_rows


@dataclass
class Result:
    """A run's outputs: ``summary`` (summary.json), per-method accuracies, bytes and seconds, and its models
    loaded on demand (:meth:`model`)."""

    folder: Path
    summary: dict[str, Any]
    _models: dict[str, nn.Module] = field(default_factory=dict, repr=False)

    @property
    def methods(self) -> list[str]:
        return list(self.summary["results"])

    def accuracy(self, method: str, select: str = "final") -> float | None:
        """Top-1 test accuracy (%) of ``method``'s model: ``final`` (last evaluation), ``val`` (the evaluation
        the validation split picks; None without one) or ``test`` (best over evaluations on test, the
        papers' protocol)."""
        keys = {"final": "accuracy", "val": "val_selected_accuracy", "test": "best_accuracy"}
        if select not in keys:
            raise ValueError(f"select: {select!r} is not one of {', '.join(keys)}")
        return self._result(method).get(keys[select])

    def bytes(self, method: str, direction: str = "up") -> int:
        """Bytes ``method`` sent: ``up`` (client to server), ``down`` or ``peer`` (relayed client data)."""
        return int(self._result(method)[f"bytes_{direction}"])

    def seconds(self, method: str) -> float:
        return float(self._result(method)["seconds"])

    def metrics(self, method: str | None = None) -> list[dict[str, Any]]:
        """The rows of metrics.jsonl (one per evaluation), of one method or all."""
        path = self.folder / "metrics.jsonl"
        rows = jsonl_rows(path) if path.is_file() else []
        return [r for r in rows if method is None or r.get("method") == method]

    def model(self, method: str, name: str | None = None) -> nn.Module:
        """``method``'s model ``name`` (default: its headline model), rebuilt and loaded from its
        safetensors file on first use."""
        from safetensors.torch import load_file

        from hetfl.models import build_model

        self._result(method)
        name = name or method
        key = f"{method}/{name}"
        if key not in self._models:
            path = self.folder / method / f"{name}.safetensors"
            if not path.is_file():
                raise FileNotFoundError(f"{path}: no saved model {name!r} for {method!r}")
            cfg = self.summary["config"]
            shape, classes = self.summary["data"]["shape"], self.summary["data"]["num_classes"]
            with torch.random.fork_rng(devices=[]):
                model = build_model(cfg["server"]["model"], shape[0], shape[1], classes)
            model.load_state_dict(load_file(str(path)))
            self._models[key] = model.eval()
        return self._models[key]

    def table(self) -> str:
        from hetfl.report import results_table

        return results_table(self.summary["results"])

    def _result(self, method: str) -> dict[str, Any]:
        try:
            return self.summary["results"][method]
        except KeyError:
            raise KeyError(f"no method {method!r} in {self.folder}; it ran {', '.join(self.methods)}") from None


def load_run(folder: str | Path) -> Result:
    """The :class:`Result` of a finished run's folder (``hetfl run --out FOLDER`` or :func:`run`)."""
    folder = Path(folder)
    path = folder / "summary.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found; is {folder} a finished run's folder?")
    return Result(folder, json.loads(path.read_text()))


def load(config: str | Path | dict[str, Any], overrides: list[str] | None = None,
         methods: list[str] | str | None = None, plugins: list[str] | None = None) -> dict[str, Any]:
    """A config (path or dict) validated, with ``overrides`` (``key.sub=value``) and the ``methods`` kept."""
    from hetfl.methods.checks import load_config, validate

    import_plugins(plugins or [], where="--plugin")
    if isinstance(config, dict):
        cfg = validate(apply_overrides(copy.deepcopy(config), overrides or []))
    else:
        cfg = load_config(config, overrides)
    select_methods(cfg, methods)
    return cfg


def select_methods(cfg: dict[str, Any], methods: list[str] | str | None, where: str = "methods") -> None:
    """Keep only these labels of the config, in this order (``"a,b"`` or a list); ``where`` names the
    option in the error."""
    if not methods:
        return
    chosen = [m.strip() for m in methods.split(",") if m.strip()] if isinstance(methods, str) else list(methods)
    if missing := [m for m in chosen if m not in cfg["methods"]]:
        raise ConfigError(f"{where} {missing} not in the config's methods {list(cfg['methods'])}")
    cfg["methods"] = {m: cfg["methods"][m] for m in chosen}


def run(config: str | Path | dict[str, Any], *, methods: list[str] | str | None = None,
        out: str | Path | None = None, data_root: str | None = None, overrides: list[str] | None = None,
        plugins: list[str] | None = None, device: str | None = None, cache_dir: str | Path | None = "cache/uploads",
        resume: bool = True, keep_checkpoints: bool = False, quiet: bool | None = None,
        announce: bool = False) -> Result:
    """Run ``config`` (a YAML path or a dict) on the in-process simulator and return its :class:`Result`.

    ``methods``: only these labels of the config; ``out``: the run folder (default ``runs/<name>``);
    ``overrides``: ``key.sub=value`` strings as ``--set`` takes; ``plugins``: modules to import first;
    ``cache_dir`` None: always retrain; ``resume`` False: ignore checkpoints; ``quiet`` None: progress
    bars only in a terminal. Writes what ``hetfl run`` writes (summary.json, metrics.jsonl, plots)."""
    from hetfl.engine.simulator import Simulator, prepare
    from hetfl.host import denormals_flushed
    from hetfl.report import write_plots

    cfg = load(config, overrides, methods, plugins)
    if device:
        cfg["device"] = device
    folder = Path(out) if out is not None else Path("runs") / cfg["name"]
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"out {folder}: a file of that name exists; give a folder")
    if quiet is None:
        quiet = not sys.stderr.isatty()
    with denormals_flushed(cfg["simulator"]["flush_denormal"]):
        exp = prepare(cfg, data_root)
        if announce:
            from hetfl.data import dataset_label

            print(f"{cfg['name']}: {dataset_label(cfg['dataset'])} ({len(exp.splits.train)} train / "
                  f"{len(exp.splits.test)} test), {cfg['clients']} clients, partition {cfg['partition']}, "
                  f"device {exp.device}", flush=True)
        summary = Simulator(exp, folder, Path(cache_dir) if cache_dir else None, quiet=quiet, resume=resume,
                            data_root=data_root, keep_checkpoints=keep_checkpoints).run()
    write_plots(folder, summary)
    return Result(folder, summary)
