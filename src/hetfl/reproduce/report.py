"""A paper's results page: our numbers beside the published ones, per budget, with two figures and the
hand-written "Where we differ and why". Reads the archived cells (``<page>-runs.json``, kept in git) and
the finished cells of the runs folder (which win); the same inputs always give the same bytes."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from hetfl.reproduce.paper import Paper, cell_config, cell_name

ARCHIVE_SUFFIX = "-runs.json"
MAX_SEEDS = 100  # seeds looked up per setting
OPTIMISER_KEYS = ("lr", "momentum", "weight_decay")
# The clients' SGD momentum before its default became 0: what a summary that records no resolved client
# settings ran with where its config named no momentum.
LEGACY_MOMENTUM = 0.9
STALE = "†"  # marks a number from runs whose client optimiser is not the one the config now resolves to


def _curve(summary: dict[str, Any], label: str, folder: Path | None) -> list[list[float]]:
    """``[[step, accuracy], ...]`` of one method's evaluations during its server stage."""
    result = summary["results"][label]
    if isinstance(result.get("curve"), list):  # FedMHO's record: one accuracy per server epoch from 0
        return [[i, a] for i, a in enumerate(result["curve"]) if a is not None]
    if label in summary.get("curves", {}):
        return summary["curves"][label]
    rows: dict[int, float] = {}
    metrics = folder / label / "metrics.jsonl" if folder is not None else None
    if metrics is not None and metrics.is_file():
        for line in metrics.read_text().splitlines():
            row = json.loads(line)
            if row.get("step", -1) >= 0 and row.get("accuracy") is not None:
                rows[row["step"]] = row["accuracy"]
    return [[s, rows[s]] for s in sorted(rows)]


def machine(env: dict[str, Any]) -> str:
    if env.get("accelerator"):
        return str(env["accelerator"])
    threads = env.get("threads")
    return f"{env.get('cpu') or 'an unrecorded CPU'}" + (f", {threads} thread{'s' * (threads != 1)}" if threads else "")


def condense(summary: dict[str, Any], folder: Path | None = None, front: bool = False) -> dict[str, Any]:
    """What the results page needs of a cell's summary: per method final / validation-selected /
    test-best accuracy and the curve, the cell's minutes and machine; with ``front``, each method's points
    of accuracy against bytes (a frontier page's)."""
    if front and folder is not None:
        from hetfl.frontier import front_entries

        fronts = front_entries(folder, summary)
    else:
        fronts = {}
    results = {}
    for label, r in summary["results"].items():
        entry = {"method": r.get("method", label), "final": round(r["accuracy"], 2),
                 "best": round(r["best_accuracy"], 2)}
        if r.get("val_selected_accuracy") is not None:
            entry["val"] = round(r["val_selected_accuracy"], 2)
        curve = _curve(summary, label, folder)
        if len(curve) > 1:
            entry["curve"] = [[s, round(a, 2)] for s, a in curve]
        settings = summary.get("config", {}).get("methods", {}).get(label) or r.get("params", {})
        if settings.get("rounds", 1) > 1:  # multi-round
            entry.update(rounds=r["params"]["rounds"], seconds=round(r["seconds"], 1), bytes_up=r["bytes_up"],
                         bytes_down=r["bytes_down"], bytes_peer=r.get("bytes_peer", 0))
            if r.get("models"):
                entry["models"] = {k: round(v, 2) for k, v in r["models"].items()}
            if r.get("code"):  # the git revision that ran the method
                entry["code"] = r["code"]
            if r.get("client_failures"):  # uploads rejected or client tasks failed, left out of their round
                entry["left_out"] = len(r["client_failures"])
            if "curve" in entry and (mib := _mebibytes(folder, label, [s for s, _ in entry["curve"]])):
                entry["mib"] = mib
        entry["optimiser"] = _optimiser(summary, label)
        if isinstance(r.get("clusters"), dict):  # HFLDD's clustering
            entry["clusters"] = {k: r["clusters"][k] for k in ("homogeneous", "heterogeneous", "sizes")
                                 if k in r["clusters"]}
        if label in fronts:
            entry["front"] = fronts[label]
        results[label] = entry
    return {"results": results, "minutes": round(summary.get("minutes") or 0.0, 1),
            "machine": machine(summary.get("environment", {}))}


def _optimiser(summary: dict[str, Any], label: str) -> dict[str, float]:
    """The client optimiser a method of a cell's summary ran with: the resolved settings it recorded or,
    in a summary from before they were recorded, its config over the defaults of that time."""
    client = summary["results"][label].get("client")
    if client is None:
        config = summary.get("config", {})
        method_client = (config.get("methods", {}).get(label) or {}).get("client") or {}
        client = {"lr": 0.01, "momentum": LEGACY_MOMENTUM, "weight_decay": 0.0, **config.get("client", {}),
                  **method_client}
    return {k: float(client[k]) for k in OPTIMISER_KEYS}


def configured_optimiser(cfg: dict[str, Any], label: str) -> dict[str, float]:
    """The client optimiser a cell's config resolves to for method ``label`` (its ``client:`` over the
    config's, over :class:`~hetfl.fl.train_config.TrainConfig`'s defaults)."""
    import hetfl.methods  # noqa: F401 (the registry and presets)
    from hetfl.fl.method import resolve_method
    from hetfl.fl.train_config import TrainConfig

    params = resolve_method(label, cfg["methods"].get(label))[1]
    client = {k: v for k, v in {**cfg.get("client", {}), **(params.get("client") or {})}.items() if k != "model"}
    return TrainConfig.checked(client).optimiser()


def describe_optimiser(opt: dict[str, float]) -> str:
    return f"SGD lr {opt['lr']:g}, momentum {opt['momentum']:g}, weight decay {opt['weight_decay']:g}"


def protocol_optimiser(paper: Paper, budget: str) -> str:
    """The clients' optimiser as the paper's config resolves it for ``budget``, per group of methods."""
    dataset = paper.budget_grid(budget, "datasets")[0]
    cfg = cell_config(paper, dataset, paper.budget_grid(budget, "settings")[0], 0, budget)
    groups: dict[str, list[str]] = {}
    for label in cfg["methods"]:
        groups.setdefault(describe_optimiser(configured_optimiser(cfg, label)), []).append(paper.label(label))
    if len(groups) == 1:
        return f"Client optimiser (resolved from the config): {next(iter(groups))}."
    parts = [f"{text} ({', '.join(labels)})" for text, labels in groups.items()]
    return "Client optimiser (resolved from the config): " + "; ".join(parts) + "."


def _cell_keys(paper: Paper) -> dict[str, tuple[str, str, int, str]]:
    """Cell name -> (dataset, setting, seed, budget) over the paper's grid."""
    return {cell_name(paper, d, s, seed, b): (d, s, seed, b) for b in paper.budgets for d in paper.datasets
            for s in paper.settings for seed in range(MAX_SEEDS)}


def stale_rows(paper: Paper, cells: dict[str, Any]) -> list[tuple[str, str, dict[str, float]]]:
    """``(cell, label, optimiser it ran with)`` of every archived result whose client optimiser differs
    from the one its cell's config resolves to now (a result from before a config or default changed)."""
    keys, out = _cell_keys(paper), []
    for name, cell in sorted(cells.items()):
        if name not in keys:
            continue
        for label, entry in cell["results"].items():
            ran = entry.get("optimiser")
            if ran is not None and label in paper.methods and ran != configured_optimiser(
                    cell_config(paper, *keys[name], methods=[label]), label):
                out.append((name, label, ran))
    return out


def _mebibytes(folder: Path | None, label: str, steps: list[int]) -> list[float] | None:
    """Tensor MiB sent up to and including each step (the ledger's ``per_round`` tensor bytes, every
    direction: the papers' traffic), None where the run's ``communication.json`` lacks them."""
    path = folder / label / "communication.json" if folder is not None else None
    if path is None or not path.is_file():
        return None
    rounds = json.loads(path.read_text()).get("per_round", [])
    if not rounds or any("tensor_bytes" not in r for r in rounds):
        return None
    return [round(sum(r["tensor_bytes"] for r in rounds if r["round"] <= s) / 2**20, 3) for s in steps]


def merge_cell(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """A cell of the runs folder over the archived one of the same name: its methods win, and the archived
    methods it did not run are kept (a cell finished in parts, e.g. ``--methods`` on a fresh machine).
    Minutes add up, less the archived seconds of the methods run again; machines are both named."""
    if not old or set(old["results"]) <= set(new["results"]):
        return new
    again = [old["results"][m] for m in new["results"] if m in old["results"]]
    minutes = old["minutes"] + new["minutes"] - sum(r.get("seconds", 0.0) for r in again) / 60
    machines = " and ".join(dict.fromkeys([*old["machine"].split(" and "), *new["machine"].split(" and ")]))
    return {"results": {**old["results"], **new["results"]}, "minutes": round(max(minutes, new["minutes"]), 1),
            "machine": machines}


def missing_methods(summary: dict[str, Any], methods: Any) -> list[str]:
    """Those of ``methods`` with no result in the cell's summary."""
    return [m for m in methods if m not in summary.get("results", {})]


def runs_cells(root: Path) -> tuple[dict[str, dict[str, Any]], dict[str, list[str]]]:
    """The runs folder's finished cells (a result for every method of their config) by name, and its
    unfinished ones with the methods they have no result for yet (a cell still running or stopped)."""
    done: dict[str, dict[str, Any]] = {}
    unfinished: dict[str, list[str]] = {}
    for path in sorted(root.glob("*/summary.json")):
        summary = json.loads(path.read_text())
        config = summary.get("config", {})
        if config.get("name") != path.parent.name:
            continue
        if missing := missing_methods(summary, config.get("methods", {})):
            unfinished[path.parent.name] = missing
        else:
            done[path.parent.name] = summary
    return done, unfinished


def load_cells(root: Path, archive: Path, front: bool = False) -> dict[str, dict[str, Any]]:
    """The archived cells, each overlaid by the runs folder's finished cell of its name; an unfinished
    cell is left out, so a stopped grid never puts some of a cell's methods beside whole cells."""
    cells = json.loads(archive.read_text()) if archive.is_file() else {}
    for name, summary in runs_cells(root)[0].items():
        cells[name] = merge_cell(cells.get(name), condense(summary, root / name, front))
    return cells


def _runs(paper: Paper, cells: dict[str, Any], dataset: str, setting: str, budget: str) -> list[dict[str, Any]]:
    names = (cell_name(paper, dataset, setting, seed, budget) for seed in range(MAX_SEEDS))
    return [cells[n] for n in names if n in cells]


def _mean(values: list[float]) -> str:
    if not values:
        return "-"
    text = f"{statistics.fmean(values):.2f}"
    return text + (f" ±{statistics.stdev(values):.2f}" if len(values) > 1 else "")


def _values(runs: list[dict[str, Any]], label: str, key: str) -> list[float]:
    return [r["results"][label][key] for r in runs if label in r["results"] and key in r["results"][label]]


def _number(text: str | None) -> float | None:
    return None if text is None else float(str(text).split("±")[0])


def _settings_head(paper: Paper, setting: str) -> str:
    return setting if setting == "2c/c" else paper.spec.get("setting_format", "α={}").format(setting)


def _dataset_table(paper: Paper, cells: dict[str, Any], dataset: str, budget: str, val: bool) -> list[str]:
    cols = ["final", *(["val"] if val else []), "test-best", "paper"]
    settings = [s for s in paper.settings if _runs(paper, cells, dataset, s, budget)  # run here or published
                or any(paper.published_value(dataset, m, s) for m in paper.methods)]
    head = ["method"] + [f"{_settings_head(paper, s)} {c}" for s in settings for c in cols]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    labels = [m for m in paper.methods if any(m in r["results"] for s in settings
                                              for r in _runs(paper, cells, dataset, s, budget))]
    for label in labels:
        row = [paper.label(label)]
        for setting in settings:
            runs = _runs(paper, cells, dataset, setting, budget)
            final = _values(runs, label, "final")
            mark = f" {STALE}" if any(r["results"].get(label, {}).get("stale") for r in runs) else ""
            row.append(f"{_mean(final)} (n={len(final)}){mark}" if final else "not run")
            if val:
                row.append(_mean(_values(runs, label, "val")))
            row += [_mean(_values(runs, label, "best")), paper.published_value(dataset, label, setting) or "-"]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _key(paper: Paper) -> str:
    return "best" if paper.metric == "best" else "final"


def _best_baseline(paper: Paper, runs: list[dict[str, Any]]) -> tuple[str, float] | None:
    means = {m: statistics.fmean(v) for m in paper.baselines if (v := _values(runs, m, _key(paper)))}
    return max(means.items(), key=lambda kv: kv[1]) if means else None


def _published_best_baseline(paper: Paper, dataset: str, setting: str) -> tuple[str, float] | None:
    rows = {m: v for m in paper.baselines if (v := _number(paper.published_value(dataset, m, setting))) is not None}
    return max(rows.items(), key=lambda kv: kv[1]) if rows else None


def budgets_run(paper: Paper, cells: dict[str, Any]) -> list[str]:
    return [b for b in paper.budgets if any(_runs(paper, cells, d, s, b) for d in paper.datasets
                                            for s in paper.settings)]


def standing(paper: Paper, cells: dict[str, Any], budgets: list[str]) -> list[str]:
    """Ours and the best baseline per budget beside the paper's method and best baseline."""
    what = "test-best" if paper.metric == "best" else "final"
    head = ["dataset", "setting", f"paper: {paper.label(paper.paper_method)}", "paper: best baseline"]
    for b in budgets:
        head += [f"`{b}`: ours", f"`{b}`: best baseline"]
    lines = [f"Ours = `{paper.ours}` ({paper.label(paper.ours)}); {what} %, mean over seeds (n); the best "
             "baseline is the baseline with the highest mean in the same cells. "
             "**Bold**: ours above that baseline.", "",
             "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for dataset, title in paper.datasets.items():
        for setting in paper.settings:
            pub = _published_best_baseline(paper, dataset, setting)
            if pub is None and not any(_runs(paper, cells, dataset, setting, b) for b in budgets):
                continue  # neither a published number nor a run: no row
            row = [title, _settings_head(paper, setting), paper.published_value(dataset, paper.paper_method, setting)
                   or "-", f"{pub[1]:.2f} {paper.label(pub[0])}" if pub else "-"]
            for b in budgets:
                runs = _runs(paper, cells, dataset, setting, b)
                ours, base = _values(runs, paper.ours, _key(paper)), _best_baseline(paper, runs)
                mean = statistics.fmean(ours) if ours else None
                text = "-" if mean is None else f"{mean:.2f} n={len(ours)}"
                if mean is not None and base is not None and mean > base[1]:
                    text = f"**{text}**"
                row += [text, f"{base[1]:.2f} {paper.label(base[0])}" if base else "-"]
            lines.append("| " + " | ".join(row) + " |")
    return lines


def budget_section(paper: Paper, cells: dict[str, Any], budget: str, folder: Path | None = None) -> list[str]:
    runs = [r for d in paper.datasets for s in paper.settings for r in _runs(paper, cells, d, s, budget)]
    minutes = [r["minutes"] for r in runs if r.get("minutes")]
    machines = sorted({r["machine"] for r in runs})
    val = any("val" in m for r in runs for m in r["results"].values())
    lines = [f"## Budget `{budget}`", "", f"{paper.budgets[budget]['about']}. {len(runs)} cells; minutes per cell "
             + (f"{statistics.fmean(minutes):.1f} (range {min(minutes):.1f}-{max(minutes):.1f})" if minutes else "-")
             + f"; on {'; '.join(machines)}.", ""]
    for dataset, title in paper.datasets.items():
        if any(_runs(paper, cells, dataset, s, budget) for s in paper.settings):
            lines += [f"### {title}", "", *_dataset_table(paper, cells, dataset, budget, val), ""]
            if paper.spec.get("reference"):
                lines += [*_rounds_table(paper, cells, dataset, budget), ""]
            lines += _cost_targets(paper, cells, dataset, budget)
    lines += _clusters(paper, cells, budget, folder)
    if paper.spec.get("orderings"):
        lines += [*_orderings(paper, cells, budget), ""]
    return lines


def _find(run: dict[str, Any], name: str) -> float | None:
    """A method's final accuracy (``label``), or one of its models' (``label:model``)."""
    label, _, model = name.partition(":")
    result = run["results"].get(label)
    if result is None:
        return None
    return result.get("models", {}).get(model) if model else result.get("final")


def _reach(curve: list[list[float]], target: float) -> int | None:
    return next((int(s) for s, a in curve if a >= target), None)


def _rounds_table(paper: Paper, cells: dict[str, Any], dataset: str, budget: str) -> list[str]:
    """Per setting and method: rounds to reach the reference's best, seconds per round, MB up and down, and
    the final accuracy of each model of a method with several (means over seeds)."""
    ref = paper.spec["reference"]
    head = ["setting", "method", f"rounds to {paper.label(ref)}'s best", "s / round", "MB up", "MB down", "MB peer",
            "models"]
    lines = [f"Cost and speed ({paper.datasets[dataset]}): rounds until the first evaluation at or above "
             f"{paper.label(ref)}'s best test accuracy in the same cell (seeds that reached it / run); seconds per "
             "round (clients and server, on the cell's machine; stages before the first round included); "
             "payload megabytes per cell.", "",
             "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    left_out: list[str] = []
    for setting in paper.settings:
        runs = _runs(paper, cells, dataset, setting, budget)
        for label in paper.methods:
            got = [r for r in runs if "rounds" in r["results"].get(label, {})]
            if not got:
                continue
            reach = [x - _offset(paper, r, label) if (x := _reach(r["results"][label].get("curve", []), max(
                a for _, a in r["results"][ref]["curve"]))) is not None else None
                     for r in got if "curve" in r["results"].get(ref, {})]
            hits = [x for x in reach if x is not None]
            mean = {key: statistics.fmean(r["results"][label].get(key, 0) for r in got)
                    for key in ("seconds", "bytes_up", "bytes_down", "bytes_peer")}
            models = sorted({m for r in got for m in r["results"][label].get("models", {})})
            row = [_settings_head(paper, setting), paper.label(label),
                   f"{statistics.fmean(hits):.0f} ({len(hits)}/{len(reach)})" if hits else f"- (0/{len(reach)})",
                   f"{mean['seconds'] / got[0]['results'][label]['rounds']:.1f}", f"{mean['bytes_up'] / 1e6:.1f}",
                   f"{mean['bytes_down'] / 1e6:.1f}", f"{mean['bytes_peer'] / 1e6:.1f}",
                   ", ".join(f"{m.split('[')[-1].rstrip(']')} {_mean(_values_of(got, label, m))}" for m in models)
                   or "-"]
            lines.append("| " + " | ".join(row) + " |")
            if left := sum(r["results"][label].get("left_out", 0) for r in got):
                left_out.append(f"{paper.label(label)} at {_settings_head(paper, setting)}: {left} "
                                f"in {len(got)} cell{'s' * (len(got) != 1)}")
    if left_out:
        lines += ["", "Client uploads left out of their round (rejected by validation or a failed client task; "
                  "`client_failures` in the run's summary.json): " + "; ".join(left_out) + "."]
    return lines


def _offset(paper: Paper, run: dict[str, Any], label: str) -> int:
    """Steps before a method's first training round (YAML ``round_offset`` per registered method; HFLDD's
    clustering and distillation steps)."""
    return int(paper.spec.get("round_offset", {}).get(run["results"][label].get("method", label), 0))


def _to_target(paper: Paper, run: dict[str, Any], label: str, target: float) -> tuple[int, float | None] | None:
    """(training rounds, MiB sent) at a method's first evaluation at or above ``target``; None if never."""
    result = run["results"].get(label, {})
    mib = result.get("mib")
    for i, (step, accuracy) in enumerate(result.get("curve", [])):
        if accuracy >= target:
            return int(step) - _offset(paper, run, label), (mib[i] if mib else None)
    return None


def _cost_cell(hits: list[tuple[int, float | None]], runs: int) -> str:
    if not hits:
        return f"- (0/{runs})"
    mib = [m for _, m in hits if m is not None]
    text = f"{statistics.fmean(mib):.1f} MiB, " if mib else ""
    rounds = statistics.fmean(r for r, _ in hits)
    return text + f"{rounds:.0f} round{'s' * (round(rounds) != 1)}" + (f" ({len(hits)}/{runs})" if runs > 1 else "")


def _cost_targets(paper: Paper, cells: dict[str, Any], dataset: str, budget: str) -> list[str]:
    """Per YAML ``cost_targets`` entry: rounds and MiB until each target accuracy (HFLDD's Table II, Fig. 6),
    the paper's beside where it gives them, and the ratio to ours."""
    lines: list[str] = []
    for spec in paper.spec.get("cost_targets", []):
        setting = str(spec["setting"])
        runs = _runs(paper, cells, dataset, setting, budget)
        if not runs:
            continue
        targets, published = spec["targets"], spec.get("published", {}).get(dataset, {})
        head = ["method", *(f"to {t} %" for t in targets)]
        if len(targets) == 1:
            head += [f"x {paper.label(paper.ours)}", *(["paper", "paper x"] if published else [])]
        lines += [f"{spec['caption']} ({paper.datasets[dataset]}, {_settings_head(paper, setting)}): tensor MiB "
                  "sent (every direction; a seeded first model is not sent) and training rounds until the first "
                  "evaluation at or above the target; means over the seeds that reached it; \"-\": not reached "
                  "in the budget's rounds.", "", "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
        ours = [h for r in runs if (h := _to_target(paper, r, paper.ours, targets[-1])) and h[1] is not None]
        for label in paper.methods:
            got = [r for r in runs if "curve" in r["results"].get(label, {})]
            if not got or "rounds" not in got[0]["results"][label]:
                continue
            hits = [[h for r in got if (h := _to_target(paper, r, label, t))] for t in targets]
            row = [paper.label(label), *(_cost_cell(h, len(got)) for h in hits)]
            if len(targets) == 1:
                mine = [m for _, m in hits[0] if m is not None]
                row.append(f"{statistics.fmean(mine) / statistics.fmean(m for _, m in ours):.1f}x"
                           if mine and ours else "-")
                if published:
                    pub, base = published.get(label), published.get(paper.ours)
                    row += [f"{pub[1]} MiB, {pub[0]} round{'s' * (pub[0] != 1)}" if pub else "-",
                            f"{pub[1] / base[1]:.1f}x" if pub and base else "-"]
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    return lines


def _clusters(paper: Paper, cells: dict[str, Any], budget: str, folder: Path | None) -> list[str]:
    """The clustering each run found (K homogeneous, H heterogeneous clusters and their sizes), with the
    per-cell figures that ``--save`` copied beside the page (YAML ``cell_figures``)."""
    rows, images = [], []
    for dataset, title in paper.datasets.items():
        for setting in paper.settings:
            for seed in range(MAX_SEEDS):
                name = cell_name(paper, dataset, setting, seed, budget)
                if name not in cells:
                    continue
                for label, entry in cells[name]["results"].items():
                    if "clusters" in entry:
                        c = entry["clusters"]
                        rows.append(f"| {title} | {_settings_head(paper, setting)} | {seed} | {paper.label(label)} | "
                                    f"{c.get('homogeneous', '-')} | {c.get('heterogeneous', '-')} | "
                                    f"{', '.join(map(str, c.get('sizes', [])))} |")
                for label, figure in paper.spec.get("cell_figures", {}).items():
                    path = f"{name}-{Path(figure).stem}.png"
                    if folder is not None and (folder / path).is_file() and label in cells[name]["results"]:
                        images.append(f"![{title}, {_settings_head(paper, setting)}, seed {seed}]({path})")
    if not rows:
        return []
    return ["Clusters found (K homogeneous; H heterogeneous, each with one client of a homogeneous cluster, "
            "and its size):", "", "| dataset | setting | seed | method | K | H | sizes |", "|---" * 7 + "|", *rows, "",
            *images, *([""] if images else [])]


def _values_of(runs: list[dict[str, Any]], label: str, model: str) -> list[float]:
    return [r["results"][label]["models"][model] for r in runs if model in r["results"][label].get("models", {})]


def _orderings(paper: Paper, cells: dict[str, Any], budget: str) -> list[str]:
    """Whether each of the paper's claimed orderings (YAML ``orderings``) holds in this budget's cells, per
    dataset: ``a >= b`` (``a > b`` with ``strict``; means over seeds, per setting), ``margin`` (ours minus
    the best baseline larger at the first setting than at the second) or ``faster`` (``a`` reaches the
    reference's best in fewer rounds than the reference itself)."""
    lines = ["The paper's orderings on these cells (means over seeds; \"-\": not run):", "",
             "| claim | " + " | ".join(paper.datasets[d] for d in paper.datasets) + " |",
             "|---" * (len(paper.datasets) + 1) + "|"]
    for claim in paper.spec["orderings"]:
        row = [claim["claim"]]
        for dataset in paper.datasets:
            row.append(_holds(paper, cells, dataset, budget, claim))
        if any(v != "-" for v in row[1:]):
            lines.append("| " + " | ".join(row) + " |")
    return lines if len(lines) > 4 else []


def _holds(paper: Paper, cells: dict[str, Any], dataset: str, budget: str, claim: dict[str, Any]) -> str:
    settings = claim.get("settings") or list(paper.settings)
    out = []
    for setting in settings:
        runs = _runs(paper, cells, dataset, setting, budget)
        if not runs:
            continue
        if claim["kind"] == "compare":
            a = [v for r in runs if (v := _find(r, claim["a"])) is not None]
            b = [v for r in runs if (v := _find(r, claim["b"])) is not None]
            if a and b:
                x, y = statistics.fmean(a), statistics.fmean(b)
                holds = x > y if claim.get("strict") else x >= y
                out.append(f"{_settings_head(paper, setting)}: {'yes' if holds else 'no'} ({x:.2f} vs {y:.2f})")
        elif claim["kind"] == "faster":
            ref = paper.spec["reference"]
            pairs = [(_reach(r["results"][claim["a"]].get("curve", []), max(a for _, a in r["results"][ref]["curve"])),
                      _reach(r["results"][ref]["curve"], max(a for _, a in r["results"][ref]["curve"])))
                     for r in runs if claim["a"] in r["results"] and "curve" in r["results"].get(ref, {})]
            if pairs:
                ok = sum(1 for a, b in pairs if a is not None and a < b)
                out.append(f"{_settings_head(paper, setting)}: {ok}/{len(pairs)} seeds")
    if claim["kind"] == "margin":
        gaps = []
        for setting in settings:
            runs = _runs(paper, cells, dataset, setting, budget)
            ours, base = _values(runs, paper.ours, "final"), _best_baseline(paper, runs)
            if ours and base:
                gaps.append(statistics.fmean(ours) - base[1])
        if len(gaps) == len(settings) == 2:
            out.append(f"{'yes' if gaps[0] > max(gaps[1], 0) else 'no'} ({gaps[0]:+.2f} vs {gaps[1]:+.2f})")
    return "; ".join(out) or "-"


def _save(fig: Any, path: Path) -> None:
    fig.savefig(path, dpi=90, metadata={"Software": None})


def plot_standing(paper: Paper, cells: dict[str, Any], budget: str, path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(paper.datasets), figsize=(5 * len(paper.datasets), 3.2), squeeze=False)
    any_bar = False
    for ax, (dataset, title) in zip(axes[0], paper.datasets.items()):
        settings = list(paper.settings)
        series = {f"paper: {paper.label(paper.paper_method)}": [], f"ours ({budget})": [],
                  f"best baseline ({budget})": []}
        for s in settings:
            runs = _runs(paper, cells, dataset, s, budget)
            ours, base = _values(runs, paper.ours, _key(paper)), _best_baseline(paper, runs)
            series[f"paper: {paper.label(paper.paper_method)}"].append(
                _number(paper.published_value(dataset, paper.paper_method, s)) or 0.0)
            series[f"ours ({budget})"].append(statistics.fmean(ours) if ours else 0.0)
            series[f"best baseline ({budget})"].append(base[1] if base else 0.0)
            any_bar = any_bar or bool(ours)
        for i, (name, values) in enumerate(series.items()):
            ax.bar([x + 0.27 * (i - 1) for x in range(len(settings))], values, width=0.27, label=name)
        ax.set_xticks(range(len(settings)), [_settings_head(paper, s) for s in settings])
        ax.set_title(title, fontsize=10)
        ax.set_ylabel("accuracy (%)")
        ax.set_ylim(0, 100)
    axes[0][0].legend(fontsize=7, loc="lower left", framealpha=0.9)
    fig.tight_layout()
    if any_bar:
        _save(fig, path)
    plt.close(fig)
    return any_bar


def plot_curves(paper: Paper, cells: dict[str, Any], budget: str, path: Path) -> bool:
    """Accuracy per server epoch (mean over seeds), one panel per dataset and setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = {(d, s) for d in paper.datasets for s in paper.settings if _runs(paper, cells, d, s, budget)}
    rows = [d for d in paper.datasets if any((d, s) in ran for s in paper.settings)] or list(paper.datasets)
    cols = [s for s in paper.settings if any((d, s) in ran for d in rows)] or list(paper.settings)
    height = 2.2 * len(rows) + 0.7  # 0.7 in for the legend below the panels
    fig, axes = plt.subplots(len(rows), len(cols), figsize=(max(2.6 * len(cols), 5.2), height), squeeze=False,
                             sharey=True)
    drawn = False
    for i, dataset in enumerate(rows):
        for j, setting in enumerate(cols):
            ax = axes[i][j]
            runs = _runs(paper, cells, dataset, setting, budget)
            for label in paper.methods:
                curves = [dict(map(tuple, r["results"][label]["curve"])) for r in runs
                          if "curve" in r["results"].get(label, {})]
                steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
                if len(steps) > 10:  # a per-epoch curve (FedDF's few evaluations read poorly at this scale)
                    shift = _offset(paper, runs[0], label)  # training rounds (HFLDD: after its two stages)
                    ax.plot([s - shift for s in steps], [statistics.fmean(c[s] for c in curves) for s in steps], lw=1,
                            label=paper.label(label))
                    drawn = True
            ax.set_title(f"{paper.datasets[dataset]}, {_settings_head(paper, setting)}", fontsize=8)
            ax.tick_params(labelsize=7)
            if i == len(rows) - 1:
                ax.set_xlabel("round" if paper.spec.get("reference") else "server epoch", fontsize=7)
    handles, labels = axes[0][0].get_legend_handles_labels()
    for ax in axes.flat:
        if len(ax.get_legend_handles_labels()[0]) > len(handles):
            handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=7)
    fig.tight_layout(rect=(0, 0.7 / height, 1, 1))
    if drawn:
        _save(fig, path)
    plt.close(fig)
    return drawn


def plot_cost(paper: Paper, cells: dict[str, Any], budget: str, path: Path) -> bool:
    """MiB to each target accuracy, log scale, one panel per dataset (YAML ``cost_targets`` entries with
    several targets: HFLDD's Fig. 6)."""
    specs = [c for c in paper.spec.get("cost_targets", []) if len(c["targets"]) > 1]
    panels = [(d, c) for c in specs for d in paper.datasets if _runs(paper, cells, d, str(c["setting"]), budget)]
    if not panels:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.0), squeeze=False)
    drawn = False
    for ax, (dataset, spec) in zip(axes[0], panels):
        runs = _runs(paper, cells, dataset, str(spec["setting"]), budget)
        for label in paper.methods:
            points = []
            for target in spec["targets"]:
                hits = [h[1] for r in runs if (h := _to_target(paper, r, label, target)) and h[1] is not None]
                if hits and len(hits) == len(runs):
                    points.append((target, statistics.fmean(hits)))
            if points:
                ax.plot(*zip(*points), marker="o", lw=1, ms=3, label=paper.label(label))
                drawn = True
        ax.set_yscale("log")
        ax.set_title(f"{paper.datasets[dataset]}, {_settings_head(paper, str(spec['setting']))}", fontsize=9)
        ax.set_xlabel("target test accuracy (%)", fontsize=8)
        ax.set_ylabel("MiB sent until reached", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=6)
    fig.tight_layout()
    if drawn:
        _save(fig, path)
    plt.close(fig)
    return drawn


def _stale_note(paper: Paper, stale: list[tuple[str, str, dict[str, float]]]) -> list[str]:
    """The footnote to :data:`STALE`: which results ran with which other optimiser."""
    if not stale:
        return []
    cells: dict[tuple[str, str], list[str]] = {}  # (optimiser, label) -> cells
    for name, label, ran in stale:
        cells.setdefault((describe_optimiser(ran), label), []).append(name)
    groups: dict[tuple[str, tuple[str, ...]], list[str]] = {}  # (optimiser, cells) -> labels
    for (ran, label), names in cells.items():
        groups.setdefault((ran, tuple(names)), []).append(paper.label(label))
    items = "; ".join(f"{', '.join(labels)} in {', '.join(names)} ({ran})" for (ran, names), labels in groups.items())
    return [f"{STALE} Not yet re-run with the optimiser above; they ran with another: {items}.", ""]


def render(paper: Paper, cells: dict[str, Any], figures: list[str], folder: Path | None = None) -> str:
    cells = json.loads(json.dumps(cells))  # marked below, not the caller's
    stale = stale_rows(paper, cells)
    for name, label, _ in stale:
        cells[name]["results"][label]["stale"] = True
    budgets = budgets_run(paper, cells)
    what = "test-best" if paper.metric == "best" else "final"
    lines = [f"# {paper.title}", "",
             f"Generated by `hetfl reproduce {paper.name} --report-only` from the archived cells "
             f"(`{paper.name}{ARCHIVE_SUFFIX}`) and the finished cells of `runs/reproduce-{paper.name}/`; "
             "do not edit by hand.", "",
             f"Source: {paper.source}. The paper reports **{what}**. {paper.protocol} "
             f"{protocol_optimiser(paper, paper.default_budget)}", "", *_stale_note(paper, stale),
             "Columns: **final** = the last model; **val** = the model picked on a validation split (where a "
             "run had one); **test-best** = the best test accuracy over the server's evaluations, i.e. "
             "test-set model selection, the papers' protocol; **paper** = the published number. Means over "
             "the seeds run (n), ± = sd over seeds.", "",
             "## Standing", "", *standing(paper, cells, budgets), ""]
    lines += [f"![{f}]({f})" for f in figures] + ([""] if figures else [])
    for budget in budgets:
        lines += budget_section(paper, cells, budget, folder)
    not_run = [b for b in paper.budgets if b not in budgets]
    if not_run:
        lines += ["Budgets with no cell run yet: " + ", ".join(
            f"`{b}` ({paper.budgets[b]['about']})" for b in not_run) + ".", ""]
    if paper.differ:
        lines += ["## Where we differ and why", "", paper.differ, ""]
    return "\n".join(lines).rstrip() + "\n"


def write_results(paper: Paper, root: Path, results: Path, archive: Path) -> None:
    if paper.spec.get("report") == "frontier":
        from hetfl.reproduce.frontier_page import write_frontier_page

        return write_frontier_page(paper, root, results, archive)
    cells = load_cells(root, archive)
    results.parent.mkdir(parents=True, exist_ok=True)
    budget = paper.default_budget
    figures = []
    for stem, plot in (("standing", plot_standing), ("curves", plot_curves), ("cost", plot_cost)):
        path = results.with_name(f"{paper.name}-{stem}.png")
        if plot(paper, cells, budget, path):
            figures.append(path.name)
    results.write_text(render(paper, cells, figures, archive.parent))  # per-cell figures lie beside the archive
