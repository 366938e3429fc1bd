"""``hetfl frontier RUN_DIR...``: every method of the given runs on one axis of accuracy against bytes.

A panel is one federation: the same dataset (and its options), partition, number of clients, seed and
validation share, so the same clients. In a panel a one-shot method is one point (its bytes, its model);
a multi-round or hybrid method is a curve, one point per evaluated round, its bytes cumulative over every
direction (up, down, and client data relayed between peers). A point's accuracy is the test accuracy of
the model a user would have picked at that byte count: where the runs hold out a validation split, the
evaluation with the best validation accuracy so far (a one-shot method: its validation-picked model);
else the last model (``final``). A method with no bytes at all (``central``) is a reference line.

A point's round is the method's evaluation step (HFLDD's steps 1 and 2 are its clustering and distillation
stages, so its training round r is step r + 2); its seconds are the method's own, cumulative, and split
where the run recorded it into the clients' seconds (summed over the clients that worked; a one-shot
method's shared uploads count in full for each method) and the server's (the rest: server stages,
evaluations, checkpoints). A point's client sample-passes, where the run recorded them, are the samples
the clients' optimiser steps took, summed over clients and cumulative
(:func:`~hetfl.fl.training.counting_sample_passes`): client compute that does not depend on the machine.

The Pareto front of a panel is the set of points that no other point of the panel matches or beats in
both bytes (fewer or equal) and accuracy (higher or equal), with one of the two strictly better.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MIB = 1 << 20
TARGETS = (50.0, 60.0, 70.0, 80.0, 90.0, 95.0, 98.0, 99.0)  # target accuracies (%), those some method reached
BUDGETS_MIB = (1.0, 10.0, 100.0, 1000.0)
AXES = {"bytes": "MiB exchanged (all directions, cumulative; log scale)", "rounds": "round",
        "seconds": "seconds (the method's, cumulative)",
        "client_seconds": "the clients' seconds (summed over clients, cumulative)",
        "server_seconds": "the server's seconds (cumulative)",
        "client_passes": "the clients' training sample-passes (summed over clients, cumulative; log scale)"}
LOG_AXES = ("bytes", "client_passes")


@dataclass
class Point:
    bytes: int
    accuracy: float
    round: int  # 0 for a one-shot method
    seconds: float  # clients' and server's
    client_seconds: float | None = None  # None: the run did not record it
    server: float | None = None  # the server's seconds where recorded (a cached client reply costs it none)
    client_passes: int | None = None  # the clients' training sample-passes where recorded

    @property
    def mib(self) -> float:
        return self.bytes / MIB

    @property
    def server_seconds(self) -> float | None:
        if self.server is not None:
            return self.server
        return None if self.client_seconds is None else max(0.0, self.seconds - self.client_seconds)


@dataclass
class Curve:
    run: str
    method: str
    family: str  # "one-shot" | "rounds"
    points: list[Point]


@dataclass
class Panel:
    key: tuple
    title: str
    selection: str  # "val" | "final"
    runs: list[str] = field(default_factory=list)
    curves: list[Curve] = field(default_factory=list)
    references: dict[str, float] = field(default_factory=dict)  # methods with no communication: accuracy


def run_folders(paths: list[Path]) -> list[Path]:
    """The run folders named, or those one level inside a named folder of runs (a reproduce --out)."""
    found: list[Path] = []
    for path in paths:
        if (path / "summary.json").is_file():
            found.append(path)
        elif path.is_dir():
            found += sorted(p.parent for p in path.glob("*/summary.json"))
        else:
            raise FileNotFoundError(f"{path}: no such run folder")
    return found


def panel_key(cfg: dict[str, Any]) -> tuple:
    """What makes two runs' clients the same: dataset and its options, partition, clients, seed, validation."""
    dataset = cfg.get("dataset")
    return (json.dumps(dataset, sort_keys=True), json.dumps(cfg.get("data") or {}, sort_keys=True),
            json.dumps(cfg.get("partition") or {}, sort_keys=True), int(cfg.get("clients", 0)),
            int(cfg.get("seed", 0)), float(cfg.get("validation") or 0.0))


def panel_title(cfg: dict[str, Any]) -> str:
    spec = dict(cfg.get("partition") or {})
    kind = spec.pop("kind", "")
    how = f"{kind} {' '.join(f'{k}={v}' for k, v in spec.items() if k != 'min_size')}".strip()
    dataset = cfg.get("dataset")
    name = f"{dataset['kind']}:{Path(dataset['path']).name}" if isinstance(dataset, dict) else str(dataset)
    return f"{name}, {cfg.get('clients')} clients, {how}, seed {cfg.get('seed', 0)}"


def selected(rows: list[dict[str, Any]], use_val: bool) -> list[float]:
    """Per evaluation, the test accuracy of the model picked so far: best validation so far (the earliest
    on ties) or the current one."""
    out, best_val, pick = [], -math.inf, None
    for row in rows:
        if not use_val:
            out.append(float(row["accuracy"]))
            continue
        val = row.get("val_accuracy")
        if val is not None and float(val) > best_val:
            best_val, pick = float(val), float(row["accuracy"])
        out.append(pick if pick is not None else float(row["accuracy"]))
    return out


def method_curve(run: str, method: str, result: dict[str, Any], rows: list[dict[str, Any]],
                 use_val: bool) -> Curve | None:
    """A method's points; None for a method with no bytes (a reference, not a point)."""
    rounds = sorted((r for r in rows if r.get("step", -1) >= 1 and "bytes_up" in r), key=lambda r: r["step"])
    if rounds:
        by_step = {r["step"]: r for r in rounds}  # a resumed round: its last row
        rounds = [by_step[s] for s in sorted(by_step)]
        start = float(rounds[-1]["logged_at"]) - float(result.get("seconds", 0.0))  # its seconds end at its last row
        accs = selected(rounds, use_val)
        points = [Point(int(r["bytes_up"]) + int(r["bytes_down"]) + int(r.get("bytes_peer", 0)), acc, int(r["step"]),
                        max(0.0, float(r["logged_at"]) - start), _float(r.get("client_seconds")),
                        _float(r.get("server_seconds")), _int(r.get("client_sample_passes")))
                  for r, acc in zip(rounds, accs)]
        return Curve(run, method, "rounds", points)
    total = int(result.get("bytes_up", 0)) + int(result.get("bytes_down", 0)) + int(result.get("bytes_peer", 0))
    if total == 0:
        return None
    acc = result.get("val_selected_accuracy") if use_val else None
    client, server = _float(result.get("client_seconds")), _float(result.get("server_seconds"))
    seconds = client + server if client is not None and server is not None else float(result.get("seconds", 0.0))
    return Curve(run, method, "one-shot", [Point(total, float(acc if acc is not None else result["accuracy"]), 0,
                                                 seconds, client if server is not None else None, server,
                                                 _int(result.get("client_sample_passes")))])


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def run_rows(folder: Path, summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The run's metrics rows; a method that keeps its own ``<method>/metrics.jsonl`` gives its rows from there."""
    path = folder / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    for method in summary["results"]:
        own = folder / method / "metrics.jsonl"
        if own.is_file():
            rows = [r for r in rows if r.get("method") != method]
            rows += [json.loads(line) for line in own.read_text().splitlines() if line.strip()]
    return rows


def run_curves(folder: Path, summary: dict[str, Any]) -> tuple[list[Curve], dict[str, float]]:
    """A run's curves and its methods without communication (their accuracy)."""
    rows, use_val = run_rows(folder, summary), float(summary["config"].get("validation") or 0.0) > 0
    curves, references = [], {}
    for method, result in summary["results"].items():
        curve = method_curve(str(folder), method, result, [r for r in rows if r.get("method") == method], use_val)
        if curve is None:
            references[method] = float(result["accuracy"])
        else:
            curves.append(curve)
    return curves, references


def front_entries(folder: Path, summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per method, what a results page needs to draw it (kept in the archive): its family and points
    ``[round, bytes, accuracy, seconds, client seconds, server seconds]`` (None where not recorded; the
    clients' sample-passes as a seventh value where recorded), or the accuracy of a method without
    communication."""
    curves, references = run_curves(folder, summary)
    out: dict[str, dict[str, Any]] = {m: {"reference": round(a, 2)} for m, a in references.items()}
    for curve in curves:
        out[curve.method] = {"family": curve.family, "points": [
            [p.round, p.bytes, round(p.accuracy, 2), round(p.seconds, 1),
             *(None if v is None else round(v, 1) for v in (p.client_seconds, p.server)),
             *([p.client_passes] if p.client_passes is not None else [])] for p in curve.points]}
    return out


def panel_from_entries(title: str, selection: str, entries: dict[str, dict[str, Any]], run: str = "") -> Panel:
    """A panel from archived :func:`front_entries` (one cell's methods)."""
    panel = Panel((title,), title, selection, runs=[run] if run else [])
    for method, entry in entries.items():
        if "reference" in entry:
            panel.references[method] = float(entry["reference"])
        else:
            points = [[*p, None, None, None][:7] for p in entry["points"]]  # older archives: 4 or 6 values
            panel.curves.append(Curve(run, method, entry["family"], [
                Point(int(b), float(a), int(r), float(s), _float(c), _float(v), _int(n))
                for r, b, a, s, c, v, n in points]))
    return panel


def read_runs(paths: list[Path]) -> tuple[list[Panel], list[str]]:
    """Panels of the runs' methods, and one line per run or method left out, with the reason."""
    panels: dict[tuple, Panel] = {}
    left_out: list[str] = []
    for folder in run_folders(paths):
        try:
            summary = json.loads((folder / "summary.json").read_text())
            curves, references = run_curves(folder, summary)
            cfg = summary["config"]
        except (OSError, KeyError, ValueError) as err:
            left_out.append(f"{folder}: unreadable summary.json or metrics.jsonl ({err})")
            continue
        key = panel_key(cfg)
        panel = panels.setdefault(key, Panel(key, panel_title(cfg), "val" if key[-1] > 0 else "final"))
        panel.runs.append(str(folder))
        have = {c.method for c in panel.curves} | set(panel.references)
        for curve in curves:
            if curve.method in have:
                left_out.append(f"{folder}: {curve.method} already comes from another run of the same federation")
            else:
                panel.curves.append(curve)
        for method, acc in references.items():
            if method in have:
                left_out.append(f"{folder}: {method} already comes from another run of the same federation")
            else:
                panel.references[method] = acc
    return list(panels.values()), left_out


def pareto(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points (bytes, accuracy) on the front: fewest bytes for their accuracy. Sorted by
    bytes, then accuracy descending, a point is on the front when it beats the best accuracy seen."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1]))
    front, best = [], -math.inf
    for i in order:
        if points[i][1] > best:
            front.append(i)
            best = points[i][1]
    return front


def panel_front(panel: Panel) -> list[tuple[Curve, Point]]:
    flat = [(c, p) for c in panel.curves for p in c.points]
    return [flat[i] for i in pareto([(p.bytes, p.accuracy) for _, p in flat])]


def targets_table(panel: Panel) -> list[dict[str, Any]]:
    """Per target accuracy reached by some method: the cheapest method to reach it (MiB, rounds, seconds)."""
    best = max((p.accuracy for c in panel.curves for p in c.points), default=0.0)
    out = []
    for target in (t for t in TARGETS if t <= best):
        firsts = []
        for curve in panel.curves:
            first = next((p for p in curve.points if p.accuracy >= target), None)
            if first is not None:
                firsts.append((first.bytes, curve, first))
        _, curve, point = min(firsts, key=lambda x: x[0])
        out.append({"target": target, "method": curve.method, "mib": point.mib, "round": point.round,
                    "seconds": point.seconds})
    return out


def budgets_table(panel: Panel) -> list[dict[str, Any]]:
    """Per byte budget: the best accuracy reached within it, and by which method (at which round)."""
    out = []
    for budget in BUDGETS_MIB:
        within = [(p.accuracy, -p.bytes, c, p) for c in panel.curves for p in c.points if p.mib <= budget]
        if not within:
            out.append({"budget_mib": budget, "method": None, "accuracy": None, "round": None, "mib": None})
            continue
        acc, _, curve, point = max(within, key=lambda x: (x[0], x[1]))
        out.append({"budget_mib": budget, "method": curve.method, "accuracy": acc, "round": point.round,
                    "mib": point.mib})
    return out


def one_shot_overtaken(panel: Panel) -> dict[str, Any] | None:
    """Where the round methods (multi-round and hybrid) meet the one-shot ones: the best one-shot point (the
    cheapest of equal accuracy), the best round point within its bytes, and the cheapest round point above
    it. None unless the panel has both families."""
    shots = [(c, p) for c in panel.curves if c.family == "one-shot" for p in c.points]
    rounds = [(c, p) for c in panel.curves if c.family != "one-shot" for p in c.points]
    if not shots or not rounds:
        return None
    shot = max(shots, key=lambda x: (x[1].accuracy, -x[1].bytes))
    within = [x for x in rounds if x[1].bytes <= shot[1].bytes]
    above = [x for x in rounds if x[1].accuracy > shot[1].accuracy]
    return {"one_shot": shot,
            "within": max(within, key=lambda x: (x[1].accuracy, -x[1].bytes)) if within else None,
            "above": min(above, key=lambda x: (x[1].bytes, -x[1].accuracy)) if above else None}


def overtaken_line(panel: Panel) -> str:
    """:func:`one_shot_overtaken` in a sentence ('' where the panel lacks a family)."""
    meet = one_shot_overtaken(panel)
    if meet is None:
        return ""
    (curve, shot), within, above = meet["one_shot"], meet["within"], meet["above"]
    text = f"Best one-shot model: {curve.method}, {shot.accuracy:.2f} % at {shot.mib:,.1f} MiB. "
    if above is not None and above[1].bytes <= shot.bytes:
        return text + (f"A round method passes it within those MiB: {above[0].method} at round {above[1].round} "
                       f"({above[1].mib:,.1f} MiB, {above[1].accuracy:.2f} %).")
    text += ("No round method fits in those MiB" if within is None else
             f"Within those MiB the best round method reaches {within[1].accuracy:.2f} % "
             f"({within[0].method}, round {within[1].round})")
    return text + ("; none passes it." if above is None else
                   f"; the first to pass it is {above[0].method} at round {above[1].round} "
                   f"({above[1].mib:,.1f} MiB, {above[1].accuracy:.2f} %).")


def markdown_tables(panel: Panel) -> str:
    pick = "validation-picked" if panel.selection == "val" else "final"
    lines = [f"| target accuracy ({pick}) | cheapest method | MiB | rounds | seconds |", "|---|---|---|---|---|"]
    for row in targets_table(panel):
        lines.append(f"| {row['target']:.0f} % | {row['method']} | {row['mib']:,.1f} | "
                     f"{row['round'] or 'one shot'} | {row['seconds']:,.0f} |")
    lines += ["", f"| byte budget | best accuracy % ({pick}) | method | rounds | MiB |", "|---|---|---|---|---|"]
    for row in budgets_table(panel):
        if row["method"] is None:
            lines.append(f"| {row['budget_mib']:,.0f} MiB | - | no method fits | - | - |")
        else:
            lines.append(f"| {row['budget_mib']:,.0f} MiB | {row['accuracy']:.2f} | {row['method']} | "
                         f"{row['round'] or 'one shot'} | {row['mib']:,.1f} |")
    if line := overtaken_line(panel):
        lines += ["", line]
    if panel.references:
        lines += ["", "Without communication (reference): " + ", ".join(
            f"{m} {a:.2f} %" for m, a in sorted(panel.references.items()))]
    return "\n".join(lines)


def write_csv(panels: list[Panel], path: Path) -> Path:
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["panel", "run", "method", "family", "round", "bytes", "mib", "accuracy", "selection",
                      "seconds", "client_seconds", "server_seconds", "client_sample_passes", "on_front"])
        for number, panel in enumerate(panels, 1):
            front = {(id(c), id(p)) for c, p in panel_front(panel)}
            for curve in panel.curves:
                for p in curve.points:
                    out.writerow([number, curve.run, curve.method, curve.family, p.round, p.bytes, f"{p.mib:.4f}",
                                  f"{p.accuracy:.4f}", panel.selection, f"{p.seconds:.2f}",
                                  *("" if v is None else f"{v:.2f}" for v in (p.client_seconds, p.server_seconds)),
                                  "" if p.client_passes is None else p.client_passes,
                                  int((id(curve), id(p)) in front)])
    return path


def x_value(point: Point, axis: str) -> float | None:
    """The point's value on ``axis``; None where the run did not record it (the clients' seconds)."""
    return {"bytes": point.mib, "rounds": point.round, "seconds": point.seconds,
            "client_seconds": point.client_seconds, "server_seconds": point.server_seconds,
            "client_passes": point.client_passes}[axis]


def minutes(point: Point) -> tuple[str, str]:
    """The point's minutes of the clients and of the server, ``-`` where the run did not record them."""
    return tuple(f"{v / 60:,.1f}" if v is not None else "-"  # type: ignore[return-value]
                 for v in (point.client_seconds, point.server_seconds))


def compute_table(panel: Panel) -> str:
    """Per method, at its last point: MiB, accuracy, minutes of the clients (summed) and the server, and
    the clients' training sample-passes."""
    pick = "validation-picked" if panel.selection == "val" else "final"
    lines = [f"Cost of each method's whole run ({pick} accuracy at its last point):", "",
             "| method | family | rounds | MiB | accuracy % | client min | server min | client sample-passes |",
             "|---" * 8 + "|"]
    for curve in panel.curves:
        p = curve.points[-1]
        client, server = minutes(p)
        passes = "-" if p.client_passes is None else f"{p.client_passes:,}"
        lines.append(f"| {curve.method} | {curve.family} | {p.round or 'one shot'} | {p.mib:,.1f} | "
                     f"{p.accuracy:.2f} | {client} | {server} | {passes} |")
    return "\n".join(lines)


def plot(panels: list[Panel], path: Path, axis: str = "bytes") -> Path:
    """One panel per setting; a method keeps its colour in every panel (one-shot methods diamonds, round
    methods lines, each family in its own colours), named in one legend beside the panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    from hetfl.report import save_figure

    curves = {c.method: c.family for panel in panels for c in panel.curves}  # first seen: the runs' order
    families: dict[str, list[str]] = {}
    for method, family in curves.items():
        families.setdefault(family, []).append(method)
    palette = plt.get_cmap("tab10").colors  # colours repeat across families, told apart by marker and line
    colors = {m: palette[i % len(palette)] for methods in families.values() for i, m in enumerate(methods)}
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols + 2.6, 4.0 * rows), squeeze=False, layout="constrained")
    for ax, panel in zip(axes.flat, panels):
        for curve in panel.curves:
            shown = [(x, p.accuracy) for p in curve.points
                     if (x := x_value(p, axis)) is not None and (x > 0 or axis not in LOG_AXES)]
            if not shown:
                continue
            xs, ys = [x for x, _ in shown], [y for _, y in shown]
            if curve.family == "one-shot":
                ax.scatter(xs, ys, marker="D", s=34, color=colors[curve.method], edgecolors="black",
                           linewidths=0.5, zorder=3)
            else:
                ax.plot(xs, ys, color=colors[curve.method], lw=1.2, marker=".", ms=3)
        if axis == "bytes":
            front = sorted(((p.mib, p.accuracy) for _, p in panel_front(panel)))
            if front:
                ax.step([x for x, _ in front], [y for _, y in front], where="post", color="black", lw=2.2, alpha=0.3,
                        zorder=1)
        if axis in LOG_AXES:
            ax.set_xscale("log")
        for method, acc in sorted(panel.references.items()):
            ax.axhline(acc, color="grey", ls=":", lw=1)
            ax.annotate(f"{method} (no communication)", (0.01, acc), xycoords=("axes fraction", "data"),
                        fontsize=6, color="grey", va="bottom")
        ax.set_xlabel(AXES[axis], fontsize=8)
        ax.set_ylabel(f"test accuracy % ({'validation-picked' if panel.selection == 'val' else 'final'} model)",
                      fontsize=8)
        ax.set_title(panel.title, fontsize=9)
        ax.grid(alpha=0.3, which="both")
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    handles = [Line2D([], [], color=colors[m], marker="D", ls="", markeredgecolor="black", markeredgewidth=0.5)
               if family == "one-shot" else Line2D([], [], color=colors[m], marker=".", lw=1.2)
               for m, family in curves.items()]
    labels = [f"{m} (one shot)" if family == "one-shot" and "one shot" not in m else m for m, family in curves.items()]
    if axis == "bytes":
        handles.append(Line2D([], [], color="black", lw=2.2, alpha=0.3))
        labels.append("Pareto front")
    fig.legend(handles, labels, loc="outside right center", fontsize=7, frameon=False)
    return save_figure(fig, path)


def frontier(paths: list[Path], out: Path, axis: str = "bytes") -> tuple[list[Panel], list[str], str]:
    """Read the runs; write ``frontier.png`` and ``frontier.csv`` under ``out``; return the panels, the
    runs and methods left out, and the tables as markdown."""
    if axis not in AXES:
        raise ValueError(f"--x {axis!r}: choose from {', '.join(AXES)}")
    panels, left_out = read_runs(paths)
    panels = [p for p in panels if p.curves]
    if not panels:
        raise ValueError("no run with an evaluated method that exchanged bytes among: "
                         + ", ".join(str(p) for p in paths))
    out.mkdir(parents=True, exist_ok=True)
    plot(panels, out / "frontier.png", axis)
    write_csv(panels, out / "frontier.csv")
    text = "\n\n".join(f"### {panel.title}\n\nRuns: {', '.join(panel.runs)}\n\n{markdown_tables(panel)}\n\n"
                       f"{compute_table(panel)}" for panel in panels)
    return panels, left_out, text
