"""`hetfl reproduce fedhydra`: FedHydra's Tables 1, 2 and 6 on MNIST and Fashion-MNIST, and the
client-count sweep of its Tables 4 and 7 (`--clients`; the paper's SVHN / CIFAR-10 rows for the trend).

Every cell (dataset x setting x seed) is one simulator run with all six methods on the same cached
client uploads; finished cells are skipped, so the command resumes after an interruption. After
each cell the results file is rewritten with our numbers beside the paper's.
"""

from __future__ import annotations

import json
import statistics
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hetfl.reproduce import common
from hetfl.reproduce.common import (  # noqa: F401  (run_cell: used as paper.run_cell)
    budget_cells,
    cell_minutes,
    minutes_per_machine,
    run_cell,
    same_uploads,
    upload_digests,
)
from hetfl.reproduce.common import stats as _stats

METHODS = ("fedavg", "ot", "feddf", "dense", "coboosting", "fedhydra")
# Our variants, reported beside the paper's methods (no paper number).
EXTRA = ("fedhydra_log1p", "fedhydra_replay", "fedhydra_dense", "fedhydra_dense_log1p")
LABELS = {"fedavg": "FedAvg", "ot": "OT", "feddf": "FedDF", "dense": "DENSE", "coboosting": "Co-Boosting",
          "fedhydra": "FedHydra", "ensemble": "ensemble (teacher)", "fedhydra_log1p": "FedHydra, log1p(U) (ours)",
          "fedhydra_replay": "FedHydra, no L_AD + replay (ours)",
          "fedhydra_dense": "FedHydra in DENSE's loop, as the authors' code (ours)",
          "fedhydra_dense_log1p": "FedHydra in DENSE's loop, log1p(U) (ours)"}
SETTINGS = ("0.5", "0.3", "0.1", "0.01", "2c/c")
GENERATOR_FAMILY = ("dense", "coboosting", "fedhydra", *EXTRA)  # the methods with a generator and server epochs
DATASETS = ("mnist", "fmnist")

# Table 1 (alpha = 0.5, 0.3, 0.1, 0.01) and Table 2 (2c/c), top-1 %, best over epochs.
PAPER: dict[str, dict[str, list[float]]] = {
    "mnist": {
        "fedavg": [81.89, 69.89, 25.96, 10.10, 20.50], "ot": [77.45, 77.32, 50.18, 25.63, 8.92],
        "feddf": [78.23, 73.59, 31.52, 10.10, 13.38], "dense": [77.86, 76.78, 36.73, 11.17, 15.58],
        "coboosting": [86.76, 83.47, 44.76, 29.11, 26.05], "fedhydra": [88.75, 85.16, 59.97, 38.83, 40.81],
    },
    "fmnist": {
        "fedavg": [75.76, 74.81, 35.35, 33.71, 32.73], "ot": [74.88, 66.91, 41.10, 39.56, 16.98],
        "feddf": [73.44, 65.61, 46.68, 40.36, 15.33], "dense": [74.20, 72.79, 43.26, 41.65, 22.31],
        "coboosting": [75.89, 72.91, 47.20, 42.38, 18.22], "fedhydra": [77.20, 76.39, 50.48, 46.02, 39.06],
    },
}
# Table 6: FedHydra at alpha = 0.5 with (lambda_1, lambda_2).
# Table 6 in the paper's loop, in the authors' code's, or for ours (that loop with log1p(U)): each
# method and its table's title
ABLATION_TITLES = {"fedhydra": "FedHydra",
                   "fedhydra_dense": "`fedhydra_dense`, ours: FedHydra in DENSE's loop",
                   "fedhydra_dense_log1p": "`fedhydra_dense_log1p`, ours: FedHydra in DENSE's loop, log1p(U), "
                                           "the summary's ours"}
ABLATION_METHODS = tuple(ABLATION_TITLES)
ABLATION = [(1.0, 1.0), (0.5, 1.0), (0.0, 1.0), (1.0, 0.5), (1.0, 0.0), (0.0, 0.0)]
PAPER_ABLATION = {"mnist": [88.75, 84.61, 83.29, 81.54, 76.19, 74.14],
                  "fmnist": [77.20, 76.72, 76.07, 73.72, 70.64, 69.38]}

# The paper's Sec. 4.1.5: local E = 200, T_g = 200, T_G = 30 (batch 256 as DENSE's README). `ours`:
# settings of our variant (VARIANT) at this budget only. Its KD at temperature 1 collapsed to one class
# at Fashion-MNIST Dir(0.5) in 7 of 7 GPU runs of 200 epochs; at DENSE's temperature 20 in 0 of 4
# (thirty-seventh session, docs/results/fedhydra-notes.md). The reduced budgets keep temperature 1,
# the setting their archived cells ran with; at `reduced` 20 was no consistent gain (9 paired Fashion runs).
PAPER_BUDGET: dict[str, Any] = {"client_epochs": 200, "epochs": 200, "generator_steps": 30, "batch_size": 256,
                                "strat_batch_size": 64, "feddf_steps": 10000, "ours": {"temperature": 20.0}}
# Fits the whole 2 x 5 x 3 grid into a few hours on 2 CPU cores; see docs/results/fedhydra.md.
REDUCED: dict[str, Any] = {"client_epochs": 10, "epochs": 20, "generator_steps": 10, "batch_size": 64,
                           "strat_batch_size": 16, "feddf_steps": 1000}
BUDGETS: dict[str, dict[str, Any]] = {
    "paper": PAPER_BUDGET,
    "reduced": REDUCED,
    # `reduced` with T_g = 60 server epochs: the paper's Fig. 3 (Fashion-MNIST) and Fig. 10 (MNIST) place
    # FedHydra's peak after about 50 epochs ("can reach the peak at 60 epochs"), past `reduced`'s 20.
    # Epochs 1-20 of a generator-family method repeat its `reduced` run (per-epoch random streams).
    # Both longer budgets keep `reduced`'s clients, so they run on the same cached uploads.
    "reduced-t60": {**REDUCED, "epochs": 60},
    # `reduced-t60` with the paper's T_G = 30 generator steps per epoch: three times the generation
    # cost; measured on the weak Fashion-MNIST cells (eighteenth session).
    "reduced-t60-g30": {**REDUCED, "epochs": 60, "generator_steps": 30},
    # `reduced-t60-g30` with bf16 autocast in the generator family's loop (generator, teacher and student
    # forwards; FedHydra's stratification keeps its float64 CE): the issue's bf16-against-fp32 check.
    # Same clients, so the same cached uploads; its cells are reported beside their fp32 twins
    # (`precision_report`), not in the standing table or the one-cache sections.
    "reduced-t60-g30-bf16": {**REDUCED, "epochs": 60, "generator_steps": 30, "precision": "bf16"},
    # `paper` with bf16 autocast in the clients' local training too (`client.precision`), for CPUs with
    # AMX, where a whole cell takes about five hours on 2 cores (forty-ninth and fiftieth sessions;
    # Co-Boosting about half of it). Its clients differ from `paper`'s, so its cells have no fp32 twin
    # on the same uploads and get a table of their own; FedDF keeps fp32 (4 min here).
    "paper-bf16": {**PAPER_BUDGET, "precision": "bf16", "client_precision": "bf16"},
}


def precision(budget: str) -> str:
    """The server stage's arithmetic of ``budget``: ``fp32`` unless the budget says otherwise."""
    return BUDGETS[budget].get("precision", "fp32")


def fp32_twin(budget: str) -> str:
    """The fp32 budget a lower-precision budget repeats (``reduced-t60-g30-bf16`` -> ``reduced-t60-g30``)."""
    twin = budget.removesuffix(f"-{precision(budget)}")
    if twin not in BUDGETS or precision(twin) != "fp32":
        raise ValueError(f"budget {budget!r} has no fp32 twin in BUDGETS")
    return twin


FP32_BUDGETS = tuple(b for b in BUDGETS if precision(b) == "fp32")
# The budgets with a Table 1/2 section of their own: the fp32 ones, and those whose clients train
# otherwise (`client_precision`), whose cells therefore have no fp32 twin on the same uploads.
TABLE_BUDGETS = tuple(b for b in BUDGETS if precision(b) == "fp32" or "client_precision" in BUDGETS[b])


def partition(setting: str) -> dict[str, Any]:
    if setting == "2c/c":
        return {"kind": "2c/c"}
    return {"kind": "dirichlet", "alpha": float(setting), "min_size": 10}


def cell_config(dataset: str, setting: str, seed: int, budget: str, methods: tuple[str, ...] = METHODS,
                clients: int = 5, lambdas: tuple[float, float] | None = None,
                ablation_method: str = "fedhydra") -> dict[str, Any]:
    b = BUDGETS[budget]
    gen = {"epochs": b["epochs"], "generator_steps": b["generator_steps"], "batch_size": b["batch_size"]}
    if precision(budget) != "fp32":  # fp32 cells keep the configs they were archived with
        gen["precision"] = precision(budget)
    per_method: dict[str, dict[str, Any]] = {
        "fedavg": {}, "ensemble": {}, "ot": {}, "feddf": {"steps": b["feddf_steps"], "eval_every": 100},
        "dense": dict(gen), "coboosting": dict(gen),
        "fedhydra": {**gen, "strat_batch_size": b["strat_batch_size"]},
        "fedhydra_log1p": {**gen, "strat_batch_size": b["strat_batch_size"]},
        "fedhydra_replay": {**gen, "strat_batch_size": b["strat_batch_size"]},
        "fedhydra_dense": {**gen, "strat_batch_size": b["strat_batch_size"]},
        "fedhydra_dense_log1p": {**gen, "strat_batch_size": b["strat_batch_size"]},
    }
    per_method[VARIANT].update(b.get("ours", {}))
    if lambdas is not None:
        per_method[ablation_method].update(lambda_bn=lambdas[0], lambda_adv=lambdas[1])
    tag = setting.replace("/", "") + ("" if clients == 5 else f"-m{clients}")
    if lambdas is not None:
        tag += f"-l{lambdas[0]}-{lambdas[1]}" + ("" if ablation_method == "fedhydra" else f"-{ablation_method}")
    return {
        "name": f"fedhydra-{dataset}-{tag}-s{seed}-{budget}", "seed": seed, "dataset": dataset,
        "partition": partition(setting), "clients": clients,
        "client": {"model": "cnn2", "epochs": b["client_epochs"], "batch_size": 128, "lr": 0.01, "momentum": 0.9,
                   **({"precision": b["client_precision"]} if "client_precision" in b else {})},
        "server": {"model": "cnn2"},
        "methods": {m: per_method[m] for m in ("ensemble", *methods, *(EXTRA if methods == METHODS else ()))},
    }


def _cells(root: Path, budget: str, archive: Path | None = None) -> list[dict[str, Any]]:
    """The cells of one budget, from the runs folder and the archive (:func:`common.cell_summaries`)."""
    return budget_cells(root, "fedhydra", budget, archive)


def _setting_of(cfg: dict[str, Any]) -> str:
    p = cfg["partition"]
    return "2c/c" if p["kind"] == "2c/c" else f"{p['alpha']:g}"


def _ablation_method(cfg: dict[str, Any]) -> str | None:
    """The method of a Table 6 cell (its (lambda_1, lambda_2) set by :func:`cell_config`), or None."""
    return next((m for m in ABLATION_METHODS if "lambda_bn" in cfg["methods"].get(m, {})), None)


def _is_ablation(cfg: dict[str, Any]) -> bool:
    return _ablation_method(cfg) is not None


def _main_cells(cells: list[dict[str, Any]], dataset: str) -> list[dict[str, Any]]:
    """The Table 1/2 cells of one dataset: 5 clients, paper lambdas (not the client sweep or Table 6)."""
    return [s for s in cells if s["config"]["dataset"] == dataset and s["config"]["clients"] == 5
            and not _is_ablation(s["config"])]


def _ours(runs: list[dict[str, Any]]) -> str:
    """``best mean ± sd (final mean ± sd) n=N`` over the seeds' results, or ``not run``."""
    if not runs:
        return "not run"
    return f"{_stats([r['best_accuracy'] for r in runs])} ({_stats([r['accuracy'] for r in runs])}) n={len(runs)}"


def _label(setting: str) -> str:
    return "2c/c" if setting == "2c/c" else f"α={setting}"


def report(root: Path, budget: str, archive: Path | None = None) -> str:
    """Markdown: our mean ± sd over seeds (best over epochs, then final) beside the paper's, from the
    cells in ``root`` and the ``archive`` folder."""
    cells = _cells(root, budget, archive)
    lines = [f"## Budget `{budget}`: {json.dumps(BUDGETS[budget])}", ""]
    for dataset in DATASETS:
        main = _main_cells(cells, dataset)
        if not main:
            continue
        lines += [f"### {dataset.upper()} (5 clients, cnn2): ours = best-over-epochs % (final %), then the paper's",
                  "", *_table(main, dataset, ("ensemble", *METHODS, *EXTRA)), *_minutes(main)]
        failures = common.failure_note(main)
        # where FedHydra as specified did not run in every cell, also our variants' place (as in one-cache)
        ours = [m for m in _candidates(main) if m != "fedhydra" and any(m in s["results"] for s in main)]
        lines += ["", _ordering(main), *(x for m in ours for x in ("", _ordering(main, m))), "",
                  *([failures, ""] if failures else [])]
    if any(_is_ablation(s["config"]) for s in cells):
        lines += _ablation_table(cells)
    return "\n".join(lines)


def _table(main: list[dict[str, Any]], dataset: str, methods: tuple[str, ...]) -> list[str]:
    """One row per method: our mean over the seeds of each setting beside the paper's number."""
    names = [_label(s) for s in SETTINGS]
    lines = ["| method | " + " | ".join(f"{n} ours | {n} paper" for n in names) + " |",
             "|---|" + "---|---|" * len(SETTINGS)]
    for method in methods:
        row = [LABELS[method]]
        for i, setting in enumerate(SETTINGS):
            runs = [s["results"][method] for s in main if _setting_of(s["config"]) == setting
                    and method in s["results"]]
            paper = PAPER[dataset].get(method, [None] * 5)[i]
            carried = sorted({r["carried_from"] for r in runs if "carried_from" in r})
            mark = f" from `{'`, `'.join(carried)}`" if carried else ""
            mark += common.older_mark(method, runs)
            row.append(f"{_ours(runs)}{mark} | {f'{paper:.2f}' if paper is not None else '-'}")
        lines.append("| " + " | ".join(row) + " |")
    return lines + common.older_note(methods, main)


def _minutes(main: list[dict[str, Any]]) -> list[str]:
    per_machine = minutes_per_machine(main)
    return ["", f"Minutes per cell (all methods, incl. local training): {per_machine}."] if per_machine else []


def _upload_check(main: list[dict[str, Any]]) -> list[str]:
    """A line on the cells that record ``uploads_sha256``: whether every method of each (carried-over
    ones included) ran on the same upload bytes; nothing when no cell records it (runs before 2026-11-25)."""
    recorded = [s for s in main if upload_digests(s)]
    if not recorded:
        return []
    mixed = [s["config"]["name"] for s in recorded if len(upload_digests(s)) > 1]
    verdict = (f"**methods ran on different uploads in {', '.join(mixed)}**." if mixed
               else "in each, every method that records it ran on byte-identical uploads.")
    return ["", f"Uploads: {len(recorded)} of {len(main)} cells record `uploads_sha256`; {verdict}"]


ONE_CACHE = "one-cache"  # archive subfolder: cells whose methods all ran on one upload cache (`--cache-dir`)
LATER_GRID = "one-cache-"  # archive subfolders one-cache-<grid>: a later one-cache grid, retrained in one go


def one_cache_grids(archive: Path) -> list[tuple[str, Path]]:
    """``("", archive/one-cache)`` (the first grid), then ``(grid, archive/one-cache-<grid>)`` for each
    later grid folder, by name; folders that do not exist are left out."""
    later = sorted((p.name.removeprefix(LATER_GRID), p) for p in archive.glob(f"{LATER_GRID}*") if p.is_dir())
    return [(g, p) for g, p in [("", archive / ONE_CACHE), *later] if p.is_dir()]


def grid_title(budget: str, grid_name: str = "") -> str:
    """The budget in backticks for the first grid; ``, grid `<name>``` after it for a later one."""
    return f"`{budget}`" + (f", grid `{grid_name}`" if grid_name else "")


def _machines(cells: list[dict[str, Any]]) -> str:
    """The processors the ``cells`` ran on and their torch thread counts, e.g. ``cpu (AMD EPYC, AVX512,
    avx512_bf16), 1 thread``; ``; ``-separated where they differ."""
    seen: dict[str, None] = {}
    for s in cells:
        threads = s.get("environment", {}).get("threads")
        seen[common.machine_label(s) + (f", {threads} thread{'s' if threads != 1 else ''}" if threads else "")] = None
    return "; ".join(seen)

ONE_CACHE_INTRO = """Every method of a cell below ran on byte-identical client uploads (one `--cache-dir`, one
torch thread count), so differences between rows are the server methods alone; the tables above
mix cells whose methods were added in different sessions, on uploads retrained under other thread
counts. FedHydra as the text specifies was not re-run here: its row quotes the paper, beside
`fedhydra_dense` (FedHydra in the loop of the authors' public code) and, where it ran,
`fedhydra_dense_log1p` (the same with U_r and U_c normalised from log(1 + U): our variant).
OT and FedDF have no generator, so T_g and T_G do not change them: where a budget did not run them,
"from `B`" marks the same cell's result at budget B, carried over only on the same uploads: equal
upload sha256 where both runs recorded it (`uploads_sha256`, runs since 2026-11-25), else FedAvg and
the ensemble equal to the last digit; they then count as baselines in the ordering."""
LATER_GRID_INTRO = """A later grid (archive folder `{folder}`): the same cells, every one retrained from its seeds in
one go on one machine and run with the defaults of that time, every method of a cell on one upload
cache. Its uploads are not the first grid's (another machine, other bits), so set the two grids side by
side through their means and orderings, not row by row. Ran on: {machines}."""


def one_cache_report(folder: Path, budget: str = "reduced", grid_name: str = "") -> str:
    """Markdown for the archived cells in ``folder`` (:data:`ONE_CACHE`, or a later grid's
    folder): the Table 1/2 grid of the methods run, and the place of ``fedhydra_dense`` (``fedhydra``
    where every cell ran it) against every paper baseline under strong heterogeneity, on the means and
    per seed."""
    cells = _one_cache_cells(folder, budget)
    lines: list[str] = []
    for dataset in DATASETS:
        main = _main_cells(cells, dataset)
        if not main:
            continue
        # the methods run, in the report's order, and always FedHydra's row (the paper's number)
        rows = tuple(m for m in ("ensemble", *METHODS, *EXTRA)
                     if m == "fedhydra" or any(m in s["results"] for s in main))
        lines += ["", f"### {dataset.upper()}, one upload cache per cell: ours = best-over-epochs % (final %), "
                  "then the paper's", "", *_table(main, dataset, rows), *_minutes(main), *_upload_check(main)]
        for candidate in _candidates(main):
            lines += ["", _ordering(main, candidate)]
    if not lines:
        return ""
    intro = ONE_CACHE_INTRO + ("\n\n" + LATER_GRID_INTRO.format(folder=folder.name, machines=_machines(cells))
                               if grid_name else "")
    title = f"## All methods on one upload cache (budget {grid_title(budget, grid_name)})"
    return "\n".join([title, "", intro, *lines])


PRECISION_INTRO = """A budget with another arithmetic (`-bf16`: bf16 autocast for the generator, teacher and student
forwards of the generator family's loop; FedHydra's stratification keeps its float64 CE) repeats its
fp32 twin's cells on the same uploads (equal `uploads_sha256`, else FedAvg and the ensemble equal to the
last digit) with the same seeds, so each row below differs in the arithmetic alone. Accuracy is
best over epochs (final epoch in brackets); Δ = bf16 minus fp32. "generation s" is the generator
stage's wall time (T_g x T_G generator steps), compared only where both runs name the same processor
(`environment.cpu`, recorded since 2026-11-25), the same malloc setting (`environment.malloc`,
since the twenty-seventh session's speed fixes) and the same torch thread count, since the fp32 cells
may come from another machine or older code. Where a method's fp32 result was re-run after a change of
its defaults (marked † in the tables) and its bf16 result was not, the fp32 row is the result that
re-run replaced, with the same defaults as the bf16 one (the cell's `replaced`); a method with no such
pair is left out."""


def _timing_host(cell: dict[str, Any], result: dict[str, Any]) -> tuple[str | None, str | None, int | None]:
    """(processor, malloc setting, torch threads) a method's ``result`` in ``cell`` was timed under: the
    result's own ``environment`` where it was merged into an archived cell from another run
    (:func:`common.merge_methods` records it), else the cell's."""
    env = result.get("environment") or cell.get("environment", {})
    return env.get("cpu"), env.get("malloc"), env.get("threads")


def _same_defaults(cell: dict[str, Any], method: str, other: dict[str, Any]) -> dict[str, Any] | None:
    """``cell``'s result of ``method`` that ran the same defaults as ``other`` (both from before a change
    of the method's defaults, or both after: :func:`common.older_defaults`): its current result, else the
    latest one a re-run replaced (the cell's ``replaced``); None if neither did."""
    want = common.older_defaults(method, other)
    earlier = [e["result"] for e in reversed(cell.get("replaced", {}).get(method, []))]
    return next((r for r in [cell["results"][method], *earlier] if common.older_defaults(method, r) == want), None)


def precision_pairs(folder: Path) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """``(budget, fp32 cell, cell)`` for every one-cache cell of a non-fp32 budget whose fp32 twin cell
    (:func:`fp32_twin`, same name otherwise) ran on the same uploads (:func:`same_uploads`)."""
    if not folder.is_dir():
        return []
    pairs = []
    for budget in BUDGETS:
        if precision(budget) == "fp32":
            continue
        twin = fp32_twin(budget)
        fp32 = {_cell_key(s, twin): s for s in budget_cells(folder, "fedhydra", twin, folder)}
        for cell in budget_cells(folder, "fedhydra", budget, folder):
            base = fp32.get(_cell_key(cell, budget))
            if base is not None and same_uploads(base, cell):
                pairs.append((budget, base, cell))
    return pairs


def precision_report(folder: Path) -> str:
    """Markdown: each generator-family method of each :func:`precision_pairs` pair, fp32 beside the other
    arithmetic (best, final, generation seconds), then per method the mean differences and speed-up."""
    pairs = precision_pairs(folder)
    if not pairs:
        return ""
    lines = ["## Precision: bf16 autocast against fp32 on the same uploads and seeds", "", PRECISION_INTRO, "",
             "### Per cell and method", "",
             "| budget | cell | method | fp32 | bf16 | Δ best | Δ final | generation s, fp32 → bf16 |",
             "|---|---|---|---|---|---|---|---|"]
    per_method: dict[str, list[tuple[float, float, float | None]]] = {}
    for budget, base, cell in pairs:
        for m in (m for m in GENERATOR_FAMILY if m in base["results"] and m in cell["results"]):
            b = cell["results"][m]
            a = _same_defaults(base, m, b)  # the arithmetic alone: both runs with the same defaults
            if a is None:
                continue
            d_best, d_final = b["best_accuracy"] - a["best_accuracy"], b["accuracy"] - a["accuracy"]
            gen_a, gen_b = (r.get("timing_seconds", {}).get("generation") for r in (a, b))
            host_a, host_b = _timing_host(base, a), _timing_host(cell, b)
            same_host = host_a[0] is not None and host_a == host_b
            speed = gen_a / gen_b if same_host and gen_a and gen_b else None
            per_method.setdefault(m, []).append((d_best, d_final, speed))
            timing = (f"{gen_a:.0f} → {gen_b:.0f} ({speed:.2f}x)" if speed is not None
                      else "other processors" if gen_a and gen_b and host_a[0] != host_b[0]
                      else "other host settings" if gen_a and gen_b else "-")
            lines.append(f"| `{budget}` | {_cell_key(cell, budget).removeprefix('fedhydra-')} | {LABELS[m]} | "
                         f"{a['best_accuracy']:.2f} ({a['accuracy']:.2f}) | {b['best_accuracy']:.2f} "
                         f"({b['accuracy']:.2f}) | {d_best:+.2f} | {d_final:+.2f} | {timing} |")
    if not per_method:
        return ""
    lines += ["", "### Per method: bf16 minus fp32", "",
              "| method | pairs | mean Δ best (sd) | mean Δ final (sd) | largest abs Δ best | "
              "generation speed-up (pairs on one processor) |", "|---|---|---|---|---|---|"]
    for m, rows in per_method.items():
        best, final = [r[0] for r in rows], [r[1] for r in rows]
        speeds = [r[2] for r in rows if r[2] is not None]
        speed = f"{statistics.mean(speeds):.2f}x ({len(speeds)})" if speeds else "-"
        lines.append(f"| {LABELS[m]} | {len(rows)} | {_signed_stats(best)} | {_signed_stats(final)} | "
                     f"{max(abs(v) for v in best):.2f} | {speed} |")
    return "\n".join(lines)


def _signed_stats(values: list[float]) -> str:
    sd = f" ({statistics.stdev(values):.2f})" if len(values) > 1 else ""
    return f"{statistics.mean(values):+.2f}{sd}"


# Table 4 (SVHN) and Table 7 (CIFAR-10): top-1 % per client count K at the paper's default alpha = 0.5
# (Sec. 4.1.2), columns FedAvg, OT, FedDF, DENSE, Co-Boosting, FedHydra. Neither dataset is on this
# machine, so the sweep runs on MNIST / Fashion-MNIST and these rows give the trend to compare with.
PAPER_CLIENTS: dict[str, dict[int, list[float]]] = {
    "SVHN (Table 4)": {
        5: [65.50, 78.24, 80.20, 79.44, 81.06, 82.39], 10: [43.45, 58.62, 70.20, 69.51, 75.92, 77.13],
        20: [47.87, 56.76, 69.36, 69.10, 70.01, 76.54], 50: [36.77, 45.68, 68.30, 67.74, 67.93, 74.89],
        100: [23.69, 35.23, 50.37, 48.87, 53.64, 60.01]},
    "CIFAR-10 (Table 7)": {
        5: [38.26, 52.88, 54.81, 58.48, 62.88, 63.15], 10: [41.71, 47.86, 50.17, 55.43, 61.56, 61.58],
        20: [33.47, 44.26, 38.70, 42.50, 53.49, 59.64], 50: [31.75, 40.37, 37.85, 39.09, 45.21, 52.66],
        100: [27.23, 37.18, 33.90, 36.25, 38.96, 47.40]},
}
SWEEP_INTRO = """The paper sweeps the client count K on SVHN (Table 4) and CIFAR-10 (Table 7), datasets this
offline machine does not have; we run the same sweep (`--clients`) on MNIST / Fashion-MNIST, so only the
trends compare: the paper's tables follow ours. Each K is its own partition of the same dataset (Dirichlet
with min_size 10, the same seed) and its own upload cache, shared by every method at that K; K = 5 is the
Table 1 cell of the same seed, from the latest one-cache grid of the budget that ran it (the cells
retrained in one go at the defaults of their time: at `reduced`, grid `amd`). Ours = best-over-epochs %
(final %)."""


def _sweep_groups(cells: list[dict[str, Any]]) -> dict[tuple[str, str], dict[int, list[dict[str, Any]]]]:
    """``{(dataset, setting): {K: cells}}`` for every (dataset, setting) with a client-count sweep
    cell (K != 5, paper lambdas); K = 5 holds the Table 1/2 cells of the seeds the sweep ran."""
    groups: dict[tuple[str, str], dict[int, list[dict[str, Any]]]] = {}
    for s in cells:
        cfg = s["config"]
        if cfg["clients"] != 5 and not _is_ablation(cfg):
            groups.setdefault((cfg["dataset"], _setting_of(cfg)), {}).setdefault(cfg["clients"], []).append(s)
    for (dataset, setting), per_k in groups.items():
        seeds = {s["config"]["seed"] for runs in per_k.values() for s in runs}
        base = [s for s in _main_cells(cells, dataset) if _setting_of(s["config"]) == setting
                and s["config"]["seed"] in seeds]
        if base:
            per_k[5] = base
    return {key: dict(sorted(per_k.items())) for key, per_k in sorted(groups.items())}


def _sweep_methods(per_k: dict[int, list[dict[str, Any]]]) -> tuple[str, ...]:
    """The methods run at every K of one sweep, in the report's order."""
    return tuple(m for m in ("ensemble", *METHODS, *EXTRA)
                 if all(m in s["results"] for runs in per_k.values() for s in runs))


def sweep_cells(root: Path, path: Path, budget: str) -> list[dict[str, Any]]:
    """The cells of ``budget`` a client-count sweep reads: the runs in ``root`` and the main archive,
    then the archived one-cache cells beside the results file ``path``, then those of the later grids
    (:func:`one_cache_grids`); a cell in several: the last of these wins, so K = 5 (a Table 1 cell) comes
    from the latest grid that ran it."""
    archive = common.archive_folder(path)
    cells = {s["config"]["name"]: s for s in _cells(root, budget, archive)}
    for _, folder in one_cache_grids(archive):  # the first grid, then the later ones
        cells.update({s["config"]["name"]: s for s in _one_cache_cells(folder, budget)})
    return list(cells.values())


def client_sweep_report(cells: list[dict[str, Any]], budget: str = "reduced") -> str:
    """Markdown for the client-count sweep (Table 4/7 protocol) among ``cells`` (:func:`sweep_cells`):
    one row per K, one column per method run at every K, the place of :data:`VARIANT` per K, and the
    paper's SVHN and CIFAR-10 tables for the trend."""
    groups = _sweep_groups(cells)
    if not groups:
        return ""
    lines = [f"## Client-count sweep (Tables 4 and 7 protocol, budget `{budget}`)", "", SWEEP_INTRO]
    for (dataset, setting), per_k in groups.items():
        methods = _sweep_methods(per_k)
        title = f"### {dataset.upper()}, {_label(setting)}: ours = best-over-epochs % (final %) per client count K"
        lines += ["", title,
                  "", "| K | " + " | ".join(LABELS[m] for m in methods) + " | minutes per cell |",
                  "|---|" + "---|" * (len(methods) + 1)]
        for k, runs in per_k.items():
            minutes = [cell_minutes(s) for s in runs if s.get("minutes")]
            results = {m: [s["results"][m] for s in runs] for m in methods}
            lines.append(f"| {k} | " + " | ".join(_ours(results[m]) + common.older_mark(m, results[m]) for m in methods)
                         + f" | {_stats(minutes) if minutes else '-'} |")
        lines += common.older_note(methods, [s for runs in per_k.values() for s in runs])
        if VARIANT in methods:
            lines += ["", _sweep_verdict(per_k)]
    lines += ["", "### The paper's client-count tables (other datasets, α = 0.5: the trend to compare with)", "",
              "| dataset | K | " + " | ".join(LABELS[m] for m in METHODS) + " |", "|---|---|" + "---|" * len(METHODS)]
    for name, table in PAPER_CLIENTS.items():
        lines += [f"| {name} | {k} | " + " | ".join(f"{v:.2f}" for v in row) + " |" for k, row in table.items()]
    return "\n".join(lines)


def _sweep_verdict(per_k: dict[int, list[dict[str, Any]]]) -> str:
    """Where :data:`VARIANT` stands against the best paper baseline at each K (mean best over epochs)."""
    places = []
    for k, runs in per_k.items():
        mean = _means(runs, "best_accuracy")
        top = _best_baseline(mean)
        if top is None:
            continue
        sign = "above" if mean[VARIANT] > mean[top] else "below"
        places.append(f"K = {k}: {sign} {LABELS[top]} ({mean[VARIANT]:.2f} vs {mean[top]:.2f})")
    # the means mix easy and hard partitions of different seeds: say how often ours wins seed by seed
    runs = [s for r in per_k.values() for s in r if VARIANT in s["results"]]
    return (f"`{VARIANT}` against the best baseline: " + "; ".join(places)
            + f". Per (K, seed): above every baseline run in {_wins(runs, VARIANT)} of {len(runs)}.")


def client_sweep_figure_path(path: Path, dataset: str, setting: str, budget: str) -> Path:
    """The accuracy-versus-K figure of one sweep, next to the results file ``path``."""
    return path.with_name(f"{path.stem}-clients-{dataset}-{setting.replace('/', '')}-{budget}.png")


def _sweep_color(method: str) -> str:
    """One colour per method in both panels of a sweep figure: a paper method keeps its colour in
    ours and in the paper's, the teacher is gray, other methods take the colours after the paper's."""
    if method == "ensemble":
        return "gray"
    order = (*METHODS, *EXTRA)
    return f"C{order.index(method)}" if method in order else "black"


def plot_client_sweep(cells: list[dict[str, Any]], path: Path, budget: str = "reduced") -> list[Path]:
    """One figure per swept (dataset, setting) among ``cells``: mean best-over-epochs accuracy against K
    (log axis), one line per method run at every K, our variant drawn thicker; the paper's SVHN trend
    beside it. Written next to ``path`` (:func:`client_sweep_figure_path`)."""
    import matplotlib.pyplot as plt

    written = []
    groups = _sweep_groups(cells)
    for (dataset, setting), per_k in groups.items():
        methods, ks = _sweep_methods(per_k), list(per_k)
        svhn = PAPER_CLIENTS["SVHN (Table 4)"]
        fig, axes = plt.subplots(1, 2, figsize=(9.6, 3.8), sharey=False)
        for m in methods:
            acc = [statistics.fmean(s["results"][m]["best_accuracy"] for s in per_k[k]) for k in ks]
            style = {"lw": 2.4, "marker": "o"} if m == VARIANT else {"lw": 1.2, "marker": "."}
            axes[0].plot(ks, acc, label=LABELS[m], color=_sweep_color(m),
                         ls="--" if m == "ensemble" else "-", **style)
        for i, m in enumerate(METHODS):
            axes[1].plot(list(svhn), [row[i] for row in svhn.values()], marker=".", lw=1.2, label=LABELS[m],
                         color=_sweep_color(m))
        seeds = "/".join(str(len(per_k[k])) for k in ks)
        axes[0].set_title(f"{dataset.upper()}, {_label(setting)}, budget {budget} (ours; seeds per K: {seeds})",
                          fontsize=9)
        axes[1].set_title("SVHN, α = 0.5: the paper's Table 4", fontsize=9)
        for ax, ticks in zip(axes, (ks, list(svhn)), strict=True):
            ax.set_xscale("log")
            ax.minorticks_off()  # a short K range would otherwise label minor ticks (6 x 10^0)
            ax.set_xticks(ticks, labels=[str(k) for k in ticks])
            ax.set_xlabel("clients K")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6, frameon=False)
        axes[0].set_ylabel("best test accuracy (%)")
        fig.tight_layout()
        out = client_sweep_figure_path(path, dataset, setting, budget)
        fig.savefig(out, dpi=110)
        plt.close(fig)
        written.append(out)
    return written


def _one_cache_cells(folder: Path, budget: str) -> list[dict[str, Any]]:
    """The archived one-cache cells of ``budget`` in ``folder`` (none if there is no such folder), with
    the generator-free baselines they did not run carried over from another budget (:func:`_carry_over`)."""
    if not folder.is_dir():
        return []
    others = {b: budget_cells(folder, "fedhydra", b, folder) for b in BUDGETS if b != budget}
    return [_carry_over(s, budget, others) for s in budget_cells(folder, "fedhydra", budget, folder)]


# Methods without a generator: on the same uploads and seed their result does not depend on T_g or T_G.
BUDGET_FREE = ("ot", "feddf")


def _cell_key(cell: dict[str, Any], budget: str) -> str:
    return cell["config"]["name"].removesuffix(f"-{budget}")


def _carry_over(cell: dict[str, Any], budget: str, others: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """``cell`` with each :data:`BUDGET_FREE` method it lacks taken from the same cell at another budget
    (first in :data:`BUDGETS` order) where :func:`same_uploads` holds and the method ran with the
    parameters this budget gives it; the result gets ``carried_from``: that budget."""
    missing = [m for m in BUDGET_FREE if m not in cell["results"]]
    if not missing or "fedavg" not in cell["results"]:
        return cell
    key, cfg = _cell_key(cell, budget), cell["config"]
    params = cell_config(cfg["dataset"], _setting_of(cfg), cfg["seed"], budget, clients=cfg["clients"])["methods"]
    results = dict(cell["results"])
    for other, cells in others.items():
        source = next((s for s in cells if _cell_key(s, other) == key and same_uploads(cell, s)), None)
        if source is None:
            continue
        for m in missing:
            if m not in results and m in source["results"] and source["config"]["methods"].get(m) == params[m]:
                results[m] = {**source["results"][m], "carried_from": other}
    return {**cell, "results": results}


VARIANT = "fedhydra_dense_log1p"  # the summary's "ours": the method that reaches the paper's numbers here
STANDING_INTRO = f"""Ours = `{VARIANT}` (FedHydra in the loop of the authors' public code, with U_r and U_c
normalised from log(1 + U): our variant; FedHydra as the text specifies collapses at these budgets, see
the notes). Each budget's columns come from its one-upload-cache cells (sections below): our 3-seed mean
of the best-over-epochs accuracy, and the paper baseline (FedAvg, OT, FedDF, DENSE, Co-Boosting) with
the highest such mean on the same uploads. **Bold** = ours above every baseline run in the cell;
"-" = not run at that budget. The last column compares our highest mean over the budgets with the
paper's FedHydra. "as specified" = `fedhydra` (the paper's Alg. 1-3 and Eq. 2-19 as written) on the
`reduced` grid's cells (uploads of other sessions, so not like for like with the columns after it).
FedAvg, OT and FedDF do not depend on the generator budget (T_g, T_G): on the same uploads they repeat
their numbers at every budget, so OT and FedDF count in a budget that did not run them where the same
cell ran them at another budget on the same uploads (sections below), and a budget where only ours ran
("none run") is compared with them through the column of another budget. The `paper` columns: the
paper's budget (local E = 200, T_g = 200, T_G = 30; ours at KD temperature 20) in fp32, on a lent
GPU or a 2-core CPU (the notes say which), n = the seeds run there, every method of a cell on its
uploads, the best baseline among those run there (section "Budget `paper`"); they count neither in
the gap nor in the figure. A column "grid `name`" comes from a
later one-cache grid (its own section below): the same settings and seeds, every cell retrained in one
go on one machine and run with the defaults of its time. A † on ours marks means over runs that took the
KD batches in pool order (the defaults before the sixty-sixth session; footnote)."""


def standing(folder: Path, specified: list[dict[str, Any]] | None = None,
             paper_cells: list[dict[str, Any]] | None = None,
             grids: list[tuple[str, Path]] | None = None) -> dict[tuple[str, str], dict[str, Any]]:
    """Per Table 1/2 cell ``(dataset, setting)``: ``paper`` (the paper's FedHydra), ``specified`` (FedHydra
    as specified, best-over-epochs per ``specified`` cell: the `reduced` grid) and, for each budget with
    one-cache cells in ``folder`` (in :data:`BUDGETS` order), ``ours`` (:data:`VARIANT`'s best-over-epochs
    per seed, empty where it did not run) and ``best`` (the paper baseline with the highest mean over the
    same cells and that mean, None if none ran in all). With ``paper_cells`` (cells of budget `paper`,
    each one upload cache by construction) that holds :data:`VARIANT` somewhere, ``paper_budget`` too,
    the same two keys from them. Each later grid of ``grids`` (:func:`one_cache_grids`, the first left
    out) adds its budgets after the first grid's same budget, keyed ``budget@grid``. Empty if
    neither ``folder`` nor a later grid holds a one-cache cell."""
    every_grid = [("", folder), *((g, p) for g, p in grids or [] if g)]
    budgets = {}
    for b in FP32_BUDGETS:
        for name, where in every_grid:
            if cells := _one_cache_cells(where, b):
                budgets[f"{b}@{name}" if name else b] = cells
    if not budgets:
        return {}
    with_paper = any(VARIANT in s["results"] for s in paper_cells or [])
    rows = {}
    for dataset in DATASETS:
        for i, setting in enumerate(SETTINGS):
            per_budget = {budget: _ours_and_best(cells, dataset, setting) for budget, cells in budgets.items()}
            spec = [s["results"]["fedhydra"]["best_accuracy"] for s in _main_cells(specified or [], dataset)
                    if _setting_of(s["config"]) == setting and "fedhydra" in s["results"]]
            rows[dataset, setting] = {"paper": PAPER[dataset]["fedhydra"][i], "specified": spec,
                                      "budgets": per_budget}
            if with_paper:
                rows[dataset, setting]["paper_budget"] = _ours_and_best(paper_cells or [], dataset, setting)
    return rows


def _ours_and_best(cells: list[dict[str, Any]], dataset: str, setting: str) -> dict[str, Any]:
    """``ours`` (:data:`VARIANT`'s best-over-epochs per seed) and ``best`` (:func:`_variant_and_best_baseline`)
    over the main ``cells`` of one dataset and setting where :data:`VARIANT` ran."""
    runs = [s for s in _main_cells(cells, dataset) if _setting_of(s["config"]) == setting and VARIANT in s["results"]]
    _, best = _variant_and_best_baseline(runs)
    mark = common.older_mark(best[0], [s["results"][best[0]] for s in runs]) if best else ""
    return {"ours": [s["results"][VARIANT]["best_accuracy"] for s in runs], "best": best, "best_mark": mark,
            "ours_mark": common.older_mark(VARIANT, [s["results"][VARIANT] for s in runs])}


def _column(key: str) -> str:
    """A :func:`standing` budget key as the table names it: ```reduced```, or ```reduced``, grid ``amd``` for
    ``reduced@amd``."""
    return grid_title(*key.split("@", 1))


def standing_report(folder: Path, specified: list[dict[str, Any]] | None = None) -> str:
    """Markdown: one row per Table 1/2 cell of :func:`standing` (:func:`standing_table`)."""
    return standing_table(standing(folder, specified))


def standing_table(rows: dict[tuple[str, str], dict[str, Any]]) -> str:
    """Markdown: one row per cell of ``rows`` (:func:`standing`): the paper's FedHydra, FedHydra as
    specified, then per budget :data:`VARIANT`'s mean and the best baseline's, and the gap to the paper
    (empty if ``rows`` is)."""
    if not rows:
        return ""
    first = next(iter(rows.values()))
    budgets = list(first["budgets"])
    with_paper = "paper_budget" in first
    head = "| dataset | setting | paper FedHydra | as specified, `reduced` | " + " | ".join(
        f"{_column(b)} ours | {_column(b)} best baseline" for b in budgets) + (
        " | `paper` ours | `paper` best baseline" if with_paper else "") + " | ours - paper |"
    lines = [head, "|---|---|---|---|" + "---|---|" * (len(budgets) + with_paper) + "---|"]
    for (dataset, setting), row in rows.items():
        cols, ours = [], {}
        for budget, cell in row["budgets"].items():
            cols.append(_ours_columns(cell))
            if cell["ours"]:
                ours[budget] = statistics.fmean(cell["ours"])
        if with_paper:
            cols.append(_ours_columns(row["paper_budget"]))
        gap = "-"
        if ours:
            top = max(ours, key=ours.get)
            gap = f"{ours[top] - row['paper']:+.2f} ({_column(top)})"
        spec = row["specified"]
        spec_text = f"{statistics.fmean(spec):.2f} n={len(spec)}" if spec else "-"
        lines.append(f"| {dataset.upper()} | {_label(setting)} | {row['paper']:.2f} | {spec_text} | "
                     + " | ".join(cols) + f" | {gap} |")
    cells = [c for row in rows.values() for c in [*row["budgets"].values(), row.get("paper_budget", {})]]
    notes = common.older_footnotes(sorted({c["best"][0] for c in cells if c.get("best_mark")}
                                          | ({VARIANT} if any(c.get("ours_mark") for c in cells) else set())))
    return "\n".join(["## Where the reproduction stands (best over epochs, one upload cache)", "",
                      STANDING_INTRO, "", "### Ours beside the paper's FedHydra and the best baseline, per cell",
                      "", *lines, *notes])


def _ours_columns(cell: dict[str, Any]) -> str:
    """Two cells of :func:`standing_table`: ours' mean (bold above the best baseline) and the best baseline."""
    if not cell["ours"]:
        return "- | -"
    mean, best = statistics.fmean(cell["ours"]), cell["best"]
    text = f"{mean:.2f} n={len(cell['ours'])}{cell.get('ours_mark', '')}"
    return (f"{f'**{text}**' if best is not None and mean > best[1] else text} | "
            + (f"{best[1]:.2f} {LABELS[best[0]]}{cell.get('best_mark', '')}" if best else "none run"))


def standing_figure_path(path: Path) -> Path:
    """The standing figure (:func:`plot_standing`), next to the results file ``path``."""
    return path.with_name(f"{path.stem}-standing.png")


def plot_standing(rows: dict[tuple[str, str], dict[str, Any]], path: Path) -> Path | None:
    """Bars per Table 1/2 cell (one panel per dataset): the paper's FedHydra, FedHydra as specified
    (`reduced`), and :data:`VARIANT` with the best baseline on the same uploads at the largest budget
    where :data:`VARIANT` ran (named under the setting); error bars = standard deviation over seeds.
    Written to :func:`standing_figure_path`; None (nothing written) if ``rows`` is empty."""
    if not rows:
        return None
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(DATASETS), figsize=(11, 4.4), sharey=True)
    width = 0.2
    for ax, dataset in zip(axes, DATASETS, strict=True):
        ticks = []
        for x, setting in enumerate(SETTINGS):
            row = rows[dataset, setting]
            ran = [b for b, cell in row["budgets"].items() if cell["ours"]]
            budget = ran[-1] if ran else None
            ours = row["budgets"][budget]["ours"] if budget else []
            best = row["budgets"][budget]["best"] if budget else None
            bars = [(row["paper"], [], "paper FedHydra", "0.25"),
                    (_mean_or_nan(row["specified"]), row["specified"], "FedHydra as specified (`reduced`)", "C3"),
                    (_mean_or_nan(ours), ours, f"ours ({VARIANT})", "C2"),
                    (best[1] if best else float("nan"), [], "best baseline, same uploads", "C0")]
            for j, (height, seeds, label, color) in enumerate(bars):
                err = statistics.stdev(seeds) if len(seeds) > 1 else None
                ax.bar(x + (j - 1.5) * width, height, width, yerr=err, color=color, capsize=2,
                       label=label if x == 0 else None)
            if best:
                ax.text(x + 1.5 * width, best[1] + 1, LABELS[best[0]], rotation=90, fontsize=6,
                        ha="center", va="bottom")
            where = (budget or "not run").replace("@", ", grid ")
            ticks.append(f"{_label(setting)}\n{where}" + (f"\nn={len(ours)}" if ours else ""))
        ax.set_xticks(range(len(SETTINGS)), labels=ticks, fontsize=7)
        ax.set_title(dataset.upper(), fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("best test accuracy (%)")
    fig.legend(*axes[0].get_legend_handles_labels(), fontsize=8, frameon=False, loc="upper center", ncol=4)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    out = standing_figure_path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _mean_or_nan(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def _variant_and_best_baseline(runs: list[dict[str, Any]]) -> tuple[float | None, tuple[str, float] | None]:
    """:data:`VARIANT`'s mean best-over-epochs accuracy over ``runs`` (None if there are none), and the
    paper baseline run in all of them with the highest such mean (None if no baseline ran in all)."""
    if not runs:
        return None, None
    mean = _means(runs, "best_accuracy")
    top = _best_baseline(mean)
    return mean[VARIANT], ((top, mean[top]) if top else None)


def _candidates(cells: list[dict[str, Any]]) -> list[str]:
    """Whose place against the baselines the one-cache section states: FedHydra where every cell ran
    it, else each run of ``fedhydra_dense`` and ``fedhydra_dense_log1p`` (``fedhydra_dense`` if neither)."""
    if all("fedhydra" in s["results"] for s in cells):
        return ["fedhydra"]
    ran = [m for m in ("fedhydra_dense", "fedhydra_dense_log1p") if any(m in s["results"] for s in cells)]
    return ran or ["fedhydra_dense"]


def _ablation_runs(cells: list[dict[str, Any]], dataset: str, lambdas: tuple[float, float],
                   method: str = "fedhydra") -> list[dict[str, Any]]:
    """``method``'s results at alpha = 0.5 with (lambda_1, lambda_2). The paper's (1, 1) row is an
    ablation cell where one ran (``fedhydra_dense``'s grid runs it), else the main grid's alpha = 0.5
    cell of each seed the ablation ran."""
    abl = [s for s in cells if s["config"]["dataset"] == dataset and _ablation_method(s["config"]) == method]
    pool = [s for s in abl if (s["config"]["methods"][method].get("lambda_bn"),
                               s["config"]["methods"][method].get("lambda_adv")) == lambdas]
    if lambdas == (1.0, 1.0) and not pool:
        seeds = {s["config"]["seed"] for s in abl}
        pool = [s for s in _main_cells(cells, dataset) if _setting_of(s["config"]) == "0.5"
                and s["config"]["seed"] in seeds]
    return [s["results"][method] for s in pool if method in s["results"]]


def _ablation_table(cells: list[dict[str, Any]]) -> list[str]:
    lines: list[str] = []
    for method in ABLATION_METHODS:
        if not any(_ablation_method(s["config"]) == method for s in cells):
            continue
        lines += [*([""] if lines else []),
                  f"### Table 6 ablation ({ABLATION_TITLES[method]}, α = 0.5): ours = best-over-epochs % "
                  "(final %), then the paper's",
                  "", "| λ1 | λ2 | " + " | ".join(f"{d.upper()} ours | {d.upper()} paper" for d in DATASETS) + " |",
                  "|---|---|" + "---|---|" * len(DATASETS)]
        for i, lambdas in enumerate(ABLATION):
            cols = [f"{_ours(_ablation_runs(cells, d, lambdas, method))} | {PAPER_ABLATION[d][i]:.2f}"
                    for d in DATASETS]
            lines.append(f"| {lambdas[0]:g} | {lambdas[1]:g} | " + " | ".join(cols) + " |")
    return lines


def _name(candidate: str) -> str:
    return "FedHydra" if candidate == "fedhydra" else f"`{candidate}`"


def _ranking(runs: list[dict[str, Any]], key: str, candidate: str = "fedhydra") -> tuple[dict[str, float], str]:
    """Mean ``key`` accuracy of every method run in all ``runs``, and ``candidate``'s place against the
    best paper baseline: ``FedHydra first (a vs best baseline b)`` or ``FedHydra below X (a vs b)``."""
    mean = _means(runs, key)
    best_other = _best_baseline(mean)
    ok = best_other is None or mean[candidate] > mean[best_other]
    place = f"{_name(candidate)} first" if ok else f"{_name(candidate)} below {LABELS[best_other]}"
    best = mean[best_other] if best_other else float("nan")
    return mean, f"{place} ({mean[candidate]:.2f} vs best baseline {best:.2f})"


def _means(runs: list[dict[str, Any]], key: str) -> dict[str, float]:
    """Mean ``key`` accuracy of every method (the paper's and ours) run in all ``runs``."""
    return {m: statistics.fmean(s["results"][m][key] for s in runs)
            for m in (*METHODS, *EXTRA) if all(m in s["results"] for s in runs)}


def _best_baseline(mean: dict[str, float]) -> str | None:
    """The paper baseline (not FedHydra, not our variants) with the highest mean, None if none ran."""
    others = {m: v for m, v in mean.items() if m not in ("fedhydra", *EXTRA)}
    return max(others, key=others.get) if others else None


def _wins(runs: list[dict[str, Any]], candidate: str) -> int:
    """In how many runs (seeds) ``candidate``'s best-over-epochs accuracy is above every paper baseline's."""
    return sum(all(s["results"][candidate]["best_accuracy"] > r["best_accuracy"]
                   for m, r in s["results"].items() if m in METHODS and m != "fedhydra") for s in runs)


def _ordering(cells: list[dict[str, Any]], candidate: str = "fedhydra") -> str:
    """Does ``candidate`` (FedHydra) beat every baseline under strong heterogeneity? On the mean
    best-over-epochs accuracy (the paper's protocol), then on the mean final-epoch accuracy, then
    per seed."""
    verdicts = []
    for setting in ("0.1", "0.01", "2c/c"):
        runs = [s for s in cells if _setting_of(s["config"]) == setting]
        if not runs or any(candidate not in s["results"] for s in runs):
            continue
        if not any(m != "fedhydra" and all(m in s["results"] for s in runs) for m in METHODS):
            verdicts.append(f"{setting} (n={len(runs)}): no baseline ran in every cell, nothing to compare")
            continue
        mean, verdict = _ranking(runs, "best_accuracy", candidate)
        verdict = f"{setting} (n={len(runs)}): {verdict}"
        for extra in EXTRA:
            if extra in mean and extra != candidate:
                verdict += f", {LABELS[extra]} {mean[extra]:.2f}"
        verdict += f"; final epoch: {_ranking(runs, 'accuracy', candidate)[1]}"
        missing = [LABELS[m] for m in METHODS if m not in mean and m != "fedhydra"]
        if missing:  # a verdict against part of the baselines must say which ones it lacks
            verdict += f"; not compared: {', '.join(missing)} (not run in every cell)"
        verdict += f"; per seed, above every baseline run in {_wins(runs, candidate)} of {len(runs)}"
        verdicts.append(verdict)
    whose = "" if candidate == "fedhydra" else f", {_name(candidate)}"
    if not verdicts:
        return f"Ordering under strong heterogeneity{whose}: no complete cells yet"
    return "\n".join([f"Ordering under strong heterogeneity{whose} (best over epochs, then final epoch):", "",
                      *(f"- {v}" for v in verdicts)])


HEADER = """# FedHydra reproduction: MNIST and Fashion-MNIST

Generated by `hetfl reproduce fedhydra` from the runs under its output folder; do not edit by hand
(notes below the tables are kept in `docs/results/fedhydra-notes.md`).

Protocol: 5 clients with cnn2 (DENSE's CNNMnist), server cnn2, Dirichlet(alpha) with min_size 10
(DENSE/MOON convention) or 2c/c; local SGD lr 0.01, momentum 0.9, batch 128. The methods of a cell
share its partition, seed and upload cache; methods added to a cell in a later session may have run
on uploads retrained under another torch thread count, so the section "All methods on one upload
cache" (byte-identical uploads) is the like-for-like comparison. Accuracy is top-1 on the official
10k test split. **best** = best test accuracy over the server's evaluations (what the paper and its
peers report: test-set model selection); **final** = the last epoch's model. ± is the standard
deviation over seeds (n = number of seeds run). The paper's numbers (Table 1, Table 2, Table 6) are
quoted after the bar.
"""


CURVE_METHODS = GENERATOR_FAMILY  # one point per server epoch


def epoch_curves(root: Path, summary: dict[str, Any]) -> dict[str, list[float]]:
    """Per-epoch test accuracy of the generator-family methods of one cell, from the cell's
    ``metrics.jsonl`` or else its archived curves (:func:`common.cell_curves`; a resumed stage logs
    some epochs twice: the last value of a step wins)."""
    curves = common.cell_curves(root, summary, CURVE_METHODS)
    return {m: [acc for _, acc in points] for m, points in curves.items() if len(points) > 1}


def figure_path(path: Path, dataset: str, budget: str) -> Path:
    """The per-epoch figure of one dataset and budget, next to the results file ``path``."""
    return path.with_name(f"{path.stem}-curves-{dataset}-{budget}.png")


def plot_curves(root: Path, path: Path, budget: str) -> list[Path]:
    """One figure per dataset, one panel per setting: the mean over seeds of each generator-family
    method's accuracy per server epoch, the band spanning the seeds' minimum to maximum, and the
    average-logit ensemble (the teacher DENSE distils) as a dashed line. Written next to ``path`` as
    ``<stem>-curves-<dataset>-<budget>.png`` (:func:`figure_path`); cells come from ``root`` and the
    archive beside ``path``; a dataset with no curves, or with a cell whose curves are not all known
    (runs that are gone), writes nothing where an earlier figure exists (that figure stays)."""
    cells = _cells(root, budget, common.archive_folder(path))
    return _plot_cells(cells, root, lambda dataset: figure_path(path, dataset, budget), f"budget {budget}")


def one_cache_figure_path(path: Path, dataset: str, budget: str, grid_name: str = "") -> Path:
    """The per-epoch figure of the one-cache cells (of a later grid) of one dataset and budget,
    next to ``path``."""
    return path.with_name(f"{path.stem}-one-cache{f'-{grid_name}' if grid_name else ''}-curves-{dataset}-{budget}.png")


def plot_one_cache_curves(path: Path, budget: str, folder: Path, grid_name: str = "") -> list[Path]:
    """:func:`plot_curves` for the archived one-cache cells in ``folder`` (:data:`ONE_CACHE`, or the
    folder of the later grid ``grid_name``: :func:`one_cache_grids`) of ``budget``."""
    return _plot_cells(_one_cache_cells(folder, budget), folder,
                       lambda dataset: one_cache_figure_path(path, dataset, budget, grid_name),
                       f"one upload cache, budget {budget}" + (f", grid {grid_name}" if grid_name else ""))


def _plot_cells(cells: list[dict[str, Any]], root: Path, out_path: Callable[[str], Path], title: str) -> list[Path]:
    """The figures of :func:`plot_curves` for ``cells`` (curves from ``root``), ``out_path(dataset)``."""
    import matplotlib.pyplot as plt
    import numpy as np

    written = []
    for dataset in DATASETS:
        main = _main_cells(cells, dataset)
        known = {s["config"]["name"]: epoch_curves(root, s) for s in main}  # read once per cell
        panels = {}  # setting -> (method -> one curve per seed, teacher accuracies, seeds)
        for setting in SETTINGS:
            mine = [s for s in main if _setting_of(s["config"]) == setting]
            per_seed = [known[s["config"]["name"]] for s in mine]
            curves = {m: [c[m] for c in per_seed if m in c] for m in CURVE_METHODS}
            if any(curves.values()):
                panels[setting] = ({m: v for m, v in curves.items() if v},
                                   [s["results"]["ensemble"]["accuracy"] for s in mine if "ensemble" in s["results"]],
                                   len(mine))
        if not panels:
            continue
        out = out_path(dataset)
        complete = all(set(known[s["config"]["name"]]) >= set(CURVE_METHODS) & set(s["results"]) for s in main)
        if out.is_file() and not complete:  # some runs' curves are gone: the earlier, fuller figure stays
            continue
        width = max(3.2 * len(panels), 6.4)  # one panel alone still fits the title and the legend
        fig, axes = plt.subplots(1, len(panels), figsize=(width, 3.6), sharey=True, squeeze=False)
        for ax, (setting, (curves, teacher, n)) in zip(axes[0], panels.items()):
            for m, runs in curves.items():
                length = min(len(r) for r in runs)
                acc = np.array([r[:length] for r in runs])
                epochs = np.arange(1, length + 1)
                color = f"C{CURVE_METHODS.index(m)}"  # one colour per method in every figure
                ax.plot(epochs, acc.mean(0), color=color, label=LABELS[m], lw=1.4)
                ax.fill_between(epochs, acc.min(0), acc.max(0), color=color, alpha=0.15, lw=0)
            if teacher:
                ax.axhline(float(np.mean(teacher)), color="gray", ls="--", lw=1, label=LABELS["ensemble"])
            ax.set_title(f"{_label(setting)} (n = {n})", fontsize=9)
            ax.set_xlabel("server epoch")
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("test accuracy (%)")
        handles = {label: h for ax in axes[0] for h, label in zip(*ax.get_legend_handles_labels())}
        fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=min(len(handles), 5), fontsize=7,
                   frameon=False)
        fig.suptitle(f"{dataset.upper()}, {title}: mean over seeds, band = min to max", fontsize=9)
        fig.tight_layout(rect=(0, 0.12 if len(handles) > 5 else 0.07, 1, 1))
        fig.savefig(out, dpi=110)
        plt.close(fig)
        written.append(out)
    return written


def write_results(root: Path, path: Path, notes: Path | None = None) -> None:
    """The results file ``path`` from the cells in ``root`` and the archive beside ``path``; each
    budget's per-epoch figures are drawn where there are curves and linked wherever a figure exists
    (one drawn from runs that are gone stays linked)."""
    archive = common.archive_folder(path)
    rows = standing(archive / ONE_CACHE, _cells(root, "reduced", archive), _cells(root, "paper", archive),
                    one_cache_grids(archive))
    standing_body = standing_table(rows)
    figure = plot_standing(rows, path)
    if figure:
        standing_body += ("\n\nThe same cells as bars: ours and the best baseline at the largest budget where ours ran "
                          "(named under each setting), error bars = standard deviation over seeds."
                          f"\n\n![{figure.stem}]({figure.name})")
    bodies = [standing_body]
    for budget in TABLE_BUDGETS:
        body = report(root, budget, archive)
        plot_curves(root, path, budget)
        if "###" in body:  # a budget without cells has no section to hang its figures on
            body += _figure_links([figure_path(path, d, budget) for d in DATASETS], "")
        bodies.append(body)
    if body := curve_runs_report(archive / CURVE_RUNS, path):
        bodies.append(body)
    for grid_name, folder in one_cache_grids(archive):
        for budget in FP32_BUDGETS:  # the one-cache sections, each with its per-epoch figures
            body = one_cache_report(folder, budget, grid_name)
            if not body:
                continue
            plot_one_cache_curves(path, budget, folder, grid_name)
            bodies.append(body + _figure_links([one_cache_figure_path(path, d, budget, grid_name) for d in DATASETS],
                                               ", one upload cache" + (f", grid {grid_name}" if grid_name else "")))
    if body := precision_report(archive / ONE_CACHE):
        bodies.append(body)
    for budget in FP32_BUDGETS:  # the client-count sweeps, each with its accuracy-versus-K figures
        cells = sweep_cells(root, path, budget)
        body = client_sweep_report(cells, budget)
        if body:
            figures = plot_client_sweep(cells, path, budget)
            bodies.append(body + "\n\n" + "\n\n".join(f"![{f.stem}]({f.name})" for f in figures))
    bodies.append(common.partial_report(archive, LABELS))
    bodies.append(common.replaced_report(archive, LABELS, BUDGETS, against=VARIANT))
    common.write_results(path, HEADER, bodies, notes)


CURVE_RUNS = common.CURVE_RUNS  # archive subfolder: server stages measured in part (its runs.json lists them)
CURVE_CLASSES = 10  # the curves are MNIST/Fashion-MNIST students: hetfl.report.collapse_bounds of 10 classes


def curve_run_rows(folder: Path, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per entry of ``runs`` (cell, method, run, file: that method's metrics.jsonl in
    ``folder``): epochs logged, best % and its epoch, final %, the epochs at chance after the curve
    had first learned (:func:`hetfl.report.collapse_bounds` of :data:`CURVE_CLASSES`: at or below
    10.5 % after passing 30 %) and the first of them, the largest student gradient norm of a KD
    step (``kd_grad_max``), the largest share of dead ReLU channels and the first epoch with any
    (``dead_units``), the largest KD loss of an epoch's fresh batches (``kd_loss_new``), each
    None where the log lacks it, and the mean and sample sd of the last quarter of the evaluated
    epochs (:func:`tail_stats`: how well a run holds what it learned, beside its final epoch)."""
    from hetfl.report import collapse_bounds

    at_chance, learned = collapse_bounds(CURVE_CLASSES)
    rows = []
    for run in runs:
        metrics = folder / run["file"]
        logged_curve = common.logged_curves(metrics, (run["method"],)).get(run["method"], [])  # a resumed epoch once
        curve = [(int(step), acc) for step, acc in logged_curve]
        if not curve:
            raise ValueError(f"{metrics}: no evaluated epoch of {run['method']}")
        logged = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        best_epoch, best = max(curve, key=lambda point: point[1])  # the first epoch at the best
        passed = next((i for i, (_, acc) in enumerate(curve) if acc >= learned), len(curve))
        collapsed = [step for step, acc in curve[passed:] if acc <= at_chance]
        first_dead = next((r["step"] for r in logged if r.get("dead_units", 0) > 0), None)
        rows.append({**run, "epochs": curve[-1][0], "best": best, "best_epoch": best_epoch, "final": curve[-1][1],
                     "collapsed": len(collapsed), "first_collapse": collapsed[0] if collapsed else None,
                     "grad_max": _largest(logged, "kd_grad_max"), "dead_max": _largest(logged, "dead_units"),
                     "first_dead": first_dead, "new_max": _largest(logged, "kd_loss_new"), "curve": curve,
                     "tail": tail_stats([acc for _, acc in curve])})
    return rows


def tail_stats(accs: list[float]) -> tuple[float, float]:
    """Mean and sample sd of the last quarter of ``accs`` (at least one value; sd 0 for one): for
    200 epochs the last 50."""
    if not accs:
        raise ValueError("tail_stats needs at least one accuracy")
    tail = accs[-max(1, len(accs) // 4):]
    return statistics.fmean(tail), statistics.stdev(tail) if len(tail) > 1 else 0.0


def _largest(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return max(values) if values else None


def curve_runs_report(folder: Path, path: Path) -> str:
    """A section for the server curves archived in ``folder`` (:func:`curve_run_rows`), with a figure
    next to ``path`` (one panel per cell); empty if ``folder`` has no runs.json."""
    if not (folder / "runs.json").is_file():
        return ""
    from hetfl.report import collapse_bounds

    at_chance, learned = collapse_bounds(CURVE_CLASSES)
    manifest = json.loads((folder / "runs.json").read_text())
    rows = curve_run_rows(folder, manifest["runs"])
    about = manifest.get("about", "")
    lines = ["## Budget `paper` clients: server stages, per-epoch logs (stopped runs, trials, probes)", "", about, "",
             f"\"collapsed\" = epochs at or below {at_chance} % after the curve first passed {learned:.0f} % "
             "(the student then predicts one class), with the first such epoch. Logs in "
             f"`{folder.parent.name}/{folder.name}/`.", "", "### Per run", "",
             "`dead units` = the largest share of the student's ReLU channels never positive on an epoch's last KD "
             "batch (with the first epoch above 0); `new-batch KD loss` = the largest KD loss of an epoch's fresh "
             "batches before their own step (both logged since the thirty-fifth session; - before).", "",
             "`last quarter` = the mean (sample sd) of the last quarter of the evaluated epochs (the last 50 of 200).",
             "",
             "| cell | method | run | epochs | best % (epoch) | final % | last quarter % | collapsed (first) "
             "| largest KD grad norm | dead units (first) | largest new-batch KD loss |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        first = f" (from {r['first_collapse']})" if r["first_collapse"] is not None else ""
        grad = f"{r['grad_max']:.1f}" if r["grad_max"] is not None else "-"
        dead = "-" if r["dead_max"] is None else f"{r['dead_max']:.2f}" + (
            f" ({r['first_dead']})" if r["first_dead"] is not None else "")
        new = f"{r['new_max']:.1f}" if r["new_max"] is not None else "-"
        lines.append(f"| {r['cell']} | {LABELS.get(r['method'], r['method'])} | {r['run']} | {r['epochs']} | "
                     f"{r['best']:.2f} ({r['best_epoch']}) | {r['final']:.2f} | "
                     f"{r['tail'][0]:.2f} ({r['tail'][1]:.2f}) | {r['collapsed']}{first} | {grad} | {dead} | {new} |")
    lines += change_table(rows)
    lines += twin_table(rows)
    figure = plot_curve_runs(rows, path.with_name(f"{path.stem}-{CURVE_RUNS}.png"))
    return "\n".join(lines) + f"\n\n![{figure.stem}]({figure.name})"


def change_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs of :func:`curve_run_rows` that name a ``change`` (runs.json), one row per (cell, change)
    in the order first met, the cell being the part of the run's ``cell`` before its first comma
    (``<dataset>-<alpha>-s<seed>``): how many runs, how many collapsed (any epoch at chance after
    learning), the best and final accuracies and the last quarter's means, the fewest epochs run, the
    paper's FedHydra for that dataset and alpha, and the mean number of epochs above it."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("change"):
            groups.setdefault((r["cell"].split(",")[0], r["change"]), []).append(r)
    out = []
    for (cell, change), runs in groups.items():
        dataset, tag = cell.split("-")[:2]
        setting = "2c/c" if tag == "2cc" else tag  # cell names drop the slash (cell_config's tag)
        paper = PAPER[dataset]["fedhydra"][SETTINGS.index(setting)]
        out.append({"cell": cell, "change": change, "runs": len(runs), "paper": paper,
                    "collapsed": sum(r["collapsed"] > 0 for r in runs), "epochs": min(r["epochs"] for r in runs),
                    "best": [r["best"] for r in runs], "final": [r["final"] for r in runs],
                    "tail": [r["tail"][0] for r in runs],
                    "above": statistics.fmean(sum(acc > paper for _, acc in r["curve"]) for r in runs)})
    return out


def _spread(values: list[float]) -> str:
    return f"{statistics.fmean(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def change_table(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown lines for :func:`change_rows`; none if no run names a change."""
    table = change_rows(rows)
    if not table:
        return []
    lines = ["", "### Our variant per change (the runs that name one in runs.json)", "",
             "Ours on the same uploads with the settings named changed from T_G = 30, lr 0.01, beta 1 and temperature "
             "1 (\"none\": the settings of the runs named \"as configured\" above, before temperature 20 became "
             "ours at budget `paper`), GPU runs unless the cell or run says CPU; a run counts as collapsed if any "
             "epoch was at chance after it had learned. \"paper\" = the paper's FedHydra for the cell's dataset and "
             "setting.", "",
             "| cell | change | runs | fewest epochs | collapsed runs | best % mean (range) | final % mean (range) "
             "| last quarter % mean (range) | paper | epochs above the paper, mean |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in table:
        lines.append(f"| {c['cell']} | {c['change']} | {c['runs']} | {c['epochs']} | {c['collapsed']} of {c['runs']} | "
                     f"{_spread(c['best'])} | {_spread(c['final'])} | {_spread(c['tail'])} | {c['paper']:.2f} | "
                     f"{c['above']:.1f} |")
    return lines


def twin_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each run of :func:`curve_run_rows` that names a ``twin`` (runs.json: the curve file of the same
    method on the same uploads and seeds with one setting apart, e.g. its server at fp32 where this run's
    is in bf16), the two side by side over the epochs both evaluated (``common``, at least one, else
    ValueError): for each, the best % and its first epoch, the mean, the mean of the last quarter of the
    common epochs and the value at the last common epoch, and ``delta`` = the run's mean minus the
    twin's. Its twin must be another listed run of the same method (ValueError naming the problem)."""
    by_file = {r["file"]: r for r in rows}
    out = []
    for r in rows:
        if not r.get("twin"):
            continue
        twin = by_file.get(r["twin"])
        if twin is None or twin is r:
            raise ValueError(f"{r['file']}: its twin {r['twin']!r} is not another run listed in runs.json")
        if twin["method"] != r["method"]:
            raise ValueError(f"{r['file']}: its twin {r['twin']} ran {twin['method']}, not {r['method']}")
        mine, theirs = dict(r["curve"]), dict(twin["curve"])
        common_epochs = sorted(set(mine) & set(theirs))
        if not common_epochs:
            raise ValueError(f"{r['file']} and its twin {r['twin']}: no epoch evaluated in both")
        sides = {}
        for side, curve in (("run", mine), ("twin", theirs)):
            accs = [curve[e] for e in common_epochs]
            best = max(range(len(accs)), key=accs.__getitem__)  # the first epoch at the best
            sides[side] = {"best": accs[best], "best_epoch": common_epochs[best], "mean": statistics.fmean(accs),
                           "tail": tail_stats(accs)[0], "last": accs[-1]}
        out.append({"cell": r["cell"], "method": r["method"], "file": r["file"], "twin_file": twin["file"],
                    "common": len(common_epochs),
                    "last_epoch": common_epochs[-1], **sides,
                    "delta": sides["run"]["mean"] - sides["twin"]["mean"]})
    return out


def twin_table(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown lines for :func:`twin_rows`; none if no run names a twin."""
    table = twin_rows(rows)
    if not table:
        return []
    lines = ["", "### Runs beside their twin (same method, uploads and seeds; one setting apart)", "",
             "Each run that names a twin in runs.json (the same method on the same archived uploads with the same "
             "seeds, one setting apart: the run's label says which), the two compared over the epochs both "
             "evaluated (a stopped twin has fewer): best % (its first epoch), the mean, the mean of the last "
             "quarter of those epochs and the value at the last of them, run / twin; Δ = the run's mean minus the "
             "twin's.", "",
             "| cell | method | run (file) | twin (file) | common epochs | best % (epoch) | mean % | Δ mean "
             "| last quarter % | at the last common epoch % |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for t in table:
        run, twin = t["run"], t["twin"]
        lines.append(
            f"| {t['cell']} | {LABELS.get(t['method'], t['method'])} | `{t['file']}` | `{t['twin_file']}` | "
            f"{t['common']} (to {t['last_epoch']}) | {run['best']:.2f} ({run['best_epoch']}) / "
            f"{twin['best']:.2f} ({twin['best_epoch']}) | {run['mean']:.2f} / {twin['mean']:.2f} | "
            f"{t['delta']:+.2f} | {run['tail']:.2f} / {twin['tail']:.2f} | {run['last']:.2f} / {twin['last']:.2f} |")
    return lines


def _run_label(row: dict[str, Any], width: int = 100) -> str:
    """A curve's legend label (method, then how it ran), wrapped at ``width`` characters: a long label
    would widen the figure's tight bounding box and shrink every panel."""
    return textwrap.fill(f"{LABELS.get(row['method'], row['method'])}, {row['run']}", width)


def plot_curve_runs(rows: list[dict[str, Any]], out: Path) -> Path:
    """Accuracy per server epoch of :func:`curve_run_rows`, one panel per cell (two per row), one line per
    run. Each panel's legend sits under it, and the figure is as much taller as each row's longest
    legend needs; the constrained layout gives each row the room of its legends (tight_layout gave up
    on legends outside the axes and let them run over the next row's titles), so that no legend hides
    a curve or a title however many runs a cell has."""
    import matplotlib.pyplot as plt

    from hetfl.report import save_figure

    cells = list(dict.fromkeys(r["cell"] for r in rows))  # in the order runs.json lists them
    ncols = min(2, len(cells))
    nrows = -(-len(cells) // ncols)
    runs = {cell: [r for r in rows if r["cell"] == cell] for cell in cells}
    lines = {c: sum(_run_label(r).count("\n") + 1 for r in runs[c]) for c in cells}
    heights = [3.0 + 0.11 * max(lines[c] for c in cells[i * ncols:(i + 1) * ncols]) for i in range(nrows)]
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.5 * ncols, sum(heights)), squeeze=False,
                             layout="constrained")
    for ax in axes.flat[len(cells):]:
        ax.set_visible(False)
    for ax, cell in zip(axes.flat, cells):
        for r in runs[cell]:
            steps, accs = zip(*r["curve"])
            ax.plot(steps, accs, lw=1, label=_run_label(r))
        ax.set_title(f"{cell} (clients of budget paper)", fontsize=9)
        ax.set_xlabel("server epoch")
        ax.set_ylabel("test accuracy %")
        ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(0.0, -0.16), frameon=False)
        ax.grid(alpha=0.3)
    return save_figure(fig, out)


def _figure_links(paths: list[Path], where: str) -> str:
    """A section linking the per-epoch figures among ``paths`` that exist (empty if none does)."""
    figures = [f for f in paths if f.is_file()]
    if not figures:
        return ""
    return (f"\n\n### Accuracy per server epoch{where} (generator family)\n\n"
            + "\n\n".join(f"![{f.stem}]({f.name})" for f in figures))


def grid(datasets: list[str], settings: list[str], seeds: list[int], budget: str, methods: tuple[str, ...],
         clients: list[int], ablation: bool, ablation_method: str = "fedhydra") -> list[dict[str, Any]]:
    """The cells to run. Table 6 (``ablation``) runs ``ablation_method`` alone at alpha = 0.5; for
    ``fedhydra`` its (1, 1) row is the main grid's cell, for ``fedhydra_dense`` a cell of its own
    (the main grid's alpha = 0.5 cells run it only on request)."""
    if ablation_method not in ABLATION_METHODS:
        raise ValueError(f"the Table 6 ablation runs one of {list(ABLATION_METHODS)}, got {ablation_method!r}")
    cells = [cell_config(d, s, seed, budget, methods, m) for d in datasets for s in settings for seed in seeds
             for m in clients]
    if ablation:
        cells += [cell_config(d, "0.5", seed, budget, (ablation_method,), 5, lam, ablation_method)
                  for d in datasets for seed in seeds for lam in ABLATION
                  if lam != (1.0, 1.0) or ablation_method != "fedhydra"]
    return cells
