"""The results page of ``hetfl reproduce frontier`` (a paper YAML with ``report: frontier``): per budget and
dataset, one figure of accuracy against bytes with a panel per setting, the two tables of
:mod:`hetfl.frontier` per setting; per budget, the minutes of every method's clients and server (and the
clients' sample-passes where counted) in each cell; then the hand-written ``papers/<name>-differ.md`` ("What
the frontier shows"). Built from the archived cells' per-method points (``front`` in ``<page>-runs.json``) and
the finished cells of the runs folder, so ``--report-only`` regenerates it byte for byte."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from hetfl.frontier import Panel, Point, markdown_tables, minutes, panel_from_entries, plot
from hetfl.reproduce.paper import Paper, cell_name
from hetfl.reproduce.report import ARCHIVE_SUFFIX, MAX_SEEDS, load_cells, protocol_optimiser


def setting_title(partition: dict[str, Any]) -> str:
    """``Dirichlet(0.1)``, ``2 classes per client``, or the partition's kind and values."""
    if partition.get("kind") == "dirichlet":
        return f"Dirichlet({partition['alpha']})"
    if partition.get("kind") == "classes":
        return f"{partition['per_client']} classes per client"
    return ", ".join(f"{k} {v}" for k, v in partition.items())


def cell_panel(paper: Paper, cell: dict[str, Any], title: str) -> Panel:
    results = cell["results"]  # in the YAML's order of methods, wherever the cell was read from
    entries = {paper.label(label): results[label]["front"] for label in paper.methods
               if "front" in results.get(label, {})}
    selection = "val" if float(paper.config.get("validation") or 0.0) > 0 else "final"
    return panel_from_entries(title, selection, entries)


def budget_section(paper: Paper, cells: dict[str, Any], budget: str, results: Path) -> list[str]:
    runs = {(d, s, seed): cells[n] for d in paper.datasets for s in paper.settings for seed in range(MAX_SEEDS)
            if (n := cell_name(paper, d, s, seed, budget)) in cells}
    if not runs:
        return []
    spent = [c["minutes"] for c in runs.values() if c.get("minutes")]
    machines = sorted({c["machine"] for c in runs.values()})
    costs: list[tuple[str, Panel]] = []
    lines = [f"## Budget `{budget}`", "", f"{paper.budgets[budget]['about']}. {len(runs)} cells; minutes per cell "
             + (f"{statistics.fmean(spent):.1f} (range {min(spent):.1f}-{max(spent):.1f})" if spent else "-")
             + f"; on {'; '.join(machines)}.", ""]
    for dataset, name in paper.datasets.items():
        keys = [k for k in runs if k[0] == dataset]
        if not keys:
            continue
        titled = [(f"{name} {setting_title(paper.settings[k[1]])}",
                   cell_panel(paper, runs[k], f"{name}, {setting_title(paper.settings[k[1]])}, seed {k[2]}"))
                  for k in keys]
        titled = [(title, panel) for title, panel in titled if panel.curves]
        if not titled:
            continue
        costs += titled
        panels = [panel for _, panel in titled]
        figure = results.with_name(f"{paper.name}-{budget}-{dataset}.png")
        plot(panels, figure)
        lines += [f"### {name}", "", f"![accuracy against MiB, {name}]({figure.name})", ""]
        for panel in panels:
            lines += [f"#### {panel.title}", "", markdown_tables(panel), ""]
    return lines + cost_table(costs)


def cost_cell(point: Point | None) -> str:
    """``client min / server min``, then ``/ passes`` (the clients' sample-passes in millions) where counted."""
    if point is None:
        return "-"
    passes = [] if point.client_passes is None else [f"{point.client_passes / 1e6:,.2f}M"]
    return " / ".join([*minutes(point), *passes])


def cost_table(costs: list[tuple[str, Panel]]) -> list[str]:
    """Per method and cell, at its last point: minutes of its clients (summed over clients; the one-shot
    methods' shared upload counted for each) / of its server, and the clients' sample-passes where the cell
    counted them."""
    if not costs:
        return []
    methods = list(dict.fromkeys(c.method for _, panel in costs for c in panel.curves))
    counted = any(p.client_passes is not None for _, panel in costs for c in panel.curves for p in c.points)
    lines = ["### Compute per method", "", "Minutes of the clients (summed over the clients that trained; the "
             "one-shot methods share one upload, counted for each) / of the server (its stages, evaluations "
             "and checkpoints), over the whole run"
             + ("; then, in the cells that counted them, the clients' training sample-passes in millions (one "
                "a sample an optimiser step, summed over the clients)." if counted else "."), "",
             "| method | " + " | ".join(title for title, _ in costs) + " |", "|---" * (len(costs) + 1) + "|"]
    for method in methods:
        cells = [cost_cell(next((c.points[-1] for c in panel.curves if c.method == method), None))
                 for _, panel in costs]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return lines + [""]


def write_frontier_page(paper: Paper, root: Path, results: Path, archive: Path) -> None:
    cells = load_cells(root, archive, front=True)
    results.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"# {paper.title}", "",
             f"Generated by `hetfl reproduce {paper.name} --report-only` from the archived cells "
             f"(`{paper.name}{ARCHIVE_SUFFIX}`) and the finished cells of `runs/reproduce-{paper.name}/`; "
             "do not edit by hand.", "",
             f"{paper.source}. {paper.protocol} {protocol_optimiser(paper, paper.default_budget)}", ""]
    ran = []
    for budget in paper.budgets:
        section = budget_section(paper, cells, budget, results)
        lines += section
        ran += [budget] if section else []
    waiting = [f"`{b}` ({paper.budgets[b]['about']})" for b in paper.budgets if b not in ran]
    if waiting:
        lines += ["Budgets with no cell run yet: " + ", ".join(waiting) + ".", ""]
    lines += ["## What the frontier shows", "", paper.differ or "Not measured yet: the grid has not run.", ""]
    results.write_text("\n".join(lines).rstrip() + "\n")
