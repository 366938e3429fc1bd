"""A paper's reproduction as data: its grid, budgets and published numbers, read from
``papers/<name>.yaml``; :func:`cell_config` turns one cell (dataset x setting x seed at a budget) into
an experiment config."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetfl.config import ConfigError, load_yaml

PAPERS = Path(__file__).with_name("papers")
KEYS = {"title", "source", "cell_name", "metric", "ours", "paper_method", "baselines", "datasets", "settings", "seeds",
        "default_budget", "protocol", "config", "methods", "labels", "budgets", "published", "anchors",
        "setting_override", "reference", "orderings", "setting_format", "cost_targets", "round_offset",
        "cell_figures", "report"}
# besides the template's values; datasets / settings / seeds: the budget's default grid
BUDGET_KEYS = {"about", "methods", "methods_override", "config_override", "datasets", "settings", "seeds"}


def paper_names() -> list[str]:
    return sorted(p.stem for p in PAPERS.glob("*.yaml"))


@dataclass
class Paper:
    name: str
    spec: dict[str, Any]

    def __getattr__(self, key: str) -> Any:
        try:
            return self.spec[key]
        except KeyError:
            raise AttributeError(key) from None

    @property
    def differ(self) -> str:
        """The hand-written "Where we differ and why" section (``papers/<name>-differ.md``)."""
        path = PAPERS / f"{self.name}-differ.md"
        return path.read_text().strip() if path.is_file() else ""

    def label(self, method: str) -> str:
        return self.spec["labels"].get(method, method)

    def budget_methods(self, budget: str) -> list[str]:
        return list(self.spec["budgets"][budget].get("methods") or self.spec["methods"])

    def budget_grid(self, budget: str, key: str) -> list:
        """The budget's default datasets, settings or seeds (the paper's where the budget names none)."""
        return list(self.spec["budgets"][budget].get(key) or self.spec[key])

    def published_value(self, dataset: str, method: str, setting: str) -> str | None:
        row = self.spec["published"].get(dataset, {}).get(method)
        if row is None:
            return None
        value = row[list(self.spec["settings"]).index(setting)]
        return f"{value:.2f}" if isinstance(value, float) else str(value)


def load_paper(name: str) -> Paper:
    path = PAPERS / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"unknown paper {name!r}; choose one of: {', '.join(paper_names())}")
    spec = load_yaml(path.read_text())
    unknown = sorted(set(spec) - KEYS)
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {unknown}; valid: {', '.join(sorted(KEYS))}")
    for budget, values in spec["budgets"].items():
        extra = sorted(k for k in values if k in BUDGET_KEYS - {"about", "methods", "methods_override",
                                                                  "config_override"} and not values[k])
        if extra:
            raise ConfigError(f"{path}: budgets.{budget}: empty {extra}")
        for method in values.get("methods") or ():
            if method not in spec["methods"]:
                raise ConfigError(f"{path}: budgets.{budget}.methods: {method!r} is not in methods")
    return Paper(name, spec)


def _fill(node: Any, values: dict[str, Any], where: str) -> Any:
    """``"${key}"`` -> ``values[key]`` anywhere in ``node``."""
    if isinstance(node, dict):
        return {k: _fill(v, values, f"{where}.{k}") for k, v in node.items()}
    if isinstance(node, list):
        return [_fill(v, values, where) for v in node]
    if isinstance(node, str) and node.startswith("${") and node.endswith("}"):
        key = node[2:-1]
        if key not in values:
            raise ConfigError(f"{where}: the budget has no value for ${{{key}}}")
        return copy.deepcopy(values[key])
    return node


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` deep-merged onto ``base``; a ``None`` value removes the key."""
    out = dict(base)
    for key, value in over.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def cell_name(paper: Paper, dataset: str, setting: str, seed: int, budget: str) -> str:
    return paper.cell_name.format(dataset=dataset, setting=setting.replace("/", ""), seed=seed, budget=budget)


def cell_config(paper: Paper, dataset: str, setting: str, seed: int, budget: str,
                methods: list[str] | None = None) -> dict[str, Any]:
    """The experiment config of one cell: the paper's template filled with the budget's values."""
    values = paper.budgets[budget]
    chosen = methods or paper.budget_methods(budget)
    method_specs = {m: paper.methods[m] for m in chosen}
    cfg = _fill({**paper.config, "methods": method_specs}, values, f"{paper.name}.{budget}")
    cfg["methods"] = _merge(cfg["methods"], {m: v for m, v in (values.get("methods_override") or {}).items()
                                             if m in chosen})
    cfg = _merge(cfg, {"partition": paper.settings[setting]})
    # per-setting values (e.g. KDIA's lambda_gen per beta), for the methods this cell runs
    over = copy.deepcopy((paper.spec.get("setting_override") or {}).get(setting) or {})
    over["methods"] = {m: v for m, v in (over.get("methods") or {}).items() if m in chosen}
    cfg = _merge(cfg, over)
    budget_over = copy.deepcopy(values.get("config_override") or {})
    if "methods" in budget_over:  # like the setting's: only the methods chosen for the cell
        budget_over["methods"] = {m: v for m, v in (budget_over["methods"] or {}).items() if m in chosen}
    cfg = _merge(cfg, budget_over)
    return {"name": cell_name(paper, dataset, setting, seed, budget), "seed": seed, "dataset": dataset, **cfg}


def grid(paper: Paper, budget: str, datasets: list[str], settings: list[str], seeds: list[int],
         methods: list[str] | None = None) -> list[dict[str, Any]]:
    return [cell_config(paper, d, s, seed, budget, methods) for d in datasets for s in settings for seed in seeds]
