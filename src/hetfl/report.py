"""Tables and plots of a run: the results table, the partition bubble plot (FedHydra Fig. 9),
accuracy curves (one panel per method, each in its own unit) and a bar chart of the final results."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from hetfl.fl.payload import jsonl_rows  # noqa: E402


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def results_table(results: dict[str, dict[str, Any]]) -> str:
    """A fixed-width table: method, final and best accuracy, seconds of the server stage and bytes
    uploaded; a method's other models (e.g. FedDF's per-architecture students) on lines of their own.
    With a validation split, the test accuracy of the model picked on it (``val-sel. %``); best acc % is
    the best test accuracy over the evaluations (test-set selection, the papers' protocol).
    Under it: :func:`budget_note` (the methods run far below their default budget), :func:`seconds_note`
    (the clients' local training, which the server seconds leave out) and :func:`collapse_notes`."""
    w = max([14, *(len(name) + 2 for name in results)])  # the method column fits the longest name and a mark
    val = any("val_selected_accuracy" in r for r in results.values())  # a run with a validation split
    header = (f"{'method':<{w}} {'final acc %':>11} " + (f"{'val-sel. %':>10} " if val else "")
              + f"{'best acc %':>10} {'server s':>8} {'bytes up':>10}")
    lines = [header, "-" * len(header)]
    caveats = caveat_notes(results)
    for name, r in results.items():
        server = r.get("server_seconds", r["seconds"])
        picked = f"{r['val_selected_accuracy']:>10.2f} " if "val_selected_accuracy" in r else f"{'-':>10} "
        shown = f"{name} *" if name in caveats else name
        lines.append(f"{shown:<{w}} {r['accuracy']:>11.2f} " + (picked if val else "")
                     + f"{r['best_accuracy']:>10.2f} {server:>8.1f} {human_bytes(r['bytes_up']):>10}")
        for sub, acc in (r.get("models") or {}).items():
            if sub != name:
                lines.append(f"  {sub:<{w - 2}} {acc:>11.2f}")
    notes = [budget_note(results), seconds_note(results)]
    return "\n".join(lines + [n for n in notes if n] + collapse_notes(results) + list(caveats.values()))


def caveat_notes(results: dict[str, dict[str, Any]]) -> dict[str, str]:
    """``{label: note}`` for each method at chance whose method class states a :attr:`Method.caveat`."""
    import hetfl.methods  # noqa: F401  (registers the methods)
    from hetfl.fl.method import METHODS

    notes = {}
    for name, r in results.items():
        cls, classes = METHODS.get(str(r.get("method"))), len(r.get("per_class") or [])
        caveat = getattr(cls, "caveat", "") if isinstance(cls, type) else ""
        if caveat and classes >= 2 and r["accuracy"] <= collapse_bounds(classes)[0]:
            notes[name] = f"* {name} ended at {r['accuracy']:.2f} % (chance for {classes} classes): {caveat}"
    return notes


# The keys that size a server stage, by the unit they count (the generator family's epochs T_g and
# generator steps T_G, FedDF's distillation steps, a round method's rounds).
BUDGET_KEYS = {"epochs": "epochs", "generator_steps": "generator steps", "steps": "steps", "rounds": "rounds"}
FAR_FROM_CONVERGED = 0.25  # a server stage at or below this fraction of its default budget


def method_defaults(name: str, result: dict[str, Any]) -> dict[str, Any]:
    """The defaults of the registered method a result ran (``result["method"]``, else its label):
    the papers' budgets for the generator family; ``{}`` for a method no longer registered."""
    from hetfl.methods import METHODS

    cls = METHODS.get(result.get("method", name))
    return dict(getattr(cls, "defaults", None) or {})


def budget_fraction(name: str, result: dict[str, Any]) -> tuple[float, str]:
    """``(fraction, "8 of 200 epochs, 8 of 30 generator steps")``: the share of its default server
    budget a method ran (the product over :data:`BUDGET_KEYS` below their default; 1.0 and ``""``
    where none is, or the result has no ``params``)."""
    params, defaults = result.get("params") or {}, method_defaults(name, result)
    fraction, parts = 1.0, []
    for key, unit in BUDGET_KEYS.items():
        ran, default = params.get(key), defaults.get(key)
        if isinstance(ran, int) and isinstance(default, int) and 0 < ran < default:
            fraction *= ran / default
            parts.append(f"{ran:,} of {default:,} {unit}")
    return fraction, ", ".join(parts)


def budget_note(results: dict[str, dict[str, Any]]) -> str:
    """One line naming the methods whose server stage ran at most :data:`FAR_FROM_CONVERGED` of its
    default budget (:func:`budget_fraction`): their numbers say little about the method at full budget
    (some are far from converged, e.g. the generator family at a few epochs; others, e.g. FedDF, may
    already sit at their teachers' accuracy: the curves tell); ``""`` if none."""
    groups: dict[str, list[str]] = defaultdict(list)
    for name, r in results.items():
        fraction, ran = budget_fraction(name, r)
        if fraction <= FAR_FROM_CONVERGED:
            groups[ran].append(name)
    if not groups:
        return ""
    named = "; ".join(f"{', '.join(names)} ({ran})" for ran, names in groups.items())
    return (f"note: {named} ran a small part of their default budget: not what these methods reach "
            f"at full budget (curves: accuracy.png; paper-budget numbers: docs/results/)")


def seconds_note(results: dict[str, dict[str, Any]]) -> str:
    """One line on what the server seconds leave out: the clients' local training (summed over the
    clients, once per distinct value, with the methods it served); ``""`` if no method had any."""
    served: dict[str, list[str]] = defaultdict(list)
    cached = []
    for name, r in results.items():
        if r.get("client_seconds", 0.0) > 0:
            served[f"{r['client_seconds']:.1f} s"].append(name)
            cached.append(bool(r.get("cached_uploads")))
    if not served:
        return ""
    if len(served) == 1:
        (took, names), = served.items()
        took = f"{took} (once, for the {len(names)} methods that share the uploads)"
    else:
        took = "; ".join(f"{t} ({', '.join(names)})" for t, names in served.items())
    when = ", as measured when the cached uploads were trained" if all(cached) else ""
    return f"server s leaves out the clients' local training: {took}{when}"


def collapse_bounds(classes: int) -> tuple[float, float]:
    """``(at_chance, learned)`` in %: a model at or below ``at_chance`` (100 / classes + 0.5) predicts
    (about) one class on a balanced test set; one at or above ``learned`` (3 x chance) had learned. A
    model at chance after it had learned has collapsed (the one rule of :func:`collapse_notes` and of
    the FedHydra report's per-epoch curves)."""
    chance = 100.0 / classes
    return chance + 0.5, 3 * chance


def collapse_notes(results: dict[str, dict[str, Any]]) -> list[str]:
    """A line for each method whose final model is at chance level after its best evaluation had
    learned (:func:`collapse_bounds`, the classes counted from its ``per_class`` accuracies): the model
    collapsed to (about) one class during training (e.g. a data-free student late in a long server
    stage), so its final and best accuracy mean different things."""
    notes = []
    for name, r in results.items():
        classes = len(r.get("per_class") or [])
        if classes < 2:
            continue
        at_chance, learned = collapse_bounds(classes)
        if r["accuracy"] <= at_chance and r["best_accuracy"] >= learned:
            notes.append(f"note: {name} ended at {r['accuracy']:.2f} %, chance for {classes} classes, "
                         f"after a best of {r['best_accuracy']:.2f} %: it collapsed to about one class "
                         f"(its curve: {name}/metrics.jsonl)")
    return notes


BUBBLE_MAX_CLIENTS = 100  # above this, the partition figure summarises (histograms) instead of one column each


def label_entropy(counts: np.ndarray) -> np.ndarray:
    """Each client's label entropy over log(classes): 0 = one class, 1 = every class alike."""
    counts = np.asarray(counts, dtype=np.float64)
    p = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -np.where(p > 0, p * np.log(p), 0.0).sum(axis=1)
    return h / np.log(counts.shape[1]) if counts.shape[1] > 1 else np.zeros(len(counts))


def plot_partition(counts: np.ndarray, path: Path, title: str = "") -> None:
    """Bubble plot: one column per client, one row per class, area proportional to the count; above
    :data:`BUBBLE_MAX_CLIENTS` clients, histograms of the clients' sizes and label entropies."""
    counts = np.asarray(counts)
    m, c = counts.shape
    if m > BUBBLE_MAX_CLIENTS:
        _plot_partition_summary(counts, path, title)
        return
    clients, classes = np.meshgrid(np.arange(m), np.arange(c), indexing="ij")
    fig, ax = plt.subplots(figsize=(max(4, 0.5 * m + 2), max(3, 0.35 * c + 1.5)))
    sizes = 900 * counts / max(counts.max(), 1)
    ax.scatter(clients.ravel(), classes.ravel(), s=sizes.ravel(), alpha=0.6, color="tab:red", edgecolors="k",
               linewidths=0.3)
    ax.set_xticks(range(m), [str(i) for i in range(m)] if m <= 30 else None)
    ax.set_yticks(range(c))
    ax.set_xlabel("client")
    ax.set_ylabel("class")
    ax.set_xlim(-0.7, m - 0.3)
    ax.set_ylim(-0.7, c - 0.3)
    ax.set_title(title or f"samples per client and class (max {counts.max()})", fontsize=9)
    save_figure(fig, path)


def _plot_partition_summary(counts: np.ndarray, path: Path, title: str) -> None:
    m, c = counts.shape
    sizes, entropy = counts.sum(axis=1), label_entropy(counts)
    held = np.count_nonzero(counts, axis=1)
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    axes[0].hist(sizes, bins=min(50, max(5, len(np.unique(sizes)))), color="tab:red", alpha=0.7)
    axes[0].set_xlabel(f"samples per client (min {sizes.min()}, median {int(np.median(sizes))}, max {sizes.max()})")
    axes[1].hist(entropy, bins=40, range=(0, 1), color="tab:blue", alpha=0.7)
    axes[1].set_xlabel("label entropy / log(classes) (0: one class, 1: uniform)")
    axes[2].hist(held, bins=np.arange(0.5, c + 1.5), color="tab:green", alpha=0.7)
    axes[2].set_xlabel("classes held per client")
    for ax in axes:
        ax.set_ylabel("clients")
    fig.suptitle((title.split("\n")[0] if title else "partition") + f": {m} clients, {c} classes", fontsize=9)
    save_figure(fig, path)


def read_curves(metrics_file: Path) -> dict[str, list[tuple[int, float]]]:
    curves: dict[str, list[tuple[int, float]]] = defaultdict(list)
    if metrics_file.is_file():
        for row in jsonl_rows(metrics_file):
            if row.get("step", -1) >= 0 and row.get("accuracy") is not None:
                curves[row["method"]].append((row["step"], row["accuracy"]))
    return curves


def plot_accuracy_lines(curves: dict[str, list[tuple[float, float]]], path: Path, xlabel: str = "round / epoch",
                        title: str = "", ylabel: str = "test accuracy (%)") -> bool:
    """Test accuracy (or ``ylabel``) against round/epoch (or ``xlabel``), one line per label with more
    than one point."""
    curves = {k: v for k, v in curves.items() if len(v) > 1}
    if not curves:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, points in curves.items():
        steps, accs = zip(*points)
        ax.plot(steps, accs, label=name, marker="." if len(points) < 40 else None)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(fig, path)
    return True


def plot_scatter_fits(points: dict[str, list[tuple[float, float]]], path: Path, xlabel: str, ylabel: str,
                      title: str = "") -> bool:
    """One scatter per label with its least-squares line (labels with at least 3 points get a line)."""
    points = {k: v for k, v in points.items() if v}
    if not points:
        return False
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for i, (name, pts) in enumerate(points.items()):
        xs, ys = zip(*pts)
        ax.scatter(xs, ys, s=16, color=f"C{i}", label=f"{name} (n={len(pts)})")
        if len(pts) >= 3 and len(set(xs)) > 1:
            fit = np.polyfit(xs, ys, 1)
            grid = np.linspace(min(xs), max(xs), 2)
            ax.plot(grid, np.polyval(fit, grid), color=f"C{i}", lw=1)
    ax.axhline(0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    save_figure(fig, path)
    return True


def save_figure(fig: Any, path: Path, dpi: int = 110) -> Path:
    """Tight layout (unless the figure has a layout engine of its own, e.g. ``layout="constrained"``),
    write ``path``, free the figure; returns ``path``. No "Software" entry (matplotlib's version) in
    the file's metadata: the same figure gives the same bytes."""
    if fig.get_layout_engine() is None:
        fig.tight_layout()
    fig.savefig(path, dpi=dpi, metadata={"Software": None})
    plt.close(fig)
    return path


def stage_axis(result: dict[str, Any] | None) -> tuple[str, int | None]:
    """``(x label, length)`` of a method's evaluations, in its own unit: FedDF's distillation steps,
    the generator family's server epochs, a round method's rounds; ``length`` is the budget it ran
    (``None`` where its params do not say)."""
    params = (result or {}).get("params") or {}
    for key, label in (("steps", "distillation step"), ("generator_steps", "server epoch"),
                       ("rounds", "round"), ("epochs", "server epoch")):
        if key in params:
            budget = params["epochs"] if key == "generator_steps" else params[key]
            return label, budget if isinstance(budget, int) else None
    return "epoch", None


def accuracy_figure(curves: dict[str, list[tuple[float, float]]],
                    results: dict[str, dict[str, Any]] | None = None) -> Any:
    """Small multiples: one panel per method with more than one evaluation (in the order of
    ``results``, then the others), test accuracy against the method's own x axis
    (:func:`stage_axis`, spanning its whole server stage where the params give its length), with
    the ensemble's (the teachers') accuracy as a dashed line where ``results`` has one. ``None``
    if no method has a curve. The caller saves (:func:`save_figure`) or closes the figure."""
    results = results or {}
    points = {name: sorted(dict(pts).items()) for name, pts in curves.items()}  # a resumed step: last wins
    points = {name: pts for name, pts in points.items() if len(pts) > 1}
    order = [n for n in results if n in points] + sorted(n for n in points if n not in results)
    if not order:
        return None
    cols = min(3, len(order))
    rows = -(-len(order) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.3 * cols, 2.6 * rows), sharey=True, squeeze=False)
    teacher = results.get("ensemble", {}).get("accuracy")
    for ax, name in zip(axes.flat, order):
        steps, accs = zip(*points[name])
        ax.plot(steps, accs, marker="." if len(steps) <= 40 else None, color="tab:blue", clip_on=False)
        if teacher is not None and name != "ensemble":
            ax.axhline(teacher, color="grey", ls="--", lw=0.9, label=f"ensemble {teacher:.1f} %")
            ax.legend(fontsize=7, loc="best")
        label, budget = stage_axis(results.get(name))
        if budget:
            ax.set_xlim(0, budget)
        ax.set_xlabel(label if budget is None else f"{label} (of {budget:,})", fontsize=8)
        final = f", final {results[name]['accuracy']:.1f} %" if name in results else ""
        ax.set_title(f"{name}{final}", fontsize=9)
        ax.set_ylim(0, 100)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("test accuracy (%)", fontsize=8)
    for ax in list(axes.flat)[len(order):]:
        fig.delaxes(ax)
    return fig


def plot_curves(metrics_file: Path, path: Path, results: dict[str, dict[str, Any]] | None = None) -> bool:
    """:func:`accuracy_figure` of the methods that logged more than one evaluation in
    ``metrics_file``, written to ``path``; False (nothing written) if none did."""
    fig = accuracy_figure(read_curves(metrics_file), results)
    if fig is None:
        return False
    save_figure(fig, path)
    return True


def plot_results(results: dict[str, dict[str, Any]], path: Path, title: str = "") -> None:
    names = list(results)
    fig, ax = plt.subplots(figsize=(max(4, 1.1 * len(names) + 1), 3.5))
    final = [results[n]["accuracy"] for n in names]
    best = [results[n]["best_accuracy"] for n in names]
    x = np.arange(len(names))
    ax.bar(x - 0.2, final, 0.4, label="final")
    ax.bar(x + 0.2, best, 0.4, label="best over evaluations")
    for xi, v in zip(x, final):
        ax.text(xi - 0.2, v + 0.5, f"{v:.1f}", ha="center", fontsize=8)
    ax.set_xticks(x, names, rotation=25, ha="right", fontsize=8)  # long labels side by side stay apart
    ax.set_ylabel("test accuracy (%)")
    ax.set_ylim(0, 105)
    ax.set_title(title)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def partition_title(cfg: dict[str, Any]) -> str:
    """``"demo-mnist: mnist, 5 clients, dirichlet (alpha 0.1, min_size 10)"`` and what the bubbles count."""
    spec = dict(cfg.get("partition") or {})
    kind = spec.pop("kind", "")
    how = f"{kind} ({', '.join(f'{k} {v}' for k, v in spec.items())})" if spec else kind
    dataset = cfg.get("dataset")
    dataset = f"{dataset['kind']}:{Path(dataset['path']).name}" if isinstance(dataset, dict) else dataset
    head = ", ".join(str(x) for x in (dataset, f"{cfg['clients']} clients" if cfg.get("clients") else None,
                                      how) if x)
    return f"{cfg.get('name', '')}: {head}\nsamples per client (column) and class (row)"


def write_plots(out_dir: Path, summary: dict[str, Any]) -> list[Path]:
    out_dir = Path(out_dir)
    written = []
    if (out_dir / "partition.json").is_file():  # a remote server never sees the partition
        part = json.loads((out_dir / "partition.json").read_text())
        plot_partition(np.array(part["counts"]), out_dir / "partition.png", partition_title(summary["config"]))
        written.append(out_dir / "partition.png")
    if plot_curves(out_dir / "metrics.jsonl", out_dir / "accuracy.png", summary["results"]):
        written.append(out_dir / "accuracy.png")
    if summary["results"]:
        plot_results(summary["results"], out_dir / "results.png", summary["config"].get("name", ""))
        written.append(out_dir / "results.png")
    return written
